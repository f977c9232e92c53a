"""The host's AdamW of a clipped step: torch's fused kernel given the clip as `grad_scale` (it stores the scaled
gradient back: 32 bytes a parameter) against `host_kernel`'s (it leaves the gradient: 28), with the unclipped
fused update and STREAM's triad over the same fp32 arenas as the bounds. Rounds alternate among the four, so
each meets the same host; torch's threads as a step has them beside a GPU (the default less one).

    python benchmarks/host_adamw.py --out benchmarks/results/host-adamw-clipped-h200.json
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import ADAMW_BYTES_PER_PARAM, machine, table, write_results  # noqa: E402
from host_arenas import best_seconds  # noqa: E402

from megatrain_optim import adamw_update_, host_kernel  # noqa: E402
from megatrain_optim.launch import set_cpu_threads  # noqa: E402

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def loops(p, g, m, v) -> dict[str, float]:
    """Seconds of each loop over the arenas, the best of 5."""
    step, scale = torch.tensor(3.0), torch.tensor(1 / 0.37)  # (a clip coefficient of 0.37)
    return {
        "triad": best_seconds(lambda: torch.add(g, m, alpha=3.0, out=p)),
        "fused AdamW, unclipped": best_seconds(lambda: torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], amsgrad=False, maximize=False, **HYPER)),
        "fused AdamW, clipped (grad_scale)": best_seconds(lambda: torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], amsgrad=False, maximize=False, grad_scale=scale, **HYPER)),
        "megatrain AdamW, clipped": best_seconds(
            lambda: adamw_update_([p], [g], [m], [v], step, grad_scale=scale, **HYPER)),
    }  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=540_000_000, help="parameters (4 fp32 arenas of this many)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/host-adamw-clipped.json")
    args = parser.parse_args()
    if not host_kernel.available():
        sys.exit("host_adamw: the clipped-update kernel did not build here (the line above says why)")
    set_cpu_threads("auto", None, beside_gpu=torch.cuda.is_available())
    arenas = [torch.full((args.params,), value) for value in (0.02, 1e-3, 1e-4, 1e-6)]
    rounds = [loops(*arenas) for _ in range(args.rounds)]
    rows = []
    for name in rounds[0]:
        seconds = [r[name] for r in rounds]
        bytes_per_param = 12 if name == "triad" else ADAMW_BYTES_PER_PARAM + 4 * ("grad_scale" in name)
        rows.append(
            {
                "system": "megatrain",
                "model": "host memory",
                "scope": f"4 fp32 host arenas of {args.params / 1e9:g}B elements (a weight, gradient and 2 moments)",
                "tokens_per_step": None,
                "step_time_s": None,
                "tokens_per_s": None,
                "model_tflops": None,
                "engine": name,
                "ms": round(min(seconds) * 1e3, 1),
                "ms_by_round": [round(s * 1e3, 1) for s in seconds],
                "gbps": round(bytes_per_param * args.params / min(seconds) / 1e9, 1),
                "bytes_per_param": bytes_per_param,
                "cpu_threads": torch.get_num_threads(),
            }
        )
    print(table(rows, ["engine", "ms", "gbps", "bytes_per_param"]), flush=True)
    write_results(
        Path(args.out),
        {
            "benchmark": "the host AdamW of a clipped step: torch's fused kernel against megatrain's",
            "machine": machine(),
            "commands": [" ".join(["python", *sys.argv])],
            "notes": [
                "ms: the best of 5 in each round (ms_by_round), rounds alternating among the loops; gbps: the bytes "
                "each loop must move (bytes_per_param: the triad 12, AdamW 28, the fused AdamW given grad_scale 32: "
                "it stores the scaled gradient) over its best time"
            ],
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
