"""A decoder block's rate by shape: what `megatrain plan` measures at a run's shape (the block's forward,
recompute and backward, the same keeping its matmul products, and the loss head), with the block's GEMMs
alone and its attention alone beside it, for several zoo presets in one process (each shape compiled
afresh).

    python benchmarks/block_shapes.py qwen2.5-0.5b:2048:8 qwen2.5-7b:4096:4 --out shapes.json
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, table, write_results  # noqa: E402

from megatrain_plan.rates import measure_block_rates  # noqa: E402
from megatrain_zoo import preset  # noqa: E402


def gemms_alone(model, tokens: int) -> float:
    """The block's GEMMs as the engine runs them: forward, the recompute (all but the down projection) and
    both backward products."""
    d, ff, q, kv = model.d_model, model.d_ff, model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    operands = []
    for k, n, recomputed in [(d, q + 2 * kv, True), (q, d, True), (d, 2 * ff, True), (ff, d, False)]:
        x, w, dy = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in [(tokens, k), (n, k), (tokens, n)]
        )
        operands.append((x, w, dy, recomputed))

    def run():
        for x, w, dy, recomputed in operands:
            for _ in range(2 if recomputed else 1):
                x @ w.t()
            dy @ w
            dy.t() @ x

    return time_ms(run) / 1e3


def attention_alone(model, seq_len: int, micro_batch: int) -> float:
    """Causal SDPA forward (and its recompute) and backward at the block's head shape."""
    q = torch.randn(micro_batch, model.n_heads, seq_len, model.head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn(micro_batch, model.n_kv_heads, seq_len, model.head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()

    def run():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    return time_ms(run) / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", help="PRESET:SEQ_LEN:MICRO_BATCH")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        name, seq_len, micro_batch = shape.split(":")
        seq_len, micro_batch = int(seq_len), int(micro_batch)
        model = preset(name)
        torch._dynamo.reset()  # each shape compiles as a run of it would: alone, static
        block_tflops, kept_tflops, head_tflops, layer_pass = measure_block_rates(model, seq_len, micro_batch)
        rows.append(
            {
                "model": name,
                "seq_len": seq_len,
                "micro_batch_seqs": micro_batch,
                "d_model": model.d_model,
                "d_ff": model.d_ff,
                "block_tflops": block_tflops,
                "kept_layer_tflops": kept_tflops,  # its matmul products kept: no GEMM recomputed
                "head_tflops": head_tflops,
                "block_ms": round(time_ms(layer_pass), 2),
                "gemms_alone_ms": round(gemms_alone(model, seq_len * micro_batch) * 1e3, 2),
                "attention_alone_ms": round(attention_alone(model, seq_len, micro_batch) * 1e3, 2),
            }
        )
        print(rows[-1], flush=True)
        del layer_pass
        torch.cuda.empty_cache()
    print(table(rows, list(rows[0])))
    if args.out:
        write_results(
            Path(args.out), {"benchmark": "block_shapes", "machine": machine(), "args": vars(args), "results": rows}
        )


if __name__ == "__main__":
    main()
