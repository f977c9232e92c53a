"""Spans of copy-in, compute, copy-out and optimizer work, written as a Chrome trace.

Device spans are timed with CUDA events recorded on their stream; host spans (the
optimizer worker) with the host clock; both are aligned at the start of each step."""

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

TRACKS = ("copy_in", "compute", "copy_out", "optimizer")


def _timing_event(stream):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


class Timeline:
    """Collects spans while `enabled`; `resolve()` turns pending device spans into times."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self.spans: list[dict] = []  # {"name", "track", "start_us", "end_us"}
        self._pending: list[tuple[str, str, object, object]] = []
        self._origin_event = None
        self._origin_host = time.perf_counter()
        self._origin_host_step = self._origin_host
        self._lock = threading.Lock()

    def start_step(self, streams) -> None:
        if not self.enabled:
            return
        self.resolve()
        if streams.cuda:
            torch.cuda.synchronize(streams.device)
            self._origin_event = _timing_event(streams.compute)
        self._origin_host_step = time.perf_counter()

    @contextmanager
    def device_span(self, name: str, track: str, streams, stream):
        """Time the work queued on `stream` inside the block."""
        if not self.enabled:
            yield
            return
        if not streams.cuda:
            with self.host_span(name, track):
                yield
            return
        start = _timing_event(stream)
        yield
        self._pending.append((name, track, start, _timing_event(stream)))

    @contextmanager
    def host_span(self, name: str, track: str):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        with self._lock:
            self.spans.append(
                {
                    "name": name,
                    "track": track,
                    "start_us": (start - self._origin_host) * 1e6,
                    "end_us": (end - self._origin_host) * 1e6,
                }
            )

    def resolve(self) -> None:
        """Convert recorded CUDA events into host-aligned times (synchronizes on them)."""
        if not self._pending:
            return
        base_us = (self._origin_host_step - self._origin_host) * 1e6
        for name, track, start, end in self._pending:
            end.synchronize()
            self.spans.append(
                {
                    "name": name,
                    "track": track,
                    "start_us": base_us + self._origin_event.elapsed_time(start) * 1e3,
                    "end_us": base_us + self._origin_event.elapsed_time(end) * 1e3,
                }
            )
        self._pending.clear()

    def write_chrome_trace(self, path: Path) -> None:
        """Write the spans as a Chrome/Perfetto trace (open in chrome://tracing or ui.perfetto.dev)."""
        self.resolve()
        tracks = list(TRACKS) + sorted({s["track"] for s in self.spans} - set(TRACKS))
        tids = {track: i for i, track in enumerate(tracks)}
        events = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": track}}
            for track, tid in tids.items()
        ]
        events += [
            {
                "name": s["name"],
                "ph": "X",
                "pid": 0,
                "tid": tids[s["track"]],
                "ts": s["start_us"],
                "dur": max(0.0, s["end_us"] - s["start_us"]),
            }
            for s in self.spans
        ]
        Path(path).write_text(json.dumps({"traceEvents": events}))
