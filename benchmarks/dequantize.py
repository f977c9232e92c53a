"""How long a packed layer's dequantization takes on the GPU, alone and on the cast stream while the compute stream
runs GEMMs (as the engine overlaps them): one layer of a model's shape (dense-120b's: 1.58B values in 7
matrices), nf4 and int8, in one compiled kernel a weight (the default) and in eager chunks (engine.compile: false).

The GEMMs are bound by compute and the dequantization by memory bandwidth, but they share the SMs: `gpu_ms_lost` is
how much longer the GEMMs take with a layer dequantized beside them, the GPU time a step loses a streamed layer.
Needs a CUDA GPU.

    python benchmarks/dequantize.py --out OUT/dequantize-h200.json
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_results  # noqa: E402

from megatrain_store import (  # noqa: E402
    dequantize_int8,
    dequantize_nf4,
    quantize_int8,
    quantize_nf4,
    set_fused_dequantize,
)
from megatrain_zoo import preset  # noqa: E402

DEQUANTIZE = {"nf4": (quantize_nf4, dequantize_nf4), "int8": (quantize_int8, dequantize_int8)}


def layer_shapes(model: str) -> list[tuple[int, int]]:
    """The [out, in] matrices of one dense decoder layer of `model`'s preset."""
    c = preset(model)
    kv = c.n_kv_heads * c.head_dim
    return [
        (c.n_heads * c.head_dim, c.d_model),
        (kv, c.d_model),
        (kv, c.d_model),
        (c.d_model, c.n_heads * c.head_dim),
        (c.d_ff, c.d_model),
        (c.d_ff, c.d_model),
        (c.d_model, c.d_ff),
    ]


def gpu_ms(run, repeats: int = 5) -> float:
    """The fastest of `repeats` timings of `run` on the current stream, in milliseconds (after one untimed call)."""
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return min(times)


def measure(shapes, fmt: str, fused: bool, gemms: int) -> dict:
    """One layer's dequantization alone, and `gemms` GEMMs of [16384, d] x [d, d_ff] with and without it beside
    them on another stream."""
    quantize, dequantize = DEQUANTIZE[fmt]
    cuda = torch.device("cuda")
    packed = [quantize(torch.randn(shape, device=cuda, dtype=torch.bfloat16) * 0.02) for shape in shapes]
    slots = [torch.empty(shape, device=cuda, dtype=torch.bfloat16) for shape in shapes]
    d_ff, d_model = shapes[4]
    a = torch.randn(16384, d_model, device=cuda, dtype=torch.bfloat16)
    b = torch.randn(d_model, d_ff, device=cuda, dtype=torch.bfloat16)
    cast = torch.cuda.Stream()
    set_fused_dequantize(fused)
    try:

        def unpack():
            for q, slot in zip(packed, slots):
                dequantize(q, out=slot)

        def compute():
            for _ in range(gemms):
                torch.matmul(a, b)

        def both():
            cast.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(cast):
                unpack()
            compute()
            torch.cuda.current_stream().wait_stream(cast)

        alone, gemms_ms, together = gpu_ms(unpack), gpu_ms(compute), gpu_ms(both)
    finally:
        set_fused_dequantize(True)
    values = sum(q.numel if fmt == "nf4" else q.codes.numel() for q in packed)
    return {
        "format": fmt,
        "kernel": "one compiled kernel a weight" if fused else "eager chunks",
        "values": values,
        "alone_ms": round(alone, 2),
        "g_values_per_s": round(values / alone / 1e6, 1),
        "gemms_ms": round(gemms_ms, 2),
        "gemms_beside_it_ms": round(together, 2),
        "gpu_ms_lost": round(together - gemms_ms, 2),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dense-120b", help="a dense preset whose layer is dequantized")
    parser.add_argument("--gemms", type=int, default=6, help="GEMMs of [16384, d_model] x [d_model, d_ff] beside it")
    parser.add_argument("--out", default="benchmarks/results/dequantize.json")
    args = parser.parse_args()
    shapes = layer_shapes(args.model)
    rows = []
    for fmt in DEQUANTIZE:
        for fused in (False, True):
            measured = measure(shapes, fmt, fused, args.gemms)
            scope = f"one layer's base dequantized from {fmt} ({measured['kernel']}), beside {args.gemms} GEMMs"
            rows.append(
                {"system": "megatrain", "model": args.model, "scope": scope}
                | {"tokens_per_step": None, "step_time_s": None, "tokens_per_s": None, "model_tflops": None}
                | measured
            )
            print(table(rows[-1:], ["format", "kernel", "alone_ms", "g_values_per_s", "gpu_ms_lost"]), flush=True)
    write_results(
        Path(args.out),
        {
            "benchmark": "a packed layer's dequantization on the GPU, alone and beside the compute stream's GEMMs",
            "machine": machine(),
            "commands": [" ".join(["python", *sys.argv])],
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
