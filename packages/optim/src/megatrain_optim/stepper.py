"""A background worker that runs group updates off the training thread, the most urgent first."""

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch


class _Job(NamedTuple):
    priority: Any
    order: int  # submission order: ties, and which of the waiting work can start first
    future: Future
    work: Callable[[], None]
    ready: Callable[[], bool] | None


class BackgroundStepper:
    """One worker thread; `submit` queues work for a group, `wait(group)` blocks until the
    latest work for that group is done and re-raises any exception it hit.

    Of the queued work whose `ready()` says it can start without waiting, the worker takes that of
    the lowest `priority` next, in submission order among equals; when none is ready, the oldest
    (the default, priority 0 and no `ready`: plain submission order). The trainer gives each
    group its place in the next forward pass and a gradient's arrival as `ready`: when the
    optimizer falls behind the backward, whose gradients arrive last layer first, it still
    finishes the first layers first, and the next forward starts while it works on the last ones."""

    def __init__(self, enabled: bool = True, torch_threads: int | None = None):
        """`torch_threads`: the CPU threads of torch's operations on the worker (its own: the caller's keep theirs);
        None: the caller's. (Set on each worker: a new thread starts with the count the last one set.)"""
        self._torch_threads = torch_threads or torch.get_num_threads()
        self._pending: dict[int, Future] = {}
        self._queue: list[_Job] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._closed = False
        self._thread = None
        if enabled:
            self._thread = threading.Thread(target=self._work, name="megatrain-optim", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        torch.set_num_threads(self._torch_threads)
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                ready = [job for job in self._queue if job.ready is None or job.ready()]
                job = min(ready) if ready else min(self._queue, key=lambda waiting: waiting.order)
                self._queue.remove(job)
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.work()
            except BaseException as error:  # handed to whoever waits for the group
                job.future.set_exception(error)
            else:
                job.future.set_result(None)

    def submit(
        self, group: int, work: Callable[[], None], priority: Any = 0, ready: Callable[[], bool] | None = None
    ) -> Future:
        """Queue `work` for `group` (`wait(group)` waits for the latest); its future. Priorities compare
        with each other (numbers, or tuples such as (step, place))."""
        future = Future()
        if self._thread is None:
            future.set_running_or_notify_cancel()
            work()
            future.set_result(None)
            return future
        with self._changed:
            if self._closed:
                raise RuntimeError("the stepper is closed")
            self._queue.append(_Job(priority, next(self._order), future, work, ready))
            self._pending[group] = future
            self._changed.notify()
        return future

    def wait(self, group: int) -> None:
        """Block until the latest work submitted for `group` is done, re-raising its exception (none queued: return)."""
        future = self._pending.pop(group, None)
        if future is not None:
            future.result()

    def wait_all(self) -> None:
        """`wait` for every group with work submitted."""
        for group in list(self._pending):
            self.wait(group)

    def busy(self, group: int) -> bool:
        """Whether `group`'s latest work is queued or running (so `wait(group)` would block)."""
        future = self._pending.get(group)
        return future is not None and not future.done()

    def close(self) -> None:
        """Stop the worker after the work it is running; work still queued is cancelled."""
        if self._thread is None:
            return
        with self._changed:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._changed.notify()
        self._thread.join()
