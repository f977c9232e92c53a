"""Qwen3-Next and Qwen3.5 (dense and MoE): linear attention (Gated DeltaNet) on three of four layers, gated softmax
attention on the fourth; Granite 4.0-H's Mamba-2 layers where rows run several chunks long. Their training steps
against transformers run with the other families' (test_dense_families, test_moe); here what is theirs alone: rows
several chunks long, the image-text checkpoints Qwen3.5 is published as (with their multi-token-prediction
modules), the published config forms, and the refusals."""

import contextlib
import json

import pytest
import torch
import transformers  # installed by the integration nox session
from hf_steps import (
    check_extra_tensors_are_left_out,
    check_text_model_trains_and_exports_alone,
    exact_reference,
    grad_norm_tolerance,
    hf_adamw,
    make_trainer,
    random_batch,
    reference_step,
    rel_err,
)
from safetensors.torch import save_file
from test_dense_families import hf_dense_model

from megatrain.config import EngineSection
from megatrain.step import StepBatch
from megatrain_zoo import ZooError, config_from_hf, config_to_hf, preset

LINEAR_PRESETS = ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next"]


@pytest.mark.parametrize(
    "name, kernel",
    [("tiny-qwen3.5", True), ("tiny-granite-4.0-h", True), *((name, False) for name in LINEAR_PRESETS)],
    ids=["tiny-qwen3.5-transformers-kernel", "tiny-granite-4.0-h-transformers-kernel", *LINEAR_PRESETS],
)
def test_rows_of_several_chunks_match_transformers(name, kernel, tmp_path):
    """Rows of 150 tokens: two whole chunks of 64 and a shorter third, the state carried between them: the logits,
    and a step's loss, gradient norm and updated weights, equal transformers' model + AdamW. Against its own
    chunked delta rule (the same in the three families) in fp32, where both sides' noise allows 2e-4 on the
    gradient norm (at most 4.7e-5 over 257 seeds; one seed in about 90 runs passed 1e-4) and experts are left out
    (a routing near-tie may flip at this length); and against the float64 reference of `exact_reference`, experts
    included. Granite 4.0-H's Mamba-2 layers against transformers' own chunked scan in fp32."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference, options, stepping = hf_dense_model(name, seed), {}, contextlib.nullcontext()
    if not kernel:
        reference, options, stepping = exact_reference(reference, preset(name))
    reference.save_pretrained(tmp_path / "hf")
    trainer, train = make_trainer(tmp_path / "hf", tmp_path, 0.5, steps=1, batch_size=2, micro_batch_size=1, **options)
    generator = torch.Generator().manual_seed(seed)
    ids, labels = random_batch(2, 150, 256, generator)
    with stepping:
        with torch.no_grad():
            assert rel_err(trainer.logits(ids), reference.eval()(ids).logits) < 1e-5
        metrics = trainer.train_step(StepBatch(ids, labels))
        optimizer = hf_adamw(reference.train(), train)
        _, loss, norm = reference_step(reference, optimizer, train, 0, 0.5, input_ids=ids, labels=labels)
    assert metrics.loss == pytest.approx(loss.item(), rel=1e-5)
    assert metrics.grad_norm == pytest.approx(norm.item(), rel=2e-4 if kernel else grad_norm_tolerance(preset(name)))
    exported = transformers.AutoModelForCausalLM.from_pretrained(trainer.export(tmp_path / "out"), dtype=torch.float64)
    trainer.close()
    ours = dict(exported.named_parameters())
    for param_name, param in reference.named_parameters():
        assert rel_err(ours[param_name].detach(), param.detach()) < 1e-4, param_name


@pytest.mark.parametrize("name", [*LINEAR_PRESETS, "tiny-granite-4.0-h"])
def test_layers_keeping_their_recurrence_results_step_as_recomputing_ones(name, tmp_path):
    """float64, rows of 150 tokens (chunks of 64 and a shorter third): layers keeping their products keep their
    attention kernel's results too (on the CPU every such layer does: `LayerPipeline.extras`), the recurrence's
    in linear-attention layers, and their backward, which then runs no recurrence forward, gives the losses and
    gradient norms of every layer recomputing, step by step; dense and MoE linear-attention layers, Gated
    DeltaNet and Mamba-2."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    hf_dense_model(name, seed).double().save_pretrained(tmp_path / "hf")
    runs = []
    for kept in (0, 2):
        trainer, _ = make_trainer(
            tmp_path / "hf",
            tmp_path / str(kept),
            0.5,
            3,
            2,
            1,
            engine=EngineSection(kept_layers=kept),
            precision="float64",
        )
        generator = torch.Generator().manual_seed(seed)
        runs.append([trainer.train_step(StepBatch(*random_batch(2, 150, 256, generator))) for _ in range(3)])
        linear_stages = {trainer.spec.layer_stage(i) for i in trainer.model_config.linear_attention_layers}
        assert set(trainer.pipeline.extras) == (set(trainer.pipeline.executed.kept) if kept else set())
        assert linear_stages & set(trainer.pipeline.extras) or not kept
        trainer.close()
    for recomputing, keeping in zip(*runs):
        assert keeping.loss == pytest.approx(recomputing.loss, rel=1e-12)
        assert keeping.grad_norm == pytest.approx(recomputing.grad_norm, rel=1e-10)


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 1.0}},
        {"rope_parameters": {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.25}},
    ],
    ids=["partial-rotary", "rotary-base"],
)
def test_the_tiny_presets_rotary_settings_change_the_result(changes):
    """The quarter of each head that rotates, and its base, bite at 12 positions (so the steps test them)."""
    ids = torch.randint(0, 256, (2, 12))
    model = hf_dense_model("tiny-qwen3.5", 3).eval()
    changed = hf_dense_model("tiny-qwen3.5", 3, **changes).eval()
    with torch.no_grad():
        assert rel_err(changed(ids).logits, model(ids).logits) > 1e-3


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe"])
def test_text_model_of_an_image_text_checkpoint_trains_and_exports_alone(name, tmp_path, capfd):
    """Qwen3.5 is published as image-text models (Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration:
    `model.language_model.*`, `lm_head.weight`, the vision tower under `model.visual.*`, a multi-token-prediction
    module under `mtp.*`, rotary settings with multimodal sections): megatrain reads the text model, leaves the
    rest out and says so, computes the text model's logits and exports a Qwen3_5(Moe)ForCausalLM, as `megatrain
    convert` does."""
    text_model = hf_dense_model(name, 5).eval()
    tensors = {
        name.replace("model.", "model.language_model.", 1): param.detach().clone()
        for name, param in text_model.named_parameters()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(16, 3, 2, 2, 2)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)
    tensors["mtp.layers.0.mlp.gate_proj.weight"] = torch.randn(32, 64)
    (tmp_path / "hf").mkdir()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    text_config = config_to_hf(preset(name))
    text_config["rope_parameters"] = {
        **text_config["rope_parameters"],
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    }
    moe = name.endswith("moe")
    image_text = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": {**text_config, "architectures": None},
        "vision_config": {"depth": 1, "hidden_size": 16, "out_hidden_size": 64},
    }
    (tmp_path / "hf" / "config.json").write_text(json.dumps(image_text))
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        expected = text_model(ids).logits
    text_class = "Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"
    check_text_model_trains_and_exports_alone(tmp_path / "hf", tmp_path, capfd, preset(name), expected, ids, text_class)


def test_qwen3_next_multi_token_prediction_tensors_are_left_out(tmp_path, capsys):
    """Qwen3-Next's published checkpoints carry an `mtp.*` module transformers does not load: left out, said so."""
    extra = {
        "mtp.pre_fc_norm_hidden.weight": torch.randn(64),
        "mtp.layers.0.self_attn.q_proj.weight": torch.randn(128, 64),
    }
    reference = hf_dense_model("tiny-qwen3-next", 3).eval()
    check_extra_tensors_are_left_out(reference, extra, "multi-token-prediction modules", tmp_path, capsys)


# The published config.json forms (the fields other projects copy from them): Qwen3.5's as image-text models with
# multimodal rotary sections, Qwen3-Next's as a causal LM with layer kinds left to full_attention_interval
QWEN3_5_ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
}
QWEN3_5_TEXT = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 248045,
    "eos_token_id": 248046,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "rope_parameters": QWEN3_5_ROPE,
    "vocab_size": 248320,
}
QWEN3_5_27B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "tie_word_embeddings": False,
    "text_config": {
        **QWEN3_5_TEXT,
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 64,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "linear_num_value_heads": 48,
        "tie_word_embeddings": False,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "out_hidden_size": 5120},
}
QWEN3_5_397B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False,
    "text_config": {
        **QWEN3_5_TEXT,
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 4096,
        "num_hidden_layers": 60,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "linear_num_value_heads": 64,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "tie_word_embeddings": False,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152, "out_hidden_size": 4096},
}
QWEN3_NEXT_80B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


# Granite-4.0-H-Micro's config.json as other projects copied it (the fields that shape the model)
GRANITE_4_0_H_MICRO = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "attention_multiplier": 0.015625,
    "bos_token_id": 100257,
    "embedding_multiplier": 12,
    "eos_token_id": 100257,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 4) * 4,
    "logits_scaling": 8,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 64,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_experts_per_tok": 0,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "num_local_experts": 0,
    "pad_token_id": 100256,
    "position_embedding_type": "nope",
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "shared_intermediate_size": 8192,
    "tie_word_embeddings": True,
    "vocab_size": 100352,
}


@pytest.mark.parametrize(
    "published, name",
    [
        (QWEN3_5_27B, "qwen3.5-27b"),
        (QWEN3_5_397B, "qwen3.5-397b-a17b"),
        (QWEN3_NEXT_80B, "qwen3-next-80b-a3b"),
        (GRANITE_4_0_H_MICRO, "granite-4.0-h-micro"),
    ],
    ids=["qwen3.5-27b", "qwen3.5-397b-a17b", "qwen3-next-80b-a3b", "granite-4.0-h-micro"],
)
def test_published_configs_parse_to_the_presets_as_transformers_reads_them(published, name):
    """The published form and transformers' reading of it (layer_types written out) parse to the preset, and the
    preset exports the layer kinds and rotary settings transformers reads from the published file."""
    assert config_from_hf(published) == preset(name)
    as_read = transformers.AutoConfig.for_model(**published).to_dict()
    assert config_from_hf(as_read) == preset(name)
    text = as_read.get("text_config", as_read)
    exported = transformers.AutoConfig.for_model(**config_to_hf(preset(name))).to_dict()
    assert exported["layer_types"] == text["layer_types"]
    for key in ("rope_theta", "partial_rotary_factor"):
        assert exported["rope_parameters"].get(key) == text["rope_parameters"].get(key), key


def test_rotary_settings_are_read_where_either_form_writes_them():
    """partial_rotary_factor inside rope_parameters (transformers 5, Qwen3.5) or beside it, else the families' 0.25."""
    text = QWEN3_5_27B["text_config"]
    assert config_from_hf({**text, "rope_parameters": {**QWEN3_5_ROPE, "partial_rotary_factor": 0.5}}).rotary_dim == 128
    unwritten = {k: v for k, v in QWEN3_5_ROPE.items() if k != "partial_rotary_factor"}
    assert config_from_hf({**text, "rope_parameters": unwritten}).rotary_dim == 64
    assert (
        config_from_hf({**text, "rope_parameters": None, "rope_theta": 1e7, "partial_rotary_factor": 0.5}).rotary_dim
        == 128
    )


def test_unsupported_settings_are_refused():
    text = QWEN3_5_27B["text_config"]
    with pytest.raises(ZooError, match="attention_bias=true"):
        config_from_hf({**text, "attention_bias": True})
    with pytest.raises(ZooError, match="layer_types"):
        config_from_hf({**text, "layer_types": ["sliding_attention"] * 64})
    with pytest.raises(ZooError, match="hidden_act"):
        config_from_hf({**text, "hidden_act": "gelu"})
    with pytest.raises(ZooError, match="multiple of linear_n_key_heads"):
        config_from_hf({**text, "linear_num_value_heads": 24})
    with pytest.raises(ZooError, match="experts on every layer"):
        preset("tiny-qwen3.5-moe").with_changes(dense_layers=(1,))
    with pytest.raises(ZooError, match="linear_attention_layers"):
        preset("tiny-qwen3").with_changes(linear_attention_layers=(0,))
