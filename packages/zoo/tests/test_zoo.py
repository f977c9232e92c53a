import json
import re

import pytest

from megatrain_templates import Lora
from megatrain_zoo import (
    PRESETS,
    ZooError,
    build_model,
    config_from_hf,
    config_to_hf,
    flops_per_token,
    linear_attention_flops_per_token,
    preset,
    read_hf_config,
)

# Published parameter counts (billions, from the model cards / safetensors totals).
PUBLISHED = {
    "llama2-7b": 6.74,
    "llama2-13b": 13.02,
    "llama2-70b": 68.98,
    "llama3-8b": 8.03,
    "llama3-70b": 70.55,
    "llama3.1-405b": 405.85,
    "llama3.2-1b": 1.24,
    "llama3.2-3b": 3.21,
    "qwen2.5-0.5b": 0.494,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.77,
    "qwen2.5-32b": 32.76,
    "qwen2.5-72b": 72.71,
    "qwen3-0.6b": 0.596,
    "qwen3-8b": 8.19,
    "qwen3-32b": 32.76,
    "mistral-7b": 7.25,
    "gemma-2-2b": 2.61,
    "gemma-2-9b": 9.24,
    "gemma-2-27b": 27.23,
    "gemma-3-270m": 0.268,
    "gemma-3-1b": 1.00,
    "phi-3-mini-4k": 3.82,
    "phi-4": 14.66,
    "olmo-2-1b": 1.485,
    "olmo-2-7b": 7.30,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published(name):
    assert PRESETS[name].n_params / 1e9 == pytest.approx(PUBLISHED[name], rel=0.005)


def test_model_spec_matches_counts():
    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "llama3.2-1b"):
        config = PRESETS[name]
        model = build_model(config)
        assert sum(p.numel for g in model.groups for p in g.params) == config.n_params
        assert len(model.stages) == config.n_layers + 2
        for stage in model.stages:  # each stage's template binds groups of exactly its layout's size
            for group, params in zip(stage.groups, stage.template.groups):
                assert sum(p.numel for p in model.groups[group].params) == sum(p.numel for p in params)
    names = [p.name for g in build_model(PRESETS["tiny-qwen2"]).groups for p in g.params]
    assert "model.layers.1.self_attn.k_proj.bias" in names and "lm_head.weight" not in names  # tied


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-gpt-oss", "qwen3-30b-a3b"])
def test_moe_layers_in_parts(name):
    """Experts in parts of 3 (the last one shorter): per MoE layer a trunk stage binding (trunk, router)
    and a stage per part binding (router, part); every parameter stored once, every stage binding
    groups of its template's sizes."""
    config = PRESETS[name]
    model = build_model(config, 3)
    parts = -(-config.n_experts // 3)
    assert model.expert_parts[-1][1] == config.n_experts and len(model.expert_parts) == parts
    n_moe = sum(config.layer_is_moe(layer) for layer in range(config.n_layers))
    assert len(model.stages) == config.n_layers + 2 + n_moe * parts
    assert sum(p.numel for g in model.groups for p in g.params) == config.n_params
    for stage in model.stages:
        for group, params in zip(stage.groups, stage.template.groups):
            assert [p.shape for p in model.groups[group].params] == [p.shape for p in params]
    router = next(i for i, g in enumerate(model.groups) if g.name.endswith(".router"))
    assert sum(router in stage.groups for stage in model.stages) == 1 + parts  # accumulated, sent out once


def test_flops_per_token():
    c = PRESETS["llama3-8b"]
    # 6 x (block matmuls + LM head) + causal attention
    assert flops_per_token(c, 4096) == 6 * c.matmul_params + 6 * 32 * 4096 * 32 * 128
    assert c.matmul_params == c.n_params - c.vocab_size * c.d_model - (2 * 32 + 1) * 4096


LLAMA31_HF = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_hf_config_parsing_and_round_trip():
    config = config_from_hf(LLAMA31_HF)
    assert config == preset("llama3.1-8b").with_changes(eos_token_id=128001)
    assert config_from_hf(config_to_hf(config)) == config
    for name in ("tiny-qwen2", "tiny-qwen3", "qwen2.5-7b", "mistral-7b", "llama3.2-1b"):
        assert config_from_hf(config_to_hf(PRESETS[name])) == PRESETS[name]


def test_transformers_v5_rope_parameters():
    hf = dict(LLAMA31_HF)
    scaling = hf.pop("rope_scaling")
    hf.pop("rope_theta")
    hf["rope_parameters"] = {**scaling, "rope_theta": 500000.0}
    assert config_from_hf(hf).rope_scaling == scaling
    assert config_from_hf(hf).rope_theta == 500000.0


def test_unsupported_inputs_are_refused():
    with pytest.raises(ZooError, match="unsupported architecture.*gpt2"):
        config_from_hf({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ZooError, match="attention_bias"):
        config_from_hf({**LLAMA31_HF, "attention_bias": True})
    with pytest.raises(ZooError, match="rope_scaling type 'dynamic'"):
        build_model(config_from_hf({**LLAMA31_HF, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}))
    with pytest.raises(ZooError, match="unknown model preset 'llama9-8b'; did you mean llama3-8b, "):
        preset("llama9-8b")
    with pytest.raises(ZooError, match="unknown model preset 'gpt5'; the presets: deepseek-v2-lite, "):
        preset("gpt5")
    with pytest.raises(ZooError, match="multiple of n_kv_heads"):
        PRESETS["tiny-llama"].with_changes(n_kv_heads=3)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": "4096"}, 'hidden_size is "4096"; it must be a whole number (a number, not in quotes)'),
        ({"rms_norm_eps": None}, "rms_norm_eps is null; it must be a number (write the model's value, or remove"),
        ({"num_hidden_layers": 32.5}, "num_hidden_layers is 32.5; it must be a whole number"),
        ({"rope_theta": True}, "rope_theta is true; it must be a number or null"),
        ({"num_key_value_heads": [8]}, "num_key_value_heads is [8]; it must be a whole number or null"),
    ],
)
def test_a_config_json_number_of_the_wrong_type_is_refused_naming_the_file_and_field(tmp_path, changes, message):
    """A number field holding text, a fraction, a bool, a list, or a null transformers refuses too: one ZooError
    naming the file, the field, its value and what it must be (not a TypeError from the checks or the model)."""
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31_HF, **changes}))
    with pytest.raises(ZooError) as refused:
        read_hf_config(tmp_path)
    assert str(refused.value).startswith(f"{tmp_path / 'config.json'}: {message}")


def test_config_json_nulls_that_mean_a_default_are_read_as_it(tmp_path):
    """Where transformers reads a null as "none" or its default (num_key_value_heads: as many as the query heads,
    head_dim, sliding_window, rope_theta, router_aux_loss_coef), so does megatrain; in an image-text model's
    text_config too, whose wrong types are named there."""
    nulls = {"num_key_value_heads": None, "head_dim": None, "sliding_window": None, "rope_theta": None}
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31_HF, **nulls}))
    config = read_hf_config(tmp_path)
    assert (config.n_kv_heads, config.head_dim, config.rope_theta) == (32, 128, 10000.0)
    assert config.sliding_window is None
    qwen_moe = config_to_hf(PRESETS["tiny-qwen3-moe"])
    (tmp_path / "config.json").write_text(json.dumps({**qwen_moe, "router_aux_loss_coef": None}))
    assert read_hf_config(tmp_path).router_aux_loss_coef == 0.0
    text = {**config_to_hf(PRESETS["tiny-llama"]), "model_type": "mistral", "rms_norm_eps": "1e-5"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral3", "text_config": text}))
    with pytest.raises(ZooError, match='config.json: text_config.rms_norm_eps is "1e-5"; it must be a number'):
        read_hf_config(tmp_path, image_text=False)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"d_model": "64"}, "model.d_model must be a whole number, got '64' (str)"),
        ({"rms_eps": None}, "model.rms_eps must be a number, got None (NoneType)"),
        ({"n_layers": True}, "model.n_layers must be a whole number, got True (bool)"),
        ({"sliding_window": 8.0}, "model.sliding_window must be a whole number or null, got 8.0 (float)"),
        ({"clip_qkv": "8"}, "model.clip_qkv must be a number or null, got '8' (str)"),
    ],
)
def test_model_config_number_fields_hold_numbers(changes, message):
    """Every number field of a ModelConfig, however it is made (a preset, a run's stored config, a config.json):
    a ZooError naming the field, rather than a TypeError in the checks or in the model's arithmetic."""
    with pytest.raises(ZooError, match=re.escape(message)):
        PRESETS["tiny-llama"].with_changes(**changes)
    assert PRESETS["tiny-llama"].with_changes(rope_theta=10000, rms_eps=1e-6).rope_theta == 10000  # (JSON's ints)


# Published totals and active parameters (billions), from the model cards.
PUBLISHED_MOE = {
    "mixtral-8x7b": (46.7, 12.9),
    "mixtral-8x22b": (140.6, 39.1),
    "qwen1.5-moe-a2.7b": (14.3, 2.7),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-235b-a22b": (235.1, 22.2),
    "olmoe-1b-7b": (6.9, 1.3),
    # OpenAI's model card: 20.91B / 116.83B total; its 3.61B / 5.13B active leave out the input embedding
    # (0.58B), which megatrain's count, like the other families', includes
    "gpt-oss-20b": (20.91, 3.61 + 0.58),
    "gpt-oss-120b": (116.83, 5.13 + 0.58),
    # DeepSeek's 2.4B active leaves out the input embedding (0.21B)
    "deepseek-v2-lite": (15.7, 2.45 + 0.21),
    # DeepSeek-V3: 671B total, 37B active (the published checkpoint's 685B adds the 14B multi-token-prediction
    # module, which megatrain does not train); Kimi K2: 1T total, 32B active
    "deepseek-v3": (671.0, 37.0),
    "kimi-k2": (1026.0, 32.9),
    # GLM-4.5-Air: 106B total; Zhipu's 12B active leaves out the input embedding and the output head (0.62B each)
    "glm-4.5-air": (106.0, 12.0 + 2 * 0.62),
    # MiniMax-M2: 230B total, 10B active without the input embedding and the output head (0.61B each)
    "minimax-m2": (230.0, 10.0 + 2 * 0.61),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_MOE))
def test_moe_parameter_counts_match_published(name):
    total, active = PUBLISHED_MOE[name]
    config = PRESETS[name]
    assert config.n_params / 1e9 == pytest.approx(total, rel=0.01)
    assert config.active_params / 1e9 == pytest.approx(active, rel=0.03)
    # FLOPs follow the active parameters: a token multiplies with top-k experts, not all of them
    assert config.matmul_params < config.active_params < config.n_params


def test_moe_specs_and_hf_round_trip():
    for name in (
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-qwen3-moe",
        "tiny-olmoe",
        "qwen1.5-moe-a2.7b",
        "olmoe-1b-7b",
        "tiny-gpt-oss",
        "gpt-oss-120b",
        "tiny-deepseek-v2",
        "tiny-deepseek-v3",
        "deepseek-v3",
        "kimi-k2",
        "moonlight-16b-a3b",
        "tiny-glm4-moe",
        "glm-4.5-air",
        "tiny-minimax-m2",
        "minimax-m2",
    ):
        config = PRESETS[name]
        assert config_from_hf(config_to_hf(config)) == config, name
        model = build_model(config)
        assert sum(p.numel for g in model.groups for p in g.params) == config.n_params
        assert model.router_load is not None
    qwen2_moe = build_model(PRESETS["tiny-qwen2-moe"])
    layer1 = [p.name for p in qwen2_moe.groups[2].params]  # dense_layers=(1,): a plain SwiGLU MLP
    assert "model.layers.1.mlp.gate_proj.weight" in layer1 and not any("experts" in n for n in layer1)
    mixtral = build_model(PRESETS["tiny-mixtral"])
    names = [p.name for p in mixtral.groups[1].params]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    fused = mixtral.fused_checkpoint_names()["model.layers.0.mlp.experts.gate_up_proj"]
    assert fused[0] == (4, 2 * 96, 64) and fused[1][:2] == (
        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
        "model.layers.0.block_sparse_moe.experts.0.w3.weight",
    )


def test_deepseek_v3_configs_as_published():
    """DeepSeek-V3's and Kimi K2's published config.json fields (FP8 quantization_config, the
    multi-token-prediction layer count, Kimi's own model_type) read as the presets."""
    v3 = {**config_to_hf(PRESETS["deepseek-v3"]), "num_nextn_predict_layers": 1}
    v3["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    assert config_from_hf(v3) == PRESETS["deepseek-v3"]
    kimi = {**config_to_hf(PRESETS["kimi-k2"]), "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]}
    assert config_from_hf(kimi) == PRESETS["kimi-k2"]
    assert config_from_hf({**v3, "rope_interleave": False}).rope_interleave is False
    model = build_model(PRESETS["deepseek-v3"])
    assert model.stages[1].template is model.stages[3].template  # dense layers 0-2 share one template
    assert model.stages[4].template.moe.scoring == "sigmoid" and model.stages[4].template.moe.n_groups == 8
    assert model.left_out("model.layers.61.eh_proj.weight") == "multi-token-prediction modules"
    minimax = config_to_hf(PRESETS["minimax-m2"])  # published with the rotating width, 64 of 128
    assert minimax["rotary_dim"] == 64 and config_from_hf(minimax).partial_rotary_factor == 0.5
    assert model.left_out("model.layers.60.mlp.gate.weight") is None


def test_unsupported_moe_inputs_are_refused():
    with pytest.raises(ZooError, match="DeepSeek-V3.2's sparse attention"):
        config_from_hf({"model_type": "deepseek_v32"})
    with pytest.raises(ZooError, match="topk_method 'noaux_tc'"):
        config_from_hf({**config_to_hf(PRESETS["tiny-deepseek-v2"]), "topk_method": "noaux_tc"})
    with pytest.raises(ZooError, match="quantization_config 'mxfp4'"):
        config_from_hf({**config_to_hf(PRESETS["tiny-mixtral"]), "quantization_config": {"quant_method": "mxfp4"}})
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}  # no double quant
    for config in (bnb, {**bnb, "bnb_4bit_quant_type": "fp4"}, {"quant_method": "bitsandbytes", "load_in_8bit": True}):
        with pytest.raises(ZooError, match="'bitsandbytes' but not 4-bit NF4 with double .* base_dtype: nf4"):
            config_from_hf({**config_to_hf(PRESETS["tiny-qwen2"]), "quantization_config": config})
    with pytest.raises(ZooError, match="quantization_config 'fp8'"):  # per-tensor FP8: no weight_block_size
        config_from_hf({**config_to_hf(PRESETS["tiny-deepseek-v3"]), "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ZooError, match="sigmoid"):
        PRESETS["tiny-deepseek-v2"].with_changes(router_scoring="sigmoid")
    with pytest.raises(ZooError, match="router_jitter_noise"):
        config_from_hf({**config_to_hf(PRESETS["tiny-mixtral"]), "router_jitter_noise": 0.1})
    with pytest.raises(ZooError, match="n_experts_per_tok must be in 1..n_experts"):
        PRESETS["tiny-mixtral"].with_changes(n_experts_per_tok=9)


def test_gpt_oss_layers_alternate_windowed_and_full_attention():
    model = build_model(PRESETS["gpt-oss-20b"])
    windows = [stage.template.shape.sliding_window for stage in model.stages[1:-1]]
    assert windows[:4] == [128, None, 128, None] and len(windows) == 24
    assert model.stages[1].template is model.stages[3].template  # one template per kind of layer
    layer = {p.name: p for p in model.groups[1].params}
    assert layer["model.layers.0.mlp.experts.gate_up_proj"].shape == (32, 2880, 5760)
    assert not layer["model.layers.0.self_attn.sinks"].weight_decay
    assert not layer["model.layers.0.mlp.experts.down_proj_bias"].weight_decay


# Qwen3.5 and Qwen3-Next as named (Qwen3.5's image-text checkpoints' totals include a vision tower of 0.1-0.4B, which
# megatrain does not train): totals within 2% of the names; active parameters (the embedding and head counted, as
# for the other families) within 3% of "A10B" and "A17B" (9.8B, 17.3B), while the "A3B" names round 3.5B and 3.9B
LINEAR_ATTENTION_SIZES = {
    "qwen3.5-0.8b": (0.8, None),
    "qwen3.5-27b": (27.0, None),
    "qwen3.5-35b-a3b": (35.0, None),
    "qwen3.5-122b-a10b": (122.0, 10.0),
    "qwen3.5-397b-a17b": (397.0, 17.0),
    "qwen3-next-80b-a3b": (80.0, None),
}


@pytest.mark.parametrize("name", sorted(LINEAR_ATTENTION_SIZES))
def test_linear_attention_counts_match_their_names(name):
    total, active = LINEAR_ATTENTION_SIZES[name]
    config = PRESETS[name]
    assert config.n_params / 1e9 == pytest.approx(total, rel=0.02 if total > 1 else 0.07)
    if active is not None:
        assert config.active_params / 1e9 == pytest.approx(active, rel=0.03)
    assert config.linear_attention_layers == tuple(i for i in range(config.n_layers) if (i + 1) % 4)


@pytest.mark.parametrize("name", ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-qwen3-next", "qwen3.5-27b"])
def test_linear_attention_specs_and_flops(name):
    """Every stored tensor counted once; linear-attention layers differ from the others in kind (their template),
    and their FLOPs are their matmul parameters' plus the delta rule's, without softmax attention's."""
    config = PRESETS[name]
    model = build_model(config)
    assert sum(p.numel for g in model.groups for p in g.params) == config.n_params
    templates = {config.layer_is_linear(layer): model.stages[layer + 1].template for layer in range(config.n_layers)}
    assert templates[True].shape.linear_attention is not None and templates[False].shape.linear_attention is None
    assert templates[False].shape.attn_output_gate
    assert templates[True].shape.linear_attention.grouped_projections == (config.arch == "qwen3_next")
    softmax_layers = config.n_layers - len(config.linear_attention_layers)
    attention = 6 * config.n_heads * config.head_dim * 4096 * softmax_layers
    linear = len(config.linear_attention_layers) * linear_attention_flops_per_token(config)
    assert flops_per_token(config, 4096) == 6 * config.matmul_params + attention + linear
    assert config_from_hf(config_to_hf(config)) == config


@pytest.mark.parametrize(
    "implementation, said",
    [("transformers", "runs, as implementation transformers asks,"), ("auto", "unsupported architecture")],
)
def test_transformers_modules_without_transformers_installed_name_the_install(monkeypatch, implementation, said):
    """Where a model would run through transformers' own modules (asked for, or no native template: an unknown
    architecture on auto), the zoo without transformers says which install gives them; an explicit
    `implementation="transformers"` raised a bare ModuleNotFoundError from deep inside."""
    import importlib.util

    from megatrain_zoo.read import model_config_from_hf

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    hf = config_to_hf(preset("tiny-llama"))
    if implementation == "auto":
        hf = {**hf, "model_type": "no_such_model", "architectures": ["NoSuchForCausalLM"]}
    with pytest.raises(ZooError, match=rf"{re.escape(said)}.*pip install 'megatrain-zoo\[transformers\]'"):
        model_config_from_hf(hf, implementation)


def test_a_config_written_for_transformers_modules_names_the_weights_dtype_under_both_keys():
    """A model run through transformers' own modules exports its own config.json: a source saved in bf16 says
    "dtype": "bfloat16" (transformers 5's key, read before "torch_dtype"), so the float32 export loaded in bf16."""
    import dataclasses

    source = {"model_type": "stablelm", "dtype": "bfloat16", "text_config": {"dtype": "bfloat16"}, "vision": {"a": 1}}
    config = dataclasses.replace(preset("tiny-llama"), implementation="transformers", hf_config=json.dumps(source))
    hf = config_to_hf(config, "float32")
    assert (hf["dtype"], hf["torch_dtype"], hf["text_config"]["dtype"], hf["text_config"]["torch_dtype"]) == (
        "float32", "float32", "float32", "float32"
    )  # fmt: skip
    assert hf["vision"] == {"a": 1} and hf["model_type"] == "stablelm"
    assert config_to_hf(preset("tiny-llama"), "bfloat16")["dtype"] == "bfloat16"


def test_a_moe_run_says_where_its_targets_reach_no_expert():
    """down_proj (or all-linear) reaches the experts of the families whose experts transformers fuses on loading
    (PEFT 0.22's too), adapted in PEFT's layout and named in its settings; gpt-oss' and Llama 4's experts are
    parameters neither adapts, which the run says, and their routers are no target."""
    from megatrain_zoo.peft import experts_note, fused_target_names, target_module_names

    lora = Lora(4, 8.0, ("q_proj", "down_proj"))
    qwen = build_model(preset("tiny-qwen2-moe"), adapter=lora)
    assert experts_note(qwen) is None
    assert fused_target_names(qwen) == ["down_proj"] and target_module_names(qwen) == ["down_proj", "q_proj"]
    # (a token computes with its top_k experts' adapters: FLOPs count those)
    experts = sum(p.numel for g in qwen.adapter_groups for p in qwen.groups[g].params if ".experts." in p.name)
    share = qwen.config.n_experts_per_tok / qwen.config.n_experts
    assert experts and qwen.active_adapter_params == pytest.approx(qwen.adapter_params - experts * (1 - share))
    assert fused_target_names(build_model(preset("tiny-olmoe"), adapter=Lora(4, 8.0, ("all-linear",)))) == [
        "down_proj", "gate.weight", "gate_up_proj"
    ]  # fmt: skip
    for name, targets in (("tiny-gpt-oss", ("all-linear",)), ("tiny-llama4", ("q_proj", "down_proj"))):
        spec = build_model(preset(name), adapter=Lora(4, 8.0, targets))
        assert f"{list(targets[-1:])} adapt no routed expert of" in experts_note(spec) and not fused_target_names(spec)
        assert not any(".experts." in p.name for g in spec.adapter_groups for p in spec.groups[g].params)
    with pytest.raises(
        ZooError, match="'router' matches no linear layer of this model; its layers have k_proj, o_proj"
    ):
        build_model(preset("tiny-gpt-oss"), adapter=Lora(4, 8.0, ("q_proj", "router")))
