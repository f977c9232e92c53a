"""The mixture-of-experts decoder block: the dense block's attention, then a router that sends
each token to its top-k SwiGLU experts (dropless: every token reaches all k), plus an optional
shared expert behind a sigmoid gate (Qwen2-MoE).

Experts are grouped GEMMs over tokens sorted by expert. Expert e's gate and up projections
sit next to each other in the flat buffer and the experts one after another, so one view
of the slot is the [n_experts, 2 * d_ff, d_model] gate-up tensor and another the
[n_experts, d_model, d_ff] down tensor, with the per-expert Hugging Face names of published
checkpoints. The load-balancing loss is a property of the whole step (all MoE layers, all
micro-batches), so its statistics live in a `RouterLoad` shared by the model's MoE layers:
forward records, backward adds the loss's gradient w.r.t. the router probabilities.

A layer too large for a GPU slot streams its experts in parts: `MoeAttention` (attention, shared
expert, routing statistics) and one `MoeExperts` stage per range of experts, each its own group.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import expert_kernels
from .attention import Documents
from .decoder import BlockShape, DecoderBlock, attention_params, attention_spans
from .layout import (
    LOAD_BIAS,
    BoundWeight,
    ParamSpec,
    ProductKeeper,
    Span,
    accumulate,
    check_buffers,
    fused_span,
    leaf,
    row_slice_name,
    span_of,
    split_precision_names,
    total_numel,
)
from .linear_attention import LINEAR_ATTENTION_LEAVES
from .ops import compiled_on_cuda, linear, swiglu, upcast

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
    # a key of EXPERT_NAMING, or of FUSED_EXPERTS: "gpt_oss" (gate and up interleaved, biases on the router
    # and the experts, the clamped SwiGLU below) or "llama4" (the routing weight scales each expert's input)
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
    fused = "mlp" if moe.naming == "mixtral" else module  # transformers >= 5 calls Mixtral's module mlp too
    pairs = tuple(f"{module}.experts.{e}.{proj}.weight" for e in range(n) for proj in (gate, up))
    return {
        f"{fused}.experts.gate_up_proj": ((n, 2 * moe.d_ff, d_model), pairs),
        f"{fused}.experts.down_proj": (
            (n, d_model, moe.d_ff),
            tuple(f"{module}.experts.{e}.{down}.weight" for e in range(n)),
        ),
    }


@dataclass
class Routing:
    """A router's decision for [tokens] rows: probabilities in fp32 (fp64 when computing in fp64), as
    transformers' routers ([tokens, n_experts]; sigmoid scoring: the scores normalised per token, the
    affinities DeepSeek's balance losses use), the chosen experts and their weights ([tokens, k]), and
    the logits the probabilities came from (for the router z-loss)."""

    probs: Tensor
    top_index: Tensor
    top_weight: Tensor
    logits: Tensor


class RouterLoad:
    """Routing statistics of one optimizer step over every MoE layer and micro-batch: the
    Switch-Transformer load-balancing loss exactly as transformers' `load_balancing_loss_func`
    computes it over one forward of the whole batch:

        aux = n_experts * sum_e f_e * P_e,  f_e = top-k picks of e / rows,  P_e = sum of p_e / rows

    where rows = tokens x MoE layers. Its gradient w.r.t. a router probability p_e is
    n_experts * f_e / rows, the same for every token and layer, known once the forward is done.
    `coef` 0 records the statistics (the loss is still reported) but adds no gradient.

    Each layer's expert loads are kept too, for `max_violation`: the forwards of a step record layer
    by layer (the pipeline is layer-major), each of the `n_layers` MoE layers once per micro-batch, in each of
    the step's sweeps (`sweeps`: how many micro-batches each ran) in turn.

    `seq_coef` adds DeepSeek-V3's complementary sequence-wise balance loss, alpha times the sum over MoE
    layers of the mean over the step's `sequences` of

        sum_e f_e * P_e,  f_e = n_experts * picks of e / (top_k * tokens),  P_e = sum of p_e / tokens

    over each sequence's own tokens (DeepSeek's and Megatron's `seq_aux_loss`). It is local to a layer and
    a micro-batch: its gradient w.r.t. p_e is alpha * f_e / (tokens * sequences), from that sequence alone.

    `z_coef` adds ST-MoE's router z-loss, the sum over MoE layers of the mean over the step's tokens of
    logsumexp(router logits)^2, which keeps the logits small (OLMoE pre-trained with 0.001)."""

    def __init__(
        self,
        n_experts: int,
        top_k: int,
        coef: float = 0.0,
        n_layers: int = 1,
        seq_coef: float = 0.0,
        z_coef: float = 0.0,
    ):
        self.n_experts, self.top_k, self.coef, self.n_layers = n_experts, top_k, coef, n_layers
        self.seq_coef, self.z_coef = seq_coef, z_coef
        self.sequences = 1  # the step's sequences over all ranks: the sequence-wise loss is a mean over them
        # with data parallelism: sums a tensor over the ranks in place, so that the statistics
        # (and the loss's gradient) are those of the global batch
        self.reduce: Callable[[Tensor], Tensor] | None = None
        self.reset()

    @property
    def routes_in_backward(self) -> bool:
        """Whether a backward needs the routing again for a loss's gradient."""
        return bool(self.coef or self.seq_coef or self.z_coef)

    def reset(self, sweeps: list[int] | None = None) -> None:
        """Forget the records, for a pass whose `sweeps` ran so many micro-batches each (None: one sweep)."""
        self.sweeps = sweeps
        # [picks per expert, probability sums per expert, rows, sequence-wise loss summed over sequences,
        # squared logsumexp summed over tokens]
        self._stats: Tensor | None = None
        self._records: list[Tensor] = []  # picks per expert of each forward, in record order
        self._layer_loads: Tensor | None = None  # [n_layers, n_experts], once final
        self._final = False

    def record(self, routing: Routing, valid: Tensor | None = None, sequences: int = 1) -> None:
        """One layer's routing of a micro-batch; valid: [tokens] bool, False for padding, which is left out
        (as transformers' attention_mask does); the tokens are `sequences` sequences of equal length, one
        after another."""
        top_index, probs = routing.top_index, routing.probs.detach()
        stats = torch.zeros(2 * self.n_experts + 3, dtype=probs.dtype, device=probs.device)
        weight = _token_weights(valid, probs)
        stats[: self.n_experts] = _expert_picks(top_index, weight, self.n_experts)
        stats[self.n_experts : 2 * self.n_experts] = (probs * weight.unsqueeze(1)).sum(0)
        stats[-3] = weight.sum()
        if self.seq_coef:
            shares, tokens = self._sequence_shares(top_index, weight, sequences)
            per_token = probs.view(sequences, -1, self.n_experts) * weight.view(sequences, -1, 1)
            stats[-2] = (shares * per_token.sum(1) / tokens.unsqueeze(1)).sum()
        if self.z_coef:
            stats[-1] = (upcast(routing.logits.detach()).logsumexp(dim=-1).square() * weight).sum()
        self._stats = stats if self._stats is None else self._stats + stats
        self._records.append(stats[: self.n_experts])

    def _finished(self) -> Tensor | None:
        """The step's statistics, summed over the ranks the first time they are read after the forward."""
        if self._stats is not None and not self._final:
            if len(self._records) % self.n_layers:
                raise ValueError(f"{len(self._records)} routing records for {self.n_layers} MoE layers")
            sweeps = self.sweeps or [len(self._records) // self.n_layers]
            sweep_records = torch.stack(self._records).split([self.n_layers * n for n in sweeps])
            layers = sum(records.view(self.n_layers, -1, self.n_experts).sum(1) for records in sweep_records)
            both = torch.cat([self._stats, layers.view(-1)])  # one collective for both
            if self.reduce is not None:
                self.reduce(both)
            self._stats, self._layer_loads = both[: self._stats.numel()], both[self._stats.numel() :].view_as(layers)
            self._records = []
            self._final = True
        return self._stats

    def max_violation(self) -> Tensor | None:
        """The "MaxVio" (DeepSeek-V3) of the step's least balanced MoE layer: max over its experts of load /
        mean load - 1; 0 when every expert of every layer got as many tokens; None before any record."""
        if self._finished() is None:
            return None
        loads = self._layer_loads
        return (loads.amax(dim=1) / loads.mean(dim=1).clamp_min(1e-30) - 1).max()

    def loss(self) -> Tensor | None:
        """The (uncoefficiented) auxiliary loss of the step recorded so far; None before any record."""
        stats = self._finished()
        if stats is None:
            return None
        picks, prob_sums, rows = stats[: self.n_experts], stats[self.n_experts : 2 * self.n_experts], stats[-3]
        return self.n_experts * (picks / rows * prob_sums / rows).sum()

    def sequence_loss(self) -> Tensor | None:
        """The (uncoefficiented) sequence-wise balance loss of the step; None when it is off or before any record."""
        stats = self._finished()
        return None if stats is None or not self.seq_coef else stats[-2] / self.sequences

    def z_loss(self) -> Tensor | None:
        """The (uncoefficiented) router z-loss of the step; None when it is off or before any record."""
        stats = self._finished()
        return None if stats is None or not self.z_coef else stats[-1] / self._tokens(stats)

    def _tokens(self, stats: Tensor) -> Tensor:
        """The step's tokens (not padding) over all ranks: rows counts each once per MoE layer."""
        return stats[-3] / self.n_layers

    def z_lse_grad(self, lse: Tensor, valid: Tensor | None) -> Tensor:
        """d(z_coef * z-loss) / d(logsumexp of a token's logits), [tokens]."""
        stats = self._finished()
        return self.z_coef * 2 * lse.detach() * _token_weights(valid, lse) / self._tokens(stats)

    def probs_grad(self) -> Tensor | None:
        """d(coef * aux) / d(router probability), [n_experts]; None when the loss is off."""
        if not self.coef:
            return None
        stats = self._finished()
        if stats is None:
            return None
        return self.coef * self.n_experts * stats[: self.n_experts] / stats[-3] / stats[-3]

    def _sequence_shares(self, top_index: Tensor, weight: Tensor, sequences: int) -> tuple[Tensor, Tensor]:
        """(f [sequences, n_experts]: each sequence's picks of each expert over an even share of them,
        its tokens [sequences])."""
        picks = torch.zeros(sequences, self.n_experts, dtype=weight.dtype, device=weight.device)
        slots = weight.repeat_interleave(self.top_k).view(sequences, -1)
        picks.scatter_add_(1, top_index.reshape(sequences, -1), slots)
        tokens = weight.view(sequences, -1).sum(1).clamp_min(1)
        return picks * self.n_experts / (self.top_k * tokens.unsqueeze(1)), tokens

    def sequence_probs_grad(self, top_index: Tensor, probs: Tensor, valid: Tensor | None, sequences: int) -> Tensor:
        """d(seq_coef * sequence-wise loss) / d(router probability) of one layer's micro-batch, [tokens, n_experts]."""
        weight = _token_weights(valid, probs)
        shares, tokens = self._sequence_shares(top_index, weight, sequences)
        per_sequence = shares * (self.seq_coef / self.sequences) / tokens.unsqueeze(1)
        return (per_sequence.unsqueeze(1) * weight.view(sequences, -1, 1)).view_as(probs)


def _token_weights(valid: Tensor | None, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """[tokens]: 1 for a real token, 0 for padding, for `like`'s rows ([tokens, ...]), in `dtype` (default
    `like`'s) on its device."""
    dtype = dtype or like.dtype
    if valid is None:
        return torch.ones(like.shape[0], dtype=dtype, device=like.device)
    return valid.to(dtype)


def _expert_picks(top_index: Tensor, weight: Tensor, n_experts: int) -> Tensor:
    """[n_experts]: how many (real) tokens chose each expert, in `weight`'s dtype."""
    picks = torch.zeros(n_experts, dtype=weight.dtype, device=weight.device)
    return picks.scatter_add_(0, top_index.reshape(-1), weight.repeat_interleave(top_index.shape[1]))


def _grouped_mm_works(device: torch.device, dtype: torch.dtype, row_major: bool = False) -> bool:
    """torch._grouped_mm runs the experts as one kernel per projection with no host sync; it
    exists for bf16 on recent GPUs. Probed once per (device, dtype, layout of the expert matrices:
    [E, out, in] transposed, or [E, in, out] as gpt-oss stores them); the loop is the fallback."""
    key = (str(device), dtype) if not row_major else (str(device), dtype, "row_major")
    if key not in _GROUPED_MM:
        ok = device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.randn(24, 32, device=device, dtype=dtype)
                b = torch.randn(2, 16, 32, device=device, dtype=dtype)
                offs = torch.tensor([8, 24], device=device, dtype=torch.int32)
                mat2 = b.transpose(1, 2).contiguous() if row_major else b.transpose(1, 2)
                got = torch._grouped_mm(a, mat2, offs=offs)
                want = torch.cat([a[:8] @ b[0].T, a[8:] @ b[1].T])
                ok = bool(torch.allclose(got.float(), want.float(), atol=1e-1, rtol=2e-2))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _GROUPED_MM[key] = ok
    return _GROUPED_MM[key]


_GROUPED_MM: dict[tuple, bool] = {}


def _swiglu_weighted(gate_up: Tensor, weight: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up * weight


def _gpt_oss_glu_weighted(gate_up: Tensor, weight: Tensor, limit: float, alpha: float) -> Tensor:
    gate = gate_up[:, ::2].clamp(max=limit)
    up = gate_up[:, 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha)) * weight


gpt_oss_glu_weighted = compiled_on_cuda(_gpt_oss_glu_weighted)
gpt_oss_glu_weighted.__doc__ = (
    """gpt-oss' clamped SwiGLU of interleaved (gate, up) columns, times the routing weight."""
)


# on [tokens * k, 2 * d_ff] the activation's elementwise kernels cost more than the expert GEMMs
swiglu_weighted = compiled_on_cuda(_swiglu_weighted)
swiglu_weighted.__doc__ = """silu(gate) * up * weight for gate_up [rows, 2 * d_ff] (gate first), weight [rows, 1]."""


@dataclass
class _Slots:
    """A micro-batch's expert choices (tokens * k) that fall in the experts a stage holds, sorted by expert:
    row i of the grouped GEMMs is choice `order[i]`, of token `token[i]`, for expert `expert[i]` (counted from
    the stage's first); `inverse` maps each choice to its row (`rows` for a choice of another expert). The
    grouped kernel reads each expert's end row on the device (`offsets`), the loop its row count on the host."""

    order: Tensor  # [rows]
    token: Tensor  # [rows]
    expert: Tensor  # [rows]
    inverse: Tensor  # [tokens * k]
    k: int
    n_experts: int
    grouped: bool  # torch._grouped_mm, else a loop over the experts

    @property
    def rows(self) -> int:
        return self.order.numel()

    @functools.cached_property
    def offsets(self) -> Tensor:
        counts = torch.zeros(self.n_experts, dtype=torch.int32, device=self.expert.device)
        counts.scatter_add_(0, self.expert, torch.ones_like(self.expert, dtype=torch.int32))
        return counts.cumsum(0, dtype=torch.int32)

    @functools.cached_property
    def counts(self) -> list[int]:
        return torch.bincount(self.expert, minlength=self.n_experts).tolist()  # (the host waits for the device)

    def runs(self):
        """(expert, its rows as a slice) for each expert with rows, in row order (the loop's)."""
        start = 0
        for expert, count in enumerate(self.counts):
            if count:
                yield expert, slice(start, start + count)
                start += count


def _grouped_matmul(a: Tensor, b: Tensor, slots: _Slots) -> Tensor:
    """a [rows, in] grouped by expert, each group times its expert's b [n_experts, in, out] -> [rows, out]."""
    if slots.grouped:
        return torch._grouped_mm(a, b, offs=slots.offsets)
    return torch.cat([a[rows] @ b[expert] for expert, rows in slots.runs()])


def _grouped_weight_grad(a: Tensor, b: Tensor, slots: _Slots) -> Tensor:
    """Each expert's sum over its rows of a^T b: a [rows, m], b [rows, n] -> [n_experts, m, n] (zeros for an
    expert with no rows)."""
    if slots.grouped:
        return torch._grouped_mm(a.T, b, offs=slots.offsets)
    grad = a.new_zeros(slots.n_experts, a.shape[1], b.shape[1])
    for expert, rows in slots.runs():
        grad[expert] = a[rows].T @ b[rows]
    return grad


def _grouped_linear_backward(x: Tensor, weight: Tensor, grad: Tensor, slots: _Slots, into: Tensor | None):
    """The backward of `_grouped_matmul(x, weight)` for `grad` [rows, out]: (x's gradient, the weight's, or None
    where it was added into `into`: by the grouped kernel that accumulates in fp32, `expert_kernels`, where the
    experts run grouped in bf16). The weight's is computed in the orientation its storage has, so that adding
    it reads and writes memory in order."""
    grad = grad.contiguous()
    grad_x = _grouped_matmul(grad, weight.transpose(1, 2), slots)
    target = weight if into is None else into
    out_in = target.transpose(1, 2).is_contiguous()  # stored [n_experts, out, in]: transformers' per-expert layout
    a, b = (grad, x) if out_in else (x, grad)  # the gradient in its storage's orientation: a^T b per expert
    if into is not None and slots.grouped and expert_kernels.runs_on(grad, into):
        expert_kernels.add_grouped_weight_grad_(into.transpose(1, 2) if out_in else into, a, b, slots.offsets)
        return grad_x, None
    grad_weight = _grouped_weight_grad(a, b, slots)
    grad_weight = grad_weight.transpose(1, 2) if out_in else grad_weight
    if into is None:
        return grad_x, grad_weight
    into.add_(grad_weight)
    return grad_x, None


class _GroupedLinear(torch.autograd.Function):
    """`_grouped_matmul` whose backward adds the weight's gradient into `into` (the weight's view of the flat
    fp32 gradient buffer) where given, else returns it; a kept `product` stands for the forward's GEMMs."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, slots: _Slots, into: Tensor | None, product: Tensor | None):
        ctx.save_for_backward(x, weight)
        ctx.slots, ctx.into = slots, into
        if product is not None:
            return product.view_as(product)  # a new tensor for autograd to own, not a copy
        return _grouped_matmul(x, weight, slots)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x, grad_weight = _grouped_linear_backward(x, weight, grad, ctx.slots, ctx.into)
        return grad_x, grad_weight, None, None, None


def _grouped_linear(x: Tensor, weight: "Tensor | BoundWeight | ProductKeeper", slots: _Slots, out_in: bool) -> Tensor:
    """x [rows, in] grouped by expert times each expert's matrix, stored [n_experts, out, in] (`out_in`:
    transformers' per-expert layout) or [n_experts, in, out] (the fused one), as `ops.linear` treats a
    `BoundWeight` (gradient into its buffer, its product standing for the GEMMs) and a `ProductKeeper`."""

    if isinstance(weight, BoundWeight):
        into = _in_out(weight.grad, out_in)
        return _GroupedLinear.apply(x, _in_out(weight.value, out_in), slots, into, weight.product)
    if isinstance(weight, ProductKeeper):
        weight.products[weight.name] = out = _grouped_matmul(x, _in_out(weight.value, out_in), slots)
        return out
    return _GroupedLinear.apply(x, _in_out(weight, out_in), slots, None, None)


def _in_out(matrices: Tensor, out_in: bool) -> Tensor:
    """[n_experts, in, out] view of experts' matrices stored [n_experts, out, in] (`out_in`) or already so."""
    return matrices.transpose(1, 2) if out_in else matrices


def _with_zero_row(rows: Tensor, slots: _Slots) -> Tensor:
    """`rows` with a zero row appended where some choices fall in other experts (inverse points there)."""
    return rows if slots.rows == slots.inverse.numel() else torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])


def _sum_of_rows(rows: Tensor, inverse: Tensor, k: int) -> Tensor:
    index = inverse.view(-1, k)
    total = upcast(rows[index[:, 0]])
    for choice in range(1, k):
        total = total + rows[index[:, choice]]
    return total.to(rows.dtype)


# compiled: one kernel reads each token's k rows and writes their sum, where eager writes the rows gathered and
# reads them back. Written as k gathers, not a sum over a gathered [tokens, k, d] view, whose compiled reduction
# was slower than eager (H200, OLMoE's [16384 * 8, 2048] rows: 0.15 ms, eager 0.48, the compiled view 0.64)
sum_of_rows = compiled_on_cuda(_sum_of_rows)
sum_of_rows.__doc__ = """[tokens, d]: the sum of each token's k rows `rows[inverse[t * k + j]]`, accumulated in fp32."""


def _gathered_sum(rows: Tensor, slots: _Slots) -> Tensor:
    """[tokens, d]: each token's k rows summed (in fp32 by the reduction), a row outside these experts as zero."""
    return sum_of_rows(_with_zero_row(rows, slots), slots.inverse, slots.k)


class _Dispatch(torch.autograd.Function):
    """Each token's row copied to its expert rows: x[i] = h[token[i]]. Backward gathers the k rows'
    gradients back and sums them, with no atomics (index_add would collide k ways)."""

    @staticmethod
    def forward(ctx, h: Tensor, slots: _Slots) -> Tensor:
        ctx.slots = slots
        return h.index_select(0, slots.token)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gathered_sum(grad, ctx.slots), None


class _Combine(torch.autograd.Function):
    """The transpose of _Dispatch: out[t] = the sum of token t's expert rows; backward copies each token's
    gradient to its rows."""

    @staticmethod
    def forward(ctx, y: Tensor, slots: _Slots) -> Tensor:
        ctx.slots = slots
        return _gathered_sum(y, slots)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.index_select(0, ctx.slots.token), None


def _valid_tokens(documents: Documents | None) -> Tensor | None:
    """[tokens] bool: False for padding, in the routing's token order; None when nothing is padding."""
    return None if documents is None or documents.valid is None else documents.valid.reshape(-1)


class MoeBlock(DecoderBlock):
    """Stateless MoE decoder block; `router_load` is the model's shared step statistics.

    Its backward recomputes the forward (routing again, which adds the balance losses' gradients) but not the
    experts' down projection, whose output no gradient needs; a forward that kept its matmul products
    (`forward_keeping_products`) leaves the recompute the norms, attention, router and activation."""

    def __init__(self, shape: BlockShape, moe: MoeShape, router_load: RouterLoad | None = None):
        self.shape, self.moe = shape, moe
        self.router_load = router_load or RouterLoad(moe.n_experts, moe.top_k)
        params = moe_params(shape, moe)
        self.groups = (params,)
        self.numel = total_numel(params)
        self._rope_cache = {}
        self._spans: dict[str, Span] = {
            **attention_spans(shape, params),
            **_router_spans(moe, params),
            **_expert_spans(moe, shape.d_model, params, 0, moe.n_experts),
            **_shared_spans(moe, params),
        }
        # autograd's leaves: norms, biases, the router (its GEMM is small and some scorings upcast it)
        self._vectors = tuple(
            name
            for name, span in self._spans.items()
            if len(span.shape) == 1 or name in LINEAR_ATTENTION_LEAVES or name == "router" or "bias" in name
        )
        # the matrices whose products a forward keeps: all but the experts' down projection (the backward's own)
        self._recomputed_matrices = tuple(
            name for name in self._spans if name not in self._vectors and name != "experts_down"
        )

    def product_bytes_per_token(self, element_size: int) -> int:
        """GPU bytes per token that `forward_keeping_products` returns (in the compute dtype): the experts'
        gate-up products are top_k rows a token."""
        moe = self.moe
        widths = [
            moe.top_k * 2 * moe.d_ff if name == "experts_gate_up" else self._spans[name].shape[0]
            for name in self._recomputed_matrices
        ]
        return sum(widths) * element_size

    def route(self, w: dict[str, Tensor], h: Tensor) -> Routing:
        """h: [tokens, d_model] -> the routing of each token."""
        moe = self.moe
        if moe.scoring == "sigmoid":
            return self._route_by_scores(w, h)
        if moe.scoring == "sigmoid_of_top_k":
            return self._route_by_top_logits(w, h)
        if moe.correction_bias:
            return self._route_by_biased_probabilities(w, h)
        logits = F.linear(h, w["router"], w.get("router_bias"))
        if moe.gpt_oss:
            return self._route_by_softmax_of_top_logits(logits)
        probs = upcast(logits).softmax(dim=-1)
        candidates = probs
        if moe.n_groups > 1:  # keep the experts of the topk_groups groups with the highest best probability
            groups = probs.view(-1, moe.n_groups, moe.n_experts // moe.n_groups)
            chosen = groups.amax(dim=-1).topk(moe.topk_groups, dim=-1).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, chosen, True)
            candidates = (groups * keep.unsqueeze(-1)).view_as(probs)
        top_weight, top_index = candidates.topk(moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        if moe.routed_scaling != 1.0:
            top_weight = top_weight * moe.routed_scaling
        return Routing(probs, top_index, top_weight, logits)

    def _route_by_softmax_of_top_logits(self, logits: Tensor) -> Routing:
        """gpt-oss' routing (transformers' GptOssTopKRouter): logits [tokens, n_experts] -> the top-k experts,
        weighted by the softmax of their logits alone. That equals the top-k probabilities renormalised, but
        only this form gives the experts no token picked exactly zero gradient: the renormalised one leaves
        them rounding noise, which AdamW (eps 1e-8) turns into updates of up to lr. The probabilities over
        every expert are kept for the load statistics."""
        top_logit, top_index = logits.topk(self.moe.top_k, dim=-1)
        probs = upcast(logits).softmax(dim=-1)
        return Routing(probs, top_index, upcast(top_logit).softmax(dim=-1), logits)

    def _route_by_scores(self, w: dict[str, Tensor], h: Tensor) -> Routing:
        """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter; GLM-4.5's and MiniMax-M2's the same with
        one group or more): sigmoid scores from an fp32 GEMM; the topk_groups groups with the highest sums of
        their two best biased scores; in them the top-k biased
        scores; weights the unbiased scores, renormalised, times routed_scaling. The probabilities recorded
        for the load statistics are the scores normalised per token (DeepSeek's balance-loss affinities)."""
        moe = self.moe
        logits = F.linear(upcast(h), upcast(w["router"]))
        scores = logits.sigmoid()
        with torch.no_grad():  # the bias only chooses: it has no gradient
            choice = scores + (upcast(w["score_bias_hi"]) + upcast(w["score_bias_lo"]))
            if moe.n_groups > 1:
                groups = choice.view(-1, moe.n_groups, moe.n_experts // moe.n_groups)
                chosen = groups.topk(2, dim=-1).values.sum(dim=-1).topk(moe.topk_groups, dim=-1).indices
                keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, chosen, True)
                choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)
            top_index = choice.topk(moe.top_k, dim=-1).indices
        top_weight = scores.gather(1, top_index)
        if moe.norm_topk_prob:
            top_weight = top_weight / (top_weight.sum(dim=-1, keepdim=True) + 1e-20)
        top_weight = top_weight * moe.routed_scaling
        return Routing(scores / scores.sum(dim=-1, keepdim=True), top_index, top_weight, logits)

    def _route_by_top_logits(self, w: dict[str, Tensor], h: Tensor) -> Routing:
        """Llama 4's routing (transformers' Llama4Router): the top-k logits of a GEMM in the compute dtype, each
        weighted by its sigmoid (in fp32, rounded to the compute dtype where it scales the expert's input). The
        probabilities recorded for the load statistics are the sigmoids normalised per token."""
        logits = F.linear(h, w["router"])
        top_logit, top_index = logits.topk(self.moe.top_k, dim=-1)
        scores = upcast(logits).sigmoid()
        return Routing(scores / scores.sum(dim=-1, keepdim=True), top_index, upcast(top_logit).sigmoid(), logits)

    def _route_by_biased_probabilities(self, w: dict[str, Tensor], h: Tensor) -> Routing:
        """ERNIE 4.5's routing (transformers' Ernie4_5_MoeTopKRouter): softmax probabilities of an fp32 GEMM,
        the top-k of probability + correction bias, weighted by their probabilities over their sum (at
        least `moe_norm_min`, 1e-12)."""
        logits = F.linear(upcast(h), upcast(w["router"]))
        probs = logits.softmax(dim=-1)
        with torch.no_grad():  # the bias only chooses: it has no gradient
            choice = probs + (upcast(w["score_bias_hi"]) + upcast(w["score_bias_lo"])).view(-1)
            top_index = choice.topk(self.moe.top_k, dim=-1).indices
        top_weight = probs.gather(1, top_index)
        return Routing(probs, top_index, top_weight / top_weight.sum(dim=-1, keepdim=True).clamp_min(1e-12), logits)

    def _slots(
        self, w: dict, h: Tensor, top_index: Tensor, first: int = 0, stop: int = 0, n_rows: int | None = None
    ) -> _Slots | None:
        """The tokens' choices of experts first..stop-1 (stop 0: all), which `w` holds, sorted by expert; None
        where none chose them. `n_rows`: how many choices fall in them, where already known (else read from
        the device)."""
        count = (stop or self.moe.n_experts) - first
        flat = top_index.reshape(-1)
        if count == self.moe.n_experts:
            expert = flat
            order = flat.argsort(stable=True)  # row -> choice; stable keeps the token order per expert
        else:  # the choices of other experts sort last and are cut off
            local = flat - first
            expert = torch.where((local >= 0) & (local < count), local, count)
            order = expert.argsort(stable=True)
            if n_rows is None:
                n_rows = int((expert < count).sum())  # the host waits for the device
            order = order[:n_rows]
            if order.numel() == 0:
                return None
        rows = order.numel()
        inverse = torch.full_like(flat, rows) if rows < flat.numel() else torch.empty_like(order)
        inverse[order] = torch.arange(rows, device=order.device)
        k = self.moe.top_k
        return _Slots(order, order // k, expert[order], inverse, k, count, self._grouped(w, h))

    def _grouped(self, w: dict, h: Tensor) -> bool:
        """Whether the grouped kernel runs the experts (else the loop): bf16 on a GPU that has it, the expert
        matrices 16-byte aligned in their slot (the kernel reads 16-byte rows)."""
        matrices = (w["experts_gate_up"], w["experts_down"])
        values = [m.value if isinstance(m, (BoundWeight, ProductKeeper)) else m for m in matrices]
        aligned = all(t.data_ptr() % 16 == 0 for t in values)
        return aligned and _grouped_mm_works(h.device, h.dtype, row_major=self.moe.fused)

    def _experts(
        self,
        w: dict,
        h: Tensor,
        top_index: Tensor,
        top_weight: Tensor,
        first: int = 0,
        stop: int = 0,
        n_rows: int | None = None,
    ) -> Tensor:
        """sum_k top_weight * expert_k(h) over the experts first..stop-1 that `w` holds (stop 0: all),
        dropless, as grouped GEMMs over the tokens' choices sorted by expert (`_slots`)."""
        slots = self._slots(w, h, top_index, first, stop, n_rows)
        if slots is None:  # no token chose these experts
            return h.new_zeros(h.shape)
        act, weight = self._expert_activation(w, h, top_weight, slots)
        return self._expert_output(w, act, weight, slots)

    def _expert_activation(self, w: dict, h: Tensor, top_weight: Tensor, slots: _Slots) -> tuple[Tensor, Tensor | None]:
        """(the experts' activations [rows, d_ff] times the routing weights, the weights [rows, 1]); Llama 4's
        weights scale the experts' inputs instead (None).

        The routing weight scales each expert's down-projection input (d_ff wide), not its output
        (d_model wide): the same by linearity, with half the elementwise traffic or less."""
        x = _Dispatch.apply(h, slots)  # [rows, d_model], grouped by expert
        weight = top_weight.reshape(-1)[slots.order].to(h.dtype).unsqueeze(1)
        if self.moe.weights_inputs:  # Llama 4: the expert sees its input scaled, its output is not
            x, weight = x * weight, None
        hidden = _grouped_linear(x, w["experts_gate_up"], slots, out_in=not self.moe.fused)
        if "experts_gate_up_bias" in w:  # gpt-oss
            hidden = hidden + w["experts_gate_up_bias"][slots.expert]
        return self._activation(hidden, weight), weight

    def _expert_output(self, w: dict, act: Tensor, weight: Tensor | None, slots: _Slots) -> Tensor:
        """[tokens, d_model]: the experts' down projections of `act` summed over each token's choices (gpt-oss'
        down bias scaled by the routing weight, as its input is)."""
        y = _grouped_linear(act, w["experts_down"], slots, out_in=not self.moe.fused)
        if "experts_down_bias" in w:
            y = y + weight * w["experts_down_bias"][slots.expert]
        return _Combine.apply(y, slots)

    def _expert_output_backward(self, down: BoundWeight, act: Tensor, grad_out: Tensor, slots: _Slots) -> Tensor:
        """`_expert_output`'s backward, its forward not recomputed (no gradient needs its output): adds the down
        projection's weight gradient into its buffer and returns `act`'s gradient. grad_out: [tokens, d_model]."""
        out_in = not self.moe.fused
        weight, into = _in_out(down.value, out_in), _in_out(down.grad, out_in)
        grad_rows = grad_out.index_select(0, slots.token)  # the combine's backward
        return _grouped_linear_backward(act.detach(), weight, grad_rows, slots, into)[0]

    def _activation(self, gate_up: Tensor, weight: Tensor | None) -> Tensor:
        """The experts' activation times the routing weight (None: Llama 4's, which scaled the input):
        SwiGLU on (gate, up) halves, or gpt-oss' clamped SwiGLU on interleaved columns (compiled on CUDA)."""
        moe = self.moe
        if moe.gpt_oss:
            return gpt_oss_glu_weighted(gate_up, weight, moe.swiglu_limit, moe.swiglu_alpha)
        return swiglu(gate_up) if weight is None else swiglu_weighted(gate_up, weight)

    def _shared_expert(self, w: dict[str, Tensor], h: Tensor) -> Tensor | None:
        """The shared expert's output (behind its sigmoid gate where the family has one); None: no shared expert."""
        if not self.moe.shared_d_ff:
            return None
        shared = linear(swiglu(linear(h, w["shared_gate_up"])), w["shared_down"])
        return torch.sigmoid(linear(h, w["shared_gate"])) * shared if "shared_gate" in w else shared

    def _mlp(self, w: dict[str, Tensor], h: Tensor) -> tuple[Tensor, Routing]:
        """h: [tokens, d_model] (post-norm) -> (MLP output, its routing)."""
        routing = self.route(w, h)
        out = self._experts(w, h, routing.top_index, routing.top_weight)
        shared = self._shared_expert(w, h)
        return (out if shared is None else out + shared), routing

    def _block_and_router(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> tuple[Tensor, Routing]:
        x = self._attention(w, x, documents)
        h = self.shape.norm(x, w["post_norm"])
        out, routing = self._mlp(w, h.reshape(-1, h.shape[-1]))
        return x + out.view_as(x), routing

    def forward(self, weights: list[Tensor], hidden: Tensor, documents: Documents | None = None) -> Tensor:
        """hidden: [batch, seq, d_model] in the compute dtype -> same shape; records routing statistics."""
        check_buffers(weights, self.groups, "MoeBlock.forward")
        out, routing = self._block_and_router(self._views(weights[0]), hidden, documents)
        self.router_load.record(routing, _valid_tokens(documents), hidden.shape[0])
        return out

    def forward_keeping_products(
        self, weights: list[Tensor], hidden: Tensor, documents: Documents | None = None, extras: bool = False
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`forward`, also returning the products of its matmuls but the experts' down projection, which the
        backward is given as `products` to stand for those GEMMs (`product_bytes_per_token` a token); `extras`
        as `DecoderBlock.forward_keeping_products`."""
        check_buffers(weights, self.groups, "MoeBlock.forward_keeping_products")
        w, products = self._keeping_views(weights[0], extras)
        out, routing = self._block_and_router(w, hidden, documents)
        self.router_load.record(routing, _valid_tokens(documents), hidden.shape[0])
        return out, products

    def _aux_outputs(self, routing: Routing | None, documents: Documents | None, sequences: int) -> tuple[list, list]:
        """(outputs, their gradients) that add the balance losses' and the z-loss's gradients (where on) to a
        backward."""
        load = self.router_load
        if routing is None or not load.routes_in_backward:
            return [], []
        valid, probs = _valid_tokens(documents), routing.probs
        grad_probs = torch.zeros_like(probs)
        if load.coef:
            grad_probs += load.probs_grad().to(probs.dtype) * _token_weights(valid, probs).unsqueeze(1)
        if load.seq_coef:
            grad_probs += load.sequence_probs_grad(routing.top_index, probs, valid, sequences)
        if not load.z_coef:
            return [probs], [grad_probs]
        lse = upcast(routing.logits).logsumexp(dim=-1)
        return [probs, lse], [grad_probs, load.z_lse_grad(lse, valid)]

    def backward(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        grad_out: Tensor,
        grads: list[Tensor],
        documents: Documents | None = None,
        products: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Recompute from `hidden` (the experts' down projection left out, `products` standing for the GEMMs
        that made them), add the weight gradients (and the router losses', where on) into `grads[0]` (flat
        fp32), return d/d(hidden)."""
        check_buffers(weights, self.groups, "MoeBlock.backward")
        w, leaves = self._bind(weights[0], grads[0], products=products)
        x = hidden.detach().requires_grad_(True)
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        with torch.enable_grad():
            after_attention = self._attention(w, x, documents)
            h = self.shape.norm(after_attention, w["post_norm"]).reshape(-1, x.shape[-1])
            routing = self.route(w, h)
            slots = self._slots(w, h, routing.top_index)
            act, weight = self._expert_activation(w, h, routing.top_weight, slots)
            shared = self._shared_expert(w, h)
            if self.moe.gpt_oss:  # its down bias, scaled by the routing weight, needs the weight's gradient
                outputs, grad_outputs = [self._expert_output(w, act, weight, slots)], [flat_grad]
            else:
                grad_act = self._expert_output_backward(w["experts_down"], act, flat_grad, slots)
                outputs, grad_outputs = [act], [grad_act]
        if shared is not None:
            outputs, grad_outputs = outputs + [shared], grad_outputs + [flat_grad]
        aux, aux_grads = self._aux_outputs(routing, documents, x.shape[0])
        # (the residual passes grad_out straight to after_attention; autograd adds the MLP's path)
        grad_in, *grad_leaves = torch.autograd.grad(
            [after_attention, *outputs, *aux],
            [x, *leaves.values()],
            [grad_out, *grad_outputs, *aux_grads],
            allow_unused=True,
        )
        for name, grad in zip(leaves, grad_leaves):
            if grad is not None:
                accumulate(grads[0], self._spans[name], grad)
        self._add_excess_load(grads[0], self._spans, routing.top_index, documents)
        return grad_in

    def _add_excess_load(self, grads: Tensor, spans: dict[str, Span], top_index: Tensor, documents) -> None:
        """A correction bias: each expert's excess load of this micro-batch, n_experts * picks - top_k * tokens
        (padding left out), added into both halves of its gradient slots (`LOAD_BIAS`)."""
        moe = self.moe
        if not moe.biased_choice:
            return
        weight = _token_weights(_valid_tokens(documents), top_index, grads.dtype)
        excess = _expert_picks(top_index, weight, moe.n_experts) * moe.n_experts - moe.top_k * weight.sum()
        for half in ("score_bias_hi", "score_bias_lo"):
            accumulate(grads, spans[half], excess)


class _MoePart(MoeBlock):
    """A stage of a MoE layer whose experts stream in parts (a layer too large for a GPU slot): the
    layer's groups are its trunk (attention, shared expert), its router group (post-attention norm,
    router) and one group per part of its experts. The stages pass the pair (a, total): the residual
    stream after attention, the same tensor through every part, and the MLP output summed so far
    (None before any). Each recomputes all of its forward: none keeps products."""

    forward_keeping_products = None

    def _bind(self, weights: list[Tensor], leaves: bool = False) -> dict[str, Tensor]:
        bound = {}
        for buffer, spans in zip(weights, self._group_spans):
            bound.update({name: leaf(buffer, span) if leaves else span.view(buffer) for name, span in spans.items()})
        return bound

    def _normed(self, w: dict[str, Tensor], a: Tensor) -> Tensor:
        """The router's and the experts' input: post-attention norm of `a`, as [tokens, d_model]."""
        return self.shape.norm(a, w["post_norm"]).reshape(-1, a.shape[-1])

    def _accumulate(self, grads: list[Tensor], leaves: dict[str, Tensor], grad_leaves: list[Tensor | None]) -> None:
        grad_of = dict(zip(leaves, grad_leaves))
        for buffer, spans in zip(grads, self._group_spans):
            for name, span in spans.items():
                if grad_of.get(name) is not None:
                    accumulate(buffer, span, grad_of[name])


class MoeAttention(_MoePart):
    """The first stage of a MoE layer streamed in parts: attention, the routing statistics (and the
    load-balancing loss's gradient) and the shared expert; binds (trunk, router group) and returns
    the pair (a, shared expert output or None)."""

    def __init__(self, shape: BlockShape, moe: MoeShape, router_load: RouterLoad | None = None):
        self.shape, self.moe = shape, moe
        self.router_load = router_load or RouterLoad(moe.n_experts, moe.top_k)
        self.groups = split_moe_params(shape, moe)
        self.numel = sum(total_numel(params) for params in self.groups)
        self._rope_cache = {}
        trunk, router = self.groups
        self._group_spans = (
            {**attention_spans(shape, trunk), **_shared_spans(moe, trunk)},
            _router_group_spans(moe, router),
        )

    def _pair(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None, route: bool):
        a = self._attention(w, x, documents)
        h = self._normed(w, a)
        shared = self._shared_expert(w, h)
        return (a, None if shared is None else shared.view_as(a)), self.route(w, h) if route else None

    def forward(self, weights: list[Tensor], hidden: Tensor, documents: Documents | None = None) -> tuple:
        """hidden: [batch, seq, d_model] -> the pair; records routing statistics."""
        check_buffers(weights, self.groups, "MoeAttention.forward")
        pair, routing = self._pair(self._bind(weights), hidden, documents, route=True)
        self.router_load.record(routing, _valid_tokens(documents), hidden.shape[0])
        return pair

    def backward(self, weights, hidden, grad_out: tuple, grads, documents: Documents | None = None) -> Tensor:
        """grad_out: the pair's gradient; returns d/d(hidden)."""
        check_buffers(weights, self.groups, "MoeAttention.backward")
        leaves = self._bind(weights, leaves=True)
        x = hidden.detach().requires_grad_(True)
        # routing again only for a router loss's gradient or the correction bias's load
        route = self.router_load.routes_in_backward or self.moe.biased_choice
        with torch.enable_grad():
            (a, shared), routing = self._pair(leaves, x, documents, route=route)
        outputs, grad_outputs = ([a], [grad_out[0]]) if shared is None else ([a, shared], list(grad_out))
        aux, aux_grads = self._aux_outputs(routing, documents, x.shape[0])
        grad_in, *grad_leaves = torch.autograd.grad(
            outputs + aux, [x, *leaves.values()], grad_outputs + aux_grads, allow_unused=True
        )
        self._accumulate(grads, leaves, grad_leaves)
        if route:
            self._add_excess_load(grads[1], self._group_spans[1], routing.top_index, documents)
        return grad_in


class MoeExperts(_MoePart):
    """Experts first..stop-1 of a MoE layer streamed in parts: binds (router group, these experts),
    routes again (the router is tiny next to the experts) and adds their output to the pair's total;
    the last part returns the layer's output, a + total. Its backward needs only `a`."""

    def __init__(self, shape: BlockShape, moe: MoeShape, first: int, stop: int):
        self.shape, self.moe, self.first, self.stop = shape, moe, first, stop
        self.last = stop == moe.n_experts
        self.checkpoint_planes = 1 if first == 0 else 0  # the parts of a layer keep the same `a`
        _, router = split_moe_params(shape, moe)
        experts = expert_params(moe, shape.d_model, first, stop)
        self.groups = (router, experts)
        self.numel = total_numel(router) + total_numel(experts)
        self._group_spans = (
            _router_group_spans(moe, router),
            _expert_spans(moe, shape.d_model, experts, first, stop),
        )

    def _route(self, w: dict[str, Tensor], a: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(normed input, top_index, top_weight, how many of the tokens' choices fall in this part, on the device)."""
        h = self._normed(w, a)
        routing = self.route(w, h)
        top_index = routing.top_index
        return h, top_index, routing.top_weight, ((top_index >= self.first) & (top_index < self.stop)).sum()

    def prepare(self, weights: list[Tensor], pair: tuple, documents: Documents | None = None) -> "PartRouting":
        """Route a micro-batch and start copying how many of its tokens' choices fall in this part to
        the host. The pipeline prepares every micro-batch before the first forward, so the forwards
        find their row counts there instead of each waiting for the GPU to catch up."""
        h, top_index, top_weight, count = self._route(self._bind(weights), pair[0])
        if not count.is_cuda:
            return PartRouting(h, top_index, top_weight, count)
        host = torch.empty((), dtype=count.dtype, pin_memory=True)
        host.copy_(count, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PartRouting(h, top_index, top_weight, host, ready)

    def forward(self, weights: list[Tensor], pair: tuple, documents: Documents | None = None, prepared=None):
        check_buffers(weights, self.groups, "MoeExperts.forward")
        a, total = pair
        routing = prepared or self.prepare(weights, pair)
        w = self._bind(weights)
        out = self._experts(w, routing.h, routing.top_index, routing.top_weight, self.first, self.stop, routing.rows())
        routing.release()  # the backward routes again, under autograd
        total = out.view_as(a) if total is None else total + out.view_as(a)
        return a + total if self.last else (a, total)

    @staticmethod
    def checkpoint(pair: tuple) -> Tensor:
        return pair[0]

    def backward(self, weights, a: Tensor, grad_out, grads, documents: Documents | None = None, prepared=None) -> tuple:
        """a: the pair's first tensor; grad_out: the layer output's gradient (last part) or the pair's;
        `prepared`: the forward's routing, for its row count; returns the input pair's gradient."""
        check_buffers(weights, self.groups, "MoeExperts.backward")
        grad_a, grad_total = (grad_out, grad_out) if self.last else grad_out
        leaves = self._bind(weights, leaves=True)
        a = a.detach().requires_grad_(True)
        with torch.enable_grad():
            h, top_index, top_weight, count = self._route(leaves, a)
            n_rows = None
            if prepared is not None:  # the forward's count, checked on the device without waiting
                n_rows = prepared.rows()
                torch._assert_async(count == n_rows, "a MoE part's row count changed between forward and backward")
            out = self._experts(leaves, h, top_index, top_weight, self.first, self.stop, n_rows).view_as(a)
        if out.requires_grad:  # some token chose one of these experts
            grad_via_experts, *grad_leaves = torch.autograd.grad(
                [out], [a, *leaves.values()], [grad_total], allow_unused=True
            )
            self._accumulate(grads, leaves, grad_leaves)
            if grad_via_experts is not None:
                grad_a = grad_a + grad_via_experts
        return grad_a, grad_total


@dataclass
class PartRouting:
    """A micro-batch's routing for one part of a MoE layer's experts (`MoeExperts.prepare`), with the
    number of its tokens' choices in the part on its way to host memory."""

    h: Tensor | None  # the post-attention-norm input, [tokens, d_model]
    top_index: Tensor | None
    top_weight: Tensor | None
    count: Tensor  # host scalar once `ready` has passed (the device scalar on the CPU)
    ready: object = None  # CUDA event: the count's copy finished
    _rows: int | None = None

    def rows(self) -> int:
        if self._rows is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._rows = int(self.count)
        return self._rows

    def release(self) -> None:
        """Keep only the row count (the backward needs nothing else of it)."""
        self.rows()
        self.h = self.top_index = self.top_weight = None
