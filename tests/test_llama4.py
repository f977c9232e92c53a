"""Llama 4 trains exactly like transformers: several optimizer steps of megatrain (fp32, micro-batches, clipped and
eager, experts whole and in parts) equal transformers' Llama4ForCausalLM + torch.optim.AdamW on the same batches,
with chunked attention, layers without rotary embedding and their query temperatures, weightless q/k RMS norms,
dense and sparse layers and two experts per token that bite; the published image-text checkpoints train and export
their text model; the published configs parse to the presets."""

import json

import pytest
import torch
import transformers  # installed by the integration nox session
from hf_steps import check_text_model_trains_and_exports_alone, rel_err
from test_dense_families import check_steps_match_transformers, hf_dense_model

from megatrain.config import EngineSection
from megatrain_zoo import ZooError, config_from_hf, config_to_hf, preset


@pytest.mark.parametrize("grad_clip", [0.5, 0.0], ids=["clipped", "eager"])
def test_steps_match_transformers(grad_clip, tmp_path):
    check_steps_match_transformers("tiny-llama4", tmp_path, "cpu", grad_clip)


def test_experts_streamed_in_parts_match_transformers(tmp_path):
    """Four experts in parts of three: the fused tensors' row slices, one stage and group each."""
    check_steps_match_transformers("tiny-llama4", tmp_path, "cpu", 0.5, EngineSection(experts_per_stage=3))


@pytest.mark.gpu
@pytest.mark.parametrize("experts_per_stage", ["auto", 3])
def test_gpu_steps_match_transformers(experts_per_stage, tmp_path):
    """The CUDA engine in fp32, TF32 off (FlexAttention for the chunks, grouped GEMMs where they run), against
    transformers on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    engine = EngineSection(experts_per_stage=experts_per_stage)
    check_steps_match_transformers("tiny-llama4", tmp_path, "cuda", 0.5, engine)


@pytest.mark.parametrize(
    "changes",
    [
        {"attention_chunk_size": 64},
        {"attn_temperature_tuning": False},
        {"use_qk_norm": False},
        {"no_rope_layers": [1] * 5},
        {"num_experts_per_tok": 1},
        {"rope_scaling": None},
    ],
    ids=["chunks", "temperatures", "qk-norms", "nope-layer", "top-k", "rotary-scaling"],
)
def test_the_tiny_presets_features_change_the_result(changes):
    """Each of the tiny preset's Llama 4 features bites at the tests' 12 positions: without it transformers'
    logits differ (so the steps above test it)."""
    ids = torch.randint(0, 256, (2, 12))
    model = hf_dense_model("tiny-llama4", 3).eval()
    changed = hf_dense_model("tiny-llama4", 3, **changes).eval()
    with torch.no_grad():
        assert rel_err(changed(ids).logits, model(ids).logits) > 1e-3


# The published config.json of the image-text checkpoints (their text_config; the vision tower's left out)
SCOUT = {
    "architectures": ["Llama4ForConditionalGeneration"],
    "model_type": "llama4",
    "boi_token_index": 200080,
    "eoi_token_index": 200081,
    "image_token_index": 200092,
    "text_config": {
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attention_dropout": 0.0,
        "attn_scale": 0.1,
        "attn_temperature_tuning": True,
        "bos_token_id": 200000,
        "eos_token_id": [200001, 200007, 200008],
        "floor_scale": 8192,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "initializer_range": 0.02,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760,
        "model_type": "llama4_text",
        "no_rope_layers": [],
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "output_router_logits": False,
        "pad_token_id": 200018,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 16.0,
            "high_freq_factor": 1.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "use_qk_norm": True,
        "vocab_size": 202048,
    },
}
MAVERICK = {
    **SCOUT,
    "text_config": {
        **{k: v for k, v in SCOUT["text_config"].items() if k not in ("attn_scale", "attn_temperature_tuning")},
        "floor_scale": 8192,
        "interleave_moe_layer_step": 2,
        "max_position_embeddings": 1048576,
        "num_local_experts": 128,
        "rope_scaling": None,
        "use_qk_norm": False,
    },
}


@pytest.mark.parametrize(
    "published, name",
    [(SCOUT, "llama-4-scout-17b-16e"), (MAVERICK, "llama-4-maverick-17b-128e")],
    ids=["scout", "maverick"],
)
def test_published_configs_parse_to_the_presets_as_transformers_reads_them(published, name):
    """The published form (no_rope_layers empty, MoE layers by interleave step, transformers' defaults left out)
    and transformers' reading of it (every layer's list written out, rope_parameters) parse to the preset, whose
    counts are the published ones (17B active; 109B and 400B with the vision tower, ~1B, not trained here)."""
    assert config_from_hf(published) == preset(name)
    as_read = transformers.AutoConfig.for_model(**published).to_dict()
    assert config_from_hf(as_read) == preset(name)
    config = preset(name)
    assert round(config.active_params / 1e9, 1) == 17.2
    assert round(config.n_params / 1e9) == {"llama-4-scout-17b-16e": 108, "llama-4-maverick-17b-128e": 401}[name]
    exported = transformers.AutoConfig.for_model(**config_to_hf(config)).to_dict()
    for key in ("layer_types", "no_rope_layers", "moe_layers", "attn_temperature_tuning", "use_qk_norm"):
        assert exported[key] == as_read["text_config"][key], key


def test_unsupported_settings_are_refused():
    text = SCOUT["text_config"]
    with pytest.raises(ZooError, match="attention_bias=true"):
        config_from_hf({**text, "attention_bias": True})
    with pytest.raises(ZooError, match="layer_types"):
        config_from_hf({**text, "layer_types": ["sliding_attention"] * 48})
    with pytest.raises(ZooError, match="Llama 4's"):
        preset("tiny-llama").with_changes(attention_chunk_size=4, chunked_layers=(0,))
    with pytest.raises(ZooError, match="fbgemm_fp8"):  # Maverick's FP8 checkpoint
        config_from_hf({**MAVERICK, "quantization_config": {"quant_method": "fbgemm_fp8"}})
    with pytest.raises(ZooError, match="as wide as its routed ones"):
        preset("tiny-llama4").with_changes(shared_expert_d_ff=64)


def test_text_model_of_an_image_text_checkpoint_trains_and_exports_alone(tmp_path, capfd):
    """Llama 4 is published as image-text models (Llama4ForConditionalGeneration): megatrain reads its text model
    (text_config; `language_model.model.*` and `language_model.lm_head.weight`), leaves the vision model and
    projector out (and says so), computes the text model's logits, and exports a Llama4ForCausalLM; `megatrain
    convert` writes the same text model."""
    from safetensors.torch import save_file

    text_model = hf_dense_model("tiny-llama4", 5).eval()
    tensors = {f"language_model.{name}": param.detach().clone() for name, param in text_model.named_parameters()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.randn(16, 12)
    tensors["multi_modal_projector.linear_1.weight"] = torch.randn(64, 16)
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    text_config = {**config_to_hf(preset("tiny-llama4")), "architectures": None}
    image_text = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text_config,
    }
    (tmp_path / "hf" / "config.json").write_text(json.dumps(image_text))

    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = text_model(ids).logits
    check_text_model_trains_and_exports_alone(
        tmp_path / "hf", tmp_path, capfd, preset("tiny-llama4"), expected, ids, "Llama4ForCausalLM"
    )
