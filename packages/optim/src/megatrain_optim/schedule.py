"""Learning-rate schedules as plain functions of the optimizer step."""

import math
from dataclasses import dataclass

from .adamw import OptimError

SCHEDULES = ("constant", "cosine", "linear")


@dataclass(frozen=True)
class Schedule:
    """Linear warmup over `warmup_steps` (the first step at lr / warmup_steps), then `kind` decay to min_lr_ratio * lr
    at `total_steps`."""

    lr: float
    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise OptimError(f"unknown schedule {self.kind!r}; choose one of {SCHEDULES}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise OptimError(
                f"warmup_steps must be >= 0 and total_steps >= 1, got {self.warmup_steps}, {self.total_steps}"
            )
        if not 0 <= self.lr < math.inf:
            raise OptimError(f"lr must be >= 0 and finite, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:  # (above 1 the decay rose)
            raise OptimError(f"min_lr_ratio must be in [0, 1] (the floor's share of lr), got {self.min_lr_ratio}")


def lr_at(step: int, schedule: Schedule) -> float:
    """The learning rate of optimizer step `step` (0 for the first step)."""
    s = schedule
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return s.lr
    progress = min(1.0, (step - s.warmup_steps) / max(1, s.total_steps - s.warmup_steps))
    low = s.lr * s.min_lr_ratio
    if s.kind == "linear":
        return s.lr - (s.lr - low) * progress
    return low + (s.lr - low) * 0.5 * (1 + math.cos(math.pi * progress))
