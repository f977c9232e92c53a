"""The store's host arenas on plain pages (`torch.zeros`, as the store allocates them) against transparent huge pages
(their own anonymous mapping, 2 MiB-aligned and advised MADV_HUGEPAGE): the seconds to take and zero them and to
page-lock them (where there is a GPU), and the CPU's streaming loops over them: STREAM's triad and the fused AdamW
that the host optimizer runs (`ADAMW_BYTES_PER_PARAM`). The loops alternate between the two kinds of arena in one
process, round by round, so that both meet the same host. The huge pages are taken second, after the plain
ones hold their memory: the slot where taking memory costs more.

    python benchmarks/host_arenas.py --out benchmarks/results/host-arenas-h200.json
"""

import argparse
import mmap
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import ADAMW_BYTES_PER_PARAM, machine, table, write_results  # noqa: E402

from megatrain_optim import adamw_update_  # noqa: E402
from megatrain_store import pin_in_place  # noqa: E402

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def zeros_on_huge_pages(numel: int) -> torch.Tensor:
    """`numel` fp32 zeros on a mapping of their own, 2 MiB-aligned and advised for transparent huge pages (which
    back it where /sys/kernel/mm/transparent_hugepage/enabled says "madvise" or "always"), every page touched."""
    nbytes = numel * 4
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # (holds the mapping while any view of it lives)
    start = -whole.data_ptr() % HUGE_PAGE
    mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    return whole[start : start + nbytes].view(torch.float32).zero_()


ALLOCATIONS = {
    "torch.zeros (plain pages)": lambda numel: torch.zeros(numel),
    "transparent huge pages": zeros_on_huge_pages,
}


def huge_page_gib() -> float:
    """The process's anonymous memory on transparent huge pages (/proc/self/smaps_rollup), in GiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def best_seconds(run, repeats: int = 5) -> float:
    run()  # (warm)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def arenas(make, numel: int) -> tuple[list[torch.Tensor], dict]:
    """A parameter's four fp32 arenas (weights, gradients, two moments) and what taking and pinning them cost."""
    huge_before, start = huge_page_gib(), time.perf_counter()
    tensors = [make(numel) for _ in range(4)]
    zero_s, start = time.perf_counter() - start, time.perf_counter()
    pinned = all([pin_in_place(t) for t in tensors])
    cost = {"zero_s": round(zero_s, 3), "pin_s": round(time.perf_counter() - start, 3) if pinned else None}
    cost["huge_page_gib"] = round(huge_page_gib() - huge_before, 2)
    tensors[0].fill_(0.5)
    tensors[1].fill_(1e-3)
    return tensors, cost


def loops_gbps(tensors: list[torch.Tensor]) -> tuple[float, float]:
    """(triad, the host optimizer's fused AdamW) bytes read and written a second over these arenas."""
    p, g, m, v = tensors
    numel, step = p.numel(), torch.tensor(1.0)
    triad = best_seconds(lambda: torch.add(g, m, alpha=3.0, out=p))
    adamw = best_seconds(
        lambda: adamw_update_([p], [g], [m], [v], step, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    )
    return round(12 * numel / triad / 1e9, 1), round(ADAMW_BYTES_PER_PARAM * numel / adamw / 1e9, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=600_000_000, help="parameters (4 fp32 arenas of this many)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/host-arenas.json")
    args = parser.parse_args()
    taken = {name: arenas(make, args.params) for name, make in ALLOCATIONS.items()}
    loops = {name: [] for name in ALLOCATIONS}
    for _ in range(args.rounds):
        for name, (tensors, _) in taken.items():
            loops[name].append(loops_gbps(tensors))
    rows = []
    for name, (_, cost) in taken.items():
        triads, adamws = zip(*loops[name])
        rows.append(
            {
                "system": "megatrain",
                "model": "host memory",  # (no model: the arenas alone)
                "scope": f"4 fp32 host arenas of {args.params / 1e9:g}B elements (a weight, gradient and 2 moments)",
                "tokens_per_step": None,
                "step_time_s": None,
                "tokens_per_s": None,
                "model_tflops": None,
                "engine": name,
                "arena_gib": round(16 * args.params / 2**30, 2),
                **cost,
                "triad_gbps": max(triads),
                "adamw_gbps": max(adamws),
                "triad_gbps_by_round": list(triads),
                "adamw_gbps_by_round": list(adamws),
                "cpu_threads": torch.get_num_threads(),
            }
        )
    print(table(rows, ["engine", "zero_s", "pin_s", "huge_page_gib", "triad_gbps", "adamw_gbps"]), flush=True)
    write_results(
        Path(args.out),
        {
            "benchmark": "the store's host arenas on plain pages against transparent huge pages",
            "machine": machine(),
            "commands": [" ".join(["python", *sys.argv])],
            "notes": [
                "zero_s: taking and touching the four arenas; pin_s: cudaHostRegister of them (null without a GPU); "
                "triad_gbps and adamw_gbps: the best of 5 in each round, rounds alternating between the two kinds"
            ],
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
