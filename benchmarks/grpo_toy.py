"""GRPO learning a toy task from scratch: prompts "a+b=" (a, b in 0..4), 8 completions of up to 4 tokens each,
rewarded 0.2 for starting with a digit and 1 more for starting with the sum; a tiny Llama trained from random
weights with `megatrain train` (CPU by default). The mean reward per 50 steps into results JSON; the run's
loss.png holds the reward curve.

    python benchmarks/grpo_toy.py --steps 300 --out benchmarks/results/grpo-toy-cpu.json
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, write_results  # noqa: E402

from megatrain.cli import main as megatrain  # noqa: E402
from megatrain_data import train_tokenizer  # noqa: E402


def digit_then_sum(prompts, completions, answer, **_):
    """0.2 for a completion starting with a digit, 1 more where it starts with the answer."""
    return [
        (0.2 if c.strip()[:1].isdigit() else 0.0) + (1.0 if c.strip().startswith(a) else 0.0)
        for c, a in zip(completions, answer)
    ]


def write_task(directory: Path, args) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (directory / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "corpus.txt").write_text(" ".join(f"{a}+{b}={a + b}" for a in range(10) for b in range(10)) * 5)
    train_tokenizer(directory / "corpus.txt", 64, directory / "tokenizer.json")
    config = {
        "model": {"preset": args.model},
        "data": {"dataset": str(directory / "prompts.jsonl"), "format": "prompt", "seq_len": 16,
                 "tokenizer": str(directory / "tokenizer.json")},
        "train": {
            "objective": "grpo", "steps": args.steps, "batch_size": 32, "lr": args.lr, "warmup_steps": 2,
            "seed": args.seed,
            "grpo": {"num_generations": 8, "max_prompt_length": 8, "max_completion_length": 4,
                     "reward_funcs": ["grpo_toy:digit_then_sum"], "log_completions_every": 50},
        },
        "precision": {"compute_dtype": "float32"},
        "device": args.device,
        "output_dir": str(directory / "run"),
    }  # fmt: skip
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--window", type=int, default=50, help="steps a row's mean reward covers")
    parser.add_argument("--keep", default=None, help="copy the run's loss.png (its reward curve) here")
    parser.add_argument("--out", default="benchmarks/results/grpo-toy.json")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp())
    config = write_task(directory, args)
    start = time.perf_counter()
    if megatrain(["train", "--config", str(config)]) != 0:
        raise SystemExit("the run failed")
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (directory / "run" / "metrics.jsonl").read_text().splitlines()]
    results = []
    for first in range(0, len(rows), args.window):
        part = rows[first : first + args.window]
        step_s = sum(r["step_time_s"] for r in part) / len(part)
        results.append({
            "system": "megatrain", "model": args.model, "scope": f"GRPO toy task, steps {first + 1}-{first + len(part)}",
            "tokens_per_step": part[0]["tokens"], "step_time_s": round(step_s, 4),
            "tokens_per_s": round(part[0]["tokens"] / step_s), "model_tflops": None,
            "reward_mean": round(sum(r["reward"] for r in part) / len(part), 4),
            "frac_reward_zero_std": round(sum(r["frac_reward_zero_std"] for r in part) / len(part), 3),
        })  # fmt: skip
    if args.keep:
        Path(args.keep).write_bytes((directory / "run" / "loss.png").read_bytes())
    payload = {
        "benchmark": f"GRPO on a toy task from random weights: {args.model}, {args.steps} steps",
        "machine": machine(),
        "commands": [" ".join(["python", *sys.argv])],
        "notes": [
            f"the whole run took {seconds:.0f} s (generation, rewards and training); step_time_s is the training "
            "step alone; reward_mean: the completions' mean reward over the row's steps (0.2 a digit, 1.2 the sum)"
        ],
        "results": results,
    }
    write_results(Path(args.out), payload)
    for row in results:
        print(f"{row['scope']}: mean reward {row['reward_mean']}")


if __name__ == "__main__":
    main()
