"""A background worker that runs group updates in submission order, off the training thread."""

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundStepper:
    """One worker thread; `submit` queues work for a group, `wait(group)` blocks until the
    latest work for that group is done and re-raises any exception it hit."""

    def __init__(self, enabled: bool = True):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-optim") if enabled else None
        self._pending: dict[int, Future] = {}

    def submit(self, group: int, work: Callable[[], None]) -> None:
        if self._pool is None:
            work()
            return
        self._pending[group] = self._pool.submit(work)

    def wait(self, group: int) -> None:
        future = self._pending.pop(group, None)
        if future is not None:
            future.result()

    def wait_all(self) -> None:
        for group in list(self._pending):
            self.wait(group)

    def busy(self, group: int) -> bool:
        future = self._pending.get(group)
        return future is not None and not future.done()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
