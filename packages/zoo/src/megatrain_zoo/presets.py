"""Named model shapes: the published sizes of each family, a 120B dense shape, and tiny test models."""

import difflib

from .config import ModelConfig, ZooError, windowed_but_every

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA32_ROPE = {**_LLAMA31_ROPE, "factor": 32.0}


def _llama2(d, layers, heads, kv, ff):
    return ModelConfig(
        "llama", 32000, d, layers, heads, kv, ff, max_seq_len=4096, rms_eps=1e-5, bos_token_id=1, eos_token_id=2
    )


def _llama3(d, layers, heads, kv, ff, rope=None, max_len=8192, tied=False, head_dim=0):
    return ModelConfig(
        "llama",
        128256,
        d,
        layers,
        heads,
        kv,
        ff,
        head_dim=head_dim,
        max_seq_len=max_len,
        rope_theta=500000.0,
        rope_scaling=rope,
        rms_eps=1e-5,
        tie_embeddings=tied,
        bos_token_id=128000,
        eos_token_id=128001,
    )


def _qwen2(d, layers, heads, kv, ff, vocab=151936, tied=False, eps=1e-6, max_len=32768):
    return ModelConfig(
        "qwen2",
        vocab,
        d,
        layers,
        heads,
        kv,
        ff,
        max_seq_len=max_len,
        rope_theta=1000000.0,
        rms_eps=eps,
        tie_embeddings=tied,
        qkv_bias=True,
        eos_token_id=151643,
    )


def _qwen3(d, layers, heads, ff, tied=False):
    return ModelConfig(
        "qwen3",
        151936,
        d,
        layers,
        heads,
        8,
        ff,
        head_dim=128,
        max_seq_len=40960,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        tie_embeddings=tied,
        qk_norm=True,
        eos_token_id=151645,
    )


def _mixtral(vocab, d, layers, heads, ff, max_len):
    return ModelConfig(
        "mixtral",
        vocab,
        d,
        layers,
        heads,
        8,
        ff,
        max_seq_len=max_len,
        rope_theta=1000000.0,
        rms_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        n_experts=8,
        n_experts_per_tok=2,
        moe_d_ff=ff,
        norm_topk_prob=True,
        router_aux_loss_coef=0.02,
    )


def _qwen3_moe(d, layers, heads, expert_ff, dense_ff):
    return ModelConfig(
        "qwen3_moe",
        151936,
        d,
        layers,
        heads,
        4,
        dense_ff,
        head_dim=128,
        max_seq_len=40960,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        qk_norm=True,
        eos_token_id=151645,
        n_experts=128,
        n_experts_per_tok=8,
        moe_d_ff=expert_ff,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    )


_DEEPSEEK_V3_YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}


def _deepseek_v3(**changes) -> ModelConfig:
    """DeepSeek-V3 (671B, 37B active): latent attention, 8 of 256 experts per token chosen by sigmoid
    scores plus a correction bias within 4 of 8 groups, one shared expert, the first 3 layers dense."""
    config = ModelConfig(
        "deepseek_v3",
        129280,
        7168,
        61,
        128,
        128,
        18432,  # the dense layers' MLP
        head_dim=64,  # the rotary part of each head
        max_seq_len=163840,
        rope_scaling=_DEEPSEEK_V3_YARN,
        rms_eps=1e-6,
        bos_token_id=0,
        eos_token_id=1,
        n_experts=256,
        n_experts_per_tok=8,
        moe_d_ff=2048,
        shared_expert_d_ff=2048,
        norm_topk_prob=True,
        dense_layers=(0, 1, 2),
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_nope_head_dim=128,
        v_head_dim=128,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        router_scoring="sigmoid",
    )
    return config.with_changes(**changes)


def _ernie4_5(arch: str, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int, **moe) -> ModelConfig:
    """ERNIE 4.5 (Baidu, 2025): heads of 128 with rotary embedding on adjacent pairs, tied embeddings; the
    MoE's router chooses by softmax probability + a correction bias (transformers' config defaults)."""
    return ModelConfig(
        arch,
        103424,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        d_ff,
        head_dim=128,
        max_seq_len=131072,
        rope_theta=500000.0,
        rms_eps=1e-5,
        tie_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **moe,
    )


def _gemma(arch: str, vocab: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int, **changes):
    """Gemma 2 and 3 (Google, 2024-25): heads of 256 (128 at 27B), tied embeddings, sliding-window layers
    (Gemma 2 every other one over 4096 tokens, soft-capped; Gemma 3 five of six over 1024 with a rotary base
    of their own), transformers' config defaults."""
    windowed = windowed_but_every(n_layers, 2 if arch == "gemma2" else 6)
    defaults = {
        "gemma2": dict(
            max_seq_len=8192, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
        ),
        "gemma3_text": dict(
            max_seq_len=131072,
            rope_theta=1_000_000.0,
            rope_local_theta=10_000.0,
            sliding_window=1024,
            qk_norm=True,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        ),
    }[arch]
    common = dict(
        head_dim=256,
        rms_eps=1e-6,
        tie_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        activation="gelu_tanh",
        query_pre_attn_scalar=256,
        sliding_layers=windowed,
    )
    return ModelConfig(arch, vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, **{**common, **defaults, **changes})


def _phi3(vocab: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int, **changes):
    """Phi-3 and Phi-4 (Microsoft, 2024): Llama's block with q/k/v and gate/up each stored as one tensor."""
    return ModelConfig(
        "phi3", vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, rms_eps=1e-5, **{"max_seq_len": 4096, **changes}
    )


def _olmo2(d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int, **changes) -> ModelConfig:
    """OLMo 2 (Ai2, 2024-25): norms on the attention's and the MLP's outputs instead of their inputs, q/k normed
    over all heads at once, the weight applied in fp32."""
    common = dict(
        max_seq_len=4096,
        rope_theta=500000.0,
        rms_eps=1e-6,
        qk_norm=True,
        qk_norm_scope="full",
        eos_token_id=100257,
        pad_token_id=100277,
    )
    return ModelConfig("olmo2", 100352, d_model, n_layers, n_heads, n_kv_heads, d_ff, **{**common, **changes})


def _olmo3(d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int) -> ModelConfig:
    """OLMo 3 (Ai2, 2025): OLMo 2's block, three of four layers attending over a 4096-token window with the
    plain rotary embedding, YaRN (8x) on the fourth, to 65k positions."""
    yarn = {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.2079441541679836,
    }
    return ModelConfig(
        "olmo3",
        100278,
        d_model,
        n_layers,
        n_heads,
        n_kv_heads,
        d_ff,
        max_seq_len=65536,
        rope_theta=500000.0,
        rope_scaling=yarn,
        rope_local_theta=500000.0,
        rms_eps=1e-6,
        qk_norm=True,
        qk_norm_scope="full",
        sliding_window=4096,
        sliding_layers=windowed_but_every(n_layers, 4),
        eos_token_id=100257,
        pad_token_id=100277,
    )


def _gpt_oss(n_layers: int, n_experts: int) -> ModelConfig:
    """gpt-oss (OpenAI, 2025): alternating 128-token sliding-window and full attention with sinks,
    YaRN to 131k positions, 4 of n_experts clamped-SwiGLU experts per token (published in MXFP4)."""
    return ModelConfig(
        "gpt_oss",
        201088,
        2880,
        n_layers,
        64,
        8,
        2880,
        head_dim=64,
        max_seq_len=131072,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        rms_eps=1e-5,
        qkv_bias=True,
        o_bias=True,
        attention_sinks=True,
        sliding_window=128,
        sliding_layers=windowed_but_every(n_layers, 2),
        bos_token_id=199998,
        eos_token_id=200002,
        pad_token_id=199999,
        n_experts=n_experts,
        n_experts_per_tok=4,
        moe_d_ff=2880,
        norm_topk_prob=True,  # softmax over the top-k logits = the top-k probabilities renormalised
        swiglu_limit=7.0,
        router_aux_loss_coef=0.9,
    )


def _llama4(
    vocab: int, d_model: int, n_layers: int, n_heads: int, n_kv_heads: int, d_ff: int, moe_d_ff: int, **changes
) -> ModelConfig:
    """Llama 4 (Meta, 2025): every fourth layer without rotary embedding (attending over everything, its
    queries' temperature rising with position), the others in chunks of 8192 positions; one routed expert
    per token (weight: its logit's sigmoid, applied to its input) beside a shared one; `moe_every`-th layers
    sparse, the rest dense MLPs `d_ff` wide."""
    moe_every = changes.pop("moe_every", 1)
    nope = tuple(range(3, n_layers, 4))
    chunk = changes.pop("attention_chunk_size", 8192)
    config = dict(
        head_dim=128,
        max_seq_len=10485760,
        rope_theta=500000.0,
        rms_eps=1e-5,
        bos_token_id=200000,
        eos_token_id=200001,
        pad_token_id=200018,
        nope_layers=nope,
        attention_chunk_size=chunk,
        chunked_layers=tuple(i for i in range(n_layers) if i not in nope),
        qk_rms_normalized=True,
        attn_temperature_floor_scale=8192.0,
        attn_temperature_scale=0.1,
        n_experts=16,
        n_experts_per_tok=1,
        moe_d_ff=moe_d_ff,
        shared_expert_d_ff=moe_d_ff,
        dense_layers=tuple(i for i in range(n_layers) if (i + 1) % moe_every),
        router_scoring="sigmoid_of_top_k",
    )
    return ModelConfig("llama4_text", vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, **{**config, **changes})


def _qwen3_5(
    arch: str, vocab: int, d_model: int, n_layers: int, n_heads: int, d_ff: int, linear_value_heads: int, **changes
) -> ModelConfig:
    """Qwen3-Next and Qwen3.5 (Alibaba, 2025-26): three of four layers Gated DeltaNet (16 query/key heads of 128,
    `linear_value_heads` value heads of 128, a 4-tap convolution), every fourth softmax attention over two or four
    key/value heads of 256 with an output gate, a quarter of each head rotating, (1 + weight) norms."""
    config = dict(
        head_dim=256,
        max_seq_len=262144,
        rope_theta=10_000_000.0,
        rms_eps=1e-6,
        qk_norm=True,
        partial_rotary_factor=0.25,
        bos_token_id=248045,
        eos_token_id=248046,
        linear_attention_layers=windowed_but_every(n_layers, 4),  # (all but every fourth)
        linear_n_key_heads=16,
        linear_n_value_heads=linear_value_heads,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
    )
    n_kv_heads = changes.pop("n_kv_heads", 2)
    return ModelConfig(arch, vocab, d_model, n_layers, n_heads, n_kv_heads, d_ff, **{**config, **changes})


def _qwen3_5_moe(
    d_model: int, n_layers: int, n_heads: int, linear_value_heads: int, n_experts: int, top_k: int, expert_d_ff: int
) -> ModelConfig:
    """Qwen3.5's MoE models: every layer's MLP `n_experts` routed experts (`top_k` per token, renormalised) and a
    shared one as wide behind a sigmoid gate."""
    return _qwen3_5(
        "qwen3_5_moe_text", 248320, d_model, n_layers, n_heads, expert_d_ff, linear_value_heads, n_experts=n_experts,
        n_experts_per_tok=top_k, moe_d_ff=expert_d_ff, shared_expert_d_ff=expert_d_ff, norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    )  # fmt: skip


def _granite(vocab: int, d_model: int, n_heads: int, d_ff: int, **changes) -> ModelConfig:
    """Granite 3.x and 4.1 (dense): 40 layers, 8 key-value heads, multipliers on the embedding (12), the residual
    branches (0.22), the scores and the logits."""
    return ModelConfig(
        "granite", vocab, d_model, 40, n_heads, 8, d_ff, max_seq_len=131072, rope_theta=10_000_000.0, rms_eps=1e-5,
        tie_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22, **changes,
    )  # fmt: skip


PRESETS: dict[str, ModelConfig] = {
    # Llama 2
    "llama2-7b": _llama2(4096, 32, 32, 32, 11008),
    "llama2-13b": _llama2(5120, 40, 40, 40, 13824),
    "llama2-70b": _llama2(8192, 80, 64, 8, 28672),
    # Llama 3 / 3.1 / 3.2
    "llama3-8b": _llama3(4096, 32, 32, 8, 14336),
    "llama3-70b": _llama3(8192, 80, 64, 8, 28672),
    "llama3.1-8b": _llama3(4096, 32, 32, 8, 14336, _LLAMA31_ROPE, 131072),
    "llama3.1-70b": _llama3(8192, 80, 64, 8, 28672, _LLAMA31_ROPE, 131072),
    "llama3.1-405b": _llama3(16384, 126, 128, 8, 53248, _LLAMA31_ROPE, 131072),
    "llama3.2-1b": _llama3(2048, 16, 32, 8, 8192, _LLAMA32_ROPE, 131072, tied=True, head_dim=64),
    "llama3.2-3b": _llama3(3072, 28, 24, 8, 8192, _LLAMA32_ROPE, 131072, tied=True, head_dim=128),
    # Qwen2 / Qwen2.5 (same shapes)
    "qwen2.5-0.5b": _qwen2(896, 24, 14, 2, 4864, tied=True),
    "qwen2.5-1.5b": _qwen2(1536, 28, 12, 2, 8960, tied=True),
    "qwen2.5-3b": _qwen2(2048, 36, 16, 2, 11008, tied=True),
    "qwen2.5-7b": _qwen2(3584, 28, 28, 4, 18944, vocab=152064),
    "qwen2.5-14b": _qwen2(5120, 48, 40, 8, 13824, vocab=152064, eps=1e-5),
    "qwen2.5-32b": _qwen2(5120, 64, 40, 8, 27648, vocab=152064, eps=1e-5),
    "qwen2.5-72b": _qwen2(8192, 80, 64, 8, 29568, vocab=152064, eps=1e-5),
    "qwen2-7b": _qwen2(3584, 28, 28, 4, 18944, vocab=152064),
    "qwen2-72b": _qwen2(8192, 80, 64, 8, 29568, vocab=152064, eps=1e-5),
    # Qwen3 dense
    "qwen3-0.6b": _qwen3(1024, 28, 16, 3072, tied=True),
    "qwen3-1.7b": _qwen3(2048, 28, 16, 6144, tied=True),
    "qwen3-4b": _qwen3(2560, 36, 32, 9728, tied=True),
    "qwen3-8b": _qwen3(4096, 36, 32, 12288),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600),
    # Mistral 7B v0.3
    "mistral-7b": ModelConfig(
        "mistral",
        32768,
        4096,
        32,
        32,
        8,
        14336,
        max_seq_len=32768,
        rope_theta=1000000.0,
        rms_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # Mixtures of experts (shapes of the published config.json files)
    "mixtral-8x7b": _mixtral(32000, 4096, 32, 32, 14336, 32768),
    "mixtral-8x22b": _mixtral(32768, 6144, 56, 48, 16384, 65536),
    "qwen1.5-moe-a2.7b": ModelConfig(
        "qwen2_moe",
        151936,
        2048,
        24,
        16,
        16,
        5632,
        max_seq_len=8192,
        rope_theta=1000000.0,
        rms_eps=1e-6,
        qkv_bias=True,
        eos_token_id=151643,
        n_experts=60,
        n_experts_per_tok=4,
        moe_d_ff=1408,
        shared_expert_d_ff=5632,
        router_aux_loss_coef=0.001,
    ),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 768, 6144),
    "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 1536, 12288),
    "olmoe-1b-7b": ModelConfig(
        "olmoe",
        50304,
        2048,
        16,
        16,
        16,
        1024,
        max_seq_len=4096,
        rms_eps=1e-5,
        qk_norm=True,
        qk_norm_scope="full",
        eos_token_id=50279,
        pad_token_id=1,
        n_experts=64,
        n_experts_per_tok=8,
        moe_d_ff=1024,
        router_aux_loss_coef=0.01,
    ),
    "deepseek-v2-lite": ModelConfig(
        "deepseek_v2",
        102400,
        2048,
        27,
        16,
        16,
        10944,  # the one dense layer's MLP
        head_dim=64,  # the rotary part of each head
        max_seq_len=163840,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096,
        },
        rms_eps=1e-6,
        bos_token_id=100000,
        eos_token_id=100001,
        n_experts=64,
        n_experts_per_tok=6,
        moe_d_ff=1408,
        shared_expert_d_ff=2 * 1408,
        dense_layers=(0,),
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),
    "deepseek-v3": _deepseek_v3(),  # also DeepSeek-R1 and V3.1
    # Kimi K2 (Moonshot, 2025): DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer
    "kimi-k2": _deepseek_v3(
        vocab_size=163840,
        n_heads=64,
        n_kv_heads=64,
        n_experts=384,
        n_group=1,
        topk_group=1,
        dense_layers=(0,),
        routed_scaling_factor=2.827,
        rope_theta=50000.0,
        rope_scaling={**_DEEPSEEK_V3_YARN, "factor": 32.0, "beta_fast": 1.0},
        max_seq_len=131072,
        bos_token_id=163584,
        eos_token_id=163585,
    ),
    # Moonlight (Moonshot, 2025): DeepSeek-V3's routing on DeepSeek-V2-Lite's shape, trained with Muon
    "moonlight-16b-a3b": _deepseek_v3(
        vocab_size=163840,
        d_model=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        d_ff=11264,
        max_seq_len=8192,
        rope_theta=50000.0,
        rope_scaling=None,
        rms_eps=1e-5,
        bos_token_id=163584,
        eos_token_id=163586,
        n_experts=64,
        n_experts_per_tok=6,
        moe_d_ff=1408,
        shared_expert_d_ff=2 * 1408,
        dense_layers=(0,),
        q_lora_rank=0,
        routed_scaling_factor=2.446,
        n_group=1,
        topk_group=1,
    ),
    # GLM-4.5-Air (Zhipu, 2025): DeepSeek-V3's routing on grouped-query attention with QKV biases, the
    # first half of each head rotating
    "glm-4.5-air": ModelConfig(
        "glm4_moe",
        151552,
        4096,
        46,
        96,
        8,
        10944,  # the dense first layer's MLP
        head_dim=128,
        max_seq_len=131072,
        rope_theta=1000000.0,
        rms_eps=1e-5,
        qkv_bias=True,
        eos_token_id=151329,
        pad_token_id=151329,
        n_experts=128,
        n_experts_per_tok=8,
        moe_d_ff=1408,
        shared_expert_d_ff=1408,
        norm_topk_prob=True,
        dense_layers=(0,),
        router_scoring="sigmoid",
        partial_rotary_factor=0.5,
    ),
    # MiniMax-M2 (2025): 8 of 256 experts chosen by sigmoid scores + a correction bias, q/k norms over all
    # heads, the first 64 of each head's 128 dims rotating
    "minimax-m2": ModelConfig(
        "minimax_m2",
        200064,
        3072,
        62,
        48,
        8,
        1536,
        head_dim=128,
        max_seq_len=196608,
        rope_theta=5000000.0,
        rms_eps=1e-6,
        qk_norm=True,
        qk_norm_scope="full",
        bos_token_id=200034,
        eos_token_id=200020,
        n_experts=256,
        n_experts_per_tok=8,
        moe_d_ff=1536,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        router_scoring="sigmoid",
        partial_rotary_factor=0.5,
    ),
    # dots.llm1 (rednote, 2025; 142.8B, 14.0B active): DeepSeek-V3's router (no groups) and shared experts on
    # Qwen3's attention (per-head q/k norms, 32 heads of 128), the first layer dense
    "dots-llm1": ModelConfig(
        "dots1",
        152064,
        4096,
        62,
        32,
        32,
        10944,
        head_dim=128,
        max_seq_len=32768,
        rope_theta=10000000.0,
        rms_eps=1e-5,
        qk_norm=True,
        eos_token_id=151649,
        n_experts=128,
        n_experts_per_tok=6,
        moe_d_ff=1408,
        shared_expert_d_ff=2 * 1408,
        norm_topk_prob=True,
        dense_layers=(0,),
        routed_scaling_factor=2.5,
        router_scoring="sigmoid",
    ),
    "ernie-4.5-0.3b": _ernie4_5("ernie4_5", 1024, 18, 16, 2, 3072),
    "ernie-4.5-21b-a3b": _ernie4_5(
        "ernie4_5_moe",
        2560,
        28,
        20,
        4,
        12288,
        n_experts=64,
        n_experts_per_tok=6,
        moe_d_ff=1536,
        shared_expert_d_ff=2 * 1536,
        norm_topk_prob=True,
        dense_layers=(0,),
        router_aux_loss_coef=0.001,
    ),
    "gemma-2-2b": _gemma("gemma2", 256000, 2304, 26, 8, 4, 9216),
    "gemma-2-9b": _gemma("gemma2", 256000, 3584, 42, 16, 8, 14336, query_pre_attn_scalar=224),
    "gemma-2-27b": _gemma("gemma2", 256000, 4608, 46, 32, 16, 36864, head_dim=128, query_pre_attn_scalar=144),
    "gemma-3-270m": _gemma(
        "gemma3_text", 262144, 640, 18, 4, 1, 2048, max_seq_len=32768, sliding_window=512, rope_scaling=None
    ),
    "gemma-3-1b": _gemma(
        "gemma3_text", 262144, 1152, 26, 4, 1, 6912, max_seq_len=32768, sliding_window=512, rope_scaling=None
    ),
    # the text models inside the published image-text checkpoints (their vocabulary has 64 image tokens more)
    "gemma-3-4b": _gemma("gemma3_text", 262208, 2560, 34, 8, 4, 10240),
    "gemma-3-12b": _gemma("gemma3_text", 262208, 3840, 48, 16, 8, 15360),
    "gemma-3-27b": _gemma("gemma3_text", 262208, 5376, 62, 32, 16, 21504, head_dim=128, query_pre_attn_scalar=168),
    # the 4k-context models (the 128k ones and Phi-4-mini scale their rotary embedding by LongRoPE, not supported)
    "phi-3-mini-4k": _phi3(
        32064,
        3072,
        32,
        32,
        32,
        8192,
        sliding_window=2047,
        sliding_layers=tuple(range(32)),
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
    ),
    "phi-3-medium-4k": _phi3(
        32064,
        5120,
        40,
        40,
        10,
        17920,
        sliding_window=2047,
        sliding_layers=tuple(range(40)),
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
    ),
    "phi-4": _phi3(
        100352,
        5120,
        40,
        40,
        10,
        17920,
        max_seq_len=16384,
        rope_theta=250000.0,
        bos_token_id=100257,
        eos_token_id=100265,
    ),
    "olmo-2-1b": _olmo2(2048, 16, 16, 16, 8192),
    "olmo-2-7b": _olmo2(4096, 32, 32, 32, 11008),
    "olmo-2-13b": _olmo2(5120, 40, 40, 40, 13824),
    "olmo-2-32b": _olmo2(5120, 64, 40, 8, 27648),
    "olmo-3-7b": _olmo3(4096, 32, 32, 32, 11008),
    "olmo-3-32b": _olmo3(5120, 64, 40, 8, 27648),
    # SmolLM3 (Hugging Face, 2025): Llama's block, every fourth layer without rotary embedding
    "smollm3-3b": ModelConfig(
        "smollm3",
        128256,
        2048,
        36,
        16,
        4,
        11008,
        max_seq_len=65536,
        rope_theta=5_000_000.0,
        rms_eps=1e-6,
        tie_embeddings=True,
        bos_token_id=128000,
        eos_token_id=128012,
        pad_token_id=128004,
        nope_layers=tuple(range(3, 36, 4)),
    ),
    # IBM Granite 3.3 and 4.1 (dense; Granite 4.0's Mamba-2 hybrids are another family)
    "granite-3.3-2b": _granite(
        49159,
        2048,
        32,
        8192,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
    "granite-3.3-8b": _granite(
        49159,
        4096,
        32,
        12800,
        attention_multiplier=0.0078125,
        logits_scaling=16.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    ),
    "granite-4.1-3b": _granite(
        100352,
        2560,
        40,
        8192,
        attention_multiplier=0.015625,
        logits_scaling=10.0,
        bos_token_id=100257,
        eos_token_id=100257,
        pad_token_id=100256,
    ),
    "granite-4.1-8b": _granite(
        100352,
        4096,
        32,
        12800,
        attention_multiplier=0.0078125,
        logits_scaling=16.0,
        bos_token_id=100257,
        eos_token_id=100257,
        pad_token_id=100256,
    ),
    # Granite 4.0-H-Micro: Mamba-2 on 36 of 40 layers (64 heads of 64, state 128), attention without rotary
    # embedding on layers 5, 15, 25 and 35
    "granite-4.0-h-micro": ModelConfig(
        "granitemoehybrid",
        100352,
        2048,
        40,
        32,
        8,
        8192,
        max_seq_len=131072,
        rms_eps=1e-5,
        tie_embeddings=True,
        bos_token_id=100257,
        eos_token_id=100257,
        pad_token_id=100256,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.015625,
        logits_scaling=8.0,
        nope_layers=tuple(range(40)),
        linear_attention_layers=tuple(i for i in range(40) if i % 10 != 5),
        linear_n_key_heads=1,
        linear_n_value_heads=64,
        linear_key_head_dim=128,
        linear_value_head_dim=64,
    ),
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
    # the text models of Llama 4's image-text checkpoints
    "llama-4-scout-17b-16e": _llama4(
        202048,
        5120,
        48,
        40,
        8,
        16384,
        8192,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-4-maverick-17b-128e": _llama4(
        202048,
        5120,
        48,
        40,
        8,
        16384,
        8192,
        max_seq_len=1048576,
        n_experts=128,
        moe_every=2,
        qk_rms_normalized=False,
    ),
    # Qwen3.5 (the text models of its image-text checkpoints) and Qwen3-Next: linear attention on three of four layers
    "qwen3.5-0.8b": _qwen3_5("qwen3_5_text", 248320, 1024, 24, 8, 3584, 16, tie_embeddings=True),
    "qwen3.5-27b": _qwen3_5("qwen3_5_text", 248320, 5120, 64, 24, 17408, 48, n_kv_heads=4),
    "qwen3.5-35b-a3b": _qwen3_5_moe(2048, 40, 16, 32, 256, 8, 512),
    "qwen3.5-122b-a10b": _qwen3_5_moe(3072, 48, 32, 64, 256, 8, 1024),
    "qwen3.5-397b-a17b": _qwen3_5_moe(4096, 60, 32, 64, 512, 10, 1024),
    "qwen3-next-80b-a3b": _qwen3_5(
        "qwen3_next",
        151936,
        2048,
        48,
        16,
        5120,
        32,
        bos_token_id=151643,
        eos_token_id=151645,
        n_experts=512,
        n_experts_per_tok=10,
        moe_d_ff=512,
        shared_expert_d_ff=512,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
    ),
    # A 120B dense Llama-style shape (the size class of the published single-GPU result).
    "dense-120b": _llama3(12288, 76, 96, 8, 32768),
    # Tiny models for tests and the built-in CPU demo.
    "tiny-llama": ModelConfig("llama", 256, 64, 2, 4, 2, 160, max_seq_len=256),
    "tiny-qwen2": ModelConfig(
        "qwen2", 256, 64, 2, 4, 2, 160, max_seq_len=256, rms_eps=1e-6, tie_embeddings=True, qkv_bias=True
    ),
    "tiny-qwen3": ModelConfig("qwen3", 256, 64, 2, 4, 2, 160, head_dim=32, max_seq_len=256, rms_eps=1e-6, qk_norm=True),
    "small-llama": ModelConfig("llama", 2048, 128, 4, 4, 2, 352, max_seq_len=1024, tie_embeddings=True),
    "tiny-mixtral": ModelConfig(
        "mixtral",
        256,
        64,
        2,
        4,
        2,
        96,
        max_seq_len=256,
        n_experts=4,
        n_experts_per_tok=2,
        moe_d_ff=96,
        norm_topk_prob=True,
        router_aux_loss_coef=0.02,
        output_router_logits=True,
    ),
    "tiny-qwen2-moe": ModelConfig(
        "qwen2_moe",
        256,
        64,
        3,
        4,
        2,
        128,
        max_seq_len=256,
        rms_eps=1e-6,
        qkv_bias=True,
        n_experts=6,
        n_experts_per_tok=3,
        moe_d_ff=48,
        shared_expert_d_ff=80,
        dense_layers=(1,),
        router_aux_loss_coef=0.01,
        output_router_logits=True,
    ),
    "tiny-gpt-oss": ModelConfig(
        "gpt_oss",
        256,
        64,
        2,
        4,
        2,
        32,
        head_dim=16,
        max_seq_len=256,
        rope_theta=150000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
        qkv_bias=True,
        o_bias=True,
        attention_sinks=True,
        sliding_window=4,
        sliding_layers=(0,),
        n_experts=4,
        n_experts_per_tok=2,
        moe_d_ff=32,
        norm_topk_prob=True,
        swiglu_limit=7.0,
        router_aux_loss_coef=0.05,
        output_router_logits=True,
    ),
    "tiny-deepseek-v2": ModelConfig(
        "deepseek_v2",
        256,
        64,
        3,
        4,
        4,
        96,
        head_dim=8,
        max_seq_len=256,
        rms_eps=1e-6,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 64,
        },
        n_experts=8,
        n_experts_per_tok=3,
        moe_d_ff=32,
        shared_expert_d_ff=64,
        dense_layers=(0,),
        kv_lora_rank=24,
        q_lora_rank=20,
        qk_nope_head_dim=16,
        v_head_dim=12,
        routed_scaling_factor=1.5,
        n_group=4,
        topk_group=2,
    ),
    "tiny-qwen3-moe": ModelConfig(
        "qwen3_moe",
        256,
        64,
        2,
        4,
        2,
        128,
        head_dim=32,
        max_seq_len=256,
        rms_eps=1e-6,
        qk_norm=True,
        n_experts=8,
        n_experts_per_tok=2,
        moe_d_ff=48,
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
    ),
    "tiny-olmoe": ModelConfig(
        "olmoe",
        256,
        64,
        2,
        4,
        4,
        64,
        max_seq_len=256,
        qk_norm=True,
        qk_norm_scope="full",
        clip_qkv=8.0,
        n_experts=8,
        n_experts_per_tok=3,
        moe_d_ff=64,
        router_aux_loss_coef=0.01,
        output_router_logits=True,
    ),
}

# tiny DeepSeek-V2's shape with V3's routing (sigmoid scores, correction bias, renormalised) and one shared expert
PRESETS["tiny-deepseek-v3"] = PRESETS["tiny-deepseek-v2"].with_changes(
    arch="deepseek_v3",
    rope_scaling={**PRESETS["tiny-deepseek-v2"].rope_scaling, "mscale": 1.0, "mscale_all_dim": 1.0},
    shared_expert_d_ff=32,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    router_scoring="sigmoid",
)
PRESETS["tiny-glm4-moe"] = ModelConfig(
    "glm4_moe",
    256,
    64,
    3,
    4,
    2,
    96,
    head_dim=16,
    max_seq_len=256,
    qkv_bias=True,
    qk_norm=True,
    n_experts=8,
    n_experts_per_tok=3,
    moe_d_ff=32,
    shared_expert_d_ff=32,
    norm_topk_prob=True,
    dense_layers=(0,),
    routed_scaling_factor=1.5,
    n_group=2,
    topk_group=1,
    router_scoring="sigmoid",
    partial_rotary_factor=0.5,
)
PRESETS["tiny-dots1"] = ModelConfig(
    "dots1",
    256,
    64,
    3,
    4,
    2,
    96,
    head_dim=16,
    max_seq_len=256,
    qk_norm=True,
    n_experts=8,
    n_experts_per_tok=3,
    moe_d_ff=32,
    shared_expert_d_ff=64,
    norm_topk_prob=True,
    dense_layers=(0,),
    routed_scaling_factor=2.5,
    router_scoring="sigmoid",
)
PRESETS["tiny-ernie4_5"] = ModelConfig(
    "ernie4_5", 256, 64, 2, 4, 2, 160, head_dim=32, max_seq_len=256, tie_embeddings=True
)
PRESETS["tiny-ernie4_5-moe"] = ModelConfig(
    "ernie4_5_moe",
    256,
    64,
    3,
    4,
    2,
    96,
    head_dim=16,
    max_seq_len=256,
    n_experts=8,
    n_experts_per_tok=3,
    moe_d_ff=32,
    shared_expert_d_ff=32,
    norm_topk_prob=True,
    dense_layers=(0,),
)
PRESETS["tiny-gemma2"] = _gemma(
    "gemma2",
    256,
    64,
    3,
    4,
    2,
    160,
    head_dim=32,
    max_seq_len=256,
    sliding_window=5,
    query_pre_attn_scalar=24,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,  # low enough that random weights meet the caps
)
PRESETS["tiny-gemma3"] = _gemma(
    "gemma3_text",
    256,
    64,
    3,
    4,
    2,
    160,
    head_dim=32,
    max_seq_len=256,
    sliding_window=5,
    rope_theta=50_000.0,
    rope_scaling={"rope_type": "linear", "factor": 4.0},
    sliding_layers=(0, 2),
    query_pre_attn_scalar=24,
)
PRESETS["tiny-phi3"] = _phi3(
    256,
    64,
    2,
    4,
    2,
    160,
    max_seq_len=256,
    partial_rotary_factor=0.75,
    sliding_window=5,
    sliding_layers=(0, 1),
)
PRESETS["tiny-olmo2"] = _olmo2(64, 2, 4, 2, 160, max_seq_len=256, eos_token_id=None, pad_token_id=1).with_changes(
    vocab_size=256
)
# five layers: dense and sparse, chunked and not, with and without the rotary embedding (layer 3), temperatures
# and rotary scaling that bite at 12 positions
PRESETS["tiny-llama4"] = _llama4(
    256,
    64,
    5,
    4,
    2,
    96,
    32,
    head_dim=16,
    max_seq_len=256,
    attention_chunk_size=5,
    moe_every=2,
    n_experts=4,
    n_experts_per_tok=2,
    attn_temperature_floor_scale=3.0,
    attn_temperature_scale=0.5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)
PRESETS["tiny-olmo3"] = ModelConfig(
    "olmo3",
    256,
    64,
    4,
    4,
    2,
    160,
    max_seq_len=256,
    rope_theta=10_000.0,
    rope_local_theta=1_000.0,
    rms_eps=1e-6,
    qk_norm=True,
    qk_norm_scope="full",
    sliding_window=5,
    sliding_layers=(0, 1, 2),
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.1,
    },
)
PRESETS["tiny-smollm3"] = ModelConfig(
    "smollm3",
    256,
    64,
    4,
    4,
    2,
    160,
    max_seq_len=256,
    rms_eps=1e-6,
    tie_embeddings=True,
    nope_layers=(1, 3),
    sliding_window=5,
    sliding_layers=(1, 3),
)
PRESETS["tiny-granite"] = ModelConfig(
    "granite", 256, 64, 3, 4, 2, 160, max_seq_len=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.4, logits_scaling=2.0,
)  # fmt: skip
# Granite 4.0's attention-only form (granitemoehybrid): the MLP as shared_mlp, no rotary embedding on any layer
PRESETS["tiny-granite-4.0"] = PRESETS["tiny-granite"].with_changes(
    arch="granitemoehybrid", tie_embeddings=True, nope_layers=(0, 1, 2)
)
# Granite 4.0-H's form: Mamba-2 on layers 0 and 2 (two groups of B and C, four heads, the state 8 x 32)
PRESETS["tiny-granite-4.0-h"] = PRESETS["tiny-granite-4.0"].with_changes(
    linear_attention_layers=(0, 2), linear_n_key_heads=2, linear_n_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=32,
)  # fmt: skip
PRESETS["tiny-minimax-m2"] = ModelConfig(
    "minimax_m2",
    256,
    64,
    2,
    4,
    2,
    32,
    head_dim=16,
    max_seq_len=256,
    qk_norm=True,
    qk_norm_scope="full",
    n_experts=8,
    n_experts_per_tok=3,
    moe_d_ff=32,
    norm_topk_prob=True,
    router_scoring="sigmoid",
    partial_rotary_factor=0.5,
)

# Qwen3.5 and Qwen3-Next at a tiny shape: linear attention on layers 0-2, gated softmax attention on layer 3 (two
# value heads per key head); Qwen3-Next's layer 1 a dense MLP (mlp_only_layers), its projections grouped by key head
_TINY_LINEAR = dict(
    head_dim=16, max_seq_len=256, rope_theta=10_000.0, linear_attention_layers=(0, 1, 2), linear_n_key_heads=2,
    linear_n_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_TINY_EXPERTS = dict(n_experts=8, n_experts_per_tok=2, moe_d_ff=32, shared_expert_d_ff=48, norm_topk_prob=True)
PRESETS["tiny-qwen3.5"] = _qwen3_5("qwen3_5_text", 256, 64, 4, 4, 160, 4, tie_embeddings=True, **_TINY_LINEAR)
PRESETS["tiny-qwen3.5-moe"] = _qwen3_5(
    "qwen3_5_moe_text", 256, 64, 4, 4, 32, 4, router_aux_loss_coef=0.02, output_router_logits=True,
    **_TINY_EXPERTS, **_TINY_LINEAR,
)  # fmt: skip
PRESETS["tiny-qwen3-next"] = _qwen3_5(
    "qwen3_next", 256, 64, 4, 4, 96, 4, dense_layers=(1,), **_TINY_EXPERTS, **_TINY_LINEAR
)


def preset(name: str) -> ModelConfig:
    """The architecture of preset `name` (`PRESETS`), or `ZooError` naming the closest ones (or all)."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=6, cutoff=0.6)
        if close:
            raise ZooError(f"unknown model preset {name!r}; did you mean {', '.join(close)}?")
        raise ZooError(f"unknown model preset {name!r}; the presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]


def preset_table(match: str = "") -> list[str]:
    """`megatrain presets`' lines: a header, then one per preset whose name contains `match` (its architecture,
    parameters, active ones, layers, width); `ZooError` where none does."""
    names = [name for name in PRESETS if match.lower() in name.lower()]
    if not names:
        raise ZooError(f"no preset name contains {match!r}; `megatrain presets` lists them all")
    lines = [f"{'preset':<28} {'architecture':<24} {'params':>9} {'active':>9} {'layers':>6} {'width':>6}"]
    for name in names:
        model = PRESETS[name]
        active = _size(model.active_params) if model.is_moe else ""
        lines.append(
            f"{name:<28} {model.arch:<24} {_size(model.n_params):>9} {active:>9} {model.n_layers:>6} {model.d_model:>6}"
        )
    return lines


def _size(params: int) -> str:
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
