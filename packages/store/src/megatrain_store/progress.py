"""Progress of long work: a live bar on a terminal, a plain line every half minute in a log.

A tqdm bar redraws itself with carriage returns; redirected into a file (a cluster job's log, `nohup`,
`| tee`) that is one line of thousands of redraws that grep and editors cannot read. So where the output is not
a terminal, `progress` returns a `LineProgress` instead, which has the part of tqdm's interface megatrain uses
(`update`, `set_postfix`, `close`, iteration) and writes whole lines.
"""

import os
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

from tqdm import tqdm

from megatrain_store import Pending

LOG_INTERVAL_S = 30.0  # a log line at most this often: a day's run writes ~3,000 lines, a short one a few


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str,
    unit: str,
    initial: int = 0,
    leave: bool = True,
    disable: bool = False,
    file: TextIO | None = None,
):
    """A progress bar over `iterable` or `total` units (update it by hand): tqdm's on a terminal, `LineProgress`
    where the output goes to a file or a pipe; none on a torchrun rank but the first."""
    out = file if file is not None else sys.stderr
    disable = disable or os.environ.get("RANK", "0") != "0"  # (under torchrun the first rank speaks for all)
    if disable or _is_terminal(out):
        return tqdm(
            iterable,
            total=total,
            desc=desc,
            unit=unit,
            initial=initial,
            leave=leave,
            disable=disable,
            dynamic_ncols=True,
            file=out,
        )
    return LineProgress(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=out)


def counting(entries: list, bar) -> list:
    """`entries` ((name, tensor or Pending) to write) whose tensors move `bar` on by one each as they are
    loaded to be written."""

    def load(tensor):
        loaded = tensor.load() if isinstance(tensor, Pending) else tensor
        bar.update(1)
        return loaded

    return [(name, Pending(tuple(t.shape), t.dtype, lambda t=t: load(t))) for name, t in entries]


def _number(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _plural(unit: str) -> str:
    return unit + ("es" if unit.endswith(("s", "x", "ch", "sh")) else "s")


def _is_terminal(file: TextIO) -> bool:
    try:
        return file.isatty()
    except (AttributeError, ValueError):  # a closed or file-like object without a terminal
        return False


class LineProgress:
    """Counts units and writes `desc: n/total unit (pct), rate, elapsed, eta, postfix` as a line of its own
    every LOG_INTERVAL_S seconds; on close, the last count, if it wrote a line before or `leave` asks for one."""

    def __init__(
        self,
        iterable: Iterable | None,
        *,
        total: int | None,
        desc: str,
        unit: str,
        initial: int,
        leave: bool,
        file: TextIO,
    ):
        if total is None and hasattr(iterable, "__len__"):  # (as tqdm counts an iterable's length itself)
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self.initial = initial
        self.leave, self.file = leave, file
        self.postfix: dict[str, object] = {}
        self.start = self.last_line = time.monotonic()
        self.written_n: int | None = None  # the count the last line showed (None: no line yet)
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self.last_line >= LOG_INTERVAL_S:
            self._write(now)

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **values) -> None:
        self.postfix = dict(ordered_dict or {}) | values

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if (self.written_n is not None or self.leave) and self.written_n != self.n:
            self._write(time.monotonic())

    def line(self, now: float) -> str:
        """The progress as one line at time `now` (time.monotonic's clock)."""
        elapsed = now - self.start
        done = self.n - self.initial
        count = f"{self.n}/{self.total}" if self.total else f"{self.n}"
        parts = [f"{self.desc}: {count} {_plural(self.unit)}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        if done > 0 and elapsed > 0:
            per_unit = elapsed / done
            per_s = f"{_number(per_unit)} s/{self.unit}" if per_unit >= 1 else f"{_number(1 / per_unit)} {self.unit}/s"
            parts.append(per_s)
        parts.append(f"elapsed {tqdm.format_interval(elapsed)}")
        if self.total and done > 0 and self.n < self.total:
            parts.append(f"eta {tqdm.format_interval(elapsed / done * (self.total - self.n))}")
        if self.postfix:
            parts.append(" ".join(f"{key}={value}" for key, value in self.postfix.items()))
        return ", ".join(parts)

    def _write(self, now: float) -> None:
        print(self.line(now), file=self.file, flush=True)
        self.written_n, self.last_line = self.n, now
