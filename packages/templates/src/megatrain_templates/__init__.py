"""Stateless layer templates: layouts plus pure forward/backward over flat weight buffers."""

from .decoder import BlockShape, DecoderBlock, block_params
from .embedding import Embedding
from .head import Head
from .layout import ParamSpec, Span, param_offsets, total_numel
from .ops import IGNORE_INDEX, RopeConfig, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, upcast

__all__ = [
    "BlockShape",
    "DecoderBlock",
    "Embedding",
    "Head",
    "IGNORE_INDEX",
    "ParamSpec",
    "RopeConfig",
    "Span",
    "apply_rope",
    "block_params",
    "param_offsets",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "total_numel",
    "upcast",
]
