"""Where the CUDA caching allocator empties its cache in a throughput run's timed steps.

A row's `host_stalls_per_step.alloc_retries` counts the allocations that found no whole free range of the
device: the allocator then gives back every free page (waiting for every stream first) and tries again, and the
GPU idles meanwhile. This runs `throughput.py` with the same arguments, records the allocator's history in the
timed window, and prints each such release with the allocations around it (size, stream, the engine's frames):

    python benchmarks/allocator_retries.py --models qwen2.5-7b --seq-len 4096 --micro-batch 4 --tokens 32768 \
        --warmup 1 --steps 3 --baseline none --out OUT/retries.json

(The recording slows the steps a little: time them without it.)"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402
import throughput  # noqa: E402

RELEASES = ("segment_unmap", "segment_free")


class RecordedStalls(common.HostStalls):
    """`HostStalls` that also records the allocator's history over its window and prints its releases."""

    def __enter__(self) -> "RecordedStalls":
        torch.cuda.memory._record_memory_history(max_entries=400_000, context="alloc", stacks="python")
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        print("\n".join(release_lines(snapshot["device_traces"][0])), flush=True)


def engine_frames(entry: dict, depth: int = 7) -> str:
    """The allocation's innermost frames in megatrain's and the benchmarks' code."""
    frames = [f for f in entry.get("frames", []) if "megatrain" in f["filename"] or "benchmarks" in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames[:depth])


def release_lines(trace: list[dict]) -> list[str]:
    """One line per release of cached memory (its GiB and streams), with the allocations before and after it:
    the one after is the one that found no room."""
    lines, i = [], 0
    while i < len(trace):
        if trace[i]["action"] not in RELEASES:
            i += 1
            continue
        end = i
        while end < len(trace) and trace[end]["action"] in RELEASES:
            end += 1
        freed = sum(entry["size"] for entry in trace[i:end]) / 2**30
        lines.append(f"release of {freed:.2f} GiB (streams {sorted({e['stream'] for e in trace[i:end]})})")
        before = next((e for e in reversed(trace[:i]) if e["action"] == "alloc"), None)
        after = next((e for e in trace[end:] if e["action"] == "alloc"), None)
        for label, entry in (("after", after), ("before", before)):
            if entry is not None:
                lines.append(
                    f"  {label}: {entry['size'] / 2**20:.0f} MiB on stream {entry['stream']}: {engine_frames(entry)}"
                )
        i = end
    return lines or ["no release of cached memory in the window"]


if __name__ == "__main__":
    common.HostStalls = RecordedStalls  # (steady_steps opens it around the timed steps)
    throughput.main()
