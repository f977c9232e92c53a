"""Hugging Face `config.json` <-> ModelConfig, for the architectures the templates implement."""

import json
from pathlib import Path

from .config import ModelConfig, ZooError

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
# Mixture-of-experts families transformers has but megatrain does not (yet) implement, with the reason.
_UNSUPPORTED_MOE = {
    "gpt_oss": "gpt-oss (attention sinks, clamped SwiGLU, MXFP4 experts) is not implemented yet",
    "deepseek_v2": "DeepSeek-V2 (multi-head latent attention, group-limited routing) is not implemented yet",
    "deepseek_v3": "DeepSeek-V3 (multi-head latent attention, sigmoid routing with bias) is not implemented yet",
}


def _first_id(value):
    return value[0] if isinstance(value, list) and value else value


def config_from_hf(hf: dict) -> ModelConfig:
    """Parse a Hugging Face config dict; refuse features the templates do not implement."""
    model_type = hf.get("model_type")
    if model_type not in _HF_CLASSES:
        archs = hf.get("architectures")
        why = _UNSUPPORTED_MOE.get(model_type, "")
        raise ZooError(
            f"unsupported architecture: model_type={model_type!r} (architectures={archs}){'; ' + why if why else ''}; "
            f"megatrain supports {sorted(_HF_CLASSES)} (Llama 2/3, Qwen2/2.5, Qwen3, Mistral; MoE: Mixtral, "
            "Qwen1.5/2-MoE, Qwen3-MoE, OLMoE)"
        )
    if hf.get("attention_bias") and model_type in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        raise ZooError(f"{model_type} with attention_bias=true (bias on o_proj too) is not supported")
    quantization = hf.get("quantization_config")
    if quantization:
        raise ZooError(
            f"config.json has quantization_config {quantization.get('quant_method', quantization)!r}: megatrain trains "
            "full-precision weights; convert the checkpoint to bf16/fp32 safetensors first"
        )
    if hf.get("mlp_bias"):
        raise ZooError("mlp_bias=true is not supported")
    # transformers >= 5 folds rope_theta/rope_scaling into rope_parameters
    rope = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", model_type in ("mistral", "mixtral")) else None
    heads = hf["num_attention_heads"]
    return ModelConfig(
        arch=model_type,
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_seq_len=hf.get("max_position_embeddings", 4096),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and hf.get("qkv_bias", True)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
        qk_norm_scope="full" if model_type == "olmoe" else "head",
        clip_qkv=hf.get("clip_qkv"),
        sliding_window=sliding or None,
        initializer_range=hf.get("initializer_range", 0.02),
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
        pad_token_id=_pad_token(hf),
        **_moe_from_hf(hf, model_type),
    )


def _pad_token(hf: dict) -> int | None:
    """The embedding's padding row, if transformers would make one (an id inside the vocabulary)."""
    pad = hf.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < hf["vocab_size"] else None


def _moe_from_hf(hf: dict, model_type: str) -> dict:
    """The ModelConfig fields of a mixture-of-experts config.json ({} for a dense one)."""
    if model_type not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return {}
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
        "norm_topk_prob": model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0)),
        "output_router_logits": bool(hf.get("output_router_logits", False)),
    }
    if model_type in ("mixtral", "olmoe"):  # every layer is sparse; intermediate_size is the experts' width
        return {**fields, "moe_d_ff": hf["intermediate_size"]}
    step = hf.get("decoder_sparse_step", 1) or 1
    only_mlp = set(hf.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(n_layers) if i in only_mlp or (i + 1) % step)
    return {
        **fields,
        "moe_d_ff": hf["moe_intermediate_size"],
        "shared_expert_d_ff": hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0,
        "dense_layers": dense,
    }


def config_to_hf(config: ModelConfig, torch_dtype: str = "float32") -> dict:
    """A config.json that transformers loads as the matching *ForCausalLM."""
    hf = {
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
        "rope_scaling": config.rope_scaling,
        "rms_norm_eps": config.rms_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "initializer_range": config.initializer_range,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": torch_dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }
    if config.arch in ("llama", "qwen3", "qwen3_moe", "olmoe"):
        hf["attention_bias"] = False
        hf["mlp_bias"] = False
    if config.arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
        hf["max_window_layers"] = config.n_layers
    if config.arch in ("mistral", "mixtral"):
        hf["sliding_window"] = config.sliding_window
    if config.is_moe:
        hf.update(_moe_to_hf(config))
    return hf


def _moe_to_hf(config: ModelConfig) -> dict:
    hf = {
        "num_experts_per_tok": config.n_experts_per_tok,
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": config.output_router_logits,
    }
    if config.arch == "mixtral":
        return {**hf, "num_local_experts": config.n_experts, "intermediate_size": config.moe_d_ff, "router_jitter_noise": 0.0}
    hf.update(num_experts=config.n_experts, norm_topk_prob=config.norm_topk_prob)
    if config.arch == "olmoe":
        return {**hf, "intermediate_size": config.moe_d_ff, "clip_qkv": config.clip_qkv}
    hf.update(
        moe_intermediate_size=config.moe_d_ff,
        decoder_sparse_step=1,
        mlp_only_layers=list(config.dense_layers),
    )
    if config.arch == "qwen2_moe":
        hf.update(shared_expert_intermediate_size=config.shared_expert_d_ff, qkv_bias=config.qkv_bias)
    return hf


def read_hf_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    try:
        return config_from_hf(json.loads(path.read_text()))
    except FileNotFoundError:
        raise ZooError(
            f"{path} not found: model.hf_dir must be a Hugging Face model directory with config.json"
        ) from None
    except (json.JSONDecodeError, KeyError) as error:
        raise ZooError(f"{path} is not a valid Hugging Face config ({error!r})") from error
