"""The stream scheduler: layer-major forward/backward over device weight slots and three streams."""

from .pipeline import (
    EXTRAS_MARGIN,
    LayerPipeline,
    MicroBatch,
    SchedError,
    Stage,
    StepResult,
    extras_that_fit,
    free_device_bytes,
    staging_buffers,
)
from .placement import DEVICE, HELD, HOST, RECOMPUTE, RESIDENT, STREAMED, Placement, PlacementError, StagePlacement
from .streams import Streams, synchronize
from .timeline import Timeline

__all__ = [
    "EXTRAS_MARGIN",
    "extras_that_fit",
    "free_device_bytes",
    "DEVICE",
    "HELD",
    "HOST",
    "RECOMPUTE",
    "RESIDENT",
    "STREAMED",
    "LayerPipeline",
    "MicroBatch",
    "Placement",
    "PlacementError",
    "SchedError",
    "Stage",
    "StagePlacement",
    "StepResult",
    "Streams",
    "Timeline",
    "staging_buffers",
    "synchronize",
]
