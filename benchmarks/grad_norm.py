"""What the gradient norm that clipping needs costs on the GPU: a decoder layer's flat fp32 gradient buffer at a
preset's size, its squared norm as the engine takes it (`megatrain_sched.gradients.sq_norm`: 1,024-element chunk
norms, their squares summed in float64) against one fp32 `vector_norm` over the whole buffer (the engine before), in
ms a layer and a step's worth (every layer's), each with its relative error against float64.

    python benchmarks/grad_norm.py --models qwen2.5-7b,olmoe-1b-7b [--out FILE]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, write_results  # noqa: E402

from megatrain_sched.gradients import sq_norm  # noqa: E402
from megatrain_zoo import build_model, preset  # noqa: E402

REPEATS = 50
ENGINES = {
    "default (sq_norm: chunk norms summed in float64)": sq_norm,
    "one fp32 vector_norm (before 1080f9b)": lambda flat: torch.linalg.vector_norm(flat).double().square(),
}


def rows_of(model: str) -> list[dict]:
    """Each engine's time over one layer's gradient buffer (its first decoder layer's size), and its error."""
    spec = build_model(preset(model))
    numel, layers = spec.stages[1].template.numel, len(spec.stages) - 2
    flat = torch.randn(numel, device="cuda") * 1e-3
    exact = flat.double().square().sum()
    rows = []
    for engine, norm in ENGINES.items():
        ms = time_ms(lambda norm=norm: norm(flat), REPEATS)
        rows.append(
            {"system": "megatrain", "model": model, "scope": f"a layer's gradient norm: [{numel}] fp32",
             "engine": engine, "tokens_per_step": None, "step_time_s": None, "tokens_per_s": None,
             "model_tflops": None, "layer_ms": round(ms, 4), "layers": layers, "step_ms": round(ms * layers, 2),
             "read_gb_per_s": round(numel * 4 / ms / 1e6, 1),
             "relative_error": float(abs(norm(flat) - exact) / exact)}
        )  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen2.5-7b,olmoe-1b-7b")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = [row for model in args.models.split(",") for row in rows_of(model)]
    if args.out:
        write_results(
            Path(args.out), {"benchmark": "the gradient norm alone", "machine": machine(), "results": results}
        )


if __name__ == "__main__":
    main()
