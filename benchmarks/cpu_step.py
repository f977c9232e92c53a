"""megatrain's training step on the CPU (no GPU): a preset's steps on random tokens, timed after a warm-up step,
as `megatrain bench` runs them, one row per run. Run it with another tree's packages on PYTHONPATH to compare two
engines on the same machine (`--engine` labels the row).

    python benchmarks/cpu_step.py --model qwen2.5-0.5b --seq-len 128 --batch 2 --steps 3 --engine HEAD --out OUT.json
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import base_row, machine, write_results  # noqa: E402

from megatrain.config import load_config  # noqa: E402
from megatrain.step import StepBatch  # noqa: E402
from megatrain.trainer import Trainer  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2, help="sequences a step, one micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    parser.add_argument("--engine", default="this tree", help="which tree's packages ran (the row's label)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    settings = [f"model.preset={args.model}", "device=cpu", f"data.seq_len={args.seq_len}", "train.grad_clip=1.0"]
    settings += [f"train.batch_size={args.batch}", f"train.micro_batch_size={args.batch}"]
    trainer = Trainer(load_config(None, settings))
    seconds = []
    for step in range(args.steps + 1):
        ids = torch.randint(0, trainer.model_config.vocab_size, (args.batch, args.seq_len))
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        start = time.perf_counter()
        trainer.train_step(StepBatch(ids, labels))
        trainer.finish_updates()
        if step:  # (the first step warms up)
            seconds.append(time.perf_counter() - start)
    trainer.close()
    row = base_row("megatrain", args.model, trainer.model_config, args.seq_len, args.batch, args.batch,
                   statistics.median(seconds))  # fmt: skip
    row |= {"engine": args.engine, "grad_clip": 1.0, "step_times_s": [round(s, 3) for s in seconds]}
    predicted = trainer.plan.step_s  # (from the rates the run measured at its shape)
    row |= {"predicted_step_s": round(predicted, 3), "prediction_error": round(predicted / row["step_time_s"] - 1, 3)}
    print(row)
    payload = {"benchmark": "megatrain's training step on the CPU", "machine": machine(), "notes": [], "results": [row]}
    write_results(Path(args.out), payload)


if __name__ == "__main__":
    main()
