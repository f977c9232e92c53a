"""Learning-rate schedules as plain functions of the optimizer step."""

import math
from dataclasses import dataclass

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
            raise ValueError(f"unknown schedule {self.kind!r}; choose one of {SCHEDULES}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("warmup_steps must be >= 0 and total_steps >= 1")


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
