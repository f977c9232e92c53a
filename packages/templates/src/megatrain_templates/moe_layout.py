"""The layout of a mixture-of-experts layer: its `MoeShape`, the families' parameter names, and the
parameters and spans of the whole layer or of its parts (a layer whose experts stream in parts).

Expert e's gate and up projections sit next to each other in the flat buffer and the experts one after
another, so one view of the slot is the [n_experts, 2 * d_ff, d_model] gate-up tensor and another the
[n_experts, d_model, d_ff] down tensor, with the per-expert Hugging Face names of published checkpoints.
"""

from dataclasses import dataclass

from .decoder import BlockShape, attention_params
from .layout import LOAD_BIAS, ParamSpec, Span, fused_span, row_slice_name, span_of, split_precision_names

# Parameter names of one expert's (gate, up, down) projections and of the MLP module, per family.
EXPERT_NAMING = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "ernie": ("mlp", ("gate_proj", "up_proj", "down_proj")),  # its correction bias in mlp.moe_statics
}
# Families whose experts are stored fused as [n_experts, d_model, 2 * d_ff] and [n_experts, d_ff, d_model] (x @
# gate_up_proj[e]), with the module holding them: gpt-oss (gate and up interleaved, biases) and Llama 4 (halves)
FUSED_EXPERTS = {"gpt_oss": "mlp", "llama4": "feed_forward"}
# The shared expert's module and whether a sigmoid gate scales it, per family
SHARED_EXPERT = {
    "qwen": ("shared_expert", True),
    "deepseek": ("shared_experts", False),
    "ernie": ("shared_experts", False),
    "llama4": ("shared_expert", False),
}
# How routers score: "softmax" over the logits; "sigmoid" of each logit, chosen with a correction bias (DeepSeek-V3,
# MiniMax-M2); "sigmoid_of_top_k", the top-k logits chosen and each one's sigmoid the weight (Llama 4)
SCORINGS = ("softmax", "sigmoid", "sigmoid_of_top_k")


@dataclass(frozen=True)
class MoeShape:
    """The routed half of a MoE block."""

    n_experts: int
    top_k: int
    d_ff: int  # each expert's intermediate size
    shared_d_ff: int = 0  # shared expert's intermediate size; 0: none
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    # a key of EXPERT_NAMING, or of FUSED_EXPERTS: "gpt_oss" (gate and up interleaved, biases on the router and
    # the experts, the clamped SwiGLU of `grouped_experts`) or "llama4" (the routing weight scales each expert's
    # input)
    naming: str = "qwen"
    swiglu_limit: float = 7.0  # gpt_oss: gate clamped to <= limit, up to [-limit, limit]
    swiglu_alpha: float = 1.702  # gpt_oss: gate * sigmoid(alpha * gate) * (up + 1)
    routed_scaling: float = 1.0  # the routing weights' factor (DeepSeek's routed_scaling_factor)
    # group-limited routing (DeepSeek-V2/V3): experts in n_groups groups, a token's top-k only from the
    # topk_groups groups holding its highest expert probabilities (V3: the highest sums of two scores)
    n_groups: int = 1
    topk_groups: int = 1
    # one of SCORINGS: "softmax" over the router logits, or "sigmoid" (DeepSeek-V3, MiniMax-M2): each expert
    # scored on its own, in fp32 as transformers does, the top-k chosen by score + a correction bias that gets no
    # gradient (it moves only by load, `LOAD_BIAS`: DeepSeek's `e_score_correction_bias`), weighted by their
    # scores alone; or "sigmoid_of_top_k" (Llama 4's, with its naming)
    scoring: str = "softmax"
    # softmax scoring with a correction bias (ERNIE 4.5): the top-k chosen by probability + bias, weighted by
    # their probabilities renormalised (sigmoid scoring always has the bias)
    correction_bias: bool = False
    # whether LoRA's target names reach the experts' fused matrices and the router (gate_proj, up_proj, down_proj,
    # gate, all-linear), as PEFT 0.22 adapts them in the families whose experts transformers fuses on loading
    lora_reaches_experts: bool = False

    def __post_init__(self):
        if not 0 < self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in 1..n_experts ({self.n_experts}), got {self.top_k}")
        if self.n_experts % self.n_groups or not 0 < self.topk_groups <= self.n_groups:
            raise ValueError(
                f"group-limited routing needs n_experts ({self.n_experts}) divisible by n_groups ({self.n_groups}) "
                f"and 1 <= topk_groups ({self.topk_groups}) <= n_groups"
            )
        if self.naming not in (*EXPERT_NAMING, *FUSED_EXPERTS):
            raise ValueError(
                f"naming must be one of {sorted(EXPERT_NAMING)} or {sorted(FUSED_EXPERTS)}, got {self.naming!r}"
            )
        if (
            self.scoring not in SCORINGS
            or (self.scoring == "sigmoid" and self.naming not in EXPERT_NAMING)
            or ((self.scoring == "sigmoid_of_top_k") != (self.naming == "llama4"))
        ):
            raise ValueError(
                f"scoring must be one of {SCORINGS}: sigmoid with an EXPERT_NAMING naming, sigmoid_of_top_k with "
                f"llama4's and only there; got {self.scoring!r} with {self.naming!r}"
            )
        if self.scoring == "sigmoid" and self.n_groups > 1 and self.n_experts // self.n_groups < 2:
            raise ValueError("sigmoid scoring ranks groups by their two best experts: each group needs two or more")
        if self.correction_bias and (self.scoring != "softmax" or self.n_groups > 1 or self.fused):
            raise ValueError("correction_bias is softmax scoring's, without groups, in an EXPERT_NAMING naming")
        if self.lora_reaches_experts and self.fused:
            raise ValueError("lora_reaches_experts is for experts stored expert by expert (an EXPERT_NAMING naming)")

    @property
    def biased_choice(self) -> bool:
        """Whether a correction bias (a split-precision pair, moved by load only) takes part in choosing."""
        return self.scoring == "sigmoid" or self.correction_bias

    @property
    def gpt_oss(self) -> bool:
        return self.naming == "gpt_oss"

    @property
    def fused(self) -> bool:
        """Whether the experts are stored fused, [n_experts, in, out] (FUSED_EXPERTS)."""
        return self.naming in FUSED_EXPERTS

    @property
    def module(self) -> str:
        """The MoE module's name in a layer: `mlp`, Mixtral's `block_sparse_moe`, Llama 4's `feed_forward`."""
        return FUSED_EXPERTS[self.naming] if self.fused else EXPERT_NAMING[self.naming][0]

    @property
    def weights_inputs(self) -> bool:
        """Whether the routing weight scales each expert's input (Llama 4) rather than its output."""
        return self.naming == "llama4"


def transformers_module(moe: MoeShape) -> str:
    """The MoE module's name in transformers (>= 5), which PEFT's adapter names use: Mixtral's `block_sparse_moe` is
    `mlp` there."""
    return "mlp" if moe.naming == "mixtral" else moe.module


def router_name(moe: MoeShape) -> str:
    return f"{moe.module}.router.weight" if moe.fused else f"{moe.module}.gate.weight"


def expert_params(moe: MoeShape, d_model: int, first: int = 0, stop: int | None = None) -> tuple[ParamSpec, ...]:
    """Experts first..stop-1 in buffer order: each expert's (gate, up) pair, then the downs; the fused
    tensors (and gpt-oss' biases) instead, row slices of them when not every expert."""
    stop = moe.n_experts if stop is None else stop
    d, f = d_model, moe.d_ff
    if moe.fused:  # the published fused layout: x @ gate_up_proj[e]
        n, whole = stop - first, (first, stop) == (0, moe.n_experts)

        def name(base: str) -> str:
            full = f"{moe.module}.experts.{base}"
            return full if whole else row_slice_name(full, first, stop)

        matrices = (ParamSpec(name("gate_up_proj"), (n, d, 2 * f)), ParamSpec(name("down_proj"), (n, f, d)))
        if not moe.gpt_oss:
            return matrices
        return matrices + (
            ParamSpec(name("gate_up_proj_bias"), (n, 2 * f), weight_decay=False),
            ParamSpec(name("down_proj_bias"), (n, d), weight_decay=False),
        )
    module, (gate, up, down) = EXPERT_NAMING[moe.naming]
    experts = []
    for e in range(first, stop):
        experts += [
            ParamSpec(f"{module}.experts.{e}.{gate}.weight", (f, d)),
            ParamSpec(f"{module}.experts.{e}.{up}.weight", (f, d)),
        ]
    experts += [ParamSpec(f"{module}.experts.{e}.{down}.weight", (d, f)) for e in range(first, stop)]
    return tuple(experts)


def _shared_expert_params(moe: MoeShape, d: int) -> tuple[ParamSpec, ...]:
    if not moe.shared_d_ff:
        return ()
    module = moe.module
    shared, gated = SHARED_EXPERT[moe.naming]
    params = (
        ParamSpec(f"{module}.{shared}.gate_proj.weight", (moe.shared_d_ff, d)),
        ParamSpec(f"{module}.{shared}.up_proj.weight", (moe.shared_d_ff, d)),
        ParamSpec(f"{module}.{shared}.down_proj.weight", (d, moe.shared_d_ff)),
    )
    return params + ((ParamSpec(f"{module}.{shared}_gate.weight", (1, d)),) if gated else ())


def _score_bias_names(moe: MoeShape) -> tuple[str, str]:
    """DeepSeek keeps the correction bias in the router (`mlp.gate`), MiniMax-M2 in the MoE module, ERNIE
    4.5 in `mlp.moe_statics` (as published; transformers' module is the router's, its files not)."""
    module = EXPERT_NAMING[moe.naming][0]
    owner = {"deepseek": f"{module}.gate", "ernie": f"{module}.moe_statics"}.get(moe.naming, module)
    return split_precision_names(f"{owner}.e_score_correction_bias")


def _router_bias(moe: MoeShape) -> tuple[ParamSpec, ...]:
    """gpt-oss' router bias; or the correction bias of sigmoid scoring, kept to ~16 bits in a bf16 slot
    (as hi + lo: it decides the routing by differences far below bf16's step at its values). It has no
    gradient: its slots get the experts' excess load, by which the optimizer moves it (`LOAD_BIAS`;
    not at all at rate 0, transformers' way)."""
    if moe.gpt_oss:
        return (ParamSpec("mlp.router.bias", (moe.n_experts,), weight_decay=False),)
    if moe.biased_choice:
        shape = (1, moe.n_experts) if moe.naming == "ernie" else (moe.n_experts,)  # as the files hold it
        return tuple(ParamSpec(name, shape, weight_decay=False, update=LOAD_BIAS) for name in _score_bias_names(moe))
    return ()


def _check_unscaled_residuals(shape: BlockShape) -> None:
    if shape.residual_scale is not None:
        raise ValueError("residual_scale (Granite's) is the dense block's: a MoE block adds its halves unscaled")


def moe_params(shape: BlockShape, moe: MoeShape) -> tuple[ParamSpec, ...]:
    """Buffer order: attention matrices, router, experts, shared expert, then norms and biases (no decay)."""
    _check_unscaled_residuals(shape)
    d = shape.d_model
    matrices, small = attention_params(shape)
    router = ParamSpec(router_name(moe), (moe.n_experts, d))
    return matrices + (router,) + expert_params(moe, d) + _shared_expert_params(moe, d) + small + _router_bias(moe)


def split_moe_params(shape: BlockShape, moe: MoeShape) -> tuple[tuple[ParamSpec, ...], tuple[ParamSpec, ...]]:
    """A MoE layer whose experts stream in parts, less its experts: (the trunk: attention and shared
    expert; the router group: post-attention norm and router, which every part binds to route)."""
    _check_unscaled_residuals(shape)
    d = shape.d_model
    matrices, small = attention_params(shape)
    post_norm = next(p for p in small if p.name == "post_attention_layernorm.weight")
    trunk = matrices + _shared_expert_params(moe, d) + tuple(p for p in small if p is not post_norm)
    return trunk, (post_norm, ParamSpec(router_name(moe), (moe.n_experts, d))) + _router_bias(moe)


def _router_spans(moe: MoeShape, params: tuple[ParamSpec, ...]) -> dict[str, Span]:
    spans = {"router": span_of(params, router_name(moe))}
    if moe.gpt_oss:
        spans["router_bias"] = span_of(params, "mlp.router.bias")
    if moe.biased_choice:
        spans["score_bias_hi"], spans["score_bias_lo"] = (span_of(params, name) for name in _score_bias_names(moe))
    return spans


def _router_group_spans(moe: MoeShape, router: tuple[ParamSpec, ...]) -> dict[str, Span]:
    """The router group of a layer in parts (`split_moe_params`): post-attention norm and router."""
    return {"post_norm": span_of(router, "post_attention_layernorm.weight"), **_router_spans(moe, router)}


def _expert_spans(moe: MoeShape, d: int, params: tuple[ParamSpec, ...], first: int, stop: int) -> dict[str, Span]:
    """Experts first..stop-1 as [count, ...] tensors: (gate, up) pairs and downs, biases for gpt-oss."""
    names = [p.name for p in expert_params(moe, d, first, stop)]
    if moe.fused:  # (gpt-oss' biases after the matrices)
        keys = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")
        return {key: span_of(params, name) for key, name in zip(keys, names)}
    count = stop - first
    return {
        "experts_gate_up": Span(span_of(params, names[0]).offset, (count, 2 * moe.d_ff, d)),
        "experts_down": Span(span_of(params, names[2 * count]).offset, (count, d, moe.d_ff)),
    }


def _shared_spans(moe: MoeShape, params: tuple[ParamSpec, ...]) -> dict[str, Span]:
    if not moe.shared_d_ff:
        return {}
    module = moe.module
    shared, gated = SHARED_EXPERT[moe.naming]
    spans = {
        "shared_gate_up": fused_span(
            params, [f"{module}.{shared}.gate_proj.weight", f"{module}.{shared}.up_proj.weight"]
        ),
        "shared_down": span_of(params, f"{module}.{shared}.down_proj.weight"),
    }
    if gated:
        spans["shared_gate"] = span_of(params, f"{module}.{shared}_gate.weight")
    return spans


def fused_expert_names(moe: MoeShape, d_model: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """transformers' fused 3-D expert tensors of a layer (module-relative names) -> (shape, the
    per-expert tensors they are, back to back). gpt-oss and Llama 4 store them fused already."""
    if moe.fused:
        return {}
    n = moe.n_experts
    module, (gate, up, down) = EXPERT_NAMING[moe.naming]
    fused = transformers_module(moe)
    pairs = tuple(f"{module}.experts.{e}.{proj}.weight" for e in range(n) for proj in (gate, up))
    return {
        f"{fused}.experts.gate_up_proj": ((n, 2 * moe.d_ff, d_model), pairs),
        f"{fused}.experts.down_proj": (
            (n, d_model, moe.d_ff),
            tuple(f"{module}.experts.{e}.{down}.weight" for e in range(n)),
        ),
    }
