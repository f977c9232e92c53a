"""The experts' weight gradients of one micro-batch added into their fp32 buffer: torch._grouped_mm's bf16
product added afterwards (the engine before) against the grouped Triton kernel that accumulates in fp32
(`megatrain_templates.expert_kernels`), per tile configuration, at a preset's expert shapes; each checked
against float64.

    python benchmarks/expert_grad.py --models olmoe-1b-7b,qwen3-30b-a3b,deepseek-v3 --tokens 16384 [--out FILE]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, write_results  # noqa: E402

from megatrain_templates.expert_kernels import Tiles, add_grouped_weight_grad_  # noqa: E402
from megatrain_zoo import preset  # noqa: E402

SAMPLE = 4  # experts checked against float64
# (block_m, block_n, block_k, warps, stages, tma). The H100's sweep of 2026-11-28 (without TMA) chose 128 x 128 x 64,
# 4 warps, 3 stages; the rest of it (128 x 256 and 256 x 128 tiles, 8 warps, 2-4 stages, 32 and 128 rows a step) ran
# slower at 16k tokens. On an H200 (2026-12-03) TMA's reads made that tile 2-3% faster; the accumulator started from
# the buffer's tile (its load before the rows) ran 4-12% slower (results/expert-grad-tma-h200.json). With more rows an
# expert the wide tile wins (`expert_kernels.tiles_for`; results/expert-grad-tiles-h200.json). A persistent kernel (one
# program per SM, descriptors made on the GPU per expert, the next item's loads pipelined under a tile's fp32
# read-add-write) ran no faster at 32k tokens on an H100 (results/expert-grad-persistent-h100.json; code in 55b3532)
# Triton's warp specialization of the TMA loop (tl.range(..., warp_specialize=True), a warp group loading while the
# others multiply) ran gate-up's as fast as without it at 32k tokens on an H100, down's 2.5% faster
# (results/rejected/expert-grad-warp-specialize-h100.json; code in 7f08eea)
CONFIGS = [
    Tiles(128, 128, 64, 4, 3),
    Tiles(128, 128, 64, 4, 3, tma=True),
    Tiles(128, 256, 64, 8, 3, tma=True),
    Tiles(256, 128, 64, 8, 3, tma=True),
]


def routed_rows(tokens: int, n_experts: int, top_k: int) -> torch.Tensor:
    """[n_experts] int32 end rows of a random top-k routing of `tokens` tokens (the top-k of random logits)."""
    choice = torch.randn(tokens, n_experts, device="cuda").topk(top_k, dim=-1).indices
    return torch.bincount(choice.reshape(-1), minlength=n_experts).cumsum(0).to(torch.int32)


def relative_error(into: torch.Tensor, start: torch.Tensor, a, b, ends) -> float:
    """|into - (start + a^T b)| / |that| over the first `len(start)` experts (a sample: DeepSeek-V3's whole
    gradient is 30 GB in fp32), the reference in float64 on the GPU."""
    want, first = start.double(), 0
    for e, end in enumerate(ends[: len(start)].tolist()):
        want[e] += a[first:end].double().T @ b[first:end].double()
        first = end
    return ((into[: len(start)].double() - want).norm() / want.norm()).item()


def time_projection(name: str, rows: int, m: int, n: int, ends: torch.Tensor) -> list[dict]:
    """Rows for one projection's gradient: into [n_experts, m, n] += a^T b, a [rows, m], b [rows, n]."""
    n_experts = ends.numel()
    a = torch.randn(rows, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    into = torch.randn(n_experts, m, n, device="cuda")
    start = into[:SAMPLE].clone()
    flops = 2 * rows * m * n
    results = []

    def row(engine, ms, error):
        results.append(
            {"projection": name, "engine": engine, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
             "relative_error": error}
        )  # fmt: skip
        print(results[-1], flush=True)

    def grouped_then_add():
        into.add_(torch._grouped_mm(a.T, b, offs=ends))

    grouped_then_add()
    error = relative_error(into, start, a, b, ends)
    row("grouped_mm + add", time_ms(grouped_then_add), error)
    for config in CONFIGS:
        into[:SAMPLE].copy_(start)
        try:
            add_grouped_weight_grad_(into, a, b, ends, config)
        except Exception as error:  # a tile too large for shared memory at this shape: report, go on
            print(config, "failed:", str(error).splitlines()[0], flush=True)
            continue
        error = relative_error(into, start, a, b, ends)
        row(f"kernel {tuple(config)}", time_ms(lambda: add_grouped_weight_grad_(into, a, b, ends, config)), error)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the micro-batch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in args.models.split(","):
        config = preset(model)
        ends = routed_rows(args.tokens, config.n_experts, config.n_experts_per_tok)
        routed = args.tokens * config.n_experts_per_tok
        # stored [n_experts, out, in]: gate-up's gradient is grad^T x, down's grad^T act
        d_ff = config.moe_d_ff
        for name, m, n in (("gate_up", 2 * d_ff, config.d_model), ("down", config.d_model, d_ff)):
            for result in time_projection(name, routed, m, n, ends):
                rows.append({"system": "megatrain", "model": model, "tokens_per_step": args.tokens,
                             "step_time_s": result["ms"] / 1e3, "tokens_per_s": None, "model_tflops": None,
                             "scope": f"one micro-batch's expert weight gradient ({name})", **result})  # fmt: skip
    if args.out:
        write_results(Path(args.out), {"benchmark": "expert weight gradients into fp32", "machine": machine(),
                                       "results": rows})  # fmt: skip


if __name__ == "__main__":
    main()
