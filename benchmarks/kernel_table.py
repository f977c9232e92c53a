"""Where the milliseconds of a training step go, by kind of kernel: one profiled step of megatrain
(random weights and tokens, as throughput.py), its device time summed per kernel kind (GEMMs,
attention, compiled elementwise, eager elementwise, reductions, copies each way) and per step.
Run it at two commits for a before/after table. On a machine without a GPU it profiles the CPU
ops instead (a smoke run of the tooling, not a measurement).

    python benchmarks/kernel_table.py --model qwen2.5-7b --seq-len 4096 --tokens 32768 \
        --out benchmarks/results/kernels-qwen2.5-7b-h100.json
"""

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, write_results  # noqa: E402
from throughput import BenchTrainer, random_batch  # noqa: E402

from megatrain.config import Config, DataSection, EngineSection, ModelSection, PrecisionSection, TrainSection  # noqa: E402
from megatrain.step import StepBatch
from megatrain_zoo import preset  # noqa: E402

# (kind, pattern over the lower-cased kernel or op name), first match wins
KINDS = [
    ("copy host->GPU", r"memcpy htod"),
    ("copy GPU->host", r"memcpy dtoh"),
    ("copy on the GPU", r"memcpy dtod|memset"),
    ("attention", r"flash|fmha|sdpa|attention|flex"),
    ("matmul (GEMM)", r"gemm|nvjet|cutlass|xmma|gemv|cublas|aten::mm$|aten::addmm|aten::bmm|_grouped_mm"),
    ("compiled elementwise (Inductor)", r"triton|cpp_fused|compiledfunction"),
    ("reductions (norms, softmax, loss)", r"reduce|norm|softmax|logsumexp|aten::sum|aten::mean"),
    ("gather, scatter, index", r"index|scatter|gather|embedding|unique|sort"),
    ("eager elementwise and casts", r"elementwise|vectorized|unrolled|copy|aten::"),
]


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, lowered)), "other")


def kernel_table(events, steps: int, on_device: bool) -> tuple[list[dict], dict]:
    """Rows of (kind, ms per step, share, kernels per step), largest first, and the 25 largest kernels
    by name (ms per step, with their kind)."""
    totals: dict[str, list[float]] = {}
    by_name: dict[str, float] = {}
    for event in events:
        if on_device and getattr(event, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue  # a CPU op's self device time is its kernels', which come as events of their own
        micros = event.self_device_time_total if on_device else event.self_cpu_time_total
        if micros <= 0:
            continue
        kind = kind_of(event.key)
        total = totals.setdefault(kind, [0.0, 0])
        total[0] += micros
        total[1] += event.count
        by_name[event.key] = by_name.get(event.key, 0.0) + micros
    busy = sum(t[0] for t in totals.values()) or 1.0
    rows = [
        {
            "kind": kind,
            "ms_per_step": round(t[0] / steps / 1e3, 2),
            "share": round(t[0] / busy, 4),
            "count": t[1] // steps,
        }
        for kind, t in sorted(totals.items(), key=lambda item: -item[1][0])
    ]
    largest = sorted(by_name.items(), key=lambda item: -item[1])[:25]
    return rows, [
        {"kernel": name[:160], "kind": kind_of(name), "ms_per_step": round(us / steps / 1e3, 2)} for name, us in largest
    ]


def op_table(events, steps: int, top: int) -> list[dict]:
    """The `top` operators (aten ops, compiled graphs, autograd nodes' ops) by the device time of the kernels they
    launched themselves: which op an eager kernel of the kind table came from."""
    cpu = torch.autograd.DeviceType.CPU
    ops = [e for e in events if getattr(e, "device_type", cpu) == cpu and e.self_device_time_total > 0]
    ops.sort(key=lambda e: -e.self_device_time_total)
    return [
        {
            "op": e.key[:160],
            "kind": kind_of(e.key),
            "ms_per_step": round(e.self_device_time_total / steps / 1e3, 2),
            "calls_per_step": e.count // steps,
        }
        for e in ops[:top]
    ]


def profiled_steps(args, on_device: bool):
    """The profiler's events of `args.steps` steps of megatrain on `args.model` after `args.warmup` unprofiled
    ones, and the seconds a profiled step took."""
    model = preset(args.model)
    n_seqs = args.tokens // args.seq_len
    config = Config(
        model=ModelSection(preset=args.model),
        data=DataSection(seq_len=args.seq_len),
        train=TrainSection(
            steps=10**6,
            batch_size=n_seqs,
            micro_batch_size=args.micro_batch,
            grad_clip=args.grad_clip,
            schedule="constant",
        ),
        precision=PrecisionSection("bfloat16" if on_device else "float32"),
        engine=EngineSection(),
        device="cuda" if on_device else "cpu",
        output_dir=str(Path(args.out).parent if args.out else Path.cwd()),
    )
    trainer = BenchTrainer(config, model)
    for _ in range(args.warmup):
        trainer.train_step(StepBatch(*random_batch(n_seqs, args.seq_len, model.vocab_size)[:2]))
    trainer.finish_updates()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as profiler:
        start = time.perf_counter()
        for _ in range(args.steps):
            trainer.train_step(StepBatch(*random_batch(n_seqs, args.seq_len, model.vocab_size)[:2]))
        trainer.finish_updates()
        if on_device:
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - start) / args.steps
    trainer.close()
    return profiler.key_averages(), step_s


def print_tables(result: dict) -> None:
    print("| kind | ms per step | share | kernels per step |\n| --- | ---: | ---: | ---: |")
    for row in result["kinds"]:
        print(f"| {row['kind']} | {row['ms_per_step']} | {100 * row['share']:.1f}% | {row['count']} |")
    for kernel in result["largest_kernels"]:
        print(f"{kernel['ms_per_step']:9.2f} ms  {kernel['kind']:<34} {kernel['kernel'][:110]}")
    for op in result["largest_ops"]:
        print(f"{op['ms_per_step']:9.2f} ms  {op['calls_per_step']:6d} calls  {op['op'][:120]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward/backward pass")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--grad-clip", type=float, default=1.0, help="global-norm clipping, as users run (0: off)")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps")
    parser.add_argument("--out", default=None)
    parser.add_argument("--top-ops", type=int, default=40, help="operators listed by the device time they launched")
    args = parser.parse_args()
    on_device = torch.cuda.is_available()
    events, step_s = profiled_steps(args, on_device)
    rows, largest = kernel_table(events, args.steps, on_device)
    result = {
        "benchmark": "kernel_table",
        "machine": machine(),
        "args": vars(args),
        "timed": "device time of kernels and copies" if on_device else "CPU op self time (no GPU: a smoke run)",
        "profiled_step_s": round(step_s, 3),  # with the profiler's overhead: compare kinds, not this
        "kinds": rows,
        "largest_kernels": largest,
        "largest_ops": op_table(events, args.steps, args.top_ops) if on_device else [],
        "command": "python benchmarks/kernel_table.py " + " ".join(sys.argv[1:]),
    }
    if args.out:
        write_results(Path(args.out), result)
    print_tables(result)


if __name__ == "__main__":
    main()
