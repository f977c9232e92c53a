"""The host memory a run may take: what the operating system will really give it, less a stated margin.

The planner counts every host allocation of a placement (`CostModel.host_items`) and takes a choice
that costs host memory only where the total stays within this budget; a plan that does not fit is refused
before anything is allocated. The budget is the room left now (the cgroup's limit less its usage, else
MemAvailable), less `HOST_MARGIN`; `MEGATRAIN_HOST_MEMORY_GIB` (the machine's limit, set where the machine is
described) and a run's `engine.host_memory_gib` can only lower it.
What the process already holds (torch, the CUDA context, the data read so far) is outside the budget: it is
measured when the run is planned (`process_bytes`) and benchmark rows add it to the plan beside the peak RSS.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import PlanError

# The share of the room left at planning that the plan may not take (at least HOST_MARGIN_MIN): what allocators
# round up and free late, the page tables of pinned memory, the operating system's own growth. A run's peak RSS
# stays within its plan, what the process held when planned, and this margin (tests/test_host_memory.py).
HOST_MARGIN_SHARE = 0.04
HOST_MARGIN_MIN = 2**30
GIB = 2**30


@dataclass(frozen=True)
class HostBudget:
    """The bytes a plan's host allocations may take (`bytes`), and where the number came from (`source`)."""

    bytes: int | None  # None: unknown (no /proc/meminfo): nothing is decided by host memory
    source: str  # in words, for the refusal and `megatrain plan`


def margin_of(room: int) -> int:
    return max(HOST_MARGIN_MIN, int(HOST_MARGIN_SHARE * room))


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo, bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cgroup_room() -> int | None:
    """What this process's memory cgroup lets it take beyond its usage now, bytes (None: no limit set)."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        # "max" (v2) or a number near 2**63 (v1): no limit
        if limit != "max" and int(limit) < 2**60:
            return max(0, int(limit) - usage)
    return None


def os_room() -> tuple[int | None, str]:
    """The memory the operating system will give this process beyond what it holds now, and which bound it is."""
    available, limited = mem_available(), cgroup_room()
    if limited is not None and (available is None or limited < available):
        return limited, "the cgroup's memory limit less its usage"
    return available, "MemAvailable"


def process_bytes() -> int:
    """The process's resident memory now, bytes."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def host_budget(config_gib: float | None = None) -> HostBudget:
    """The bytes this run's plan may take: the room the operating system gives less the margin, lowered (never
    raised) by MEGATRAIN_HOST_MEMORY_GIB and `engine.host_memory_gib` (`config_gib`)."""
    room, source = os_room()
    budget = None if room is None else room - margin_of(room)
    if room is not None:
        source = f"{source} {room / GIB:.1f} GiB less a {margin_of(room) / GIB:.1f} GiB margin"
    for name, gib in (("MEGATRAIN_HOST_MEMORY_GIB", _env_gib()), ("engine.host_memory_gib", config_gib)):
        if gib is not None and (budget is None or gib * GIB < budget):
            budget, source = int(gib * GIB), f"{name} {gib:g}"
    return HostBudget(budget, source)


def _env_gib() -> float | None:
    value = os.environ.get("MEGATRAIN_HOST_MEMORY_GIB")
    if not value:
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise PlanError(
            f"MEGATRAIN_HOST_MEMORY_GIB={value!r} is not a positive number of GiB; set it to one or unset it"
        )
    return gib
