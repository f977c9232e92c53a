"""The MoE dispatch's copy of each token's row to its k choices' rows on the GPU, at a preset's shapes: the gather
of each row's token (`index_select`, the engine before) against the kernel that reads each token's row once and
writes it k times (`expert_kernels.copy_to_rows`) at the tiles it is swept over, with the bytes each moves and the
rate (GB/s) of the bytes the kernel must move (h read once, the rows written once). A MoE layer's pass makes three
such copies: the forward's dispatch, its repeat in the backward, and the combine's backward.

    python benchmarks/expert_dispatch.py --models olmoe-1b-7b,qwen3-30b-a3b,deepseek-v3 --tokens 16384,32768 [--out FILE]
"""

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, write_results  # noqa: E402

from megatrain_templates import expert_kernels  # noqa: E402
from megatrain_templates.grouped_experts import _Slots  # noqa: E402
from megatrain_zoo import preset  # noqa: E402

REPEATS = 20
# (tokens, columns, warps) a program: the sweep
TILES = [(1, 2048, 4), (2, 1024, 4), (4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8), (16, 256, 4)]


def time_shape(model: str, tokens: int, d: int, n_experts: int, k: int) -> list[dict]:
    """Rows for one shape: the gather's time and each tile's, each output checked equal to the gather's."""
    h = torch.randn(tokens, d, device="cuda").bfloat16()
    choices = torch.rand(tokens, n_experts, device="cuda").topk(k, dim=-1).indices
    slots = _Slots.of_choices(choices, n_experts, 0, 0, None, grouped=True)
    want = h.index_select(0, slots.token)
    needed_gb = (h.numel() + want.numel()) * h.element_size() / 1e9
    scope = f"the dispatch's copy [{tokens}, {d}] to {slots.rows} rows"
    engines = {"index_select (the gather by each row's token)": lambda: h.index_select(0, slots.token)}
    for tile in TILES:
        engines[f"copy_to_rows ({tile[0]} tokens x {tile[1]} columns, {tile[2]} warps)"] = functools.partial(
            expert_kernels.copy_to_rows, h, slots.inverse, slots.rows, slots.k, tile
        )
    results = []
    for engine, copy in engines.items():
        assert torch.equal(copy(), want), f"{engine}: the copied rows differ"
        ms = time_ms(copy, REPEATS)
        results.append(
            {"system": "megatrain", "model": model, "scope": scope, "engine": engine, "tokens_per_step": tokens,
             "step_time_s": None, "tokens_per_s": None, "model_tflops": None, "copy_ms": round(ms, 4),
             "needed_gb": round(needed_gb, 3), "needed_gbps": round(needed_gb / ms * 1e3, 1)}
        )  # fmt: skip
        print(results[-1], flush=True)
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="olmoe-1b-7b,qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--tokens", default="16384,32768", help="tokens in the micro-batch, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = []
    for model in args.models.split(","):
        config = preset(model)
        for tokens in map(int, args.tokens.split(",")):
            results += time_shape(model, tokens, config.d_model, config.n_experts, config.n_experts_per_tok)
    if args.out:
        write_results(
            Path(args.out), {"benchmark": "the MoE dispatch's copy", "machine": machine(), "results": results}
        )


if __name__ == "__main__":
    main()
