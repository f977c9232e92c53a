"""Where each named tensor of a group lives inside that group's flat buffers."""

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

from torch import Tensor


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int
    weight_decay: bool

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class GroupLayout:
    """Tensors of one group back to back in one flat buffer, in the given order."""

    entries: tuple[Entry, ...]

    @staticmethod
    def from_specs(specs: Iterable[tuple[str, tuple[int, ...], bool]]) -> "GroupLayout":
        """specs: (name, shape, weight_decay) in buffer order."""
        entries, offset = [], 0
        for name, shape, decay in specs:
            entry = Entry(name, tuple(shape), offset, bool(decay))
            entries.append(entry)
            offset += entry.numel
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in a group layout: {names}")
        return GroupLayout(tuple(entries))

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        """Named views (no copies) of a flat buffer holding this group."""
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def decay_runs(self) -> list[tuple[int, int, bool]]:
        """Maximal (offset, numel, weight_decay) runs: the optimizer updates each run as one tensor."""
        runs: list[tuple[int, int, bool]] = []
        for e in self.entries:
            if runs and runs[-1][2] == e.weight_decay and runs[-1][0] + runs[-1][1] == e.offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + e.numel, e.weight_decay)
            else:
                runs.append((e.offset, e.numel, e.weight_decay))
        return runs
