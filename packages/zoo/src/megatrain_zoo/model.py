"""Building a model's spec: a native family's groups and stages from its templates, or a generic or image-text
model's (`generic.py`, `image_text.py`); Hugging Face initialisation of its weights."""

import zlib
from dataclasses import replace

import torch
from torch import Tensor

from megatrain_templates import (
    ALL_LINEAR,
    ATTENTION_STAGE_SUFFIX,
    EXPERT_NAMING,
    DecoderBlock,
    Embedding,
    Head,
    Lora,
    MoeAttention,
    MoeBlock,
    MoeExperts,
    ParamSpec,
    RouterLoad,
    row_slice_of,
    split_precision_of,
)
from megatrain_templates.moe_layout import router_name

from .config import ModelConfig, ZooError
from .generic import build_generic_model
from .image_text import build_image_text_model
from .shapes import block_shape, moe_shape
from .spec import ADAPTER_GROUP_SUFFIX, Group, ModelSpec, StageSpec


def _renamed(params: tuple[ParamSpec, ...], prefix: str) -> tuple[ParamSpec, ...]:
    return tuple(replace(p, name=prefix + p.name) for p in params)


def expert_parts(n_experts: int, experts_per_stage: int) -> tuple[tuple[int, int], ...]:
    """(first, stop) expert ranges of at most `experts_per_stage` experts; empty where that is all of them."""
    if not 0 < experts_per_stage < n_experts:
        return ()
    return tuple((first, min(first + experts_per_stage, n_experts)) for first in range(0, n_experts, experts_per_stage))


def build_model(config: ModelConfig, experts_per_stage: int = 0, adapter: Lora | None = None) -> ModelSpec:
    """Groups: [embedding, layer 0 .. layer L-1, head]; stages: embedding, blocks, head.

    One template serves every layer of a kind (dense or MoE): templates are stateless; the
    MoE layers share the step's routing statistics. With `experts_per_stage` below the expert count
    (0: all), a MoE layer is several groups and stages so that a GPU slot holds a part of its experts:
    trunk (attention, shared expert) + router group in one stage, then a stage per part of the experts. A model of
    no native family (`implementation` "transformers") runs transformers' own modules (`generic.py`).

    With `adapter`, each decoder layer also has a group of LoRA adapters (`layerN.lora`), and the rest is frozen."""
    if adapter is not None:
        _check_adapter_model(config)
    if config.image_text:
        return build_image_text_model(config)
    if config.implementation == "transformers":
        model = build_generic_model(config, adapter)
        if adapter is not None:
            check_targets(model, adapter)
        return model
    embed_scale = config.d_model**0.5 if config.gemma else config.embedding_multiplier
    embedding = Embedding(config.vocab_size, config.d_model, config.pad_token_id, embed_scale)
    router_load = _router_load(config)
    parts = expert_parts(config.n_experts, experts_per_stage) if config.is_moe else ()
    spec = _SpecBuilder()
    spec.add_stage("embed", embedding, ("embed",), "model.")
    for layer in range(config.n_layers):
        _add_layer(spec, config, layer, router_load, parts, adapter)
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
    model = ModelSpec(config, tuple(spec.groups), tuple(spec.stages), router_load, parts, adapter=adapter)
    if adapter is not None:
        check_targets(model, adapter)
    return model


def _check_adapter_model(config: ModelConfig) -> None:
    """Refuse the models whose layers take no LoRA adapters yet, naming what does."""
    if config.image_text:
        raise ZooError(
            "LoRA adapters are not built for an image-text model yet; train it fully (remove model.adapter), or its "
            "text model alone (model.image_text: false)"
        )


def check_targets(spec: ModelSpec, adapter: Lora) -> None:
    """Refuse an adapter whose target_modules name a module that no layer of `spec` adapts, naming those it has."""
    if ALL_LINEAR in adapter.target_modules:
        return
    adapted = {p.name.rsplit(".lora_", 1)[0] + ".weight" for g in spec.adapter_groups for p in spec.groups[g].params}
    experts = _adaptable_expert_projections(spec.config)
    for target in adapter.target_modules:
        if target.rsplit(".", 1)[-1] in experts:
            continue
        if not any(replace(adapter, target_modules=(target,)).adapts(name) for name in adapted):
            layers = [g for g, group in enumerate(spec.groups) if group.name.startswith("layer")]
            matrices = {
                p.name.removesuffix(".weight").rsplit(".", 1)[-1]
                for g in layers
                if g not in spec.adapter_groups
                for p in spec.groups[g].params
                if len(p.shape) == 2 and p.name.endswith(".weight") and ".experts." not in p.name
            } - _unadapted_router(spec.config)
            raise ZooError(
                f"model.adapter.target_modules: {target!r} matches no linear layer of this model; its layers have "
                f"{', '.join(sorted(matrices | experts))} (or use all-linear)"
            )


def _unadapted_router(config: ModelConfig) -> set[str]:
    """The router's name where a MoE's router takes no adapters (`MoeBlock._adapt`)."""
    if not config.is_moe or moe_shape(config).lora_reaches_experts:
        return set()
    return {router_name(moe_shape(config)).removesuffix(".weight").rsplit(".", 1)[-1]}


def _adaptable_expert_projections(config: ModelConfig) -> set[str]:
    """The names target_modules reach a MoE's experts by (`MoeShape.lora_reaches_experts`): each expert's
    projections' and transformers' fused matrices'."""
    if not config.is_moe or not moe_shape(config).lora_reaches_experts:
        return set()
    return {*EXPERT_NAMING[moe_shape(config).naming][1], "gate_up_proj", "down_proj"}


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


def _add_layer(spec: _SpecBuilder, config: ModelConfig, layer: int, router_load, parts, adapter=None) -> None:
    """Decoder layer `layer`'s stages: one block (and its adapters' group, with an `adapter`), or a MoE layer's trunk
    and then a stage per part of its experts (each with the layer's adapters' group where it binds it)."""
    shape, prefix, name = block_shape(config, layer), f"model.layers.{layer}.", f"layer{layer}"

    def add(stage: str, template, *groups: str) -> None:  # (a template's one more group: the layer's adapters)
        adapters = (name + ADAPTER_GROUP_SUFFIX,)[: len(template.groups) - len(groups)]
        spec.add_stage(stage, template, (*groups, *adapters), prefix)

    if not config.layer_is_moe(layer):
        add(name, spec.template((shape, "dense", adapter), lambda: DecoderBlock(shape, adapter)), name)
    elif not parts:
        block = spec.template(
            (shape, "moe", adapter), lambda: _moe_block(MoeBlock, shape, config, router_load, adapter)
        )
        add(name, block, name)
    else:
        attention = spec.template(
            (shape, "attention", adapter), lambda: _moe_block(MoeAttention, shape, config, router_load, adapter)
        )
        add(name + ATTENTION_STAGE_SUFFIX, attention, name, f"{name}.router")
        for first, stop in parts:
            part = spec.template(
                (shape, first, adapter), lambda: MoeExperts(shape, moe_shape(config), first, stop, adapter)
            )
            add(f"{name}.experts{first}-{stop - 1}", part, f"{name}.router", f"{name}.experts{first}")


def _moe_block(template, shape, config: ModelConfig, router_load, adapter: Lora | None):
    """A MoE layer's template (`MoeBlock`, or the attention stage of one in parts, `MoeAttention`); an adapter it
    cannot take (dropout on a fused matrix, half of one) refused."""
    try:
        return template(shape, moe_shape(config), router_load, adapter)
    except ValueError as error:
        if adapter is None:
            raise
        raise ZooError(str(error)) from None


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
    if base.endswith(".lora_A.weight"):  # as PEFT starts an adapter: A as nn.Linear's own init, B at zero
        bound = 1.0 / tensor.shape[1] ** 0.5  # kaiming_uniform_(a=sqrt(5)): 1 / sqrt(fan_in)
        tensor.copy_(torch.empty(tensor.shape).uniform_(-bound, bound, generator=_generator(seed, base)))
        return
    if base.endswith(".lora_B.weight"):
        tensor.zero_()
        return
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
