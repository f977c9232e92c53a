"""Hugging Face `config.json` <-> ModelConfig, for the architectures the templates implement."""

import json
from pathlib import Path

from .config import ModelConfig, ZooError

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def _first_id(value):
    return value[0] if isinstance(value, list) and value else value


def config_from_hf(hf: dict) -> ModelConfig:
    """Parse a Hugging Face config dict; refuse features the templates do not implement."""
    model_type = hf.get("model_type")
    if model_type not in _HF_CLASSES:
        archs = hf.get("architectures")
        raise ZooError(
            f"unsupported architecture: model_type={model_type!r} (architectures={archs}); megatrain "
            f"supports {sorted(_HF_CLASSES)} (Llama 2/3, Qwen2/2.5, Qwen3 dense, Mistral)"
        )
    if hf.get("attention_bias") and model_type in ("llama", "qwen3"):
        raise ZooError(f"{model_type} with attention_bias=true (bias on o_proj too) is not supported")
    if hf.get("mlp_bias"):
        raise ZooError("mlp_bias=true is not supported")
    # transformers >= 5 folds rope_theta/rope_scaling into rope_parameters
    rope = dict(hf.get("rope_parameters") or {})
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None
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
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        sliding_window=sliding,
        initializer_range=hf.get("initializer_range", 0.02),
        bos_token_id=_first_id(hf.get("bos_token_id")),
        eos_token_id=_first_id(hf.get("eos_token_id")),
    )


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
    }
    if config.arch in ("llama", "qwen3"):
        hf["attention_bias"] = False
        hf["mlp_bias"] = False
    if config.arch in ("qwen2", "qwen3"):
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
        hf["max_window_layers"] = config.n_layers
    if config.arch == "mistral":
        hf["sliding_window"] = config.sliding_window
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
