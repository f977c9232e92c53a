"""Learning-rate schedules as plain functions of the optimizer step."""

import math
from dataclasses import dataclass

from .adamw import OptimError

SCHEDULES = ("constant", "cosine", "linear", "wsd")

# How a decay falls from the peak (1) to the floor (0) as its progress goes from 0 to 1: `wsd`'s `decay_shape`s, as
# transformers' `get_wsd_schedule` names them ("1-sqrt": Hägele et al. 2024's, which their runs found best)
DECAY_SHAPES = {
    "cosine": lambda progress: 0.5 * (1 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1 - progress,
    "1-sqrt": lambda progress: 1 - math.sqrt(progress),
}


@dataclass(frozen=True)
class Schedule:
    """Linear warmup over `warmup_steps` (the first step at lr / warmup_steps), then `kind` decay to min_lr_ratio * lr
    at `total_steps`: `cosine` or `linear` from the warmup's end; `wsd` (warmup-stable-decay) at the peak until its
    last `decay_steps` steps, which decay by `decay_shape` (so a run lengthened before its decay trains on at the
    peak, as `constant` would); `constant` stays at the peak."""

    lr: float
    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_steps: int = 0  # wsd's
    decay_shape: str = "cosine"  # wsd's: a key of DECAY_SHAPES

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise OptimError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise OptimError(
                f"warmup_steps must be >= 0 and total_steps >= 1, got {self.warmup_steps}, {self.total_steps}"
            )
        if not 0 <= self.lr < math.inf:
            raise OptimError(f"lr must be >= 0 and finite, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:  # (above 1 the decay rose)
            raise OptimError(f"min_lr_ratio must be in [0, 1] (the floor's share of lr), got {self.min_lr_ratio}")
        self._check_decay()

    def _check_decay(self) -> None:
        """wsd's decay: 1 to total_steps - warmup_steps steps, of a known shape; no decay setting for another kind."""
        if self.decay_shape not in DECAY_SHAPES:
            raise OptimError(f"decay_shape must be one of {', '.join(DECAY_SHAPES)}, got {self.decay_shape!r}")
        if self.kind != "wsd":
            if self.decay_steps or self.decay_shape != "cosine":
                raise OptimError(f"decay_steps and decay_shape are schedule wsd's, not {self.kind}'s: leave them out")
            return
        after_warmup = self.total_steps - self.warmup_steps
        if not 1 <= self.decay_steps <= after_warmup:
            raise OptimError(
                f"decay_steps (schedule wsd's last steps, which decay) must be in [1, {after_warmup}] (the steps after "
                f"the warmup), got {self.decay_steps}"
            )


def lr_at(step: int, schedule: Schedule) -> float:
    """The learning rate of optimizer step `step` (0 for the first step)."""
    s = schedule
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    if s.kind == "constant":
        return s.lr
    decay_from = s.total_steps - s.decay_steps if s.kind == "wsd" else s.warmup_steps
    if step < decay_from:
        return s.lr
    progress = min(1.0, (step - decay_from) / max(1, s.total_steps - decay_from))
    shape = DECAY_SHAPES[s.decay_shape if s.kind == "wsd" else s.kind]
    low = s.lr * s.min_lr_ratio
    return low + (s.lr - low) * shape(progress)
