"""The host's AdamW: torch's fused kernel (given a clip as `grad_scale`, it stores the scaled gradient back: 32 bytes
a parameter, not 28; its threads take equal shares) against megatrain's (`host_kernel`: the gradient left as it
was; threads take chunks as they finish), unclipped and clipped, with STREAM's triad over the same fp32 arenas as
the bound. Alone, and where there is a GPU beside its work as in a step (a thread queues 256 MiB copies both ways
and bf16 GEMMs, as the planner's rate measurement does). Rounds alternate among the loops, so each meets the same
host; torch's threads as a step has them beside a GPU (the default less one).

    python benchmarks/host_adamw.py --out benchmarks/results/host-adamw-h200.json
"""

import argparse
import sys
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import ADAMW_BYTES_PER_PARAM, machine, table, write_results  # noqa: E402
from host_arenas import best_seconds  # noqa: E402

from megatrain_optim import adamw_update_, host_kernel  # noqa: E402
from megatrain_optim.launch import set_cpu_threads  # noqa: E402
from megatrain_plan.rates import _Copies  # noqa: E402

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def loops(p, g, m, v) -> dict[str, float]:
    """Seconds of each loop over the arenas, the best of 5."""
    step, scale = torch.tensor(3.0), torch.tensor(1 / 0.37)  # (a clip coefficient of 0.37)

    def fused(grad_scale):
        return lambda: torch._fused_adamw_(
            [p], [g], [m], [v], [], [step], amsgrad=False, maximize=False, grad_scale=grad_scale, **HYPER
        )

    def megatrain(grad_scale):
        return lambda: adamw_update_([p], [g], [m], [v], step, grad_scale=grad_scale, **HYPER)

    return {
        "triad": best_seconds(lambda: torch.add(g, m, alpha=3.0, out=p)),
        "fused AdamW, unclipped": best_seconds(fused(None)),
        "fused AdamW, clipped (grad_scale)": best_seconds(fused(scale)),
        "megatrain AdamW, unclipped": best_seconds(megatrain(None)),
        "megatrain AdamW, clipped": best_seconds(megatrain(scale)),
    }  # fmt: skip


@contextmanager
def gpu_work():
    """A thread queuing copies both ways and GEMMs on the GPU, as a step's launch thread and copies do."""
    copies, a = _Copies(), torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    stop = threading.Event()

    def work():
        while not stop.is_set():
            copies.queue(both_ways=True)
            for _ in range(6):
                a @ a
            torch.cuda.synchronize()

    thread = threading.Thread(target=work)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def row(name: str, seconds: list[float], params: int, beside: bool) -> dict:
    bytes_per_param = 12 if name == "triad" else ADAMW_BYTES_PER_PARAM + 4 * ("grad_scale" in name)
    return {
        "system": "megatrain",
        "model": "host memory",
        "scope": f"4 fp32 host arenas of {params / 1e9:g}B elements (a weight, gradient and 2 moments)"
        + (", beside the GPU's copies and GEMMs" if beside else ", alone"),
        "tokens_per_step": None,
        "step_time_s": None,
        "tokens_per_s": None,
        "model_tflops": None,
        "engine": name,
        "beside_gpu_work": beside,
        "ms": round(min(seconds) * 1e3, 1),
        "ms_by_round": [round(s * 1e3, 1) for s in seconds],
        "gbps": round(bytes_per_param * params / min(seconds) / 1e9, 1),
        "bytes_per_param": bytes_per_param,
        "cpu_threads": torch.get_num_threads(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=540_000_000, help="parameters (4 fp32 arenas of this many)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/host-adamw.json")
    args = parser.parse_args()
    if not host_kernel.available():
        sys.exit("host_adamw: megatrain's host AdamW kernel did not build here (the line above says why)")
    set_cpu_threads("auto", None, beside_gpu=torch.cuda.is_available())
    arenas = [torch.full((args.params,), value) for value in (0.02, 1e-3, 1e-4, 1e-6)]
    rows = []
    for beside in (False, True) if torch.cuda.is_available() else (False,):
        with gpu_work() if beside else nullcontext():
            rounds = [loops(*arenas) for _ in range(args.rounds)]
        rows += [row(name, [r[name] for r in rounds], args.params, beside) for name in rounds[0]]
    print(table(rows, ["engine", "beside_gpu_work", "ms", "gbps", "bytes_per_param"]), flush=True)
    write_results(
        Path(args.out),
        {
            "benchmark": "the host's AdamW: torch's fused kernel against megatrain's, unclipped and clipped",
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
