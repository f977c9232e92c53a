"""ModelConfig -> Hugging Face `config.json` (`config_to_hf`): what an export writes, and what generation builds
a native family's transformers model from."""

import json

from .config import (
    ERNIE,
    GATED_SHARED_EXPERT,
    GEMMA,
    GRANITE,
    GRANITE_MULTIPLIERS,
    LINEAR_ATTENTION_ARCHITECTURES,
    OLMO,
    ModelConfig,
    ZooError,
)
from .hf import (
    _DEEPSEEK_MOE,
    _GEMMA_ACTIVATIONS,
    _HF_CLASSES,
    _LATENT_ATTENTION,
    _WINDOW_ON_EVERY_LAYER,
    _int_if_whole,
)


def config_to_hf(config: ModelConfig, torch_dtype: str = "float32") -> dict:
    """A config.json that transformers loads as the matching *ForCausalLM."""
    if config.implementation == "transformers":  # (its own config.json, as read, in the dtype written)
        return _with_dtype(json.loads(config.hf_config), torch_dtype)
    hf = _common_to_hf(config, torch_dtype)
    for part in (_biases_to_hf, _granite_to_hf, _layer_kinds_to_hf, _gemma_to_hf, _rotary_to_hf, _experts_to_hf):
        hf.update(part(config))
    for part in (_latent_attention_to_hf, _glm_to_hf, _linear_attention_to_hf, _gpt_oss_to_hf):
        hf.update(part(config))
    return hf


def _with_dtype(hf: dict, torch_dtype: str) -> dict:
    """`hf` naming `torch_dtype` under both keys transformers reads (`dtype` first, since 5.0) at its top and in each
    sub-config that names one: a source's own "dtype": "bfloat16" beside ours had float32 weights load in bf16."""
    named = {key: torch_dtype for key in ("dtype", "torch_dtype")}
    subs = {
        key: {**value, **named} for key, value in hf.items() if isinstance(value, dict) and named.keys() & value.keys()
    }
    return {**hf, **subs, **named}


def _common_to_hf(config: ModelConfig, torch_dtype: str) -> dict:
    """The fields every decoder's config.json has (gpt-oss names its rotary settings `rope_parameters` alone)."""
    scaling = dict(config.rope_scaling) if config.rope_scaling else None  # (transformers adds to it)
    rope_scaling = {} if config.arch == "gpt_oss" else {"rope_scaling": scaling}
    return {
        "architectures": [_HF_CLASSES[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rope_theta": config.rope_theta,
        **rope_scaling,
        "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": config.initializer_range,
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": torch_dtype,
        "torch_dtype": torch_dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }


def _biases_to_hf(config: ModelConfig) -> dict:
    if config.arch in ("llama", "qwen3", "qwen3_moe", "olmoe", "dots1", *OLMO, "smollm3", *GRANITE):
        return {"attention_bias": False, "mlp_bias": False}
    if config.arch in ERNIE:  # (biases on every projection, the MLP's too, where true)
        return {"use_bias": False}
    return {}


def _granite_to_hf(config: ModelConfig) -> dict:
    """Granite's multipliers; Granite 4's hybrid layers (Mamba-2 or attention) and their Mamba shape."""
    if config.arch not in GRANITE:
        return {}
    hf = {name: getattr(config, name) for name in GRANITE_MULTIPLIERS}
    if config.arch != "granitemoehybrid":
        return hf
    hf.update(
        shared_intermediate_size=config.d_ff,
        num_local_experts=0,
        layer_types=["mamba" if config.layer_is_linear(i) else "attention" for i in range(config.n_layers)],
        position_embedding_type=None if config.nope_layers else "rope",
    )
    if not config.linear_attention_layers:  # (transformers still checks that its default heads divide 2 x hidden)
        return {**hf, "mamba_n_heads": 1}
    inner = config.linear_n_value_heads * config.linear_value_head_dim
    return {
        **hf,
        "mamba_n_heads": config.linear_n_value_heads,
        "mamba_d_head": config.linear_value_head_dim,
        "mamba_n_groups": config.linear_n_key_heads,
        "mamba_d_state": config.linear_key_head_dim,
        "mamba_d_conv": config.linear_conv_kernel,
        "mamba_expand": inner // config.d_model,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
    }


def _layer_kinds_to_hf(config: ModelConfig) -> dict:
    """Which layers skip the rotary embedding and which attend within a window."""
    hf = {}
    if config.arch in ("llama4_text", "smollm3"):
        hf["no_rope_layers"] = [int(i not in config.nope_layers) for i in range(config.n_layers)]
    windowed = config.sliding_layers
    if config.arch == "smollm3":
        hf["use_sliding_window"] = bool(windowed)
    if config.arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "dots1"):  # windows from max_window_layers on
        hf["use_sliding_window"] = bool(windowed)
        hf["max_window_layers"] = windowed[0] if windowed else config.n_layers
    hf["sliding_window"] = config.sliding_window if windowed else None
    if windowed and config.arch not in _WINDOW_ON_EVERY_LAYER:
        hf["layer_types"] = ["sliding_attention" if i in windowed else "full_attention" for i in range(config.n_layers)]
    return hf


def _gemma_to_hf(config: ModelConfig) -> dict:
    if config.arch not in GEMMA:
        return {}
    activation = next(name for name, ours in _GEMMA_ACTIVATIONS.items() if ours == config.activation)
    return {
        "hidden_activation": activation,
        "hidden_act": activation,
        "attention_bias": False,
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
    }


def _rotary_to_hf(config: ModelConfig) -> dict:
    """The rotary embedding's family-specific fields: partial rotation, a second base for windowed layers."""
    if config.arch == "phi3":
        original = (config.rope_scaling or {}).get("original_max_position_embeddings", config.max_seq_len)
        return {"partial_rotary_factor": config.partial_rotary_factor, "original_max_position_embeddings": original}
    if config.arch == "gemma3_text":  # read by transformers 4 and 5 alike (5 folds it into rope_parameters)
        return {"rope_local_base_freq": config.rope_local_theta}
    if config.arch == "olmo3":  # each layer type's own: transformers' reading of rope_theta alone gives it one
        full = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
        local = {"rope_type": "default", "rope_theta": config.rope_local_theta}
        return {"rope_scaling": None, "rope_parameters": {"full_attention": full, "sliding_attention": local}}
    if config.arch == "minimax_m2":  # published as rotary_dim, which transformers before ~5.2x ignores
        return {
            "rotary_dim": config.rotary_dim,
            "partial_rotary_factor": config.partial_rotary_factor,
            "use_qk_norm": True,
        }
    return {}


def _experts_to_hf(config: ModelConfig) -> dict:
    if config.arch == "ernie4_5_moe":
        return {**_ernie_moe_to_hf(config), "num_nextn_predict_layers": 0}
    if config.arch == "llama4_text":
        return _llama4_to_hf(config)
    hf = _moe_to_hf(config) if config.is_moe else {}
    if config.arch in _DEEPSEEK_MOE:
        hf.update(
            n_routed_experts=config.n_experts,
            n_shared_experts=config.shared_expert_d_ff // config.moe_d_ff,
            moe_intermediate_size=config.moe_d_ff,
            first_k_dense_replace=len(config.dense_layers),
            routed_scaling_factor=config.routed_scaling_factor,
            n_group=config.n_group,
            topk_group=config.topk_group,
            norm_topk_prob=config.norm_topk_prob,
        )
    return hf


def _latent_attention_to_hf(config: ModelConfig) -> dict:
    """DeepSeek-V2/V3's latent attention and routing method (no multi-token-prediction layers are trained or
    written)."""
    if config.arch not in _LATENT_ATTENTION:
        return {}
    hf = {
        "attention_bias": False,
        "mlp_bias": False,
        "kv_lora_rank": config.kv_lora_rank,
        "q_lora_rank": config.q_lora_rank or None,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.head_dim,
        "v_head_dim": config.v_head_dim,
    }
    if config.arch == "deepseek_v2":
        return {**hf, "topk_method": "group_limited_greedy" if config.n_group > 1 else "greedy"}
    return {**hf, "topk_method": "noaux_tc", "rope_interleave": config.rope_interleave, "num_nextn_predict_layers": 0}


def _glm_to_hf(config: ModelConfig) -> dict:
    if config.arch != "glm4_moe":
        return {}
    return {
        "attention_bias": config.qkv_bias,
        "use_qk_norm": config.qk_norm,
        "partial_rotary_factor": config.partial_rotary_factor,
        "num_nextn_predict_layers": 0,
    }


def _gpt_oss_to_hf(config: ModelConfig) -> dict:
    if config.arch != "gpt_oss":
        return {}
    return {
        "attention_bias": config.o_bias,
        "swiglu_limit": config.swiglu_limit,
        "rope_parameters": {"rope_theta": config.rope_theta, **(config.rope_scaling or {"rope_type": "default"})},
    }


def _moe_to_hf(config: ModelConfig) -> dict:
    hf = {
        "num_experts_per_tok": config.n_experts_per_tok,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": config.output_router_logits,
    }
    if config.arch in ("mixtral", "minimax_m2"):
        return {
            **hf,
            "num_local_experts": config.n_experts,
            "intermediate_size": config.moe_d_ff,
            "router_jitter_noise": 0.0,
        }
    if config.arch == "gpt_oss":
        return {**hf, "num_local_experts": config.n_experts, "intermediate_size": config.moe_d_ff}
    if config.arch in _DEEPSEEK_MOE:
        return {**hf, "num_experts_per_tok": config.n_experts_per_tok}
    hf.update(num_experts=config.n_experts, norm_topk_prob=config.norm_topk_prob)
    if config.arch == "olmoe":
        return {**hf, "intermediate_size": config.moe_d_ff, "clip_qkv": config.clip_qkv}
    hf.update(
        moe_intermediate_size=config.moe_d_ff,
        decoder_sparse_step=1,
        mlp_only_layers=list(config.dense_layers),
    )
    if config.arch in GATED_SHARED_EXPERT:
        hf["shared_expert_intermediate_size"] = config.shared_expert_d_ff
    if config.arch == "qwen2_moe":
        hf["qkv_bias"] = config.qkv_bias
    return hf


def _linear_attention_to_hf(config: ModelConfig) -> dict:
    if config.arch not in LINEAR_ATTENTION_ARCHITECTURES:
        return {}
    rope = {"rope_type": "default", **(config.rope_scaling or {})}
    rope.update(rope_theta=config.rope_theta, partial_rotary_factor=config.partial_rotary_factor)
    return {
        "rope_scaling": None,
        "rope_parameters": rope,
        "partial_rotary_factor": config.partial_rotary_factor,
        "attention_bias": False,
        "layer_types": [
            "linear_attention" if config.layer_is_linear(i) else "full_attention" for i in range(config.n_layers)
        ],
        "linear_num_key_heads": config.linear_n_key_heads,
        "linear_num_value_heads": config.linear_n_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel,
    }


def _llama4_to_hf(config: ModelConfig) -> dict:
    n_layers = config.n_layers
    return {
        "intermediate_size": config.moe_d_ff,
        "intermediate_size_mlp": config.d_ff,
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.n_experts_per_tok,
        "moe_layers": [i for i in range(n_layers) if config.layer_is_moe(i)],
        "attention_chunk_size": config.attention_chunk_size,
        "layer_types": [
            "chunked_attention" if i in config.chunked_layers else "full_attention" for i in range(n_layers)
        ],
        "use_qk_norm": config.qk_rms_normalized,
        "attn_temperature_tuning": config.attn_temperature_floor_scale > 0,
        "floor_scale": _int_if_whole(config.attn_temperature_floor_scale or 8192),
        "attn_scale": config.attn_temperature_scale,
        "attention_bias": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
        "router_jitter_noise": 0.0,
    }


def _ernie_moe_to_hf(config: ModelConfig) -> dict:
    moe = [i for i in range(config.n_layers) if config.layer_is_moe(i)]
    interval = moe[1] - moe[0] if len(moe) > 1 else moe[0] + 1
    if [i for i in range(moe[0], moe[-1] + 1) if (i + 1) % interval == 0] != moe:
        raise ZooError(f"ERNIE 4.5 cannot express MoE layers {moe}: every interval-th layer of a range only")
    return {
        "moe_num_experts": config.n_experts,
        "moe_k": config.n_experts_per_tok,
        "moe_intermediate_size": config.moe_d_ff,
        "moe_num_shared_experts": config.shared_expert_d_ff // config.moe_d_ff,
        "moe_layer_start_index": moe[0],
        "moe_layer_end_index": moe[-1],
        "moe_layer_interval": interval,
        "moe_norm_min": 1e-12,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
    }
