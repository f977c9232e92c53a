"""The shapes the templates take (attention, MLA, linear attention, MoE), read from a `ModelConfig`."""

from megatrain_templates import BlockShape, GatedDeltaNetShape, Mamba2Shape, MlaShape, MoeShape, RopeConfig, yarn_mscale

from .config import LINEAR_ATTENTION_CHUNK, ModelConfig


def block_shape(config: ModelConfig, layer: int = 0) -> BlockShape:
    """Layer `layer`'s attention and dense-MLP shape (layers differ only in a sliding window, and with it
    Gemma 3's rotary base; in Llama 4's rotary embedding, chunks and temperatures; in Qwen3-Next's and Qwen3.5's
    token mixer, linear or softmax attention)."""
    linear = config.layer_is_linear(layer)
    windowed = layer in config.sliding_layers
    rotary = layer not in config.nope_layers
    # frozen (hashable) form; LongRoPE's per-frequency factors are lists
    scaling = (
        tuple(sorted((key, tuple(v) if isinstance(v, list) else v) for key, v in config.rope_scaling.items()))
        if config.rope_scaling
        else None
    )
    rope = RopeConfig(head_dim=config.rotary_dim, theta=config.rope_theta, scaling=scaling)
    if windowed and config.rope_local_theta is not None:
        rope = RopeConfig(head_dim=config.rotary_dim, theta=config.rope_local_theta)
    return BlockShape(
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        d_ff=config.d_ff,
        rms_eps=config.rms_eps,
        qkv_bias=config.qkv_bias,
        qk_norm=config.qk_norm,
        qk_norm_scope=config.qk_norm_scope,
        clip_qkv=config.clip_qkv,
        rope=rope,
        o_bias=config.o_bias,
        sinks=config.attention_sinks,
        sliding_window=config.sliding_window if windowed else None,
        mla=_mla_shape(config),
        rope_interleaved=config.rope_interleaved,
        norm_scale=config.norm_scale,
        norm_placement=config.norm_placement,
        activation=config.activation,
        softmax_scale=config.softmax_scale,
        attn_softcap=config.attn_logit_softcapping,
        fused_projections=config.arch == "phi3",
        rotary=rotary,
        qk_rms_normalized=config.qk_rms_normalized and rotary,
        attention_chunk=config.attention_chunk_size if layer in config.chunked_layers else None,
        attn_temperature=(config.attn_temperature_floor_scale, config.attn_temperature_scale)
        if config.attn_temperature_floor_scale and not rotary
        else None,
        mlp_module="feed_forward" if config.arch == "llama4_text" else "mlp",
        mlp_names=("shared_mlp.input_linear", "shared_mlp.output_linear")
        if config.arch == "granitemoehybrid"
        else None,
        linear_attention=_linear_attention_shape(config) if linear else None,
        attn_output_gate=config.attn_output_gate and not linear,
        residual_scale=config.residual_multiplier,
    )


def _linear_attention_shape(config: ModelConfig) -> GatedDeltaNetShape | Mamba2Shape:
    if config.arch == "granitemoehybrid":
        return Mamba2Shape(
            n_groups=config.linear_n_key_heads,
            n_heads=config.linear_n_value_heads,
            state_dim=config.linear_key_head_dim,
            head_dim=config.linear_value_head_dim,
            conv_kernel=config.linear_conv_kernel,
            chunk=LINEAR_ATTENTION_CHUNK,
        )
    return GatedDeltaNetShape(
        n_key_heads=config.linear_n_key_heads,
        n_value_heads=config.linear_n_value_heads,
        key_head_dim=config.linear_key_head_dim,
        value_head_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel,
        grouped_projections=config.arch == "qwen3_next",  # its published in_proj_qkvz / in_proj_ba
        chunk=LINEAR_ATTENTION_CHUNK,
    )


def _mla_shape(config: ModelConfig) -> MlaShape | None:
    if not config.kv_lora_rank:
        return None
    qk = config.qk_nope_head_dim + config.head_dim
    scale = qk**-0.5
    scaling = config.rope_scaling or {}
    if scaling.get("mscale_all_dim"):  # YaRN's magnitude correction, squared, in the softmax scale
        scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return MlaShape(
        kv_lora_rank=config.kv_lora_rank,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.head_dim,
        v_head_dim=config.v_head_dim,
        softmax_scale=scale,
        q_lora_rank=config.q_lora_rank,
    )


# the template's parameter naming (`EXPERT_NAMING`) per family; "qwen" for the others
EXPERT_NAMING_OF = {
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "glm4_moe": "deepseek",
    "dots1": "deepseek",
    "ernie4_5_moe": "ernie",
    "minimax_m2": "mixtral",
    "llama4_text": "llama4",
}

# families whose experts transformers fuses on loading and PEFT 0.22 adapts through target_modules (its
# conversion of gate_proj, up_proj, down_proj to the fused gate_up_proj and down_proj, and of gate to the router)
PEFT_FUSED_EXPERTS = (
    "mixtral",
    "minimax_m2",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "qwen3_next",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "dots1",
    "ernie4_5_moe",
)


def moe_shape(config: ModelConfig) -> MoeShape:
    return MoeShape(
        n_experts=config.n_experts,
        top_k=config.n_experts_per_tok,
        d_ff=config.moe_d_ff,
        shared_d_ff=config.shared_expert_d_ff,
        norm_topk_prob=config.norm_topk_prob,
        naming=EXPERT_NAMING_OF.get(config.arch, "qwen"),
        swiglu_limit=config.swiglu_limit,
        routed_scaling=config.routed_scaling_factor,
        n_groups=config.n_group,
        topk_groups=config.topk_group,
        scoring=config.router_scoring,
        correction_bias=config.router_bias and config.router_scoring == "softmax",
        lora_reaches_experts=config.arch in PEFT_FUSED_EXPERTS,
    )
