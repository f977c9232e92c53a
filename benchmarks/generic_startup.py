"""What a run through transformers' own modules (the generic path) spends before its first step, at a family's real
size: the planner's trace of each kind of layer on the CPU (the bytes it keeps, through torch.compile's partitioner
where the run compiles it) and the GPU's rate measurement (most of it compiling each kind's kernels, which the run's
first steps then reuse), with the layers' measured rates. Layers with a Mamba mixer run eagerly (their scan is
`mamba_ssm`'s kernel where installed, else transformers' reference in torch); short convolutions compile.

    python benchmarks/generic_startup.py --families falcon_h1,jamba,bamba,lfm2 --seq-len 4096 --micro-batch 2 \
        --out OUT/generic-startup.json

Each family is transformers' default configuration (its 7B-class size) with `--layers` layers, random weights.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, scope_row, table, write_results  # noqa: E402

from megatrain_plan import rates  # noqa: E402
from megatrain_zoo import build_model, generic_stages, model_config_from_hf  # noqa: E402

SCOPE = "startup: the planner's trace and the GPU rate measurement of each kind of layer"


# where transformers' default config has one kind of layer in its first ones, the mix of the released models
MIXED = {
    "lfm2": {"full_attn_idxs": [2, 5]},  # short-convolution layers, attention at these (LFM2-1.2B's start so)
    "bamba": {"attn_layer_indices": [4]},
}


def hf_config(family: str, layers: int) -> dict:
    """transformers' default config of `family` with `layers` layers (of the released models' mix of kinds)."""
    config = transformers.AutoConfig.for_model(family, num_hidden_layers=layers, **MIXED.get(family, {})).to_dict()
    if family == "lfm2":  # (its layer types are derived from full_attn_idxs only where none are given)
        config["layer_types"] = ["full_attention" if i in config["full_attn_idxs"] else "conv" for i in range(layers)]
    if isinstance(config.get("layers_block_type"), list):  # (Falcon-H1's default list is 32 long)
        config["layers_block_type"] = config["layers_block_type"][:layers]
    return config


def startup_row(family: str, args) -> dict:
    """The results row of `family`: its planner trace and rate measurement, timed."""
    model = model_config_from_hf(hf_config(family, args.layers), implementation="transformers")
    spec = build_model(model)
    start = time.perf_counter()
    kinds = {}
    for layer in (stage.template for stage in spec.stages[1:-1]):
        if layer.kind not in kinds:
            kinds[layer.kind] = layer.product_bytes_per_token(2)
    trace_s = time.perf_counter() - start
    rates.FIRST_CALLS.seconds = 0.0
    start = time.perf_counter()
    layer_tflops, kept_tflops, head_tflops, _ = rates.measure_block_rates(model, args.seq_len, args.micro_batch)
    measurement_s = time.perf_counter() - start
    eager = [kind[:2] for kind in generic_stages.KINDS_RUN_EAGERLY if kind in kinds]  # (class and layer type)
    name = f"{family} (transformers' default size, {args.layers} layers)"
    return scope_row(name, model, args.seq_len, args.micro_batch, SCOPE) | {
        "implementation": "transformers",
        "kinds_of_layer": len(kinds),
        "product_kib_per_token": {" ".join(map(str, kind[:2])): round(b / 1024, 1) for kind, b in kinds.items()},
        "kinds_run_eagerly": [" ".join(map(str, kind)) for kind in eager],
        "planner_trace_s": round(trace_s, 1),
        "rate_measurement_s": round(measurement_s, 1),
        "compiling_s": round(rates.FIRST_CALLS.seconds, 1),
        "layer_tflops": round(layer_tflops, 1),
        "kept_layer_tflops": None if kept_tflops is None else round(kept_tflops, 1),
        "head_tflops": round(head_tflops, 1),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="falcon_h1,jamba,bamba,lfm2", help="transformers model types")
    parser.add_argument("--layers", type=int, default=8, help="layers of each model (Jamba's pattern repeats in 8)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/generic-startup.json")
    args = parser.parse_args()
    results = []
    payload = {"benchmark": "generic_startup", "machine": machine(), "args": vars(args), "results": results}
    for family in args.families.split(","):
        try:
            results.append(startup_row(family, args))
        except Exception as error:  # (one family's failure is a row, not the end of the others')
            results.append({"system": "megatrain", "model": family, "scope": SCOPE, "tokens_per_step": None})
            results[-1] |= {"step_time_s": None, "tokens_per_s": None, "model_tflops": None}
            results[-1]["error"] = f"{type(error).__name__}: {error}"[:500]
        print(table(results[-1:], [k for k in results[-1] if k.endswith("_s") or k == "model"]), flush=True)
        write_results(Path(args.out), payload)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
