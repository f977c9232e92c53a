"""LoRA adapters over a template's frozen matrices: each adapted weight W [out, in] gains A [r, in] and B [out, r]
in a group of their own beside the frozen base's, and its product x W^T becomes x W^T + (scale * x A^T) B^T: PEFT's
`LoraLayer` (which scales after B: equal up to rounding), computed by `ops.adapted_linear`. A fused matrix (q, k and
v as one GEMM) adapts each member it holds apart, with PEFT's names for each, so that an adapter trained here loads
into PEFT and back. LoRA dropout draws each targeted module's mask from a key (`DropoutKey`), so that a layer's
recompute draws its forward's masks."""

import hashlib
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from .layout import BoundWeight, ParamSpec, ProductKeeper, Span, param_offsets, span_of

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer of the decoder (the output head aside)


@dataclass(frozen=True)
class Lora:
    """A LoRA adapter's settings, with PEFT's meanings: rank `r`, `alpha` (the delta is scaled by alpha / r),
    `dropout` on the adapter's input, and `target_modules`, module names a weight's module path ends with
    (`q_proj` adapts every `...self_attn.q_proj`), or `("all-linear",)`. `base_format`: how the store holds the
    frozen base's decoder layers, "nf4" or "int8" (QLoRA: `megatrain_store.PackedLayout`), or None: in the compute
    dtype (the templates see the dequantized weights either way)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0
    base_format: str | None = None

    def __post_init__(self):
        if self.r <= 0:
            raise ValueError(f"LoRA rank r must be positive, got {self.r}")
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty: name the modules to adapt (q_proj, ...) or all-linear")

    @property
    def scale(self) -> float:
        """What the adapter's delta (B A x) is multiplied by: alpha / r."""
        return self.alpha / self.r

    def adapts(self, weight_name: str) -> bool:
        """Whether the matrix `weight_name` (`self_attn.q_proj.weight`, any prefix) is one this adapter targets."""
        if not weight_name.endswith(".weight"):
            return False
        module = weight_name.removesuffix(".weight")
        if ALL_LINEAR in self.target_modules:
            return True
        return any(module == target or module.endswith("." + target) for target in self.target_modules)


@dataclass(frozen=True)
class DropoutKey:
    """What names one training pass's LoRA dropout masks: the run's seed, the step, the micro-batch (its first row in
    the step, unique over the ranks) and the layer (its stage's name, `at`). A targeted module's mask is a pure
    function of the key and the module's name (`generator_seed`), so that the recompute of a layer in its backward
    draws the forward's masks, and masks differ between modules, layers, micro-batches and steps."""

    seed: int
    step: int
    micro_batch: int
    layer: str = ""

    def at(self, layer: str) -> "DropoutKey":
        """The key of layer `layer` (a stage's name: `layer3`)."""
        return replace(self, layer=layer)

    def generator_seed(self, module: str) -> int:
        """The seed of module `module`'s mask (`self_attn.q_proj`): a hash of the key and the name, < 2**63."""
        key = repr((self.seed, self.step, self.micro_batch, self.layer, module)).encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def dropout_noise(x: Tensor, p: float, seed: int) -> Tensor:
    """nn.Dropout's noise for x [..., in]: a keep-mask drawn with probability 1 - p by a generator on x's device
    seeded `seed`, scaled by 1 / (1 - p); x * noise is the dropped input. Drawn in x's shape (contiguous), so that
    a recompute of the same x draws the same mask."""
    generator = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1 - p, generator=generator)
    return keep.div_(1 - p)


def lora_names(weight_name: str) -> tuple[str, str]:
    """PEFT's names of the A and B matrices adapting `weight_name` (`X.weight` -> `X.lora_A.weight`, `X.lora_B...`)."""
    module = weight_name.removesuffix(".weight")
    return f"{module}.lora_A.weight", f"{module}.lora_B.weight"


@dataclass(frozen=True)
class _AdaptedSpan:
    """Where one fused base matrix's adapters lie in the adapter group: the A matrices of its adapted members back
    to back (one GEMM makes all their low-rank products), and each member's B with the rows of the base matrix its
    output adds to."""

    down: Span  # [members * r, in]
    ups: tuple[tuple[Span, int, int], ...]  # (B [rows, r], first row, row past the last) per adapted member
    rows: int  # the base matrix's output rows
    modules: tuple[str, ...]  # each adapted member's module name (`self_attn.q_proj`): its dropout mask's


@dataclass(frozen=True)
class Adapted:
    """A base weight (a view, a `BoundWeight` or a `ProductKeeper`) with its adapters, bound for one call, which
    `ops.linear` computes with (`ops.adapted_linear`). `down` (the A matrices) and each up (a B, with its rows of
    the base's output) are views or `BoundWeight`s (their gradients then go straight into the adapter group's fp32
    gradient buffer)."""

    base: "Tensor | BoundWeight | ProductKeeper | None"  # None: the delta alone
    down: "Tensor | BoundWeight"
    ups: tuple[tuple["Tensor | BoundWeight", int, int], ...]
    rows: int
    rank: int
    scale: float
    low: Tensor | None = None  # the forward's kept scale * x A^T (beside the base's kept product), for a backward
    dropout: float = 0.0  # LoRA dropout's p on each member's input (0: none)
    seeds: tuple[int, ...] = ()  # with dropout, each member's mask seed (`dropout_noise`), in the order of `ups`


LOW_RANK = ".low_rank"  # a kept product's name + this: its adapters' low-rank product, kept beside it


class AdapterLayout:
    """The adapter group of a template whose matrices lie at `spans` in its base group `params`: which spans are
    adapted, the group's `params` (PEFT's names, of the module `renames` maps a base matrix's name to where PEFT's
    differs; the A matrices of one fused span adjacent, then their Bs) and the binding of both groups for a call.
    Adapters of another kind (a MoE's experts', `expert_adapters.ExpertAdapters`) join the group by `attach`."""

    def __init__(
        self,
        lora: Lora,
        params: tuple[ParamSpec, ...],
        spans: dict[str, Span],
        matrices: tuple[str, ...],
        renames: dict[str, str] | None = None,
    ):
        self.lora = lora
        offsets, renames = param_offsets(params), renames or {}
        adapted: dict[str, list[ParamSpec]] = {}
        for name in matrices:
            span = spans[name]
            if len(span.shape) != 2:  # (experts' [n_experts, ...] tensors: `expert_adapters`')
                continue
            members = [p for p in params if span.offset <= offsets[p.name] < span.offset + span.numel]
            chosen = [p for p in members if len(p.shape) == 2 and lora.adapts(p.name)]
            if chosen:
                adapted[name] = [replace(p, name=renames.get(p.name, p.name)) for p in chosen]
        self.params: tuple[ParamSpec, ...] = tuple(
            spec
            for members in adapted.values()
            for spec in [ParamSpec(lora_names(p.name)[0], (lora.r, p.shape[1])) for p in members]
            + [ParamSpec(lora_names(p.name)[1], (p.shape[0], lora.r)) for p in members]
        )
        base_offsets = {renames.get(name, name): offset for name, offset in offsets.items()}
        self._spans = {name: self._span(spans[name], members, base_offsets) for name, members in adapted.items()}
        self._attached: list = []

    def attach(self, adapters) -> None:
        """Adapters of another kind after this group's (`params` and `bind(views, buffer, grad, first_expert)`, their
        spans counted from the group's start: `expert_adapters.ExpertAdapters`), bound with these."""
        self.params += adapters.params
        self._attached.append(adapters)

    def _span(self, base: Span, members: list[ParamSpec], offsets: dict[str, int]) -> _AdaptedSpan:
        first_a = span_of(self.params, lora_names(members[0].name)[0])
        down = Span(first_a.offset, (len(members) * self.lora.r, base.shape[1]))
        ups = []
        for member in members:
            first_row = (offsets[member.name] - base.offset) // base.shape[1]
            ups.append((span_of(self.params, lora_names(member.name)[1]), first_row, first_row + member.shape[0]))
        modules = tuple(member.name.removesuffix(".weight") for member in members)
        return _AdaptedSpan(down, tuple(ups), base.shape[0], modules)

    @property
    def adapted(self) -> tuple[str, ...]:
        """The template's span names whose matrices carry adapters."""
        return tuple(self._spans) + tuple(name for adapters in self._attached for name in adapters.adapted)

    def bind(
        self,
        views: dict,
        buffer: Tensor,
        grad: Tensor | None = None,
        products: dict | None = None,
        dropout: DropoutKey | None = None,
        first_expert: int = 0,
    ) -> dict:
        """`views` (the base's, by span name) with each adapted one wrapped in an `Adapted` over the adapter group
        `buffer`; given `grad` (that group's flat fp32 gradient buffer), its matrices are `BoundWeight`s into it, and
        the low-rank products a forward kept (`products`) stand for theirs. `dropout`: the training pass's key of
        the masks of LoRA dropout (None: no dropout); `first_expert`: the first of the experts a MoE layer's part
        binds (`expert_adapters.ExpertAdapters.bind`)."""
        out = dict(views)
        for name in self._spans:
            if name in views:
                low = None if products is None else products.get(name + LOW_RANK)
                out[name] = self.adapters(name, buffer, grad, base=views[name], low=low, dropout=dropout)
        for adapters in self._attached:
            out = adapters.bind(out, buffer, grad, first_expert)
        return out

    def adapters(
        self, name: str, buffer: Tensor, grad: Tensor | None = None, base=None, low=None, dropout=None
    ) -> Adapted:
        """Span `name`'s adapters bound to `buffer` (and `grad`) over `base`; with no base, `ops.linear` of it is the
        adapters' delta alone (for a backward that does the base GEMM by hand); `dropout` as `bind`'s."""
        where = self._spans[name]

        def matrix(span: Span):
            return span.view(buffer) if grad is None else BoundWeight(span.view(buffer), span.view(grad))

        ups = tuple((matrix(up), first, stop) for up, first, stop in where.ups)
        keyed = dropout is not None and self.lora.dropout > 0
        seeds = tuple(dropout.generator_seed(module) for module in where.modules) if keyed else ()
        p = self.lora.dropout if keyed else 0.0
        return Adapted(base, matrix(where.down), ups, where.rows, self.lora.r, self.lora.scale, low, p, seeds)

    def low_rank_width(self, name: str) -> int:
        """Elements a token's kept low-rank product of span `name` takes (0: not adapted)."""
        return len(self._spans[name].ups) * self.lora.r if name in self._spans else 0
