"""Model zoo: architecture configs, presets, Hugging Face config I/O, counts, layer specs; Hugging Face weights into
and out of a store (`hf_weights`), generation on transformers' modules (`generate`)."""

from .config import (
    ARCHITECTURES,
    CORRECTION_BIASED,
    ModelConfig,
    TemplateLacks,
    ZooError,
    flops_per_token,
    linear_attention_flops_per_token,
    softmax_attention_flops_per_token,
)
from .generic import generic_notes
from .hf import config_from_hf
from .hf_export import config_to_hf
from .hf_weights import check_hf_weights, load_hf_weights
from .model import build_model, expert_parts, init_param_
from .peft import check_peft_weights, load_peft_adapter, read_peft_config, write_peft_adapter
from .presets import PRESETS, preset, preset_table
from .read import model_config_from_hf, read_hf_config
from .shapes import block_shape
from .skeleton import GenericError
from .spec import Group, ModelSpec, StageSpec

__all__ = [
    "ARCHITECTURES",
    "CORRECTION_BIASED",
    "PRESETS",
    "Group",
    "ModelConfig",
    "ModelSpec",
    "StageSpec",
    "TemplateLacks",
    "ZooError",
    "block_shape",
    "build_model",
    "read_peft_config",
    "check_peft_weights",
    "load_peft_adapter",
    "write_peft_adapter",
    "expert_parts",
    "config_from_hf",
    "model_config_from_hf",
    "GenericError",
    "generic_notes",
    "config_to_hf",
    "check_hf_weights",
    "load_hf_weights",
    "flops_per_token",
    "linear_attention_flops_per_token",
    "softmax_attention_flops_per_token",
    "init_param_",
    "preset",
    "preset_table",
    "read_hf_config",
]
