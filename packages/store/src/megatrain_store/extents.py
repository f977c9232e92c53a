"""First-fit extents of one buffer lent to groups (the gradient pool's landing buffers), across threads."""

import threading

from .errors import StoreError


class Extents:
    """Extents of a buffer of `size` elements: `take` lends one to a key, blocking until the room is free, and
    `give` takes it back, joined with its free neighbours so that a large request finds its room again."""

    def __init__(self, size: int):
        self._changed = threading.Condition()
        self._held: dict[object, tuple[int, int]] = {}  # key -> (start, length) it holds
        self.reset(size)

    def reset(self, size: int) -> None:
        """Start over with one free extent of `size` (none may be lent)."""
        with self._changed:
            if self._held:
                raise StoreError(f"the gradient pool cannot change while groups {sorted(self._held)} hold buffers")
            self._free = [(0, size)]  # (start, length), by start

    def start(self, key) -> int | None:
        """Where `key`'s extent starts, or None where it holds none."""
        with self._changed:
            held = self._held.get(key)
            return None if held is None else held[0]

    def take(self, key, need: int) -> int:
        """The start of an extent of `need` elements lent to `key` (the one it holds, if any), first fit."""
        with self._changed:
            if key not in self._held:
                self._changed.wait_for(lambda: self._first_fit(need) is not None)
                index = self._first_fit(need)
                start, length = self._free[index]
                if length == need:
                    del self._free[index]
                else:
                    self._free[index] = (start + need, length - need)
                self._held[key] = (start, need)
            return self._held[key][0]

    def _first_fit(self, need: int) -> int | None:
        return next((i for i, (_, length) in enumerate(self._free) if length >= need), None)

    def give(self, key) -> None:
        """Take `key`'s extent back, and wake those waiting for room."""
        with self._changed:
            extents = sorted([*self._free, self._held.pop(key)])
            merged = [extents[0]]
            for extent in extents[1:]:
                last = merged[-1]
                if last[0] + last[1] == extent[0]:
                    merged[-1] = (last[0], last[1] + extent[1])
                else:
                    merged.append(extent)
            self._free = merged
            self._changed.notify_all()
