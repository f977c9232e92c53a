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
    """Collects spans while `enabled`; `resolve()` turns pending device spans into times.

    `keep_steps` bounds memory on long runs: only the spans of the last that many steps
    are kept (None keeps everything, for benchmarks that time several steps)."""

    def __init__(self, enabled: bool = False, keep_steps: int | None = 1):
        self.enabled = enabled
        self.keep_steps = keep_steps
        self._step_starts: list[int] = []  # index in `spans` where each step's spans begin
        self.spans: list[dict] = []  # {"name", "track", "start_us", "end_us"}
        # (name, track, start event, end event, the step's origin event, that origin's microseconds on the host clock)
        self._pending: list[tuple[str, str, object, object, object, float]] = []
        self._origin_event = None
        self._origin_host = time.perf_counter()
        self._origin_host_step = self._origin_host
        self._lock = threading.Lock()

    def start_step(self, streams) -> None:
        """Mark a step's start (called by `LayerPipeline` before a step's first sweep): resolve the finished spans,
        drop steps beyond `keep_steps`, and, on CUDA, wait for the compute stream and time the step's device spans
        from here."""
        if not self.enabled:
            return
        self.resolve(wait=False)  # (work still running beside the new step, the GPU optimizer's, is not waited for)
        self._step_starts.append(len(self.spans))
        if self.keep_steps is not None and len(self._step_starts) > self.keep_steps:
            first = self._step_starts[-self.keep_steps]
            del self.spans[:first]
            self._step_starts = [start - first for start in self._step_starts[-self.keep_steps :]]
        if streams.cuda:
            # the compute stream alone: work queued on other streams to run beside the next step (the GPU
            # optimizer's clipped updates) would otherwise be waited for here, and the trace would show a stall
            streams.compute.synchronize()
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
        origin_us = (self._origin_host_step - self._origin_host) * 1e6
        self._pending.append((name, track, start, _timing_event(stream), self._origin_event, origin_us))

    def current_stream_span(self, name: str, streams):
        """Time the work queued inside on the current stream: on the compute track where that is the compute
        stream, else on the GPU optimizer's (its updates beside the compute stream)."""
        stream = torch.cuda.current_stream(streams.device) if streams.cuda else None
        track = "compute" if stream == streams.compute else "gpu_optimizer"
        return self.device_span(name, track, streams, stream)

    @contextmanager
    def host_span(self, name: str, track: str):
        """Time the block on the host's clock (thread-safe): a span `name` on `track`, start and end in us."""
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

    def resolve(self, wait: bool = True) -> None:
        """Convert recorded CUDA events into host-aligned times, each against its step's origin: all of them
        (synchronizing on them), or without `wait` those whose work has finished."""
        pending, self._pending = self._pending, []
        for span in pending:
            name, track, start, end, origin, origin_us = span
            if not wait and not end.query():
                self._pending.append(span)
                continue
            end.synchronize()
            self.spans.append(
                {
                    "name": name,
                    "track": track,
                    "start_us": origin_us + origin.elapsed_time(start) * 1e3,
                    "end_us": origin_us + origin.elapsed_time(end) * 1e3,
                }
            )

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
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"traceEvents": events}))
