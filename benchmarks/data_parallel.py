"""Data-parallel throughput: run alone for one GPU, under torchrun for several; the same model,
the same tokens per step per GPU. Rank 0 prints one JSON row (and appends it to --out).

    python benchmarks/data_parallel.py --model qwen2.5-7b --tokens-per-gpu 65536 --out dp.json
    torchrun --standalone --nproc-per-node 2 benchmarks/data_parallel.py --model qwen2.5-7b --tokens-per-gpu 65536 --out dp.json
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import base_row, machine, steady_steps  # noqa: E402
from throughput import BenchTrainer, random_batch  # noqa: E402

from megatrain.config import (  # noqa: E402
    Config,
    DataSection,
    EngineSection,
    ModelSection,
    PrecisionSection,
    TrainSection,
)
from megatrain.step import StepBatch


def arguments():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--tokens-per-gpu", type=int, default=65536)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--grad-clip", type=float, default=0.0)
    parser.add_argument("--trace-dir", default=None, help="write each rank's Chrome trace of the last step here")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def bench_config(args, n_seqs: int) -> Config:
    """A step of `n_seqs` sequences over all the GPUs, bfloat16 on CUDA, its outputs in a fresh temporary folder."""
    return Config(
        model=ModelSection(preset=args.model),
        data=DataSection(seq_len=args.seq_len),
        train=TrainSection(
            steps=10**6,
            batch_size=n_seqs,
            micro_batch_size=args.micro_batch,
            grad_clip=args.grad_clip,
            lr=1e-5,
            schedule="constant",
        ),
        precision=PrecisionSection("bfloat16"),
        engine=EngineSection(trace=args.trace_dir is not None),
        device="cuda",
        output_dir=tempfile.mkdtemp(),
    )


def main():
    args = arguments()
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    n_seqs = gpus * args.tokens_per_gpu // args.seq_len
    config = bench_config(args, n_seqs)
    start = time.perf_counter()
    trainer = BenchTrainer(config)
    setup_s = time.perf_counter() - start
    model = trainer.model_config
    generator = torch.Generator().manual_seed(0)  # every rank draws the same global batch

    def batch():
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=generator)))
        return random_batch(n_seqs, args.seq_len, model.vocab_size)

    timing = steady_steps(trainer, lambda: StepBatch(*batch()), args.steps, args.warmup)
    step_s, losses = timing["step_s"], timing["losses"]
    if args.trace_dir:
        rank = 0 if trainer.ranks is None else trainer.ranks.rank
        trainer.timeline.write_chrome_trace(Path(args.trace_dir) / f"trace-{args.model}-{gpus}gpu-rank{rank}.json")
    if trainer.sync is not None:
        trainer.sync.barrier()
    if trainer.is_main:
        row = base_row("megatrain", args.model, model, args.seq_len, n_seqs, args.micro_batch, step_s)
        row |= {
            "gpus": gpus,
            "tokens_per_gpu": args.tokens_per_gpu,
            "host_bytes_per_param": round(trainer.host_bytes() / model.n_params, 2),
            "setup_s": round(setup_s, 1),
            "losses": [round(x, 4) for x in losses],
            "machine": machine(),
        }
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as handle:
                handle.write(json.dumps(row) + "\n")
    trainer.close()


if __name__ == "__main__":
    main()
