"""The stream scheduler: layer-major forward/backward over device weight slots and three streams."""

from .pipeline import LayerPipeline, MicroBatch, SchedError, Stage, StepResult
from .streams import Streams, synchronize
from .timeline import Timeline

__all__ = ["LayerPipeline", "MicroBatch", "SchedError", "Stage", "StepResult", "Streams", "Timeline", "synchronize"]
