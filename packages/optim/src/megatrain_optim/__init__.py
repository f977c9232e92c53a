"""CPU optimizers over flat host buffers (and a few groups on the GPU): AdamW, clipping, LR schedules, a background stepper."""

from .adamw import FUSED, STATE_NAMES, AdamWConfig, DeviceAdamW, HostAdamW, OptimError, adamw_update_, clip_coefficient
from .schedule import SCHEDULES, Schedule, lr_at
from .stepper import BackgroundStepper

__all__ = [
    "FUSED",
    "SCHEDULES",
    "STATE_NAMES",
    "AdamWConfig",
    "BackgroundStepper",
    "DeviceAdamW",
    "HostAdamW",
    "OptimError",
    "Schedule",
    "adamw_update_",
    "clip_coefficient",
    "lr_at",
]
