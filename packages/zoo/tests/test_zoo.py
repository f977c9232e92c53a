import pytest

from megatrain_zoo import PRESETS, ZooError, build_model, config_from_hf, config_to_hf, flops_per_token, preset

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
    with pytest.raises(ZooError, match="rope_scaling type 'yarn'|yarn"):
        build_model(config_from_hf({**LLAMA31_HF, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ZooError, match="unknown model preset 'llama9-8b'"):
        preset("llama9-8b")
    with pytest.raises(ZooError, match="multiple of n_kv_heads"):
        PRESETS["tiny-llama"].with_changes(n_kv_heads=3)
