"""Stateless layer templates: layouts plus pure forward/backward over flat weight buffers; the step-level objectives
beside the head."""

from .attention import Documents, causal_attention
from .decoder import BlockShape, DecoderBlock, MlaShape, attention_params, block_params
from .embedding import Embedding
from .head import Head, distribution_entropy
from .layout import (
    ParamSpec,
    Span,
    file_tensors,
    join_stored,
    param_offsets,
    row_slice_name,
    row_slice_of,
    split_precision,
    split_precision_names,
    split_precision_of,
    total_numel,
)
from .linear_attention import GatedDeltaNetShape, Mamba2Shape, chunked_gated_delta_rule, chunked_ssd
from .lora import ALL_LINEAR, DropoutKey, Lora, dropout_noise, lora_names
from .media import Media
from .moe import MoeBlock
from .moe_layout import EXPERT_NAMING, MoeShape, fused_expert_names, moe_params
from .moe_parts import ATTENTION_STAGE_SUFFIX, MoeAttention, MoeExperts
from .moe_routing import RouterLoad
from .objectives import (
    DPO,
    GRPO,
    REFERENCE_FREE_LOSSES,
    Objective,
    Rollout,
    SequenceObjective,
    Sequences,
    TokenObjective,
    dpo_losses,
    group_advantages,
)
from .ops import (
    IGNORE_INDEX,
    RopeConfig,
    apply_rope,
    compiling,
    rms_norm,
    rope_cos_sin,
    rope_inv_freq,
    set_compile,
    upcast,
    yarn_mscale,
)
from .template import Template

__all__ = [
    "ALL_LINEAR",
    "Lora",
    "DropoutKey",
    "dropout_noise",
    "lora_names",
    "REFERENCE_FREE_LOSSES",
    "DPO",
    "EXPERT_NAMING",
    "SequenceObjective",
    "Objective",
    "Rollout",
    "TokenObjective",
    "GRPO",
    "group_advantages",
    "Sequences",
    "dpo_losses",
    "BlockShape",
    "GatedDeltaNetShape",
    "Mamba2Shape",
    "DecoderBlock",
    "Documents",
    "Media",
    "Embedding",
    "MlaShape",
    "ATTENTION_STAGE_SUFFIX",
    "MoeAttention",
    "MoeBlock",
    "MoeExperts",
    "MoeShape",
    "RouterLoad",
    "Head",
    "distribution_entropy",
    "IGNORE_INDEX",
    "ParamSpec",
    "RopeConfig",
    "Span",
    "Template",
    "apply_rope",
    "attention_params",
    "causal_attention",
    "compiling",
    "chunked_gated_delta_rule",
    "chunked_ssd",
    "block_params",
    "file_tensors",
    "fused_expert_names",
    "join_stored",
    "moe_params",
    "param_offsets",
    "rms_norm",
    "row_slice_name",
    "row_slice_of",
    "rope_cos_sin",
    "rope_inv_freq",
    "set_compile",
    "split_precision",
    "split_precision_names",
    "split_precision_of",
    "total_numel",
    "upcast",
    "yarn_mscale",
]
