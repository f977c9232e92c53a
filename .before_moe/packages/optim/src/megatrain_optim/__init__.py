"""CPU optimizers over flat host buffers (and a few groups on the GPU): AdamW, clipping, LR schedules, a background
stepper, and the update policies that decide when each group is updated during training."""

from .adamw import FUSED, STATE_NAMES, AdamWConfig, DeviceAdamW, HostAdamW, OptimError, adamw_update_, clip_coefficient
from .schedule import SCHEDULES, Schedule, lr_at
from .stepper import BackgroundStepper
from .updates import EmbeddingRowsFirst, HostUpdates, Sharing, UpdatesAfterClipping, UpdatesAsGradientsLand

__all__ = [
    "FUSED",
    "SCHEDULES",
    "STATE_NAMES",
    "AdamWConfig",
    "BackgroundStepper",
    "DeviceAdamW",
    "EmbeddingRowsFirst",
    "HostAdamW",
    "HostUpdates",
    "OptimError",
    "Schedule",
    "Sharing",
    "UpdatesAfterClipping",
    "UpdatesAsGradientsLand",
    "adamw_update_",
    "clip_coefficient",
    "lr_at",
]
