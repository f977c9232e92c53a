"""Where each named tensor of a group lives inside that group's flat buffers."""

import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

from torch import Tensor

# How the optimizer moves a tensor, besides AdamW: LOAD_BIAS is a router's correction bias balanced by
# load (DeepSeek-V3's aux-loss-free balancing), stored as a split-precision pair hi + lo of equal shape
# back to back. It has no gradient: the backward writes each expert's excess load (E * picks - top_k *
# tokens) into both halves' gradient slots instead, and the optimizer moves the bias against its sign.
ADAMW, LOAD_BIAS = "adamw", "load_bias"


@dataclass(frozen=True)
class Entry:
    """One named tensor of a group (`GroupLayout`): its shape, its element offset in the group's flat buffers,
    whether AdamW's weight decay applies to it, and how the optimizer moves it."""

    name: str
    shape: tuple[int, ...]
    offset: int
    weight_decay: bool
    update: str = ADAMW  # ADAMW or LOAD_BIAS

    @property
    def numel(self) -> int:
        return prod(self.shape)


@dataclass(frozen=True)
class GroupLayout:
    """Tensors of one group back to back in one flat buffer, in the given order."""

    entries: tuple[Entry, ...]

    @staticmethod
    def from_specs(specs: Iterable[tuple]) -> "GroupLayout":
        """specs: (name, shape, weight_decay) or (name, shape, weight_decay, update) in buffer order."""
        entries, offset = [], 0
        for name, shape, decay, *update in specs:
            entry = Entry(name, tuple(shape), offset, bool(decay), *update)
            if not all(isinstance(dim, numbers.Integral) and dim >= 0 for dim in entry.shape):
                raise ValueError(f"{name}: shape must be whole numbers >= 0, got {entry.shape}")
            if entry.update not in (ADAMW, LOAD_BIAS):
                raise ValueError(f"{name}: update must be {ADAMW!r} or {LOAD_BIAS!r}, got {entry.update!r}")
            entries.append(entry)
            offset += entry.numel
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tensor names in a group layout: {names}")
        biases = [e for e in entries if e.update == LOAD_BIAS]
        for hi, lo in zip(biases[::2], biases[1::2]):
            if lo.offset != hi.offset + hi.numel or lo.shape != hi.shape:
                raise ValueError(f"load-balanced bias {hi.name} must be followed by its lo half of equal shape")
        if len(biases) % 2:
            raise ValueError(f"load-balanced bias {biases[-1].name} has no lo half after it")
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

    def update_runs(self) -> list[tuple[int, int, str]]:
        """(offset, numel, rule) runs, rule "decay" or "no_decay" (AdamW with or without weight decay,
        maximal runs: the optimizer updates each as one tensor) or LOAD_BIAS (one hi + lo pair each)."""
        runs: list[tuple[int, int, str]] = []
        for e in self.entries:
            rule = LOAD_BIAS if e.update == LOAD_BIAS else "decay" if e.weight_decay else "no_decay"
            merges = runs and runs[-1][2] == rule and runs[-1][0] + runs[-1][1] == e.offset
            if merges and (rule != LOAD_BIAS or runs[-1][1] == e.numel):  # a hi joins its lo, pairs stay apart
                runs[-1] = (runs[-1][0], runs[-1][1] + e.numel, rule)
            else:
                runs.append((e.offset, e.numel, rule))
        return runs

    def gradient_runs(self) -> list[tuple[int, int]]:
        """(offset, numel) runs holding gradients: all but the load-balanced biases' statistics."""
        runs: list[tuple[int, int]] = []
        for offset, numel, rule in self.update_runs():
            if rule == LOAD_BIAS:
                continue
            if runs and sum(runs[-1]) == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + numel)
            else:
                runs.append((offset, numel))
        return runs
