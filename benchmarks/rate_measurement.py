"""Where a native model's GPU rate measurement (a run's first plan of its shape) spends its time: each measured
pass's first call (compiling the kernels the run then uses) and its timed window, Dynamo's and Inductor's share of
the compiling and the graphs they built. `--cache-dir DIR` keeps torch's Inductor and Triton caches in DIR: a new
one measures a fresh machine, the same one again a machine that has run the shape before.

    python benchmarks/rate_measurement.py --model qwen3.5-27b --layers 8 --seq-len 4096 --micro-batch 4 \
        --cache-dir /tmp/compile-cache --out OUT/rate-measurement-cold.json
"""

import argparse
import os
import sys
import time
from pathlib import Path

CACHE_DIR = sys.argv[sys.argv.index("--cache-dir") + 1] if "--cache-dir" in sys.argv[:-1] else None
CACHES_EMPTY = CACHE_DIR is not None and not any(Path(CACHE_DIR).glob("*/*"))
if CACHE_DIR:  # (before torch is imported: Inductor and Triton read their cache directories from these)
    os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"] = (
        f"{CACHE_DIR}/inductor",
        f"{CACHE_DIR}/triton",
    )

from torch._dynamo.utils import calculate_time_spent, counters  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, scope_row, table, write_results  # noqa: E402

from megatrain_plan import rates  # noqa: E402
from megatrain_templates import ops  # noqa: E402
from megatrain_zoo import presets  # noqa: E402

SCOPE = "startup: the GPU rate measurement at the run's shape (each kind of layer and the head)"


def timed_passes(passes: list[dict]):
    """`rates._sustained_seconds`, recording each measured pass's first call and its sustained time in `passes`."""
    sustained = rates._sustained_seconds

    def recording(run, device_type="cuda"):
        before = rates.FIRST_CALLS.seconds
        seconds = sustained(run, device_type)
        first = rates.FIRST_CALLS.seconds - before
        name = run.__qualname__.split(".")[-1].replace("<lambda>", "head")  # (layer_pass, kept_layer_pass, head)
        passes.append({"pass": name, "first_call_s": round(first, 2), "ms": round(seconds * 1e3, 1)})
        return seconds

    return recording


def first_calls_by_function(record: dict):
    """`ops.compile_once` whose compiled functions add to `record[name]` [compiles, seconds] on each call during which
    Dynamo compiled a frame (the forward's graph and kernels: a backward's graph compiles later, in its backward)."""
    compile_once = ops.compile_once

    def compile_timed(fn, *args, **kwargs):
        compiled = compile_once(fn, *args, **kwargs)

        def call(*call_args, **call_kwargs):
            frames, start = counters["frames"]["ok"], time.perf_counter()
            out = compiled(*call_args, **call_kwargs)
            if counters["frames"]["ok"] != frames:
                entry = record.setdefault(fn.__name__, [0, 0.0])
                entry[0] += counters["frames"]["ok"] - frames
                entry[1] += time.perf_counter() - start
            return out

        return call

    return compile_timed


def first_launches(record: dict):
    """Triton's JITFunction.run, recording in `record[kernel]` the seconds of each kernel's first launch (its
    compilation, or its load from Triton's cache)."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def timed_run(self, *args, **kwargs):
        name = getattr(self.fn, "__name__", str(self.fn))
        if name in record:
            return run(self, *args, **kwargs)
        start = time.perf_counter()
        out = run(self, *args, **kwargs)
        record[name] = round(time.perf_counter() - start, 2)
        return out

    JITFunction.run = timed_run


def measurement_row(args) -> dict:
    """The results row: the measurement's seconds, its passes' and Dynamo's parts, the rates it found."""
    model = presets.PRESETS[args.model].first_layers(args.layers) if args.layers else presets.PRESETS[args.model]
    passes: list[dict] = []
    rates._sustained_seconds = timed_passes(passes)
    rates.FIRST_CALLS.seconds = 0.0
    functions, kernels = {}, {}
    ops.compile_once = first_calls_by_function(functions)
    first_launches(kernels)
    start = time.perf_counter()
    layer_tflops, kept_tflops, head_tflops, _ = rates.measure_block_rates(model, args.seq_len, args.micro_batch)
    seconds = time.perf_counter() - start
    spent = calculate_time_spent()  # Dynamo's phases, summed over every compiled frame
    name = args.model + (f" (first {args.layers} layers)" if args.layers else "")
    return scope_row(name, model, args.seq_len, args.micro_batch, SCOPE) | {
        "compile_caches": "empty" if CACHES_EMPTY else f"{CACHE_DIR or 'this machine'}'s as an earlier run left them",
        "rate_measurement_s": round(seconds, 1),
        "compiling_s": round(rates.FIRST_CALLS.seconds, 1),
        "dynamo_s": round(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0), 1),
        "inductor_waiting_for_triton_s": round(spent.get("async_compile.wait", 0.0), 1),
        "compiled_frames": counters["frames"]["ok"],
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "passes": passes,
        "compiled_functions": [
            {"function": name, "frames": frames, "first_calls_s": round(seconds, 2)}
            for name, (frames, seconds) in sorted(functions.items(), key=lambda item: -item[1][1])
        ],
        "backward_compile_s": round(spent.get("entire_backward_compile", 0.0), 1),
        "triton_kernels_first_launch_s": dict(sorted(kernels.items(), key=lambda item: -item[1])),
        "layer_tflops": layer_tflops,
        "kept_layer_tflops": kept_tflops,
        "head_tflops": head_tflops,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3.5-27b", help="a preset's name")
    parser.add_argument("--layers", type=int, default=8, help="the model's first layers (0: all)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--cache-dir", help="Inductor's and Triton's caches here (a new directory: a fresh machine)")
    parser.add_argument("--out", default="benchmarks/results/rate-measurement.json")
    args = parser.parse_args()
    if args.model not in presets.PRESETS:
        sys.exit(f"rate_measurement.py: no preset {args.model!r}; `megatrain presets` lists them")
    row = measurement_row(args)
    print(table([row], ["model", "rate_measurement_s", "compiling_s", "dynamo_s", "compiled_graphs"]), flush=True)
    write_results(Path(args.out), {"benchmark": "rate_measurement", "machine": machine(), "results": [row]})


if __name__ == "__main__":
    main()
