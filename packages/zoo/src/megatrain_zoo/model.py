"""A model as groups (transfer units of parameters, Hugging Face names) and stages (templates)."""

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatrain_templates import BlockShape, DecoderBlock, Embedding, Head, ParamSpec, RopeConfig

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

    def checkpoint_names_to_ignore(self, name: str) -> bool:
        """Tensors a Hugging Face checkpoint may carry that this model does not store."""
        return name.endswith("rotary_emb.inv_freq") or (self.config.tie_embeddings and name == "lm_head.weight")


def block_shape(config: ModelConfig) -> BlockShape:
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
        rope=RopeConfig(head_dim=config.head_dim, theta=config.rope_theta, scaling=scaling),
    )


def _renamed(params: tuple[ParamSpec, ...], prefix: str) -> tuple[ParamSpec, ...]:
    return tuple(ParamSpec(prefix + p.name, p.shape, p.weight_decay) for p in params)


def build_model(config: ModelConfig) -> ModelSpec:
    """Groups: [embedding, layer 0 .. layer L-1, head]; stages: embedding, blocks, head.

    One decoder template serves every layer: templates are stateless."""
    embedding = Embedding(config.vocab_size, config.d_model)
    block = DecoderBlock(block_shape(config))
    head = Head(config.vocab_size, config.d_model, config.rms_eps, tied=config.tie_embeddings)
    groups = [Group("embed", _renamed(embedding.groups[0], "model."))]
    for layer in range(config.n_layers):
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
    stages += [StageSpec(f"layer{layer}", block, (layer + 1,)) for layer in range(config.n_layers)]
    stages.append(StageSpec("head", head, (0, head_group) if config.tie_embeddings else (head_group,)))
    return ModelSpec(config, tuple(groups), tuple(stages))


def init_param_(name: str, tensor: Tensor, config: ModelConfig, generator: torch.Generator) -> None:
    """Hugging Face initialisation: norms at one, biases at zero, matrices N(0, initializer_range)."""
    if name.endswith("norm.weight"):
        tensor.fill_(1.0)
    elif name.endswith(".bias"):
        tensor.zero_()
    else:
        tensor.normal_(0.0, config.initializer_range, generator=generator)
