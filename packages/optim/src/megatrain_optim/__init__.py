"""CPU optimizers over flat host buffers (and a few groups on the GPU): AdamW, clipping, LR schedules, a background
stepper, the update policies that decide when each group is updated during training, and the ranks of a host
sharing one store's updates (several GPUs)."""

from .adamw import (
    FUSED,
    STATE_NAMES,
    AdamWConfig,
    DeviceAdamW,
    DeviceClip,
    HostAdamW,
    OptimError,
    adamw_update_,
    clip_coefficient,
)
from .ranks import RankError, Ranks, RankSharing, RankSync
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
    "DeviceClip",
    "EmbeddingRowsFirst",
    "HostAdamW",
    "HostUpdates",
    "OptimError",
    "RankError",
    "RankSharing",
    "RankSync",
    "Ranks",
    "Schedule",
    "Sharing",
    "UpdatesAfterClipping",
    "UpdatesAsGradientsLand",
    "adamw_update_",
    "clip_coefficient",
    "lr_at",
]
