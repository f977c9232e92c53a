"""Gemma 2, Gemma 3, Phi-3/Phi-4, OLMo 2 and 3, SmolLM3, Qwen3.5 and Granite train exactly like transformers: several
optimizer steps of megatrain (fp32, micro-batches, clipped and eager, weight decay) equal transformers' *ForCausalLM
of each + torch.optim.AdamW on the same batches, with windows, soft caps, per-layer rotary bases and scaling,
(1 + weight) norms, norms after the halves, partial rotary embedding and layers without it, Granite's multipliers,
that bite; exports load in transformers with equal logits;
published config forms parse to the presets."""

import json

import pytest
import torch
import transformers  # installed by the integration nox session
from hf_steps import (
    check_text_model_trains_and_exports_alone,
    exact_reference,
    grad_norm_tolerance,
    hf_adamw,
    make_trainer,
    random_batch,
    reference_step,
    rel_err,
    reload_export,
)

from megatrain.config import EngineSection
from megatrain.step import StepBatch
from megatrain_zoo import ZooError, config_from_hf, config_to_hf, preset

PRESETS = [
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-olmo2",
    "tiny-olmo3",
    "tiny-smollm3",
    "tiny-qwen3.5",
    "tiny-granite",
    "tiny-granite-4.0",
    "tiny-granite-4.0-h",
]


def hf_dense_model(name: str, seed: int, **overrides):
    """transformers' model of preset `name` with fresh random weights: norms around 1 (around 0 for Gemma, which
    scales by 1 + weight), matrices large enough that the soft caps and windows change the result."""
    hf_config = transformers.AutoConfig.for_model(**{**config_to_hf(preset(name)), **overrides})
    torch.manual_seed(seed)
    # eager: transformers' SDPA path leaves Gemma 2's attention soft cap out (5.17 picks it by default)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):  # (linear attention's gated norm scales by its weight alone)
                one_plus = preset(name).norm_scale == "one_plus_fp32" and "linear_attn.norm" not in param_name
                param.normal_(0.0 if one_plus else 1.0, 0.2)
            else:
                param.normal_(0.0, 0.15)
    return model.train()


def check_steps_match_transformers(name, tmp_path, device, grad_clip, engine=EngineSection()):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference, options, stepping = exact_reference(hf_dense_model(name, seed), preset(name))
    reference.save_pretrained(tmp_path / "hf")
    with stepping:
        check_steps(name, tmp_path, device, grad_clip, engine, reference, seed, options)


def check_steps(name, tmp_path, device, grad_clip, engine, reference, seed, options):
    trainer, train = make_trainer(
        tmp_path / "hf", tmp_path, grad_clip, steps=4, device=device, engine=engine, **options
    )
    assert trainer.model_config == preset(name).with_changes(initializer_range=trainer.model_config.initializer_range)
    optimizer = hf_adamw(reference, train)
    generator = torch.Generator().manual_seed(seed)
    for step in range(train.steps):
        ids, labels = random_batch(train.batch_size, 12, trainer.model_config.vocab_size, generator)
        metrics = trainer.train_step(StepBatch(ids, labels))
        _, loss, norm = reference_step(reference, optimizer, train, step, grad_clip, input_ids=ids, labels=labels)
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=grad_norm_tolerance(trainer.model_config))
    if engine.kept_layers != "auto":
        assert len(trainer.pipeline.executed.keeping) == engine.kept_layers
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, 12))
    our_logits = trainer.logits(ids)
    exported = trainer.export(tmp_path / "out")
    trainer.close()
    reloaded = reload_export(exported, reference, attn_implementation="eager")
    ours = dict(reloaded.named_parameters())
    for param_name, param in reference.named_parameters():
        assert rel_err(ours[param_name].detach(), param.detach()) < 1e-4, param_name
    with torch.no_grad():
        assert rel_err(our_logits.cpu(), reloaded(ids).logits) < 1e-5


@pytest.mark.parametrize("grad_clip", [0.5, 0.0], ids=["clipped", "eager"])
@pytest.mark.parametrize("name", PRESETS)
def test_steps_match_transformers(name, grad_clip, tmp_path):
    check_steps_match_transformers(name, tmp_path, "cpu", grad_clip)


@pytest.mark.parametrize("name", PRESETS)
def test_layers_keeping_their_products_match_transformers(name, tmp_path):
    """Layers that keep their matmul products for the backward keep the down projection's too (the norm
    on the MLP's output needs it)."""
    check_steps_match_transformers(name, tmp_path, "cpu", 0.5, EngineSection(kept_layers=2))


@pytest.mark.gpu
@pytest.mark.parametrize("name", PRESETS)
def test_gpu_steps_match_transformers(name, tmp_path):
    """The CUDA engine in fp32 (TF32 off; FlexAttention with the soft cap as its score modification and the
    window as its block mask; the layers keep their products where the GPU has room) against transformers
    on the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    check_steps_match_transformers(name, tmp_path, "cuda", 0.5)


OLMO3_ROPE = config_to_hf(preset("tiny-olmo3"))["rope_parameters"]  # YaRN on full attention, a base of its own


def test_caps_windows_and_rotary_parts_change_the_result():
    """The tiny presets' soft caps, windows and partial rotary embedding bite at the tests' scale: without
    them transformers' logits differ (so the steps above test them)."""
    ids = torch.randint(0, 256, (2, 12))
    for name, changes in [
        ("tiny-gemma2", {"attn_logit_softcapping": None}),
        ("tiny-gemma2", {"final_logit_softcapping": None}),
        ("tiny-gemma2", {"sliding_window": 64}),
        ("tiny-gemma3", {"sliding_window": 64}),
        ("tiny-gemma3", {"rope_local_base_freq": 1_000_000.0}),
        ("tiny-phi3", {"partial_rotary_factor": 1.0}),
        ("tiny-phi3", {"sliding_window": 64}),
        ("tiny-granite", {"embedding_multiplier": 1.0}),
        ("tiny-granite", {"residual_multiplier": 1.0}),
        ("tiny-granite", {"attention_multiplier": 0.25}),  # head_dim ** -0.5
        ("tiny-granite", {"logits_scaling": 1.0}),
        ("tiny-granite-4.0", {"position_embedding_type": "rope"}),
        ("tiny-smollm3", {"no_rope_layers": [1] * 4}),
        ("tiny-smollm3", {"sliding_window": 64}),
        ("tiny-olmo3", {"sliding_window": 64}),
        ("tiny-olmo3", {"rope_parameters": {**OLMO3_ROPE, "full_attention": OLMO3_ROPE["sliding_attention"]}}),
        ("tiny-olmo3", {"rope_parameters": {**OLMO3_ROPE, "sliding_attention": OLMO3_ROPE["full_attention"]}}),
    ]:
        model = hf_dense_model(name, 3).eval()
        changed = hf_dense_model(name, 3, **changes).eval()
        with torch.no_grad():
            assert rel_err(changed(ids).logits, model(ids).logits) > 1e-3, (name, changes)


# Published config.json forms (transformers 4's keys; Gemma 3's image-text models' text_config writes only what
# differs from transformers' defaults)
GEMMA_3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
}
GEMMA_3_27B_TEXT = {
    "model_type": "gemma3_text",
    "head_dim": 128,
    "hidden_size": 5376,
    "intermediate_size": 21504,
    "num_attention_heads": 32,
    "num_hidden_layers": 62,
    "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}
PHI_3_MINI_4K = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "embd_pdrop": 0.0,
    "eos_token_id": 32000,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 32000,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "vocab_size": 32064,
}
GEMMA_2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 224,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
}


@pytest.mark.parametrize(
    "published, name",
    [
        (GEMMA_3_1B, "gemma-3-1b"),
        (GEMMA_3_27B_TEXT, "gemma-3-27b"),
        (GEMMA_2_9B, "gemma-2-9b"),
        (PHI_3_MINI_4K, "phi-3-mini-4k"),
    ],
)
def test_published_configs_parse_to_the_presets_as_transformers_reads_them(published, name):
    """The published form (rope_theta + rope_local_base_freq + rope_scaling, a window pattern instead of
    layer_types, defaults left out) and transformers' own reading of it (rope_parameters per layer type,
    layer_types) both parse to the preset; the preset's config.json reads back the same in transformers."""
    assert config_from_hf(published) == preset(name)
    as_read = transformers.AutoConfig.for_model(**published).to_dict()
    assert config_from_hf(as_read) == preset(name)
    exported = transformers.AutoConfig.for_model(**config_to_hf(preset(name))).to_dict()
    for key in ("layer_types", "rope_parameters", "query_pre_attn_scalar", "final_logit_softcapping", "sliding_window"):
        assert exported.get(key) == as_read.get(key), key


# SmolLM3-3B's published config.json (no_rope_layers written out: 0 on every fourth layer)
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"],
    "model_type": "smollm3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128012,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "mlp_bias": False,
    "no_rope_layer_interval": 4,
    "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 4,
    "pad_token_id": 128004,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 5000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "vocab_size": 128256,
}


# OLMo-3-7B's (YaRN in rope_scaling, for the full-attention layers only; no layer_types: three of four windowed)
OLMO_3_7B = {
    "architectures": ["Olmo3ForCausalLM"],
    "model_type": "olmo3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "eos_token_id": 100257,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 65536,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "pad_token_id": 100277,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "attention_factor": 1.2079441541679836,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "yarn",
    },
    "rope_theta": 500000,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 100278,
}


# Granite-3.3-8B's published config.json (transformers 4.49 wrote it)
GRANITE_3_3_8B = {
    "architectures": ["GraniteForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attention_multiplier": 0.0078125,
    "bos_token_id": 0,
    "embedding_multiplier": 12.0,
    "eos_token_id": 0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12800,
    "logits_scaling": 16.0,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "granite",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "pad_token_id": 0,
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 10000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 49159,
}


@pytest.mark.parametrize(
    "published, name, billions",
    [(SMOLLM3_3B, "smollm3-3b", 3.08), (OLMO_3_7B, "olmo-3-7b", 7.30), (GRANITE_3_3_8B, "granite-3.3-8b", 8.17)],
    ids=["smollm3", "olmo3", "granite"],
)
def test_published_configs_of_layers_without_rotary_or_with_their_own_parse_to_the_presets(published, name, billions):
    """SmolLM3's, OLMo 3's and Granite's published config.json, and transformers' reading of them, parse to the
    presets."""
    assert config_from_hf(published) == preset(name)
    assert config_from_hf(transformers.AutoConfig.for_model(**published).to_dict()) == preset(name)
    assert round(preset(name).n_params / 1e9, 2) == billions


def test_unsupported_settings_are_refused():
    with pytest.raises(ZooError, match="use_bidirectional_attention"):
        config_from_hf({**GEMMA_3_1B, "use_bidirectional_attention": True})
    with pytest.raises(ZooError, match="hidden_activation='silu'"):
        config_from_hf({**GEMMA_2_9B, "hidden_activation": "silu"})
    with pytest.raises(ZooError, match="Gemma's"):
        preset("tiny-llama").with_changes(final_logit_softcapping=30.0)
    with pytest.raises(ZooError, match="nope_layers"):
        preset("tiny-llama").with_changes(nope_layers=(1,))
    with pytest.raises(ZooError, match="without dropout"):
        config_from_hf({**PHI_3_MINI_4K, "resid_pdrop": 0.1})
    with pytest.raises(ZooError, match="Granite's"):
        preset("tiny-llama").with_changes(residual_multiplier=0.5)
    with pytest.raises(ZooError, match="all four positive"):
        preset("tiny-granite").with_changes(logits_scaling=0.0)
    with pytest.raises(ZooError, match="attention_bias"):
        config_from_hf({**GRANITE_3_3_8B, "attention_bias": True})
    granite_4 = {**GRANITE_3_3_8B, "model_type": "granitemoehybrid", "shared_intermediate_size": 8192}
    granite_4_h = {**granite_4, "layer_types": (["mamba"] * 9 + ["attention"]) * 4, "mamba_n_heads": 128}
    with pytest.raises(ZooError, match="experts"):
        config_from_hf({**granite_4, "layer_types": ["attention"] * 40, "num_local_experts": 62})
    with pytest.raises(ZooError, match="time_step_limit"):
        config_from_hf({**granite_4_h, "mamba_d_state": 128, "time_step_limit": [0.0, 1.0]})
    with pytest.raises(ZooError, match="mamba_proj_bias"):
        config_from_hf({**granite_4_h, "mamba_d_state": 128, "mamba_proj_bias": True})
    assert config_from_hf({**granite_4, "layer_types": ["attention"] * 40, "num_local_experts": 0}).d_ff == 8192


@pytest.mark.parametrize("layout", ["language_model.model.", "model.language_model."], ids=["published", "4.52-4.57"])
def test_text_model_of_an_image_text_checkpoint_trains_and_exports_alone(layout, tmp_path, capfd):
    """Gemma 3's 4B-27B are published as image-text models (Gemma3ForConditionalGeneration): megatrain reads its
    text model (text_config; `language_model.model.*` as published, or `model.language_model.*` as transformers
    4.52-4.57 wrote), leaves the vision tower and projector out (and says so), trains the same logits as the
    image-text model on text, and exports a Gemma3ForCausalLM; `megatrain convert` writes the same text model."""
    from safetensors.torch import load_file, save_file

    text = config_to_hf(preset("tiny-gemma3"))
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    hf_config = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=255,
        boi_token_index=253,
        eoi_token_index=254,
    )
    torch.manual_seed(5)
    image_text = transformers.Gemma3ForConditionalGeneration(hf_config).eval()
    with torch.no_grad():
        for param_name, param in image_text.named_parameters():
            param.normal_(0.0, 0.2 if param_name.endswith("norm.weight") else 0.15)
    image_text.save_pretrained(tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    renamed = {name.replace("language_model.model.", layout, 1): value for name, value in tensors.items()}
    assert any(name.startswith("vision_tower.") for name in renamed)
    save_file(renamed, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})

    ids = torch.randint(0, 250, (2, 12))
    with torch.no_grad():
        expected = image_text(input_ids=ids).logits
    check_text_model_trains_and_exports_alone(
        tmp_path / "hf", tmp_path, capfd, preset("tiny-gemma3"), expected, ids, "Gemma3ForCausalLM"
    )


def test_text_model_of_mistral_small_3_image_text_checkpoint_trains_and_exports_alone(tmp_path, capfd):
    """Mistral Small 3.1/3.2 (and Magistral, Devstral Small) are published as image-text models
    (Mistral3ForConditionalGeneration, a Mistral text model): megatrain reads its text model (text_config;
    `language_model.model.*`, `language_model.lm_head.weight`), leaves the vision tower and projector out, and
    exports a MistralForCausalLM."""
    from safetensors.torch import save_file

    config = preset("tiny-llama").with_changes(arch="mistral", head_dim=32)
    text_config = config_to_hf(config)
    torch.manual_seed(9)
    text_model = transformers.MistralForCausalLM(transformers.MistralConfig(**text_config)).eval()
    tensors = {f"language_model.{name}": param.detach().clone() for name, param in text_model.named_parameters()}
    tensors["vision_tower.patch_conv.weight"] = torch.randn(16, 3, 4, 4)
    tensors["multi_modal_projector.linear_1.weight"] = torch.randn(64, 16)
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    image_text = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3"}
    image_text["text_config"] = {k: v for k, v in text_config.items() if k not in ("architectures", "model_type")}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(image_text))
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = text_model(ids).logits
    check_text_model_trains_and_exports_alone(
        tmp_path / "hf", tmp_path, capfd, config, expected, ids, "MistralForCausalLM"
    )


@pytest.mark.parametrize("original_context", [8, 16], ids=["long-factors", "short-factors"])
def test_longrope_matches_transformers_on_both_sides_of_the_original_context(original_context, tmp_path):
    """Phi-3.5's and Phi-4-mini's LongRoPE: per-frequency factors, the long ones for sequences longer than the
    original context (12 tokens here against 8 and 16), and cos/sin scaled by sqrt(1 + ln(stretch) / ln(original));
    logits as transformers' after a config.json round trip, and training steps."""
    generator = torch.Generator().manual_seed(original_context)
    half = preset("tiny-phi3").rotary_dim // 2
    longrope = {
        "rope_type": "longrope",
        "short_factor": (1 + torch.rand(half, generator=generator)).tolist(),
        "long_factor": (1 + 3 * torch.rand(half, generator=generator)).tolist(),
    }
    published = {**config_to_hf(preset("tiny-phi3")), "rope_scaling": longrope}
    published["original_max_position_embeddings"] = original_context
    config = config_from_hf(published)
    assert config.rope_scaling["factor"] == 256 / original_context
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**published), dtype=torch.float32
    )
    with torch.no_grad():
        for param_name, param in reference.named_parameters():
            param.normal_(1.0, 0.2) if param_name.endswith("norm.weight") else param.normal_(0.0, 0.15)
    reference.save_pretrained(tmp_path / "hf")
    trainer, _ = make_trainer(tmp_path / "hf", tmp_path, 0.0, steps=1)
    assert trainer.model_config == config.with_changes(initializer_range=trainer.model_config.initializer_range)
    ids = torch.randint(0, 256, (2, 12), generator=generator)
    with torch.no_grad():
        expected = reference.eval()(ids).logits
    assert rel_err(trainer.logits(ids), expected) < 1e-5
    exported = trainer.export(tmp_path / "out")
    trainer.close()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel_err(reloaded(ids).logits, expected) < 1e-5
