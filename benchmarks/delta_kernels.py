"""The chunked delta rule's Triton kernels (`megatrain_templates.delta_kernels`) alone, at a preset's Gated
DeltaNet shape: each kernel's share of the rule's forward and backward (a kept layer's two passes) by the
profiler; with `--sweep`, each kernel's time, registers and spills per launch configuration, its outputs checked
against the default launch's; then the rule's two passes with the default launches against each kernel's
fastest, and the `LAUNCH` table that names them.

    python benchmarks/delta_kernels.py --models qwen3.5-0.8b,qwen3.5-27b --sweep --out dk.json
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, table, write_results  # noqa: E402

from megatrain_templates import delta_kernels as dk  # noqa: E402
from megatrain_zoo import preset  # noqa: E402
from megatrain_zoo.model import block_shape  # noqa: E402

CHUNK = 64
# Each kernel's launches to try: (block_v, key_step, warps, stages)
SWEEP = {
    name: [dk.Launch(*launch) for launch in itertools.product(*choices)]
    for name, choices in {
        "state_pass_forward": ([64], [None], [None, 4], [2, 3]),
        "state_pass_backward": ([64], [None], [None, 4], [2, 3]),
        "chunk_prepare": ([32, 64, 128], [None], [4, 8], [1, 3]),
        "chunk_backward_prepare": ([32, 64, 128], [None], [4, 8], [1, 3]),
        "chunk_output": ([32, 64, 128], [None], [4, 8], [1, 3]),
        "chunk_backward_states": ([32, 64], [128, 64, 32], [4, 8, 16], [1, 2]),
        "chunk_backward_ut": ([None], [128, 64, 32], [4, 8, 16], [1, 2]),
    }.items()
}


class Recording:
    """A Triton kernel whose launches keep the compiled kernel they ran (its registers and spills)."""

    def __init__(self, kernel):
        self.kernel, self.last = kernel, None

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.last = self.kernel[grid](*args, **kwargs)
            return self.last

        return launch


def rule_inputs(model_name: str, micro_batch: int, seq_len: int, device: str = "cuda") -> dict:
    """The rule's inputs in the kernels' layout ([batch, heads, chunks, chunk, d], fp32) at the model's shape."""
    model = preset(model_name)
    shape = block_shape(model, model.linear_attention_layers[0]).linear_attention
    lead = (micro_batch, shape.n_value_heads, seq_len // CHUNK, CHUNK)

    def randn(d):
        return torch.randn(*lead, d, device=device)

    return {
        "q": F.normalize(randn(shape.key_head_dim), dim=-1) * shape.key_head_dim**-0.5,
        "k": F.normalize(randn(shape.key_head_dim), dim=-1),
        "v": randn(shape.value_head_dim),
        "log_decay": -torch.rand(lead, device=device) * 0.5,
        "beta": torch.rand(lead, device=device),
        "d_out": randn(shape.value_head_dim),
    }


def passes(x: dict) -> dict:
    """Each kernel's call (its wrapper's) in the order a kept layer's forward and backward run them, each on what
    the calls before it made (named `keys`): name -> call."""
    calls, made = {}, {}

    def step(name, call, keys):
        made.update(zip(keys, call()))
        calls[name] = call

    q, k, v, log_decay, beta, d_out = (x[n] for n in ("q", "k", "v", "log_decay", "beta", "d_out"))
    step("chunk_prepare", lambda: dk.chunk_prepare(k, v, log_decay, beta, None, True),
         ("u", "w", "k_end", "carry", "ut"))  # fmt: skip
    step("state_pass_forward", lambda: dk.state_pass(made["w"], made["u"], made["k_end"], made["carry"], True),
         ("states", "delta"))  # fmt: skip
    step("chunk_output", lambda: (dk.chunk_output(q, k, log_decay, made["states"], made["delta"], None, True),),
         ("out",))  # fmt: skip
    step("chunk_backward_prepare", lambda: dk.chunk_backward_prepare(q, k, log_decay, beta, made["ut"], None, d_out, True),
         ("w", "k_end", "carry", "d_states", "d_delta"))  # fmt: skip
    step("state_pass_backward", lambda: dk.state_pass_backward(
        made["w"], made["k_end"], made["carry"], made["d_states"], made["d_delta"], True), ("d_u", "d_leaving"))  # fmt: skip
    step("chunk_backward", lambda: dk.chunk_backward(
        q, k, v, log_decay, beta, made["ut"], made["states"], made["delta"], d_out, made["d_u"], made["d_leaving"],
        None, True), ("d_q", "d_k", "d_v", "d_log_decay", "d_beta"))  # fmt: skip
    return calls


def wrapper_of(kernel: str) -> str:
    return "chunk_backward" if kernel in ("chunk_backward_states", "chunk_backward_ut") else kernel


def largest_difference(got, want) -> float:
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True))


def profile_shares(calls: dict) -> dict:
    """CUDA ms per kernel over one forward and backward, by the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for call in calls.values():
            call()
        torch.cuda.synchronize()
    return {
        e.key: round(e.device_time_total / 1e3, 3)
        for e in prof.key_averages()
        if any(e.key.startswith(name) for name in dk.LAUNCH)
    }


def sweep_kernel(kernel: str, calls: dict, recording: Recording) -> tuple[list[dict], dk.Launch]:
    """Each launch of `SWEEP[kernel]`: ms of its wrapper (and of the default launch's), registers, spills and its
    outputs' largest relative difference from the default launch's; and the fastest launch whose outputs agree."""
    call = calls[wrapper_of(kernel)]
    default, want, rows = dk.LAUNCH[kernel], call(), []
    default_ms, fastest = time_ms(call, repeats=20), (float("inf"), default)
    for launch in SWEEP[kernel]:
        dk.LAUNCH[kernel] = launch
        try:
            difference = largest_difference(call(), want)
            ms = time_ms(call, repeats=20)
        except Exception as error:  # a launch that does not compile or fit (shared memory, registers)
            rows.append({"kernel": kernel, "launch": str(tuple(launch)), "error": str(error).splitlines()[0][:120]})
            continue
        finally:
            dk.LAUNCH[kernel] = default
        compiled = recording.last
        rows.append({
            "kernel": kernel, "launch": str(tuple(launch)), "ms": round(ms, 3), "of_default": round(ms / default_ms, 3),
            "regs": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None),
            "difference": float(f"{difference:.2e}"),
        })  # fmt: skip
        if difference < 1e-4 and ms < fastest[0]:
            fastest = (ms, launch)
    return rows, fastest[1]


def two_passes_ms(calls: dict) -> float:
    return time_ms(lambda: [call() for call in calls.values()], repeats=10)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3.5-0.8b,qwen3.5-27b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--sweep", action="store_true", help="time every launch of SWEEP per kernel")
    parser.add_argument("--kernels", default=",".join(SWEEP), help="the kernels --sweep takes (comma-separated)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    from megatrain_templates import delta_triton  # imports Triton, which only a GPU machine need have

    recordings = {name: Recording(getattr(delta_triton, name)) for name in dk.LAUNCH}
    for name, recording in recordings.items():
        setattr(delta_triton, name, recording)
    rows = []
    for model in args.models.split(","):
        calls = passes(rule_inputs(model, args.micro_batch, args.seq_len))
        tokens = args.micro_batch * args.seq_len
        base = {"system": "megatrain", "model": model, "tokens_per_step": tokens, "tokens_per_s": None,
                "model_tflops": None, "seq_len": args.seq_len, "micro_batch_seqs": args.micro_batch}  # fmt: skip
        shares = profile_shares(calls)
        print(model, "CUDA ms per kernel, one forward and backward:", shares, flush=True)
        default_ms = two_passes_ms(calls)
        rows.append(base | {"scope": "delta rule kernels: forward and backward", "step_time_s": default_ms / 1e3,
                            "engine": "default launches", "kernel_ms": shares})  # fmt: skip
        if not args.sweep:
            continue
        fastest = {}
        for kernel in args.kernels.split(","):
            kernel_rows, fastest[kernel] = sweep_kernel(kernel, calls, recordings[kernel])
            print(table(kernel_rows, ["kernel", "launch", "ms", "of_default", "regs", "spills", "difference"]))
            rows += [base | {"scope": f"delta rule kernel {kernel}", "step_time_s": r["ms"] / 1e3} | r
                     for r in kernel_rows if "ms" in r]  # fmt: skip
        default_launch = dict(dk.LAUNCH)
        dk.LAUNCH.update(fastest)
        tuned_ms = two_passes_ms(calls)
        print(model, f"forward and backward: default launches {default_ms:.3f} ms, fastest each {tuned_ms:.3f} ms")
        print("LAUNCH =", {k: tuple(v) for k, v in dk.LAUNCH.items()}, flush=True)
        rows.append(base | {"scope": "delta rule kernels: forward and backward", "step_time_s": tuned_ms / 1e3,
                            "engine": f"fastest launch each: {dict((k, tuple(v)) for k, v in dk.LAUNCH.items())}"})  # fmt: skip
        dk.LAUNCH.update(default_launch)
    if args.out:
        arguments = vars(args) | {"out": str(args.out)}
        write_results(
            args.out, {"benchmark": "delta_kernels", "machine": machine(), "args": arguments, "results": rows}
        )


if __name__ == "__main__":
    main()
