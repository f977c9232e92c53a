"""A model as groups (transfer units of parameters, Hugging Face names) and stages (templates)."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatrain_templates import (
    BlockShape,
    DecoderBlock,
    Embedding,
    Head,
    MlaShape,
    MoeBlock,
    MoeShape,
    ParamSpec,
    RopeConfig,
    RouterLoad,
    fused_expert_names,
    yarn_mscale,
)

from .config import ModelConfig


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

    def checkpoint_names_to_ignore(self, name: str) -> bool:
        """Tensors a Hugging Face checkpoint may carry that this model does not store."""
        return name.endswith("rotary_emb.inv_freq") or (self.config.tie_embeddings and name == "lm_head.weight")

    def fused_checkpoint_names(self) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """transformers' fused 3-D expert tensors -> (shape, the per-expert names it covers): the
        fused tensor is the same bytes as those tensors, which lie back to back in the layer."""
        fused = {}
        for layer in range(self.config.n_layers):
            template = self.stages[layer + 1].template
            if not isinstance(template, MoeBlock):
                continue
            prefix = f"model.layers.{layer}."
            names = [p.name for p in template.groups[0]]
            for name, (first, count, shape) in fused_expert_names(template.moe, self.config.d_model).items():
                start = names.index(first)
                fused[prefix + name] = (shape, tuple(prefix + n for n in names[start : start + count]))
        return fused

    def checkpoint_alias(self, name: str) -> str:
        """The name transformers >= 5 gives tensor `name` in memory (Mixtral's block_sparse_moe is mlp there)."""
        return name.replace(".block_sparse_moe.", ".mlp.")

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's shape by Hugging Face name."""
        return {p.name: p.shape for group in self.groups for p in group.params}


def block_shape(config: ModelConfig, layer: int = 0) -> BlockShape:
    """Layer `layer`'s attention and dense-MLP shape (layers differ only in a sliding window)."""
    scaling = tuple(sorted(config.rope_scaling.items())) if config.rope_scaling else None
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
        rope=RopeConfig(head_dim=config.head_dim, theta=config.rope_theta, scaling=scaling),
        o_bias=config.o_bias,
        sinks=config.attention_sinks,
        sliding_window=config.sliding_window if layer in config.sliding_layers else None,
        mla=_mla_shape(config),
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


def _renamed(params: tuple[ParamSpec, ...], prefix: str) -> tuple[ParamSpec, ...]:
    return tuple(ParamSpec(prefix + p.name, p.shape, p.weight_decay) for p in params)


def moe_shape(config: ModelConfig) -> MoeShape:
    return MoeShape(
        n_experts=config.n_experts,
        top_k=config.n_experts_per_tok,
        d_ff=config.moe_d_ff,
        shared_d_ff=config.shared_expert_d_ff,
        norm_topk_prob=config.norm_topk_prob,
        naming={"mixtral": "mixtral", "gpt_oss": "gpt_oss", "deepseek_v2": "deepseek"}.get(config.arch, "qwen"),
        swiglu_limit=config.swiglu_limit,
        routed_scaling=config.routed_scaling_factor,
        n_groups=config.n_group,
        topk_groups=config.topk_group,
    )


def build_model(config: ModelConfig) -> ModelSpec:
    """Groups: [embedding, layer 0 .. layer L-1, head]; stages: embedding, blocks, head.

    One template serves every layer of a kind (dense or MoE): templates are stateless; the
    MoE layers share the step's routing statistics."""
    embedding = Embedding(config.vocab_size, config.d_model, config.pad_token_id)
    router_load = None
    if config.is_moe:
        coef = config.router_aux_loss_coef if config.output_router_logits else 0.0
        router_load = RouterLoad(config.n_experts, config.n_experts_per_tok, coef)
    templates: dict[tuple, DecoderBlock] = {}  # one per kind of layer (dense or MoE, windowed or not)
    blocks = []
    for layer in range(config.n_layers):
        shape, is_moe = block_shape(config, layer), config.layer_is_moe(layer)
        if (shape, is_moe) not in templates:
            templates[shape, is_moe] = (
                MoeBlock(shape, moe_shape(config), router_load) if is_moe else DecoderBlock(shape)
            )
        blocks.append(templates[shape, is_moe])
    head = Head(config.vocab_size, config.d_model, config.rms_eps, tied=config.tie_embeddings)
    groups = [Group("embed", _renamed(embedding.groups[0], "model."))]
    for layer, block in enumerate(blocks):
        groups.append(Group(f"layer{layer}", _renamed(block.groups[0], f"model.layers.{layer}.")))
    head_group = len(groups)
    head_params = head.groups[-1]
    groups.append(
        Group(
            "head",
            tuple(
                ParamSpec("model." + p.name if p.name == "norm.weight" else p.name, p.shape, p.weight_decay)
                for p in head_params
            ),
        )
    )
    stages = [StageSpec("embed", embedding, (0,))]
    stages += [StageSpec(f"layer{layer}", block, (layer + 1,)) for layer, block in enumerate(blocks)]
    stages.append(StageSpec("head", head, (0, head_group) if config.tie_embeddings else (head_group,)))
    return ModelSpec(config, tuple(groups), tuple(stages), router_load)


def init_param_(name: str, tensor: Tensor, config: ModelConfig, generator: torch.Generator) -> None:
    """Hugging Face initialisation: norms at one, biases at zero, matrices N(0, initializer_range)."""
    if name.endswith("norm.weight"):
        tensor.fill_(1.0)
    elif name.endswith((".bias", "_bias")) and not name.endswith("router.bias"):
        tensor.zero_()
    else:
        tensor.normal_(0.0, config.initializer_range, generator=generator)
        if name.endswith("embed_tokens.weight") and config.pad_token_id is not None:
            tensor[config.pad_token_id].zero_()  # as nn.Embedding(padding_idx=...) starts
