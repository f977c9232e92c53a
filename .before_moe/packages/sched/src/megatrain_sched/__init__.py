"""The stream scheduler: layer-major forward/backward over device weight slots and three streams."""

from .pipeline import STAGING_NUMEL, LayerPipeline, MicroBatch, SchedError, Stage, StepResult, free_device_bytes
from .placement import DEVICE, HELD, HOST, RECOMPUTE, RESIDENT, STREAMED, Placement, PlacementError, StagePlacement
from .streams import Streams, synchronize
from .timeline import Timeline

__all__ = [
    "free_device_bytes",
    "DEVICE",
    "HELD",
    "HOST",
    "RECOMPUTE",
    "RESIDENT",
    "STAGING_NUMEL",
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
    "synchronize",
]
