"""A MoE layer too large for a GPU slot streams its experts in parts: `MoeAttention` (attention, shared
expert, routing statistics) and one `MoeExperts` stage per range of experts, each its own group. With LoRA the
layer's adapters are one more group, laid out as a whole layer's (`MoeBlock._adapt`), which every stage that
uses them binds: the attention stage all of it, a part its experts' slice and the router's adapter.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import Documents
from .decoder import BlockShape, attention_spans
from .layout import BoundWeight, accumulate, check_buffers, leaf, total_numel
from .lora import AdapterLayout, DropoutKey, Lora
from .moe import MoeBlock, autograd_leaf
from .moe_layout import MoeShape, _expert_spans, _router_group_spans, _shared_spans, expert_params, split_moe_params
from .moe_routing import RouterLoad, _valid_tokens

# a MoE layer's attention stage is named its layer's name and this (`layer3.attention`)
ATTENTION_STAGE_SUFFIX = ".attention"
# the span names whose adapters a part of the experts binds (the rest of the layer's are the attention stage's)
_PART_ADAPTED = ("router", "experts_gate_up", "experts_down")


class _MoePart(MoeBlock):
    """A stage of a MoE layer whose experts stream in parts (a layer too large for a GPU slot): the
    layer's groups are its trunk (attention, shared expert), its router group (post-attention norm,
    router) and one group per part of its experts. The stages pass the pair (a, total): the residual
    stream after attention, the same tensor through every part, and the MLP output summed so far
    (None before any). Each recomputes its forward (a part's backward, as a whole layer's, not its experts' down
    projection, `MoeBlock._experts_past_gate_up`): none keeps products. With LoRA the base is frozen
    and the stage's last group is the layer's adapters (`_adapters`, where it binds them)."""

    forward_keeping_products = None
    _adapters: AdapterLayout | None = None
    _first_expert = 0

    def _adapt_layer(self, lora: Lora | None, only: tuple[str, ...] = ()) -> None:
        """With `lora`: the whole layer's adapters, laid out as `MoeBlock` lays them (one layout, so that a
        checkpoint resumes whole or in parts), bound as this stage's last group; where `only` names spans, only if
        `lora` adapts one of them."""
        if lora is None:
            return
        adapters = MoeBlock(self.shape, self.moe, None, lora)._adapters
        if not only or any(name in adapters.adapted for name in only):
            self._adapters = adapters
            self.groups = (*self.groups, adapters.params)

    def _bind(
        self, weights: list[Tensor], grads: list | None = None, dropout: DropoutKey | None = None
    ) -> tuple[dict[str, "Tensor | BoundWeight"], dict[str, Tensor]]:
        """(every parameter the stage binds, the autograd leaves among them): for a forward (no `grads`) the groups'
        spans as views; for a backward as `DecoderBlock._bind` binds them: matrices bound to their span of their
        group's gradient buffer (their gradients added inside the GEMMs that make them: the experts' by the grouped
        kernel into fp32; none for a frozen group's), the vectors of a trained group as leaves (`autograd_leaf`).
        Adapted matrices with their adapters, bound to the adapter group's gradient where given."""
        bound, leaves = {}, {}
        for i, (buffer, spans) in enumerate(zip(weights, self._group_spans)):
            grad = None if grads is None else grads[i]
            for name, span in spans.items():
                if grads is not None and not autograd_leaf(name, span):  # a matrix, in a backward
                    bound[name] = BoundWeight(span.view(buffer), None if grad is None else span.view(grad))
                elif grad is not None:  # a trained group's vector
                    bound[name] = leaves[name] = leaf(buffer, span)
                else:
                    bound[name] = span.view(buffer)
        if self._adapters is not None:
            grad = None if grads is None else grads[-1]
            bound = self._adapters.bind(bound, weights[-1], grad, dropout=dropout, first_expert=self._first_expert)
        return bound, leaves

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
    load-balancing loss's gradient) and the shared expert; binds (trunk, router group[, the layer's adapters]) and
    returns the pair (a, shared expert output or None)."""

    def __init__(
        self, shape: BlockShape, moe: MoeShape, router_load: RouterLoad | None = None, lora: Lora | None = None
    ):
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
        self._adapt_layer(lora)
        # (dropout is refused on the router's and the experts' adapters: only this stage's draw masks)
        self.takes_dropout = lora is not None and lora.dropout > 0

    def _pair(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None, route: bool):
        a, h = self._attention_and_norm(w, x, documents)
        h = h.reshape(-1, a.shape[-1])
        shared = self._shared_expert(w, h)
        return (a, None if shared is None else shared.view_as(a)), self.route(w, h) if route else None

    def forward(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        documents: Documents | None = None,
        dropout: DropoutKey | None = None,
    ) -> tuple:
        """hidden: [batch, seq, d_model] -> the pair; records routing statistics. `dropout`: the training pass's
        key of LoRA dropout's masks."""
        check_buffers(weights, self.groups, "MoeAttention.forward")
        pair, routing = self._pair(self._bind(weights, dropout=_layer_key(dropout))[0], hidden, documents, route=True)
        self.router_load.record(routing, _valid_tokens(documents), hidden.shape[0])
        return pair

    def backward(
        self,
        weights,
        hidden,
        grad_out: tuple,
        grads,
        documents: Documents | None = None,
        dropout: DropoutKey | None = None,
    ) -> Tensor:
        """grad_out: the pair's gradient; returns d/d(hidden)."""
        check_buffers(weights, self.groups, "MoeAttention.backward")
        w, leaves = self._bind(weights, grads, _layer_key(dropout))
        x = hidden.detach().requires_grad_(True)
        # routing again only for a router loss's gradient or the correction bias's load
        route = self.router_load.routes_in_backward or self.moe.biased_choice
        with torch.enable_grad():
            (a, shared), routing = self._pair(w, x, documents, route=route)
        outputs, grad_outputs = ([a], [grad_out[0]]) if shared is None else ([a, shared], list(grad_out))
        aux, aux_grads = self._aux_outputs(routing, documents, x.shape[0])
        grad_in, *grad_leaves = torch.autograd.grad(
            outputs + aux, [x, *leaves.values()], grad_outputs + aux_grads, allow_unused=True
        )
        self._accumulate(grads, leaves, grad_leaves)
        if route and grads[1] is not None:  # (a frozen router's correction bias is not moved)
            self._add_excess_load(grads[1], self._group_spans[1], routing.top_index, documents)
        return grad_in


def _layer_key(dropout: DropoutKey | None) -> DropoutKey | None:
    """The attention stage's key of dropout masks at its layer's name (`layer3`, not the stage's `layer3.attention`):
    a layer draws the same masks whole or in parts."""
    return None if dropout is None else dropout.at(dropout.layer.removesuffix(ATTENTION_STAGE_SUFFIX))


class MoeExperts(_MoePart):
    """Experts first..stop-1 of a MoE layer streamed in parts: binds (router group, these experts[, the layer's
    adapters, where LoRA reaches the router or the experts]), routes again (the router is tiny next to the experts)
    and adds their output to the pair's total; the last part returns the layer's output, a + total. Its backward
    needs only `a`."""

    def __init__(self, shape: BlockShape, moe: MoeShape, first: int, stop: int, lora: Lora | None = None):
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
        self._first_expert = first
        self._adapt_layer(lora, only=_PART_ADAPTED)

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
        h, top_index, top_weight, count = self._route(self._bind(weights)[0], pair[0])
        if not count.is_cuda:
            return PartRouting(h, top_index, top_weight, count)
        host = torch.empty((), dtype=count.dtype, pin_memory=True)
        host.copy_(count, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PartRouting(h, top_index, top_weight, host, ready)

    def forward(self, weights: list[Tensor], pair: tuple, documents: Documents | None = None, prepared=None):
        """pair: (a [batch, seq, d_model], total so far or None) -> (a, total + these experts' output), or for the
        last part the layer's output a + total [batch, seq, d_model]; `prepared`: this part's routing (`prepare`)."""
        check_buffers(weights, self.groups, "MoeExperts.forward")
        a, total = pair
        routing = prepared or self.prepare(weights, pair)
        w = self._bind(weights)[0]
        out = self._experts(w, routing.h, routing.top_index, routing.top_weight, self.first, self.stop, routing.rows())
        routing.release()  # the backward routes again, under autograd
        total = out.view_as(a) if total is None else total + out.view_as(a)
        return a + total if self.last else (a, total)

    @staticmethod
    def checkpoint(pair: tuple) -> Tensor:
        """The pair's `a` [batch, seq, d_model], all the backward needs (shared by the layer's parts)."""
        return pair[0]

    def backward(self, weights, a: Tensor, grad_out, grads, documents: Documents | None = None, prepared=None) -> tuple:
        """a: the pair's first tensor; grad_out: the layer output's gradient (last part) or the pair's;
        `prepared`: the forward's routing, for its row count; returns the input pair's gradient."""
        check_buffers(weights, self.groups, "MoeExperts.backward")
        grad_a, grad_total = (grad_out, grad_out) if self.last else grad_out
        w, leaves = self._bind(weights, grads)
        a = a.detach().requires_grad_(True)
        with torch.enable_grad():
            h, top_index, top_weight, count = self._route(w, a)
            n_rows = None
            if prepared is not None:  # the forward's count, checked on the device without waiting
                n_rows = prepared.rows()
                torch._assert_async(count == n_rows, "a MoE part's row count changed between forward and backward")
            slots = self._slots(w, h, top_index, self.first, self.stop, n_rows)
            if slots is None:  # no token chose these experts: no gradient passes them
                return grad_a, grad_total
            gate_up, weight = self._expert_gate_up(w, h, top_weight, slots)
        flat_grad = grad_total.reshape(-1, a.shape[-1])
        outputs, grad_outputs = self._experts_past_gate_up(w, gate_up, weight, flat_grad, slots)
        grad_via_experts, *grad_leaves = torch.autograd.grad(
            outputs, [a, *leaves.values()], grad_outputs, allow_unused=True
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
