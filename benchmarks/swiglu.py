"""SwiGLU alone on the GPU at a preset's shapes: Inductor's compiled silu(gate) * up (the engine before) against the
SwiGLU Triton kernels (`megatrain_templates.swiglu_kernels`), forward and forward + backward, the dense MLP's
[tokens, 2 * d_ff] and, for a MoE preset, the experts' [tokens * top_k, 2 * moe_d_ff] times each row's routing
weight (whose gradient the backward makes too); each with the largest difference of the two outputs.

    python benchmarks/swiglu.py --models qwen2.5-7b,olmoe-1b-7b,qwen3-30b-a3b --tokens 16384 [--out FILE]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, write_results  # noqa: E402

from megatrain_templates.ops import compile_once, swiglu_written_out  # noqa: E402
from megatrain_templates.swiglu_kernels import BLOCK, WARPS, SwiGLU  # noqa: E402
from megatrain_zoo import preset  # noqa: E402

REPEATS = 20


def time_shape(model: str, what: str, tokens: int, rows: int, d_ff: int, weighted: bool) -> list[dict]:
    """Rows for one shape: each engine's forward and forward + backward (ms), and how far the outputs differ."""
    gate_up = (torch.randn(rows, 2 * d_ff, device="cuda") * 2).bfloat16().requires_grad_(True)
    weight = torch.rand(rows, 1, device="cuda").bfloat16().requires_grad_(True) if weighted else None
    grad = torch.randn(rows, d_ff, device="cuda").bfloat16()
    inputs = [t for t in (gate_up, weight) if t is not None]
    engines = {"inductor": compile_once(swiglu_written_out), f"kernels ({BLOCK} columns, {WARPS} warps)": SwiGLU.apply}
    outputs, results = {}, []
    for engine, fn in engines.items():
        outputs[engine] = fn(*inputs).float()

        def both(fn=fn):
            torch.autograd.grad(fn(*inputs), inputs, grad)

        forward_ms = time_ms(lambda fn=fn: fn(*[t.detach() for t in inputs]), REPEATS)
        results.append(
            {"system": "megatrain", "model": model, "scope": f"SwiGLU alone: {what} [{rows}, 2 x {d_ff}]",
             "engine": engine, "tokens_per_step": tokens, "step_time_s": None, "tokens_per_s": None,
             "model_tflops": None, "forward_ms": round(forward_ms, 4),
             "forward_backward_ms": round(time_ms(both, REPEATS), 4)}
        )  # fmt: skip
        print(results[-1], flush=True)
    first, second = outputs.values()
    for row in results:
        row["largest_output_difference"] = float((first - second).abs().max())
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen2.5-7b,olmoe-1b-7b,qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the micro-batch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for model in args.models.split(","):
        config = preset(model)
        if config.n_experts:
            rows = args.tokens * config.n_experts_per_tok
            results += time_shape(model, "the experts' rows, weighted", args.tokens, rows, config.moe_d_ff, True)
        if not config.n_experts or config.dense_layers:
            results += time_shape(model, "the dense MLP", args.tokens, args.tokens, config.d_ff, False)
    if args.out:
        write_results(Path(args.out), {"benchmark": "SwiGLU alone", "machine": machine(), "results": results})


if __name__ == "__main__":
    main()
