"""LoRA on a mixture of experts' fused expert matrices, as PEFT 0.22 adapts them (its `ParamWrapper` over
transformers' [n_experts, out, in] `gate_up_proj` and `down_proj`): each expert e's matrix W_e gains its own A_e
[R, in] and B_e [out, R], and its product x W_e^T becomes x W_e^T + (scale * x A_e^T) B_e^T, computed as two more
grouped GEMMs over the tokens' choices (never a delta the size of the experts).

The adapter group holds them as PEFT's files do, so that checkpoints and exports need no conversion: A as one
[n_experts * R, in] matrix (expert e's rows e*R..e*R+R-1) and B as one [out, R * n_experts] matrix (expert e's
columns e, e + n_experts, ...). A is viewed as [n_experts, R, in] in place; B, small, is copied to [n_experts, out,
R] for the GEMMs and its gradient added back through the same strided view. The gate and up projections are one
fused matrix, adapted at rank R = 2r with alpha 2 alpha (PEFT's rank_pattern and alpha_pattern: the scale stays
alpha / r), the down projection at rank r."""

from dataclasses import dataclass

from torch import Tensor

from .layout import BoundWeight, ParamSpec, ProductKeeper, Span, param_offsets
from .lora import ALL_LINEAR, Lora

# transformers' names of the fused expert matrices (the files' and PEFT 0.22's `target_parameters`), by the span
# names of the MoE template that holds them
FUSED_MATRICES = {"experts_gate_up": "gate_up_proj", "experts_down": "down_proj"}


@dataclass(frozen=True)
class AdaptedExperts:
    """Experts' matrices `base` ([n_experts, out, in] as stored; a view, `BoundWeight` or `ProductKeeper`) with
    their adapters for one call: `down` (each expert's A, [n_experts, R, in]) and `up` (each expert's B, [n_experts,
    out, R], contiguous), views or `BoundWeight`s whose gradients go into the adapter group's buffer;
    `grouped_experts._grouped_linear` computes with them."""

    base: "Tensor | BoundWeight | ProductKeeper"
    down: "Tensor | BoundWeight"
    up: "Tensor | BoundWeight"
    scale: float


def adapted_expert_matrices(lora: Lora, projections: tuple[str, str, str]) -> tuple[str, ...]:
    """The span names of the expert matrices `lora` adapts, for experts whose (gate, up, down) projections have
    the names `projections` (Mixtral's w1, w3, w2): all-linear adapts both; the gate-up matrix is adapted where
    target_modules name both its members (or gate_up_proj), refused where they name one (PEFT 0.22 refuses it too:
    the two are one matrix); the down matrix where they name it (or down_proj)."""
    gate, up, down = projections
    names = {target.rsplit(".", 1)[-1] for target in lora.target_modules}
    if ALL_LINEAR in names:
        return tuple(FUSED_MATRICES)
    adapted = []
    halves = [name for name in (gate, up) if name in names]
    if len(halves) == 2 or "gate_up_proj" in names:
        adapted.append("experts_gate_up")
    elif halves:
        other = up if halves[0] == gate else gate
        raise ValueError(
            f"model.adapter.target_modules names {halves[0]} but not {other}: each expert's {gate} and {up} are one "
            f"fused matrix (gate_up_proj), adapted whole, as PEFT 0.22 adapts it; name both, or neither"
        )
    if down in names or "down_proj" in names:
        adapted.append("experts_down")
    return tuple(adapted)


class ExpertAdapters:
    """The adapters of a MoE layer's fused expert matrices: their `params` (after `offset` elements of the adapter
    group: its 2-D adapters'), PEFT's names under `module` (transformers' MoE module, `mlp`), and the binding of
    each adapted span for a call."""

    def __init__(self, lora: Lora, spans: dict[str, Span], adapted: tuple[str, ...], module: str, offset: int):
        self.lora = lora
        nested = len(adapted) == 2  # (PEFT wraps the down projection's wrapper around the gate-up one's)
        self.params: tuple[ParamSpec, ...] = ()
        self._ranks: dict[str, int] = {}
        for name in adapted:
            n_experts, out, inner = spans[name].shape
            rank = lora.r * (2 if name == "experts_gate_up" else 1)
            prefix = f"{module}.experts." + ("base_layer." if nested and name == "experts_gate_up" else "")
            self.params += (
                ParamSpec(prefix + "lora_A.weight", (n_experts * rank, inner)),
                ParamSpec(prefix + "lora_B.weight", (out, rank * n_experts)),
            )
            self._ranks[name] = rank
        offsets = param_offsets(self.params)
        self._spans = {
            name: tuple(Span(offset + offsets[p.name], p.shape) for p in self.params[2 * i : 2 * i + 2])
            for i, name in enumerate(adapted)
        }
        self._experts = {name: spans[name].shape[0] for name in adapted}

    @property
    def adapted(self) -> tuple[str, ...]:
        return tuple(self._spans)

    def bind(self, views: dict, buffer: Tensor, grad: Tensor | None = None, first_expert: int = 0) -> dict:
        """`views` with each adapted expert matrix wrapped in an `AdaptedExperts` over the adapter group `buffer`
        (and its gradient buffer `grad`, where given). `first_expert`: the first expert the views hold (a MoE layer
        streamed in parts binds its experts' slice of the whole layer's adapters, as many as its views have)."""
        out = dict(views)
        for name, (down, up) in self._spans.items():
            if name not in views:
                continue
            n_experts, rank = self._experts[name], self._ranks[name]
            held = slice(first_expert, first_expert + _held_experts(views[name]))
            a = down.view(buffer).view(n_experts, rank, -1)[held]
            b = _per_expert(up.view(buffer), n_experts, rank)[held]
            if grad is not None:
                a = BoundWeight(a, down.view(grad).view(n_experts, rank, -1)[held])
                b = BoundWeight(b.contiguous(), _per_expert(up.view(grad), n_experts, rank)[held])
            else:
                b = b.contiguous()
            out[name] = AdaptedExperts(views[name], a, b, self.lora.scale)
        return out


def _held_experts(view: "Tensor | BoundWeight | ProductKeeper") -> int:
    """How many experts a bound expert matrix holds ([n_experts, out, in] as stored)."""
    return (view.value if isinstance(view, (BoundWeight, ProductKeeper)) else view).shape[0]


def _per_expert(b: Tensor, n_experts: int, rank: int) -> Tensor:
    """PEFT's [out, rank * n_experts] B (column i * n_experts + e: expert e's i-th) as [n_experts, out, rank]: a
    strided view of the same memory."""
    return b.view(b.shape[0], rank, n_experts).permute(2, 0, 1)
