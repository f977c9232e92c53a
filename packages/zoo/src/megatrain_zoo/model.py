"""A model as groups (transfer units of parameters, Hugging Face names) and stages (templates)."""

import zlib
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from megatrain_templates import (
    BlockShape,
    DecoderBlock,
    Embedding,
    GatedDeltaNetShape,
    Head,
    Mamba2Shape,
    MlaShape,
    MoeAttention,
    MoeBlock,
    MoeExperts,
    MoeShape,
    ParamSpec,
    RopeConfig,
    RouterLoad,
    fused_expert_names,
    row_slice_of,
    split_precision_of,
    yarn_mscale,
)

from .config import LINEAR_ATTENTION_ARCHITECTURES, LINEAR_ATTENTION_CHUNK, ModelConfig


@dataclass(frozen=True)
class Group:
    """One transfer unit: the parameters stored, moved and updated together."""

    name: str
    params: tuple[ParamSpec, ...]  # global (Hugging Face) names, in buffer order


@dataclass(frozen=True)
class StageSpec:
    name: str
    template: Any
    groups: tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    config: ModelConfig
    groups: tuple[Group, ...]
    stages: tuple[StageSpec, ...]
    router_load: RouterLoad | None = None  # the MoE layers' shared routing statistics (None: dense)
    # (first, stop) expert ranges a MoE layer streams in, one stage and group each; empty: whole layers
    expert_parts: tuple[tuple[int, int], ...] = ()
    # a model of transformers' own modules: how its family's checkpoints name and lay out its weights
    checkpoint_layout: Any = None
    # an image-text model's part of each group: "vision_tower", "multi_modal_projector" or "language_model" (what
    # train.freeze_* names), or "unused" (tower blocks after those whose output the model takes: always frozen);
    # empty: a text model's, all language model
    group_parts: tuple[str, ...] = ()

    def layer_stage(self, layer: int) -> int:
        """The stage of decoder layer `layer` (whole layers: no expert parts): after the embedding, or after an
        image-text model's vision stages."""
        return next(i for i, stage in enumerate(self.stages) if stage.name == "layer0") + layer

    def frozen_groups(self, frozen_parts: set[str]) -> frozenset[int]:
        """The groups of the parts `frozen_parts` names, and any unused (those keep no gradient and no optimizer
        state)."""
        return frozenset(g for g, part in enumerate(self.group_parts) if part in frozen_parts or part == "unused")

    def checkpoint_names_to_ignore(self, name: str) -> bool:
        """Tensors a Hugging Face checkpoint may carry that this model does not store."""
        return (
            name.endswith("rotary_emb.inv_freq")
            or (self.config.tie_embeddings and name in ("lm_head.weight", "language_model.lm_head.weight"))
            or self.left_out(name) is not None
        )

    def left_out(self, name: str) -> str | None:
        """What tensor `name` of a published checkpoint belongs to when it is a part the causal language model
        does not have (so transformers' *ForCausalLM leaves it out too), else None: multi-token-prediction
        modules (DeepSeek-V3's and GLM-4.5's, published as layers past the last; ERNIE 4.5's, named `mtp`),
        and Qwen3-Next's and Qwen3.5's, named `mtp.*`), the vision towers and projectors of Gemma 3's, Mistral
        Small 3's, Llama 4's and Qwen3.5's image-text checkpoints (which hold the text model trained here)."""
        arch = self.config.arch
        if (arch == "ernie4_5_moe" and "mtp" in name) or (
            arch in LINEAR_ATTENTION_ARCHITECTURES and name.startswith("mtp.")
        ):
            return "multi-token-prediction modules"
        if name.startswith(_VISION_PARTS.get(arch, ())):
            return "the vision tower and its projector"
        if arch in ("deepseek_v3", "glm4_moe") and name.startswith("model.layers."):
            layer = name.split(".")[2]
            if layer.isdigit() and int(layer) >= self.config.n_layers:
                return "multi-token-prediction modules"
        return None

    def fused_checkpoint_names(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """transformers' fused 3-D expert tensors -> (shape, the per-expert names it covers): the
        fused tensor is the same bytes as those tensors back to back."""
        if not self.config.is_moe:
            return {}
        fused = {}
        for layer in range(self.config.n_layers):
            if self.config.layer_is_moe(layer):
                prefix = f"model.layers.{layer}."
                for name, (shape, covered) in fused_expert_names(moe_shape(self.config), self.config.d_model).items():
                    fused[prefix + name] = (shape, tuple(prefix + n for n in covered))
        return fused

    def checkpoint_aliases(self, name: str) -> tuple[str, ...]:
        """Other names files may give tensor `name`: transformers >= 5's in memory (Mixtral's block_sparse_moe
        is mlp there); image-text checkpoints' for their text model (Gemma 3's, Mistral Small 3's and Llama 4's
        `language_model.model.*` and `language_model.lm_head.weight` as published, `model.language_model.*` as
        transformers 4.52 and later write them and Qwen3.5 publishes them)."""
        if self.config.arch in _VISION_PARTS and name.startswith(("model.", "lm_head.")):
            inside = ("model.language_model." + name.removeprefix("model."),) if name.startswith("model.") else ()
            return ("language_model." + name, *inside)
        alias = name.replace(".block_sparse_moe.", ".mlp.")
        return (alias,) if alias != name else ()

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's shape by Hugging Face name."""
        return {p.name: p.shape for group in self.groups for p in group.params}


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


# the parts of image-text checkpoints beside their text model, in every layout transformers has written
_LLAVA_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_VISION_PARTS = {
    "gemma3_text": _LLAVA_VISION,
    "mistral": _LLAVA_VISION,  # Mistral Small 3.1 and later
    "llama4_text": ("vision_model.", "multi_modal_projector."),
    "qwen3_5_text": ("model.visual.",),
    "qwen3_5_moe_text": ("model.visual.",),
}

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


def _renamed(params: tuple[ParamSpec, ...], prefix: str) -> tuple[ParamSpec, ...]:
    return tuple(replace(p, name=prefix + p.name) for p in params)


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
    )


def expert_parts(n_experts: int, experts_per_stage: int) -> tuple[tuple[int, int], ...]:
    """(first, stop) expert ranges of at most `experts_per_stage` experts; empty where that is all of them."""
    if not 0 < experts_per_stage < n_experts:
        return ()
    return tuple((first, min(first + experts_per_stage, n_experts)) for first in range(0, n_experts, experts_per_stage))


def build_model(config: ModelConfig, experts_per_stage: int = 0) -> ModelSpec:
    """Groups: [embedding, layer 0 .. layer L-1, head]; stages: embedding, blocks, head.

    One template serves every layer of a kind (dense or MoE): templates are stateless; the
    MoE layers share the step's routing statistics. With `experts_per_stage` below the expert count
    (0: all), a MoE layer is several groups and stages so that a GPU slot holds a part of its experts:
    trunk (attention, shared expert) + router group in one stage, then a stage per part of the experts. A model of
    no native family (`implementation` "transformers") runs transformers' own modules (`generic.py`)."""
    if config.image_text:
        from .image_text import build_image_text_model

        return build_image_text_model(config)
    if config.implementation == "transformers":
        from .generic import build_generic_model

        return build_generic_model(config)
    embed_scale = config.d_model**0.5 if config.gemma else config.embedding_multiplier
    embedding = Embedding(config.vocab_size, config.d_model, config.pad_token_id, embed_scale)
    router_load = _router_load(config)
    parts = expert_parts(config.n_experts, experts_per_stage) if config.is_moe else ()
    spec = _SpecBuilder()
    spec.add_stage("embed", embedding, ("embed",), "model.")
    for layer in range(config.n_layers):
        _add_layer(spec, config, layer, router_load, parts)
    head = Head(
        config.vocab_size,
        config.d_model,
        config.rms_eps,
        tied=config.tie_embeddings,
        norm_scale=config.norm_scale,
        logit_softcap=config.final_logit_softcapping,
        logit_divisor=config.logits_scaling,
    )
    # the head's final norm is the model's ("model.norm.weight"); its projection is "lm_head.weight"
    spec.groups.append(
        Group(
            "head", tuple(replace(p, name="model." + p.name) if p.name == "norm.weight" else p for p in head.groups[-1])
        )
    )
    head_group = len(spec.groups) - 1
    spec.stages.append(StageSpec("head", head, (0, head_group) if config.tie_embeddings else (head_group,)))
    return ModelSpec(config, tuple(spec.groups), tuple(spec.stages), router_load, parts)


def _router_load(config: ModelConfig) -> RouterLoad | None:
    """The routing statistics every MoE layer of a step shares (None for a dense model)."""
    if not config.is_moe:
        return None
    coef = config.router_aux_loss_coef if config.output_router_logits else 0.0
    n_moe_layers = sum(config.layer_is_moe(layer) for layer in range(config.n_layers))
    return RouterLoad(config.n_experts, config.n_experts_per_tok, coef, n_moe_layers)


class _SpecBuilder:
    """A model's groups and stages as they are added, one template per kind of layer (dense or MoE, windowed or
    not) and expert part."""

    def __init__(self):
        self.groups: list[Group] = []
        self.stages: list[StageSpec] = []
        self._group_index: dict[str, int] = {}
        self._templates: dict[tuple, object] = {}

    def template(self, key: tuple, make):
        if key not in self._templates:
            self._templates[key] = make()
        return self._templates[key]

    def add_stage(self, name: str, block, group_names: tuple[str, ...], prefix: str) -> None:
        """A stage binding `group_names` (in the template's order), each made at its first stage."""
        for group_name, params in zip(group_names, block.groups):
            if group_name not in self._group_index:
                self._group_index[group_name] = len(self.groups)
                self.groups.append(Group(group_name, _renamed(params, prefix)))
        self.stages.append(StageSpec(name, block, tuple(self._group_index[g] for g in group_names)))


def _add_layer(spec: _SpecBuilder, config: ModelConfig, layer: int, router_load, parts) -> None:
    """Decoder layer `layer`'s stages: one block, or a MoE layer's trunk and then a stage per part of its experts."""
    shape, prefix, name = block_shape(config, layer), f"model.layers.{layer}.", f"layer{layer}"
    if not config.layer_is_moe(layer):
        spec.add_stage(name, spec.template((shape, "dense"), lambda: DecoderBlock(shape)), (name,), prefix)
        return
    if not parts:
        block = spec.template((shape, "moe"), lambda: MoeBlock(shape, moe_shape(config), router_load))
        spec.add_stage(name, block, (name,), prefix)
        return
    attention = spec.template((shape, "attention"), lambda: MoeAttention(shape, moe_shape(config), router_load))
    spec.add_stage(f"{name}.attention", attention, (name, f"{name}.router"), prefix)
    for first, stop in parts:
        part = spec.template((shape, first), lambda: MoeExperts(shape, moe_shape(config), first, stop))
        spec.add_stage(f"{name}.experts{first}-{stop - 1}", part, (f"{name}.router", f"{name}.experts{first}"), prefix)


def init_param_(name: str, tensor: Tensor, config: ModelConfig, seed: int) -> None:
    """Hugging Face initialisation: norms at one (those that scale by 1 + weight at zero), biases at zero,
    matrices N(0, initializer_range); linear attention's dt_bias at one and A_log at log(U(0.01, 16)), as
    transformers' Qwen3-Next and Qwen3.5 start them; Mamba-2's dt_bias and D at one, A_log at log(1 .. n_heads), as
    Granite 4.0-H's.

    Each tensor is drawn from a generator of its own, seeded by (seed, name), so the weights do not
    depend on how the tensors are grouped or in which order they are made (a MoE layer in parts,
    hosts that split the state); 3-D expert tensors, and their row slices `NAME[a:b]`, draw expert
    by expert, so a slice holds the same rows as the whole tensor."""
    base, first, _ = row_slice_of(name) or (name, 0, 0)
    base = (split_precision_of(base) or (base,))[0]
    if base.endswith("norm.weight"):  # (the linear attention's gated norm scales by its weight alone)
        one_plus = config.norm_scale == "one_plus_fp32" and not base.endswith("linear_attn.norm.weight")
        tensor.fill_(0.0 if one_plus else 1.0)
        return
    if base.endswith("linear_attn.dt_bias"):
        tensor.fill_(1.0)
        return
    if base.endswith("linear_attn.A_log"):
        tensor.copy_(torch.empty(tensor.shape).uniform_(0.01, 16, generator=_generator(seed, base)).log())
        return
    if base.endswith(("mamba.dt_bias", "mamba.D")):
        tensor.fill_(1.0)
        return
    if base.endswith("mamba.A_log"):  # log(1 .. n_heads)
        tensor.copy_(torch.arange(1, tensor.numel() + 1, dtype=torch.float64).log())
        return
    if base.endswith((".bias", "_bias")) and not base.endswith("router.bias"):
        tensor.zero_()
        return
    if tensor.dim() == 3:
        for index, expert in enumerate(tensor):
            expert.normal_(0.0, config.initializer_range, generator=_generator(seed, base, first + index))
    else:
        tensor.normal_(0.0, config.initializer_range, generator=_generator(seed, base))
    if base.endswith("embed_tokens.weight") and config.pad_token_id is not None:
        tensor[config.pad_token_id].zero_()  # as nn.Embedding(padding_idx=...) starts


def _generator(seed: int, *key) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(repr(key).encode())) % 2**63)
