"""Hugging Face `config.json` -> ModelConfig, for the architectures the templates implement (the other way:
`hf_export.py`; which way a model trains: `read.py`)."""

import json

from .config import (
    ERNIE,
    GATED_SHARED_EXPERT,
    GEMMA,
    GRANITE,
    GRANITE_MULTIPLIERS,
    LINEAR_ATTENTION_ARCHITECTURES,
    LOCAL_ROPE_ARCHITECTURES,
    NOPE_ARCHITECTURES,
    OLMO,
    ModelConfig,
    TemplateLacks,
    ZooError,
    windowed_but_every,
)

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "dots1": "Dots1ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}
# transformers' config defaults where a family's published configs rely on them (Gemma 3's text_config
# writes only what differs from Gemma3TextConfig's)
_GEMMA_DEFAULTS = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}
# transformers' Qwen3-Next and Qwen3.5 defaults for what their published configs might leave out
_LINEAR_ATTENTION_DEFAULTS = {
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
_DEFAULTS = {
    **{model_type: _LINEAR_ATTENTION_DEFAULTS for model_type in LINEAR_ATTENTION_ARCHITECTURES},
    "gemma2": {
        **_GEMMA_DEFAULTS,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
    },
    "gemma3_text": {**_GEMMA_DEFAULTS, "vocab_size": 262208, "max_position_embeddings": 131072},
    # Llama4TextConfig's (Scout's shape)
    "llama4_text": {
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "use_qk_norm": True,
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    },
}
# image-text model_types whose text model trains (and exports) alone, with its model_type where text_config
# does not say (Mistral Small 3.1/3.2, Magistral, Devstral: Mistral3ForConditionalGeneration)
_TEXT_MODEL_OF = {
    "gemma3": "gemma3_text",
    "llama4": "llama4_text",
    "mistral3": "mistral",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
}
# model_type values of published configs that are one of the above (transformers maps them the same way)
_SAME_AS = {"kimi_k2": "deepseek_v3"}
# Mixture-of-experts families transformers has but megatrain does not (yet) implement, with the reason.
_UNSUPPORTED_MOE = {
    "deepseek_v32": "DeepSeek-V3.2's sparse attention (an indexer choosing the keys) is not implemented yet",
    "granitemoe": "Granite's mixture-of-experts models are not implemented yet (its dense ones, model_type granite, are)",
}
_LATENT_ATTENTION = ("deepseek_v2", "deepseek_v3")
# families with DeepSeek's MoE config fields (n_routed_experts, n_shared_experts, first_k_dense_replace, ...)
_DEEPSEEK_MOE = (*_LATENT_ATTENTION, "glm4_moe", "dots1")
# families whose sliding window, where config.json sets one, is on every layer (no layer_types)
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3")
# families whose transformers load-balancing loss counts the unbiased top-k, not the experts chosen with the bias
_AUX_OVER_UNBIASED_TOP_K = ("minimax_m2", "ernie4_5_moe")


# config.json's fields the native reader computes with, by what transformers' configs take there: whole numbers or any
# number, null or not (null where it means "none", or transformers' default, to both; a null elsewhere transformers
# refuses too). Not here: the token ids (lists too), mamba_d_head ("auto" too) and moe_num_experts (a list in VL models).
_HF_WHOLE = """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads max_position_embeddings
    max_window_layers sliding_window_pattern num_experts num_experts_per_tok moe_intermediate_size n_routed_experts
    first_k_dense_replace shared_expert_intermediate_size moe_k moe_layer_start_index moe_layer_interval
    moe_layer_end_index kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim intermediate_size_mlp
    interleave_moe_layer_step no_rope_layer_interval full_attention_interval linear_conv_kernel_dim linear_key_head_dim
    linear_value_head_dim linear_num_key_heads linear_num_value_heads shared_intermediate_size mamba_n_heads
    mamba_expand mamba_n_groups mamba_d_state mamba_d_conv"""
_HF_WHOLE_OR_NULL = """num_key_value_heads head_dim sliding_window rotary_dim num_local_experts n_shared_experts
    moe_num_shared_experts n_group topk_group decoder_sparse_step q_lora_rank attention_chunk_size"""
_HF_NUMBER = """rms_norm_eps initializer_range partial_rotary_factor rope_local_base_freq routed_scaling_factor swiglu_limit
    query_pre_attn_scalar floor_scale attn_scale"""
_HF_NUMBER_OR_NULL = """rope_theta original_max_position_embeddings clip_qkv router_aux_loss_coef attn_logit_softcapping
    final_logit_softcapping embedding_multiplier residual_multiplier attention_multiplier logits_scaling"""
_HF_NUMBER_FIELDS = {  # name -> (int for a whole number, float for any; whether null is allowed)
    **dict.fromkeys(_HF_WHOLE.split(), (int, False)),
    **dict.fromkeys(_HF_WHOLE_OR_NULL.split(), (int, True)),
    **dict.fromkeys(_HF_NUMBER.split(), (float, False)),
    **dict.fromkeys(_HF_NUMBER_OR_NULL.split(), (float, True)),
}


def check_hf_numbers(hf: dict, source: str = "config.json") -> None:
    """A ZooError naming `source` (the file `hf` was read from), the first number field of `hf` or its text_config
    (`_HF_NUMBER_FIELDS`) that holds something else, its value and what it must be."""
    for prefix, section in (("", hf), ("text_config.", hf.get("text_config"))):
        for name, value in (section if isinstance(section, dict) else {}).items():
            kind, nullable = _HF_NUMBER_FIELDS.get(name, (None, True))
            if kind is None or (value is None and nullable):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
                what = ("a whole number" if kind is int else "a number") + (" or null" if nullable else "")
                if value is None:
                    what += " (write the model's value, or remove the line for transformers' default)"
                elif isinstance(value, str):
                    what += " (a number, not in quotes)"
                raise ZooError(f"{source}: {prefix}{name} is {json.dumps(value)}; it must be {what}")


def _first_id(value):
    return value[0] if isinstance(value, list) and value else value


def has_template(hf: dict) -> bool:
    """Whether megatrain has a native template for a config.json's family."""
    model_type = _TEXT_MODEL_OF.get(hf.get("model_type"), hf.get("model_type"))
    return _SAME_AS.get(model_type, model_type) in _HF_CLASSES


def config_from_hf(hf: dict) -> ModelConfig:
    """Parse a Hugging Face config dict; refuse features the templates do not implement."""
    hf, model_type = _text_model_config(hf)
    _refuse_what_templates_lack(hf, model_type)
    gemma = _gemma_from_hf(hf, model_type)
    theta, scaling, partial_rotary, local_theta = _rotary_from_hf(hf, model_type)
    sliding_layers = _sliding_layers(hf, model_type)
    heads = hf["num_attention_heads"]
    if model_type in _LATENT_ATTENTION:  # the rotary part of a head is its head_dim; every head has its own k/v
        hf = {**hf, "head_dim": hf["qk_rope_head_dim"], "num_key_value_heads": heads}
    return ModelConfig(
        arch=model_type,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=_dense_d_ff(hf, model_type),
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_seq_len=hf.get("max_position_embeddings", 4096),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2"
        or (model_type == "qwen2_moe" and hf.get("qkv_bias", True))
        or (model_type in ("gpt_oss", "glm4_moe") and hf.get("attention_bias", True)),
        qk_norm=model_type
        in ("qwen3", "qwen3_moe", "olmoe", "minimax_m2", "dots1", "gemma3_text", *OLMO, *LINEAR_ATTENTION_ARCHITECTURES)
        or (model_type == "glm4_moe" and hf.get("use_qk_norm")),
        partial_rotary_factor=partial_rotary,
        qk_norm_scope="full" if model_type in ("olmoe", "minimax_m2", *OLMO) else "head",
        clip_qkv=hf.get("clip_qkv"),
        sliding_window=hf["sliding_window"] if sliding_layers else None,
        sliding_layers=sliding_layers,
        initializer_range=hf.get("initializer_range", 0.02),
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
        pad_token_id=_pad_token(hf),
        **_moe_from_hf(hf, model_type),
        **_gpt_oss_from_hf(hf, model_type),
        **_latent_attention_from_hf(hf, model_type),
        **_llama4_from_hf(hf, model_type),
        **_linear_attention_from_hf(hf, model_type),
        nope_layers=_nope_layers(hf, model_type),
        rope_local_theta=local_theta,
        **gemma,
        **_granite_from_hf(hf, model_type),
    )


def _text_model_config(hf: dict) -> tuple[dict, str]:
    """(the config of the text model, its family's defaults filled in; the family's model_type)."""
    if hf.get("model_type") in _TEXT_MODEL_OF:  # an image-text model: its text model trains (and exports) alone
        outer = {k: hf[k] for k in ("quantization_config",) if k in hf}  # (written beside text_config)
        text = hf.get("text_config") or {}
        hf = {**outer, **text, "model_type": text.get("model_type") or _TEXT_MODEL_OF[hf["model_type"]]}
    model_type = _SAME_AS.get(hf.get("model_type"), hf.get("model_type"))
    hf = {**_DEFAULTS.get(model_type, {}), **hf}
    return hf, model_type


def _refuse_what_templates_lack(hf: dict, model_type: str) -> None:
    """A ZooError naming the first feature of `hf` that the templates do not implement (an unknown architecture,
    biases where the family's template has none, dropout, an unreadable quantization)."""
    if model_type not in _HF_CLASSES:
        archs = hf.get("architectures")
        why = _UNSUPPORTED_MOE.get(model_type, "")
        raise TemplateLacks(
            f"unsupported architecture: model_type={model_type!r} (architectures={archs}){'; ' + why if why else ''}; "
            f"megatrain supports {sorted(_HF_CLASSES)} (Llama 2/3, Qwen2/2.5, Qwen3, Mistral; MoE: Mixtral, "
            "Qwen1.5/2-MoE, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V2, DeepSeek-V3, Kimi K2, GLM-4.5, MiniMax-M2, "
            "dots.llm1, ERNIE 4.5 and Llama 4; Gemma 2 and 3, Phi-3 and Phi-4, OLMo 2 and 3, SmolLM3, Granite 3, 4.0 "
            "(dense) and 4.1; with linear attention: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE, Granite 4.0-H)"
        )
    biased_attention_refused = (
        "llama",
        "qwen3",
        "qwen3_moe",
        "olmoe",
        "dots1",
        *_LATENT_ATTENTION,
        *GEMMA,
        "phi3",
        *OLMO,
        "llama4_text",
        "smollm3",
        *LINEAR_ATTENTION_ARCHITECTURES,
        *GRANITE,
    )
    if hf.get("attention_bias") and model_type in biased_attention_refused:
        raise TemplateLacks(f"{model_type} with attention_bias=true (bias on o_proj too) is not supported")
    _check_quantization(hf.get("quantization_config"), model_type)
    dropout = {key: hf[key] for key in ("resid_pdrop", "embd_pdrop", "attention_dropout") if hf.get(key)}
    if dropout:
        raise ZooError(f"{model_type} with dropout {dropout}: megatrain trains without dropout; set them to 0.0")
    if hf.get("mlp_bias") or (model_type in ERNIE and hf.get("use_bias")):
        raise TemplateLacks(
            f"{model_type} with biases on the MLP projections (mlp_bias / use_bias=true) is not supported"
        )


def _rotary_from_hf(hf: dict, model_type: str) -> tuple[float, dict | None, float, float | None]:
    """(rope_theta, the rope_scaling dict or None, the rotating fraction of a head, the windowed layers' own
    base or None) as every transformers version writes them."""
    # transformers >= 5 folds rope_theta/rope_scaling into rope_parameters
    rope = dict(hf.get("rope_parameters") or {})
    local_theta = None
    if model_type in LOCAL_ROPE_ARCHITECTURES:
        rope, local_theta = _rope_per_layer_type(hf, rope, model_type)
    theta = hf.get("rope_theta") or rope.get("rope_theta") or (500000.0 if model_type in ERNIE else 10000.0)
    default_rotary = 0.25 if model_type in LINEAR_ATTENTION_ARCHITECTURES else 1.0  # (transformers' default)
    partial_rotary = float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", default_rotary)))
    if hf.get("rotary_dim"):  # MiniMax-M2 publishes the rotating width itself
        partial_rotary = hf["rotary_dim"] / (hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
    # (transformers 5 writes some families' rope_parameters under rope_scaling too, rope_theta and all; Qwen3.5's
    # multimodal rotary sections give a text's tokens one position on every axis, which is the plain embedding)
    not_scaling = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
    scaling = {k: v for k, v in (hf.get("rope_scaling") or rope).items() if k not in not_scaling} or None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":  # as transformers completes it
        original = scaling.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
        max_len = hf.get("max_position_embeddings", 4096)
        scaling = {"original_max_position_embeddings": original, "factor": max_len / original, **scaling}
    return float(theta), scaling, partial_rotary, local_theta


def _granite_from_hf(hf: dict, model_type: str) -> dict:
    """Granite's multipliers (transformers' default: 1.0 each); Granite 4.0's Mamba-2 layers (`mamba` in
    layer_types, or transformers 5's `linear_attention`) as its linear-attention layers. Its experts are refused."""
    if model_type not in GRANITE:
        return {}
    multipliers = {name: float(hf.get(name) or 1.0) for name in GRANITE_MULTIPLIERS}
    if model_type == "granite":
        return multipliers
    if hf.get("num_local_experts"):
        raise TemplateLacks(
            "Granite 4.0's experts (num_local_experts > 0: H-Tiny, H-Small) are not implemented yet; its dense "
            "models (Micro, H-Micro, 1B, H-1B, 350M, H-350M) are"
        )
    types = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * hf["num_hidden_layers"]
    unknown = sorted(set(types) - {"mamba", "linear_attention", "attention", "full_attention"})
    if unknown:
        raise ZooError(f"Granite 4.0 layer_types {unknown} are not known (mamba, attention)")
    mamba = tuple(i for i, kind in enumerate(types) if kind in ("mamba", "linear_attention"))
    return multipliers | (_mamba_from_hf(hf, mamba) if mamba else {})


def _mamba_from_hf(hf: dict, layers: tuple[int, ...]) -> dict:
    """Granite 4.0-H's Mamba-2 `layers` as linear-attention fields: its groups as key heads, its state size as the
    key head dim, its heads and their dim as the value heads'."""
    refused = {
        "mamba_conv_bias": hf.get("mamba_conv_bias", True) is not True,
        "mamba_proj_bias": bool(hf.get("mamba_proj_bias")),
        "time_step_limit": tuple(hf.get("time_step_limit") or (0.0, float("inf"))) != (0.0, float("inf")),
    }
    if any(refused.values()):
        raise TemplateLacks(
            f"Granite 4.0-H with {[name for name, bad in refused.items() if bad]} other than transformers' defaults "
            "(a bias on the convolution, none on the projections, dt unclamped) is not supported"
        )
    heads, head_dim = hf.get("mamba_n_heads", 128), hf.get("mamba_d_head", "auto")  # (transformers' defaults)
    if head_dim in (None, "auto"):
        head_dim = hf.get("mamba_expand", 2) * hf["hidden_size"] // heads
    return {
        "linear_attention_layers": layers,
        "linear_n_key_heads": hf.get("mamba_n_groups", 1),
        "linear_n_value_heads": heads,
        "linear_key_head_dim": hf.get("mamba_d_state", 256),
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel": hf.get("mamba_d_conv", 4),
    }


def _dense_d_ff(hf: dict, model_type: str) -> int:
    """The dense MLP's width (Qwen3.5-MoE has none: its experts' then, unused)."""
    if model_type == "llama4_text":
        return hf["intermediate_size_mlp"]
    if model_type == "qwen3_5_moe_text":
        return hf.get("intermediate_size") or hf["moe_intermediate_size"]
    if model_type == "granitemoehybrid":  # (its dense MLP is the shared one; intermediate_size is the experts')
        return hf["shared_intermediate_size"]
    return hf["intermediate_size"]


def _linear_attention_layer_types(hf: dict) -> list[str]:
    """Qwen3-Next's and Qwen3.5's `layer_types`, or transformers' default: softmax attention every
    `full_attention_interval`-th layer, linear attention on the others."""
    interval = hf["full_attention_interval"]
    default = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(hf["num_hidden_layers"])
    ]
    types = hf.get("layer_types") or default
    unknown = sorted(set(types) - {"linear_attention", "full_attention"})
    if unknown:
        raise TemplateLacks(f"layer_types {unknown} are not supported here (linear_attention, full_attention)")
    return types


def _linear_attention_from_hf(hf: dict, model_type: str) -> dict:
    if model_type not in LINEAR_ATTENTION_ARCHITECTURES:
        return {}
    if hf.get("hidden_act", "silu") != "silu":
        raise TemplateLacks(f"{model_type} with hidden_act={hf['hidden_act']!r} is not supported (silu)")
    types = _linear_attention_layer_types(hf)[: hf["num_hidden_layers"]]
    return {
        "linear_attention_layers": tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        "linear_n_key_heads": hf["linear_num_key_heads"],
        "linear_n_value_heads": hf["linear_num_value_heads"],
        "linear_key_head_dim": hf["linear_key_head_dim"],
        "linear_value_head_dim": hf["linear_value_head_dim"],
        "linear_conv_kernel": hf["linear_conv_kernel_dim"],
    }


_GEMMA_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # transformers' name -> ModelConfig's


def _gemma_from_hf(hf: dict, model_type: str) -> dict:
    if model_type not in GEMMA:
        return {}
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _GEMMA_ACTIVATIONS:
        raise TemplateLacks(
            f"{model_type} with hidden_activation={activation!r} is not supported ({list(_GEMMA_ACTIVATIONS)})"
        )
    if hf.get("use_bidirectional_attention"):
        raise ZooError(f"{model_type} with use_bidirectional_attention=true (an embedding model) is not supported")
    caps = ("attn_logit_softcapping", "final_logit_softcapping")
    return {
        "activation": _GEMMA_ACTIVATIONS[activation],
        "query_pre_attn_scalar": _int_if_whole(hf["query_pre_attn_scalar"]),  # transformers' field is an int
        **{cap: None if hf.get(cap) is None else float(hf[cap]) for cap in caps},
    }


def _int_if_whole(value: float) -> float:
    return int(value) if float(value).is_integer() else float(value)


def _rope_per_layer_type(hf: dict, rope: dict, model_type: str) -> tuple[dict, float]:
    """Gemma 3's and OLMo 3's two rotary settings: (the full-attention layers' rope_theta and rope_scaling, the
    sliding layers' base, never scaled); transformers >= 5 writes rope_parameters per layer type. Unwritten, the
    sliding layers' base is Gemma 3's rope_local_base_freq, and OLMo 3's transformers default (500000: its
    config gives a published rope_theta to the full-attention layers only)."""
    by_layer_type = rope if {"full_attention", "sliding_attention"} & set(rope) else {}
    default_theta = 1_000_000.0 if model_type == "gemma3_text" else 500_000.0
    full = {"rope_theta": hf.get("rope_theta") or default_theta, **(by_layer_type.get("full_attention") or {})}
    full.update(hf.get("rope_scaling") or {})
    local = by_layer_type.get("sliding_attention") or {}
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise TemplateLacks(f"{model_type} with rotary scaling {local} on its sliding-window layers is not supported")
    local_default = hf.get("rope_local_base_freq", 10_000.0) if model_type == "gemma3_text" else 500_000.0
    return full, float(local.get("rope_theta", local_default))


def _check_quantization(quantization: dict | None, model_type: str) -> None:
    """Quantized checkpoints megatrain dequantizes into its fp32 masters on import: gpt-oss' MXFP4
    experts, block-scaled FP8 (DeepSeek-V3, Kimi K2, Qwen3 FP8: `weight` in e4m3 with
    `weight_scale_inv` per block), and bitsandbytes' NF4 with double quantization (a QLoRA base saved by
    transformers; a run over an nf4 base takes its bytes as they are). Anything else is refused."""
    if not quantization:
        return
    method = quantization.get("quant_method", quantization)
    if model_type == "gpt_oss" and method == "mxfp4":
        return
    if method == "fp8" and quantization.get("weight_block_size") and quantization.get("fmt", "e4m3") == "e4m3":
        return
    if method == "bitsandbytes":  # (a QLoRA base published pre-quantized, as many "-bnb-4bit" models are)
        nf4 = quantization.get("load_in_4bit") and quantization.get("bnb_4bit_quant_type") == "nf4"
        if nf4 and quantization.get("bnb_4bit_use_double_quant"):
            return
        raise ZooError(
            "config.json has quantization_config 'bitsandbytes' but not 4-bit NF4 with double quantization, the one "
            "bitsandbytes form megatrain reads (as QLoRA saves it); give model.hf_dir the bf16 model it was "
            "quantized from, with model.adapter: {type: lora, base_dtype: nf4} to hold its base in that format"
        )
    raise ZooError(
        f"config.json has quantization_config {method!r}: megatrain trains full-precision weights and reads "
        "only gpt-oss' MXFP4 and block-scaled FP8 (e4m3 + weight_scale_inv) checkpoints; convert this one to "
        "bf16/fp32 safetensors first"
    )


def _latent_attention_from_hf(hf: dict, model_type: str) -> dict:
    if model_type not in _LATENT_ATTENTION:
        return {}
    return {
        "kv_lora_rank": hf["kv_lora_rank"],
        "q_lora_rank": hf.get("q_lora_rank") or 0,
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        "rope_interleave": bool(hf.get("rope_interleave", True)),
    }


def _deepseek_routing_from_hf(hf: dict, model_type: str) -> dict:
    """DeepSeek's routing fields: V2 softmax, greedy or group-limited; V3 and GLM-4.5 the noaux_tc way
    (sigmoid scores, correction bias), which transformers uses for every model of theirs."""
    method = "noaux_tc"
    if model_type == "deepseek_v2":
        method = hf.get("topk_method", "greedy")
        if method not in ("greedy", "group_limited_greedy"):
            raise TemplateLacks(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method != "greedy"
    return {
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "n_group": hf.get("n_group") or 1 if grouped else 1,
        "topk_group": hf.get("topk_group") or 1 if grouped else 1,
        "router_scoring": "sigmoid" if method == "noaux_tc" else "softmax",
    }


def _gpt_oss_from_hf(hf: dict, model_type: str) -> dict:
    if model_type != "gpt_oss":
        return {}
    if hf.get("swiglu_alpha", 1.702) != 1.702:
        raise TemplateLacks(f"gpt_oss swiglu_alpha {hf['swiglu_alpha']} is not supported (1.702)")
    return {
        "o_bias": bool(hf.get("attention_bias", True)),
        "attention_sinks": True,
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }


def _llama4_from_hf(hf: dict, model_type: str) -> dict:
    """Llama 4's layers as transformers' Llama4TextConfig makes them: without rotary embedding where
    `no_rope_layers` says 0 (default: every `no_rope_layer_interval`-th), chunked where `layer_types` says
    (default: the rotary layers, when there is a chunk size), sparse in `moe_layers` (default: every
    `interleave_moe_layer_step`-th); one routed expert as wide as the shared one. transformers adds no
    load-balancing loss for it."""
    if model_type != "llama4_text":
        return {}
    n_layers = hf["num_hidden_layers"]
    rotates = _rotary_layer_flags(hf)
    chunk = hf.get("attention_chunk_size")
    types = hf.get("layer_types") or [
        "chunked_attention" if rotary and chunk is not None else "full_attention" for rotary in rotates
    ]
    unknown = sorted(set(types) - {"chunked_attention", "full_attention"})
    if unknown:
        raise TemplateLacks(f"llama4_text layer_types {unknown} are not supported (chunked_attention, full_attention)")
    chunked = tuple(i for i, kind in enumerate(types[:n_layers]) if kind == "chunked_attention")
    step = hf.get("interleave_moe_layer_step", 1)
    moe_layers = hf.get("moe_layers")
    moe_layers = set(range(step - 1, n_layers, step) if moe_layers is None else moe_layers)
    tuning = bool(hf.get("attn_temperature_tuning"))
    return {
        "attention_chunk_size": chunk if chunked else None,
        "chunked_layers": chunked,
        "qk_rms_normalized": bool(hf.get("use_qk_norm")),
        "attn_temperature_floor_scale": float(hf["floor_scale"]) if tuning else 0.0,
        "attn_temperature_scale": float(hf["attn_scale"]) if tuning else 0.0,
        "n_experts": hf["num_local_experts"],
        "n_experts_per_tok": hf["num_experts_per_tok"],
        "moe_d_ff": hf["intermediate_size"],
        "shared_expert_d_ff": hf["intermediate_size"],
        "dense_layers": tuple(i for i in range(n_layers) if i not in moe_layers),
        "router_scoring": "sigmoid_of_top_k",
    }


def _rotary_layer_flags(hf: dict) -> list[int]:
    """Llama 4's and SmolLM3's `no_rope_layers`: 1 where a layer has the rotary embedding, 0 where not
    (default: every `no_rope_layer_interval`-th layer has none)."""
    interval = hf.get("no_rope_layer_interval", 4)
    return hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(hf["num_hidden_layers"])]


def _nope_layers(hf: dict, model_type: str) -> tuple[int, ...]:
    """The layers without rotary embedding."""
    if model_type not in NOPE_ARCHITECTURES:
        return ()
    if model_type == "granitemoehybrid":  # rotary on every layer or on none
        return () if hf.get("position_embedding_type") == "rope" else tuple(range(hf["num_hidden_layers"]))
    return tuple(i for i, rotary in enumerate(_rotary_layer_flags(hf)[: hf["num_hidden_layers"]]) if not rotary)


def _sliding_layers(hf: dict, model_type: str) -> tuple[int, ...]:
    """The layers that attend over a sliding window, as transformers decides them: `layer_types` where
    written; else gpt-oss and Gemma 2 every other layer, Gemma 3 five of six (`sliding_window_pattern`),
    Mistral, Mixtral and Phi-3 every layer, Qwen and dots.llm1 the layers from `max_window_layers` on (Qwen only
    with `use_sliding_window`), SmolLM3 its layers without rotary embedding (with `use_sliding_window`). None
    without a window."""
    n_layers = hf["num_hidden_layers"]
    if not hf.get("sliding_window") or model_type in LINEAR_ATTENTION_ARCHITECTURES:
        return ()
    if model_type == "smollm3" and hf.get("layer_types") is None:  # by default on the layers without rotary embedding
        return _nope_layers(hf, model_type) if hf.get("use_sliding_window") else ()
    types = hf.get("layer_types")
    every = {"gpt_oss": 2, "gemma2": 2, "gemma3_text": hf.get("sliding_window_pattern", 6), "olmo3": 4}.get(model_type)
    if types is None and every:
        return windowed_but_every(n_layers, every)
    if types is not None:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise TemplateLacks(
                f"{model_type} layer_types {unknown} are not supported (sliding_attention, full_attention)"
            )
        return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    if model_type in _WINDOW_ON_EVERY_LAYER:
        return tuple(range(n_layers))
    if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "dots1") and hf.get(
        "use_sliding_window", model_type == "dots1"
    ):
        return tuple(range(hf.get("max_window_layers", n_layers), n_layers))
    return ()


def _pad_token(hf: dict) -> int | None:
    """The embedding's padding row, if transformers would make one (an id inside the vocabulary)."""
    pad = hf.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < hf["vocab_size"] else None


def _moe_from_hf(hf: dict, model_type: str) -> dict:
    """The ModelConfig fields of a mixture-of-experts config.json ({} for a dense one)."""
    if model_type in _AUX_OVER_UNBIASED_TOP_K and hf.get("output_router_logits"):
        raise ZooError(
            f"{model_type} with output_router_logits=true: transformers' load-balancing loss for it counts each "
            "token's unbiased top-k, which megatrain's routing statistics (the chosen experts) do not; set it to "
            "false (train.router_bias_update_rate balances by its correction bias instead)"
        )
    generic = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "minimax_m2", "qwen3_next", "qwen3_5_moe_text")
    if model_type not in (*generic, *_DEEPSEEK_MOE):
        return _ernie_moe_from_hf(hf) if model_type == "ernie4_5_moe" else {}
    if model_type in _DEEPSEEK_MOE:  # transformers adds no load-balancing loss; DeepSeek-V2 never renormalises
        return {
            "n_experts": hf["n_routed_experts"],
            "n_experts_per_tok": hf["num_experts_per_tok"],
            "moe_d_ff": hf["moe_intermediate_size"],
            "shared_expert_d_ff": (hf.get("n_shared_experts") or 0) * hf["moe_intermediate_size"],
            "dense_layers": tuple(range(hf.get("first_k_dense_replace", 0))),
            # transformers' defaults: V3 and GLM-4.5 renormalise, dots.llm1 not (its published config does)
            "norm_topk_prob": model_type != "deepseek_v2" and bool(hf.get("norm_topk_prob", model_type != "dots1")),
            **_deepseek_routing_from_hf(hf, model_type),
        }
    if hf.get("router_jitter_noise"):
        raise ZooError(
            f"router_jitter_noise={hf['router_jitter_noise']} (random router noise in training) is not supported; "
            "set it to 0 in config.json"
        )
    n_layers = hf["num_hidden_layers"]
    fields = {
        # transformers writes num_local_experts for some families that published as num_experts
        "n_experts": hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"],
        "n_experts_per_tok": hf["num_experts_per_tok"],
        # (Qwen3-Next's transformers default renormalises; Qwen3.5-MoE's router always does)
        "norm_topk_prob": model_type in ("mixtral", "qwen3_5_moe_text")
        or bool(hf.get("norm_topk_prob", model_type == "qwen3_next")),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0),
        "output_router_logits": bool(hf.get("output_router_logits", False)),
    }
    if model_type == "gpt_oss":  # softmax over the top-k logits: the top-k probabilities renormalised
        fields["norm_topk_prob"] = True
    if model_type == "minimax_m2":  # its router: a sigmoid, a correction bias, the top-k renormalised
        fields.update(norm_topk_prob=True, router_scoring="sigmoid")
    if model_type in ("mixtral", "olmoe", "gpt_oss", "minimax_m2"):  # all layers sparse; intermediate_size: experts'
        return {**fields, "moe_d_ff": hf["intermediate_size"]}
    step = hf.get("decoder_sparse_step", 1) or 1
    only_mlp = set(hf.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(n_layers) if i in only_mlp or (i + 1) % step)
    return {
        **fields,
        "moe_d_ff": hf["moe_intermediate_size"],
        "shared_expert_d_ff": hf.get("shared_expert_intermediate_size", 0) if model_type in GATED_SHARED_EXPERT else 0,
        "dense_layers": dense,
    }


def _ernie_moe_from_hf(hf: dict) -> dict:
    """ERNIE 4.5's MoE fields: softmax routing with a correction bias, shared experts, the MoE layers every
    `moe_layer_interval` from `moe_layer_start_index` to `moe_layer_end_index` (-1: the last)."""
    n_layers = hf["num_hidden_layers"]
    n_experts = hf.get("moe_num_experts", hf.get("num_experts"))
    if not isinstance(n_experts, int):
        raise ZooError(f"ernie4_5_moe with moe_num_experts={n_experts!r}: only text models (one expert count) train")
    start, interval = hf.get("moe_layer_start_index", 1), hf.get("moe_layer_interval", 1)
    end = hf.get("moe_layer_end_index", -1)
    end = n_layers - 1 if end == -1 else end
    d_ff = hf["moe_intermediate_size"]
    return {
        "n_experts": n_experts,
        "n_experts_per_tok": hf.get("moe_k", hf.get("num_experts_per_tok")),
        "moe_d_ff": d_ff,
        "shared_expert_d_ff": (hf.get("moe_num_shared_experts") or 0) * d_ff,
        "dense_layers": tuple(i for i in range(n_layers) if not ((i + 1) % interval == 0 and start <= i <= end)),
        "norm_topk_prob": True,
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0),
    }
