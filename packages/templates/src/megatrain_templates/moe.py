"""The mixture-of-experts decoder block: the dense block's attention, then a router that sends
each token to its top-k SwiGLU experts (dropless: every token reaches all k), plus an optional
shared expert behind a sigmoid gate (Qwen2-MoE).

Experts are grouped GEMMs over tokens sorted by expert (`grouped_experts`), laid out in the flat buffer
as `moe_layout` says; the load-balancing loss's statistics live in a `RouterLoad` shared by the model's
MoE layers (`moe_routing`). A layer too large for a GPU slot streams its experts in parts (`moe_parts`).
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import Documents
from .decoder import BlockShape, DecoderBlock, attention_spans, plain_causal_attention
from .expert_adapters import AdaptedExperts, ExpertAdapters, adapted_expert_matrices
from .grouped_experts import (
    _add_grouped_weight_grad,
    _Combine,
    _Dispatch,
    _grouped_input_grad,
    _grouped_linear,
    _grouped_mm_works,
    _in_out,
    _low_rank_slots,
    _Slots,
    _to_rows,
    adapters_input_grad,
    add_adapters_weight_grads,
    gpt_oss_glu_weighted,
)
from .layout import BoundWeight, ProductKeeper, Span, accumulate, check_buffers, total_numel
from .linear_attention import LINEAR_ATTENTION_LEAVES
from .lora import Adapted, AdapterLayout, DropoutKey, Lora
from .moe_layout import (
    EXPERT_NAMING,
    MoeShape,
    _expert_spans,
    _router_spans,
    _shared_spans,
    moe_params,
    router_name,
    transformers_module,
)
from .moe_routing import RouterLoad, Routing, _expert_picks, _token_weights, _valid_tokens
from .ops import linear, swiglu, swiglu_output_and_backward, upcast

# the key of a kept forward's products that holds its choice of experts [tokens, k], which its backward reuses
CHOSEN_EXPERTS = "chosen experts"


def autograd_leaf(name: str, span: Span) -> bool:
    """Whether a MoE layer's backward binds parameter `name` as an autograd leaf (norms, biases, the router: its GEMM
    is small and some scorings upcast it), not as a matrix whose gradient its GEMM adds into the buffer."""
    return len(span.shape) == 1 or name in LINEAR_ATTENTION_LEAVES or name == "router" or "bias" in name


def _top_k(scores: Tensor, k: int, chosen: Tensor | None) -> tuple[Tensor, Tensor]:
    """(values, indices) of each row's k largest scores, or of the `chosen` indices where given."""
    if chosen is None:
        return scores.topk(k, dim=-1)
    return scores.gather(1, chosen), chosen


class MoeBlock(DecoderBlock):
    """Stateless MoE decoder block; `router_load` is the model's shared step statistics.

    Its backward recomputes the forward (routing again, which adds the balance losses' gradients) but not the
    experts' down projection, whose output no gradient needs; a forward that kept its matmul products
    (`forward_keeping_products`) leaves the recompute the norms, attention, router and activation, and with its
    extras (its attention's results) not the attention."""

    def __init__(
        self, shape: BlockShape, moe: MoeShape, router_load: RouterLoad | None = None, lora: Lora | None = None
    ):
        self.shape, self.moe = shape, moe
        self.router_load = router_load or RouterLoad(moe.n_experts, moe.top_k)
        params = moe_params(shape, moe)
        self.groups = (params,)
        self.numel = total_numel(params)
        self._rope_cache = {}
        self._keeps_attention = plain_causal_attention(shape)
        self._spans: dict[str, Span] = {
            **attention_spans(shape, params),
            **_router_spans(moe, params),
            **_expert_spans(moe, shape.d_model, params, 0, moe.n_experts),
            **_shared_spans(moe, params),
        }
        self._vectors = tuple(name for name, span in self._spans.items() if autograd_leaf(name, span))
        # the matrices whose products a forward keeps: all but the experts' down projection (the backward's own)
        self._recomputed_matrices = tuple(
            name for name in self._spans if name not in self._vectors and name != "experts_down"
        )
        self._adapters = None if lora is None else self._adapt(lora)

    def _adapt(self, lora: Lora) -> AdapterLayout:
        """`DecoderBlock._adapt`'s adapters (attention, shared expert); where PEFT 0.22 adapts them
        (`MoeShape.lora_reaches_experts`) also the router's and the experts' (`expert_adapters`), named as PEFT names
        them. (Llama 4's router, an nn.Linear returning a tuple, crashes PEFT's LoRA layer: not adapted.)"""
        moe = self.moe
        if not moe.lora_reaches_experts:
            return super()._adapt(lora)
        router = router_name(moe)
        adapters = super()._adapt(lora, ("router",), {router: f"{transformers_module(moe)}.{router.split('.', 1)[1]}"})
        experts = adapted_expert_matrices(lora, EXPERT_NAMING[moe.naming][1])
        reached = experts + (("router",) if "router" in adapters.adapted else ())
        if reached and lora.dropout:
            raise ValueError(
                f"model.adapter.dropout {lora.dropout} on {', '.join(reached)}: LoRA dropout can't be applied to a "
                "matrix transformers fuses (PEFT 0.22 refuses it as well); set model.adapter.dropout to 0, or "
                "target other modules"
            )
        if experts:
            offset = total_numel(adapters.params)
            adapters.attach(ExpertAdapters(lora, self._spans, experts, transformers_module(moe), offset))
            self.groups = (self.groups[0], adapters.params)
        return adapters

    def product_bytes_per_token(self, element_size: int) -> int:
        """GPU bytes per token that `forward_keeping_products` returns: `DecoderBlock.product_bytes_per_token`'s,
        the experts' gate-up products top_k rows a token (`_product_width`), and the token's choice of experts
        (top_k int64)."""
        chosen = self.moe.top_k * torch.long.itemsize
        return super().product_bytes_per_token(element_size) + chosen

    def _product_width(self, name: str) -> int:
        return self.moe.top_k * 2 * self.moe.d_ff if name == "experts_gate_up" else super()._product_width(name)

    def route(self, w: dict[str, Tensor], h: Tensor, chosen: Tensor | None = None) -> Routing:
        """h: [tokens, d_model] -> the routing of each token; `chosen` [tokens, k]: the experts a forward chose
        (a backward's recompute takes them rather than choosing again: the same choice, whatever rounding its
        recompute differs by), weighted as the router weighs them."""
        moe = self.moe
        if moe.scoring == "sigmoid":
            return self._route_by_scores(w, h, chosen)
        if moe.scoring == "sigmoid_of_top_k":
            return self._route_by_top_logits(w, h, chosen)
        if moe.correction_bias:
            return self._route_by_biased_probabilities(w, h, chosen)
        logits = self._router_logits(w, h)
        if moe.gpt_oss:
            return self._route_by_softmax_of_top_logits(logits, chosen)
        probs = upcast(logits).softmax(dim=-1)
        candidates = probs
        if moe.n_groups > 1 and chosen is None:  # keep the experts of the topk_groups groups with the best probability
            groups = probs.view(-1, moe.n_groups, moe.n_experts // moe.n_groups)
            best = groups.amax(dim=-1).topk(moe.topk_groups, dim=-1).indices
            keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
            candidates = (groups * keep.unsqueeze(-1)).view_as(probs)
        top_weight, top_index = _top_k(candidates, moe.top_k, chosen)
        if moe.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        if moe.routed_scaling != 1.0:
            top_weight = top_weight * moe.routed_scaling
        return Routing(probs, top_index, top_weight, logits)

    def _router_logits(self, w: dict, h: Tensor, in_fp32: bool = False) -> Tensor:
        """[tokens, n_experts]: the router's GEMM in the compute dtype, or in fp32 (`in_fp32`: the scorings that
        transformers upcasts), plus its LoRA delta where adapted (made in the compute dtype)."""
        router, delta = w["router"], None
        if isinstance(router, Adapted):
            router, delta = router.base, linear(h, replace(router, base=None))
        logits = F.linear(upcast(h), upcast(router)) if in_fp32 else F.linear(h, router, w.get("router_bias"))
        return logits if delta is None else logits + delta

    def _route_by_softmax_of_top_logits(self, logits: Tensor, chosen: Tensor | None) -> Routing:
        """gpt-oss' routing (transformers' GptOssTopKRouter): logits [tokens, n_experts] -> the top-k experts,
        weighted by the softmax of their logits alone. That equals the top-k probabilities renormalised, but
        only this form gives the experts no token picked exactly zero gradient: the renormalised one leaves
        them rounding noise, which AdamW (eps 1e-8) turns into updates of up to lr. The probabilities over
        every expert are kept for the load statistics."""
        top_logit, top_index = _top_k(logits, self.moe.top_k, chosen)
        probs = upcast(logits).softmax(dim=-1)
        return Routing(probs, top_index, upcast(top_logit).softmax(dim=-1), logits)

    def _route_by_scores(self, w: dict[str, Tensor], h: Tensor, chosen: Tensor | None) -> Routing:
        """DeepSeek-V3's routing (transformers' DeepseekV3TopkRouter; GLM-4.5's and MiniMax-M2's the same with
        one group or more): sigmoid scores from an fp32 GEMM; the topk_groups groups with the highest sums of
        their two best biased scores; in them the top-k biased
        scores; weights the unbiased scores, renormalised, times routed_scaling. The probabilities recorded
        for the load statistics are the scores normalised per token (DeepSeek's balance-loss affinities)."""
        moe = self.moe
        logits = self._router_logits(w, h, in_fp32=True)
        scores = logits.sigmoid()
        top_index = chosen if chosen is not None else self._biased_choice(w, scores)
        top_weight = scores.gather(1, top_index)
        if moe.norm_topk_prob:
            top_weight = top_weight / (top_weight.sum(dim=-1, keepdim=True) + 1e-20)
        top_weight = top_weight * moe.routed_scaling
        return Routing(scores / scores.sum(dim=-1, keepdim=True), top_index, top_weight, logits)

    def _biased_choice(self, w: dict[str, Tensor], scores: Tensor) -> Tensor:
        """DeepSeek-V3's choice of top-k experts by their scores plus the correction bias, within the best groups."""
        moe = self.moe
        with torch.no_grad():  # the bias only chooses: it has no gradient
            choice = scores + (upcast(w["score_bias_hi"]) + upcast(w["score_bias_lo"]))
            if moe.n_groups > 1:
                groups = choice.view(-1, moe.n_groups, moe.n_experts // moe.n_groups)
                best = groups.topk(2, dim=-1).values.sum(dim=-1).topk(moe.topk_groups, dim=-1).indices
                keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best, True)
                choice = groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(scores)
            return choice.topk(moe.top_k, dim=-1).indices

    def _route_by_top_logits(self, w: dict[str, Tensor], h: Tensor, chosen: Tensor | None) -> Routing:
        """Llama 4's routing (transformers' Llama4Router): the top-k logits of a GEMM in the compute dtype, each
        weighted by its sigmoid (in fp32, rounded to the compute dtype where it scales the expert's input). The
        probabilities recorded for the load statistics are the sigmoids normalised per token."""
        logits = self._router_logits(w, h)
        top_logit, top_index = _top_k(logits, self.moe.top_k, chosen)
        scores = upcast(logits).sigmoid()
        return Routing(scores / scores.sum(dim=-1, keepdim=True), top_index, upcast(top_logit).sigmoid(), logits)

    def _route_by_biased_probabilities(self, w: dict[str, Tensor], h: Tensor, chosen: Tensor | None) -> Routing:
        """ERNIE 4.5's routing (transformers' Ernie4_5_MoeTopKRouter): softmax probabilities of an fp32 GEMM,
        the top-k of probability + correction bias, weighted by their probabilities over their sum (at
        least `moe_norm_min`, 1e-12)."""
        logits = self._router_logits(w, h, in_fp32=True)
        probs = logits.softmax(dim=-1)
        top_index = chosen
        if top_index is None:
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
        return _Slots.of_choices(top_index, self.moe.n_experts, first, stop, n_rows, self._grouped(w, h))

    def _grouped(self, w: dict, h: Tensor) -> bool:
        """Whether the grouped kernel runs the experts (else the loop): bf16 on a GPU that has it, the expert
        matrices 16-byte aligned in their slot (the kernel reads 16-byte rows)."""
        matrices = [m.base if isinstance(m, AdaptedExperts) else m for m in (w["experts_gate_up"], w["experts_down"])]
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
        gate_up, weight = self._expert_gate_up(w, h, top_weight, slots)
        return self._activation(gate_up, weight), weight

    def _expert_gate_up(self, w: dict, h: Tensor, top_weight: Tensor, slots: _Slots) -> tuple[Tensor, Tensor | None]:
        """(the experts' gate|up projections [rows, 2 * d_ff], the routing weights their activations are scaled by
        [rows, 1], or None: `_expert_activation`'s)."""
        x = _Dispatch.apply(h, slots)  # [rows, d_model], grouped by expert
        weight = top_weight.reshape(-1)[slots.order].to(h.dtype).unsqueeze(1)
        if self.moe.weights_inputs:  # Llama 4: the expert sees its input scaled, its output is not
            x, weight = x * weight, None
        hidden = _grouped_linear(x, w["experts_gate_up"], slots, out_in=not self.moe.fused)
        if "experts_gate_up_bias" in w:  # gpt-oss
            hidden = hidden + w["experts_gate_up_bias"][slots.expert]
        return hidden, weight

    def _expert_output(self, w: dict, act: Tensor, weight: Tensor | None, slots: _Slots) -> Tensor:
        """[tokens, d_model]: the experts' down projections of `act` summed over each token's choices (gpt-oss'
        down bias scaled by the routing weight, as its input is)."""
        y = _grouped_linear(act, w["experts_down"], slots, out_in=not self.moe.fused)
        if "experts_down_bias" in w:
            y = y + weight * w["experts_down_bias"][slots.expert]
        return _Combine.apply(y, slots)

    def _experts_past_gate_up(
        self, w: dict, gate_up: Tensor, weight: Tensor | None, grad_out: Tensor, slots: _Slots
    ) -> tuple[list[Tensor], list[Tensor]]:
        """(outputs, their gradients) for autograd from the experts' recomputed gate-up projection back, given the
        experts' output's gradient `grad_out` [tokens, d_model]: by hand (`_experts_by_hand`), or where gpt-oss' down
        bias, scaled by the routing weight, needs that weight's gradient, the output recomputed under autograd."""
        if not self.moe.gpt_oss:
            return self._experts_by_hand(w["experts_down"], gate_up, weight, grad_out, slots)
        with torch.enable_grad():
            act = self._activation(gate_up, weight)
            return [self._expert_output(w, act, weight, slots)], [grad_out]

    def _experts_by_hand(
        self,
        down: "BoundWeight | AdaptedExperts",
        gate_up: Tensor,
        weight: Tensor | None,
        grad_out: Tensor,
        slots: _Slots,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The experts' SwiGLU and down projection backward by hand, their forward not recomputed (no gradient needs
        the projection's output): the activation's gradient first, then the activation and its inputs' gradients in
        one pass (`swiglu_output_and_backward`, the gradient over gate_up: only its graph is needed from here), then
        the projection's weight gradient (or its LoRA adapters') added into its buffer. Returns the outputs
        (`gate_up`, `weight`) and their gradients, for autograd from there. grad_out: [tokens, d_model]."""
        adapters = down if isinstance(down, AdaptedExperts) else None
        base = down.base if adapters is not None else down
        out_in, frozen = not self.moe.fused, base.grad is None
        matrix = _in_out(base.value, out_in)
        grad_rows = _to_rows(grad_out, slots)  # the combine's backward
        grad_act = _grouped_input_grad(matrix, grad_rows, slots)
        if adapters is not None:
            low_slots = _low_rank_slots(adapters, grad_rows, slots)
            grad_low, grad_act_delta = adapters_input_grad(adapters, grad_rows, low_slots)
            grad_act += grad_act_delta
        act, grad_gate_up, grad_weight = swiglu_output_and_backward(
            gate_up.detach(), grad_act, None if weight is None else weight.detach(), overwrite=True
        )
        if not frozen:
            _add_grouped_weight_grad(act, matrix, grad_rows, slots, _in_out(base.grad, out_in))
        if adapters is not None:
            add_adapters_weight_grads(adapters, act, grad_rows, grad_low, low_slots)
        if weight is None:
            return [gate_up], [grad_gate_up]
        return [gate_up, weight], [grad_gate_up, grad_weight]

    def _activation(self, gate_up: Tensor, weight: Tensor | None) -> Tensor:
        """The experts' activation times the routing weight (None: Llama 4's, which scaled the input):
        SwiGLU on (gate, up) halves, or gpt-oss' clamped SwiGLU on interleaved columns (compiled on CUDA)."""
        moe = self.moe
        if moe.gpt_oss:
            return gpt_oss_glu_weighted(gate_up, weight, moe.swiglu_limit, moe.swiglu_alpha)
        return swiglu(gate_up, weight)

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
        x, h = self._attention_and_norm(w, x, documents)
        out, routing = self._mlp(w, h.reshape(-1, h.shape[-1]))
        return x + out.view_as(x), routing

    def forward(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        documents: Documents | None = None,
        dropout: DropoutKey | None = None,
    ) -> Tensor:
        """hidden: [batch, seq, d_model] in the compute dtype -> same shape; records routing statistics; `dropout`
        as `DecoderBlock.forward`'s."""
        check_buffers(weights, self.groups, "MoeBlock.forward")
        out, routing = self._block_and_router(self._views(weights, dropout), hidden, documents)
        self.router_load.record(routing, _valid_tokens(documents), hidden.shape[0])
        return out

    def forward_keeping_products(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        documents: Documents | None = None,
        extras: bool = False,
        dropout: DropoutKey | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`forward`, also returning the products of its matmuls but the experts' down projection, which the
        backward is given as `products` to stand for those GEMMs (`product_bytes_per_token` a token); `extras`
        as `DecoderBlock.forward_keeping_products`."""
        check_buffers(weights, self.groups, "MoeBlock.forward_keeping_products")
        w, products = self._keeping_views(weights, hidden, extras, dropout)
        out, routing = self._block_and_router(w, hidden, documents)
        self.router_load.record(routing, _valid_tokens(documents), hidden.shape[0])
        products[CHOSEN_EXPERTS] = routing.top_index
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
        dropout: DropoutKey | None = None,
    ) -> Tensor:
        """Recompute from `hidden` (the experts' down projection left out, `products` standing for the GEMMs
        that made them), add the weight gradients (and the router losses', where on) into `grads[0]` (flat
        fp32), return d/d(hidden)."""
        check_buffers(weights, self.groups, "MoeBlock.backward")
        w, leaves = self._bind(weights, grads, products=products, dropout=dropout)
        x = hidden.detach().requires_grad_(True)
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])
        with torch.enable_grad():
            after_attention, h = self._attention_and_norm(w, x, documents)
            h = h.reshape(-1, x.shape[-1])
            routing = self.route(w, h, None if products is None else products.get(CHOSEN_EXPERTS))
            slots = self._slots(w, h, routing.top_index)
            gate_up, weight = self._expert_gate_up(w, h, routing.top_weight, slots)
            shared = self._shared_expert(w, h)
        outputs, grad_outputs = self._experts_past_gate_up(w, gate_up, weight, flat_grad, slots)
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
        if grads[0] is not None:  # (a frozen layer's correction bias is not moved)
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
