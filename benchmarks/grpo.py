"""GRPO's speed on one GPU: a rollout of --prompts x --generations completions generated from the current weights
(the decoder layers resident on the GPU, and streamed layer by layer from host memory), then the GRPO step that
trains on them; the share of the step each phase takes. Random weights and prompts, of lengths drawn evenly from
--shortest-prompt to --prompt-len (a batch of them left-padded, as users' prompts are); no stop token, so every
completion runs to --completion-len (the longest case). Streamed generation is timed over its first
--streamed-tokens decoding steps (its rate is the PCIe copy of every layer per step, the same at every step).

    python benchmarks/grpo.py --model qwen2.5-1.5b --prompts 64 --generations 8 --prompt-len 128 \
        --completion-len 1024 --out $OUT/grpo-qwen2.5-1.5b.json
    python benchmarks/grpo.py --plot benchmarks/results/grpo-*-h100.json --keep docs/grpo-phases.png
"""

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import base_row, machine, table, write_results  # noqa: E402
from throughput import BenchTrainer, placement_fields  # noqa: E402

from megatrain.config import Config, DataSection, GRPOSection, ModelSection, PrecisionSection, TrainSection  # noqa: E402
from megatrain.rollouts import rows_of  # noqa: E402
from megatrain.step import StepBatch  # noqa: E402
from megatrain_templates import Rollout, group_advantages  # noqa: E402
from megatrain_zoo import preset  # noqa: E402
from megatrain_zoo.generate import Generator, Sampling  # noqa: E402


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(run):
    """(what `run()` returns, its seconds), the GPU's work included; the GPU's peak memory counted from its start
    (the row reads it)."""
    synchronize()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = run()
    synchronize()
    return out, time.perf_counter() - start


def generation_row(args, model, generator, prompts, weights: str, new_tokens: int) -> tuple[dict, list]:
    """Generate `new_tokens` per prompt with `weights` resident or streamed; its row and the completions."""
    generator.weights = weights
    sampling = Sampling(max_new_tokens=new_tokens, temperature=1.0)
    first = None
    if generator.decoding == "compiled":  # (a whole first rollout: it compiles the step for this batch and cache)
        first = timed(lambda: generator.generate(prompts, sampling, pad_id=0, seed=0))[1]
    else:
        generator.generate(prompts[:8], Sampling(max_new_tokens=4), pad_id=0)  # (kernels, host copies made)
    completions, seconds = timed(lambda: generator.generate(prompts, sampling, pad_id=0, seed=1))
    generated = sum(len(c) for c in completions)
    plan = generator.last_plan
    row = base_row(
        "megatrain", model_name(args), model, args.prompt_len + new_tokens, len(prompts), plan.batch, seconds
    )
    row |= {
        "scope": f"generation, weights {weights}" + (", decoding compiled" if plan.compiled else ""),
        "tokens_per_s": round(generated / seconds),  # (generated tokens, the prompts' not counted)
        "model_tflops": None,
        "generated_tokens": generated,
        "kv_batch": plan.batch,
        "plan": plan.reason,
        "first_generation_s": None if first is None else round(first, 2),
    }
    return row, completions


def model_name(args) -> str:
    return args.model + (f" (first {args.layers} layers)" if args.layers else "")


def arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--layers", type=int, default=0, help="keep the first N layers (0: all)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128, help="the longest prompt")
    parser.add_argument("--shortest-prompt", type=int, help="the shortest prompt (default: half --prompt-len)")
    parser.add_argument("--completion-len", type=int, default=1024)
    parser.add_argument("--streamed-tokens", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=4, help="rows per micro-batch of the GRPO step")
    parser.add_argument("--weights", default="resident,streamed")
    parser.add_argument("--decoding", default="eager", help="eager or compiled (resident weights: Generator's)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping (4 B/param less host memory)")
    parser.add_argument("--out", default="benchmarks/results/grpo.json")
    parser.add_argument("--device", default="cuda", help="cuda (a CPU run checks the script only)")
    parser.add_argument("--plot", nargs="*", help="results files to draw the phases of (no run)")
    parser.add_argument("--keep", default="docs/grpo-phases.png")
    return parser.parse_args()


def grpo_trainer(args, model) -> BenchTrainer:
    """A trainer of GRPO steps of --prompts x --generations rows of prompt + completion, random weights."""
    grpo = GRPOSection(
        num_generations=args.generations, max_prompt_length=args.prompt_len, max_completion_length=args.completion_len
    )
    train = TrainSection(
        steps=10**6, batch_size=args.prompts * args.generations, micro_batch_size=args.micro_batch, lr=1e-6,
        grad_clip=args.grad_clip, warmup_steps=0, schedule="constant", objective="grpo", grpo=grpo,
    )  # fmt: skip
    config = Config(
        model=ModelSection(preset=args.model),
        data=DataSection(seq_len=args.prompt_len + args.completion_len),
        train=train,
        precision=PrecisionSection("bfloat16" if args.device == "cuda" else "float32"),
        device=args.device,
        output_dir=tempfile.mkdtemp(),
    )
    return BenchTrainer(config, model)


def training_row(args, model, trainer, prompts, completions) -> dict:
    """One GRPO step on the completions (random rewards), timed after a first step placed for its size."""
    seq_len = args.prompt_len + args.completion_len
    advantages, _ = group_advantages(torch.rand(len(prompts), dtype=torch.float64), args.generations, "group")
    batch = rows_of(prompts, completions, seq_len, pad_id=0)

    def step():
        trainer.train_step(
            StepBatch(batch.input_ids, batch.labels, valid=batch.valid, extras=Rollout(advantages, None))
        )
        trainer.finish_updates()

    step()
    _, step_s = timed(step)
    row = base_row("megatrain", model_name(args), model, seq_len, len(prompts), args.micro_batch, step_s)
    fields = {
        "scope": "GRPO step (training)",
        "grad_clip": args.grad_clip,
        "host_bytes_per_param": round(trainer.store.memory_report().bytes_per_param, 2),
    }
    return row | fields | placement_fields(trainer, step_s)  # (what the timed step ran, and the plan's prediction)


def main():
    args = arguments()
    if args.plot:
        return plot(args.plot, Path(args.keep))
    model = preset(args.model)
    if args.layers:
        model = replace(model, n_layers=args.layers)
    trainer = grpo_trainer(args, model)
    generator = Generator(trainer, decoding=args.decoding)
    shortest = args.prompt_len // 2 if args.shortest_prompt is None else args.shortest_prompt
    lengths = torch.randint(shortest, args.prompt_len + 1, (args.prompts,)).tolist()
    prompts = [torch.randint(3, model.vocab_size, (n,)).tolist() for n in lengths]
    prompts = [p for p in prompts for _ in range(args.generations)]
    rows, completions = [], None
    for weights in args.weights.split(","):
        new = args.completion_len if weights == "resident" else min(args.streamed_tokens, args.completion_len)
        row, made = generation_row(args, model, generator, prompts, weights, new)
        rows.append(row)
        completions = made if new == args.completion_len else completions
        print(f"{row['scope']}: {row['tokens_per_s']:,} tokens/s ({row['plan']})", file=sys.stderr)
    if completions is None:
        completions = [torch.randint(3, model.vocab_size, (args.completion_len,)).tolist() for _ in prompts]
    rows.append(training_row(args, model, trainer, prompts, completions))
    trainer.close()
    phases = [r for r in rows if r["scope"].startswith("generation, weights resident") or r["scope"].startswith("GRPO")]
    if len(phases) == 2:  # one GRPO step's phases: generation (resident), training
        for row in phases:
            row["share_of_grpo_step"] = round(row["step_time_s"] / sum(r["step_time_s"] for r in phases), 3)
    payload = {
        "benchmark": (
            f"GRPO on one GPU: {model_name(args)}, "
            f"{args.prompts} prompts x {args.generations} generations of {args.completion_len} tokens after "
            f"prompts of {shortest}-{args.prompt_len} tokens"
        ),
        "machine": machine(),
        "commands": [" ".join(["python", *sys.argv])],
        "notes": [
            "generation rows: tokens_per_s counts generated tokens; kv_batch the sequences decoded together; "
            f"streamed weights timed over {args.streamed_tokens} decoding steps; first_generation_s: a compiled "
            "decoding's first rollout, which compiles its step. share_of_grpo_step: of one "
            "step of generation (resident) + training (rewards and advantages take milliseconds)"
        ],
        "results": rows,
    }
    write_results(Path(args.out), payload)
    print(table(rows, ["scope", "tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops"]))


def plot(paths: list[str], keep: Path) -> None:
    """A bar per model: one GRPO step's seconds in generation and in training."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = []
    for path in paths:
        rows = json.loads(Path(path).read_text())["results"]
        phases = {r["scope"]: r["step_time_s"] for r in rows if "share_of_grpo_step" in r}
        bars.append((rows[0]["model"], phases))
    figure, axis = plt.subplots(figsize=(8, 1 + 0.6 * len(bars)))
    for index, (_, phases) in enumerate(bars):
        left = 0.0
        for (scope, seconds), color in zip(phases.items(), ("tab:orange", "tab:blue")):
            axis.barh(index, seconds, left=left, color=color, label=scope if index == 0 else None)
            axis.text(left + seconds / 2, index, f"{seconds:.0f} s", ha="center", va="center", color="white")
            left += seconds
    axis.set_yticks(range(len(bars)), [name for name, _ in bars])
    axis.set_xlabel("seconds of one GRPO step (512 completions of 1024 tokens)")
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(keep, dpi=120)
    print(f"wrote {keep}")


if __name__ == "__main__":
    main()
