"""A model as groups (transfer units of parameters, Hugging Face names) and stages (templates): the specs every
builder (native, generic, image-text) returns, and what they say of a checkpoint's names."""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from megatrain_store import GroupLayout, PackedLayout
from megatrain_templates import ParamSpec, RouterLoad, fused_expert_names

from .config import LINEAR_ATTENTION_ARCHITECTURES, ModelConfig
from .shapes import moe_shape

ADAPTER_GROUP_SUFFIX = ".lora"  # a layer's adapter group is named after its base's: `layer3.lora`

# the parts of image-text checkpoints beside their text model, in every layout transformers has written
_LLAVA_VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_VISION_PARTS = {
    "gemma3_text": _LLAVA_VISION,
    "mistral": _LLAVA_VISION,  # Mistral Small 3.1 and later
    "llama4_text": ("vision_model.", "multi_modal_projector."),
    "qwen3_5_text": ("model.visual.",),
    "qwen3_5_moe_text": ("model.visual.",),
}


@dataclass(frozen=True)
class Group:
    """One transfer unit: the parameters stored, moved and updated together."""

    name: str
    params: tuple[ParamSpec, ...]  # global (Hugging Face) names, in buffer order

    def layout(self) -> GroupLayout:
        """Where each parameter lies in the group's flat buffers (the store's layout of it)."""
        return GroupLayout.from_specs((p.name, p.shape, p.weight_decay, p.update) for p in self.params)


@dataclass(frozen=True)
class StageSpec:
    """One stage of a model, in run order: its name ("embed", "layer3", "head"; an image-text model's
    "vision.*" first), its template, and the indices in `ModelSpec.groups` of the groups it binds, in the
    template's order (a tied head binds the embedding's too)."""

    name: str
    template: Any
    groups: tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    """A model as `build_model` gives it: its config, its groups (the store's transfer units of parameters, under
    Hugging Face names) and its stages (templates binding those groups), with what MoE, image-text and LoRA models
    add; the scheduler runs the stages over a store built from the groups' layouts."""

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
    # LoRA adapters (`megatrain_templates.Lora`) over a frozen base: the groups named `*.lora` hold them, and only
    # they train; None: every parameter trains
    adapter: Any = None

    @property
    def adapter_groups(self) -> frozenset[int]:
        """The groups holding LoRA adapters (none without an adapter)."""
        return frozenset(g for g, group in enumerate(self.groups) if group.name.endswith(ADAPTER_GROUP_SUFFIX))

    def groups_of(self, stages: Iterable[int]) -> list[int]:
        """The groups these stages bind, in store order."""
        return sorted({g for i in stages for g in self.stages[i].groups})

    def layer_stage(self, layer: int) -> int:
        """The stage of decoder layer `layer` (whole layers: no expert parts): after the embedding, or after an
        image-text model's vision stages."""
        return next(i for i, stage in enumerate(self.stages) if stage.name == "layer0") + layer

    @property
    def experts_per_stage(self) -> int:
        """The experts a stage binds where the MoE layers stream in parts (`expert_parts`); 0: whole layers."""
        return self.expert_parts[0][1] - self.expert_parts[0][0] if self.expert_parts else 0

    def layer_stages(self, layer: int) -> list[int]:
        """The stages of decoder layer `layer`, in run order: its one stage, or a MoE layer's attention stage and one
        stage a part of its experts where they stream in parts (`expert_parts`)."""
        name = f"layer{layer}"
        return [i for i, stage in enumerate(self.stages) if stage.name == name or stage.name.startswith(name + ".")]

    @property
    def adapter_params(self) -> int | None:
        """Parameters of the LoRA adapters (None without an adapter)."""
        if self.adapter is None:
            return None
        return sum(p.numel for g in self.adapter_groups for p in self.groups[g].params)

    @property
    def active_adapter_params(self) -> float | None:
        """The adapters' parameters a token computes with, what `flops_per_token` counts them by: a MoE's experts'
        adapters by the share of the experts a token chooses (top_k of n_experts), as its experts' parameters."""
        if self.adapter is None:
            return None
        share = self.config.n_experts_per_tok / self.config.n_experts if self.config.is_moe else 1.0
        params = [p for g in self.adapter_groups for p in self.groups[g].params]
        return sum(p.numel * (share if ".experts." in p.name else 1.0) for p in params)

    @property
    def packed_groups(self) -> frozenset[int]:
        """The frozen groups the store holds packed (`adapter.base_format`, QLoRA): the decoder layers' base, not the
        embedding's nor the head's (kept in the compute dtype, as QLoRA keeps them)."""
        if self.adapter is None or self.adapter.base_format is None:
            return frozenset()
        ends = set(self.stages[0].groups) | set(self.stages[-1].groups)
        return frozenset(range(len(self.groups))) - self.adapter_groups - ends

    def packed_layouts(self, dtype) -> dict[int, PackedLayout]:
        """Each packed group's layout as the store packs it, unpacking into `dtype` (the compute dtype)."""
        return {
            g: PackedLayout.of(self.groups[g].layout(), self.adapter.base_format, dtype) for g in self.packed_groups
        }

    def frozen_groups(self, frozen_parts: set[str]) -> frozenset[int]:
        """The groups of the parts `frozen_parts` names, and any unused (those keep no gradient and no optimizer
        state); with an adapter, every group but the adapters'."""
        if self.adapter is not None:
            return frozenset(range(len(self.groups))) - self.adapter_groups
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

    def param_shapes(self, adapters: bool = True) -> dict[str, tuple[int, ...]]:
        """Every stored tensor's shape by Hugging Face name (PEFT's for adapters; without `adapters`, the base
        model's alone: what its checkpoint holds)."""
        skip = () if adapters else self.adapter_groups
        return {p.name: p.shape for g, group in enumerate(self.groups) if g not in skip for p in group.params}
