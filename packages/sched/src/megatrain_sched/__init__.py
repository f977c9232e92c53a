"""The stream scheduler: layer-major forward/backward over device weight slots and three streams."""

from .activations import ActivationStore
from .costs import EXTRAS_MARGIN, StageCosts, extras_that_fit, fit_to_device
from .gradients import GradientSink
from .hooks import Hooks
from .pipeline import LayerPipeline, MicroBatch, SchedError, Stage, StepResult
from .placement import (
    DEVICE,
    HELD,
    HOST,
    RECOMPUTE,
    RESIDENT,
    RESIDENT_COPY,
    STREAMED,
    Placement,
    PlacementError,
    StagePlacement,
)
from .streams import Streams, synchronize
from .template import StageTemplate, StepObjective
from .timeline import Timeline
from .weights import WeightStream, staging_buffers

__all__ = [
    "EXTRAS_MARGIN",
    "extras_that_fit",
    "fit_to_device",
    "ActivationStore",
    "DEVICE",
    "GradientSink",
    "HELD",
    "HOST",
    "Hooks",
    "RECOMPUTE",
    "RESIDENT",
    "RESIDENT_COPY",
    "STREAMED",
    "LayerPipeline",
    "MicroBatch",
    "Placement",
    "PlacementError",
    "SchedError",
    "Stage",
    "StageCosts",
    "StagePlacement",
    "StageTemplate",
    "StepObjective",
    "StepResult",
    "Streams",
    "Timeline",
    "WeightStream",
    "staging_buffers",
    "synchronize",
]
