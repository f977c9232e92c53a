"""The experts of a MoE layer as grouped GEMMs over the tokens' choices sorted by expert: the choices'
rows (`_Slots`), the dispatch to and combine from those rows, the grouped linear (torch._grouped_mm where it
works, else a loop over the experts) with its backward, and gpt-oss' weighted activation (SwiGLU's
is `ops.swiglu`'s).
"""

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from . import expert_kernels
from .expert_adapters import AdaptedExperts
from .layout import BoundWeight, ProductKeeper
from .ops import _value, compiled_on_cuda, upcast


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


def _gpt_oss_glu_weighted(gate_up: Tensor, weight: Tensor, limit: float, alpha: float) -> Tensor:
    gate = gate_up[:, ::2].clamp(max=limit)
    up = gate_up[:, 1::2].clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha)) * weight


gpt_oss_glu_weighted = compiled_on_cuda(_gpt_oss_glu_weighted)
gpt_oss_glu_weighted.__doc__ = (
    """gpt-oss' clamped SwiGLU of interleaved (gate, up) columns, times the routing weight."""
)


@dataclass
class _Slots:
    """A micro-batch's expert choices (tokens * k) that fall in the experts a stage holds, sorted by expert:
    row i of the grouped GEMMs is choice `order[i]`, of token `token[i]`, for expert `expert[i]` (counted from
    the stage's first); `inverse` maps each choice to its row (`rows` for a choice of another expert). The
    grouped kernel reads each expert's end row on the device (`offsets`), the loop the same ends on the host."""

    order: Tensor  # [rows]
    token: Tensor  # [rows]
    expert: Tensor  # [rows]
    inverse: Tensor  # [tokens * k]
    k: int
    n_experts: int
    grouped: bool  # torch._grouped_mm, else a loop over the experts

    @classmethod
    def of_choices(
        cls, top_index: Tensor, n_experts: int, first: int, stop: int, n_rows: int | None, grouped: bool
    ) -> "_Slots | None":
        """The choices `top_index` [tokens, k] of experts first..stop-1 of n_experts (stop 0: all), sorted by
        expert; None where none chose them. `n_rows`: how many choices fall in them, where already known (else
        read from the device). `grouped`: torch._grouped_mm runs the experts."""
        count = (stop or n_experts) - first
        flat = top_index.reshape(-1)
        if count == n_experts:
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
        k = top_index.shape[-1]
        return cls(order, order // k, expert[order], inverse, k, count, grouped)

    @property
    def rows(self) -> int:
        return self.order.numel()

    @functools.cached_property
    def offsets(self) -> Tensor:
        """[n_experts] int32, each expert's end row: a binary search of the sorted `expert` per expert (counting
        the rows by atomic adds into so few counters took 0.18 ms at OLMoE's 262k rows on an H200, this 0.01)."""
        experts = torch.arange(self.n_experts, device=self.expert.device, dtype=self.expert.dtype)
        return torch.searchsorted(self.expert, experts, right=True, out_int32=True)

    def runs(self):
        """(expert, its rows as a slice) for each expert with rows, in row order (the loop's), from `offsets`
        read on the host (which waits for the device)."""
        start = 0
        for expert, end in enumerate(self.offsets.tolist()):
            if end > start:
                yield expert, slice(start, end)
            start = end


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


def _grouped_linear_backward(
    x: Tensor, weight: Tensor, grad: Tensor, slots: _Slots, into: Tensor | None, weight_grad: bool = True
):
    """The backward of `_grouped_matmul(x, weight)` for `grad` [rows, out]: (x's gradient, the weight's, or None
    where it was added into `into` (`_add_grouped_weight_grad`) or no `weight_grad` is wanted: a frozen weight's)."""
    grad = grad.contiguous()
    grad_x = _grouped_input_grad(weight, grad, slots)
    return grad_x, _add_grouped_weight_grad(x, weight, grad, slots, into) if weight_grad else None


def _grouped_input_grad(weight: Tensor, grad: Tensor, slots: _Slots) -> Tensor:
    """The gradient of `_grouped_matmul(x, weight)`'s input x for `grad` [rows, out] (contiguous)."""
    return _grouped_matmul(grad, weight.transpose(1, 2), slots)


def _add_grouped_weight_grad(x: Tensor, weight: Tensor, grad: Tensor, slots: _Slots, into: Tensor | None):
    """The gradient of `_grouped_matmul(x, weight)`'s weight for `grad` [rows, out] (contiguous): added into `into`
    (None returned), by the grouped kernel that accumulates in fp32 (`expert_kernels`) where the experts run
    grouped in bf16; or returned where `into` is None. Computed in the orientation its storage has, so that
    adding it reads and writes memory in order."""
    target = weight if into is None else into
    out_in = target.transpose(1, 2).is_contiguous()  # stored [n_experts, out, in]: transformers' per-expert layout
    a, b = (grad, x) if out_in else (x, grad)  # the gradient in its storage's orientation: a^T b per expert
    if into is not None and slots.grouped and expert_kernels.runs_on(grad, into):
        expert_kernels.add_grouped_weight_grad_(into.transpose(1, 2) if out_in else into, a, b, slots.offsets)
        return None
    grad_weight = _grouped_weight_grad(a, b, slots)
    grad_weight = grad_weight.transpose(1, 2) if out_in else grad_weight
    if into is None:
        return grad_weight
    into.add_(grad_weight)
    return None


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
        wanted = ctx.into is not None or ctx.needs_input_grad[1]  # (a frozen expert's weight gradient is not)
        grad_x, grad_weight = _grouped_linear_backward(x, weight, grad, ctx.slots, ctx.into, wanted)
        return grad_x, grad_weight, None, None, None


def _grouped_linear(
    x: Tensor, weight: "Tensor | BoundWeight | ProductKeeper | AdaptedExperts", slots: _Slots, out_in: bool
) -> Tensor:
    """x [rows, in] grouped by expert times each expert's matrix, stored [n_experts, out, in] (`out_in`:
    transformers' per-expert layout) or [n_experts, in, out] (the fused one), as `ops.linear` treats a
    `BoundWeight` (gradient into its buffer, its product standing for the GEMMs), a `ProductKeeper` and LoRA's
    `AdaptedExperts` (the base's product plus each expert's low-rank delta)."""
    if isinstance(weight, AdaptedExperts):
        low_slots = _low_rank_slots(weight, x, slots)
        low = _grouped_linear(x, weight.down, low_slots, out_in=True) * weight.scale
        return _grouped_linear(x, weight.base, slots, out_in) + _grouped_linear(low, weight.up, low_slots, True)
    if isinstance(weight, BoundWeight):
        into = None if weight.grad is None else _in_out(weight.grad, out_in)
        return _GroupedLinear.apply(x, _in_out(weight.value, out_in), slots, into, weight.product)
    if isinstance(weight, ProductKeeper):
        return weight.put(_grouped_matmul(x, _in_out(weight.value, out_in), slots))
    return _GroupedLinear.apply(x, _in_out(weight, out_in), slots, None, None)


def _low_rank_slots(adapted: AdaptedExperts, x: Tensor, slots: _Slots) -> _Slots:
    """The slots of the adapters' low-rank GEMMs: `slots`, or their loop's where the grouped kernel cannot read the
    rank's rows (16-byte aligned: a bf16 rank of 8 or more)."""
    aligned = _value(adapted.up).shape[-1] * x.element_size() % 16 == 0
    return slots if aligned or not slots.grouped else replace(slots, grouped=False)


def adapters_input_grad(adapted: AdaptedExperts, grad: Tensor, slots: _Slots) -> tuple[Tensor, Tensor]:
    """For `grad` [rows, out] of the adapters' delta (scale * x A_e^T) B_e^T: (the gradient of its scaled low-rank
    product [rows, R], already times the scale; its gradient of x [rows, in]). `slots`: `_low_rank_slots`'."""
    grad_low = _grouped_matmul(grad, _value(adapted.up), slots) * adapted.scale
    return grad_low, _grouped_matmul(grad_low, _value(adapted.down), slots)


def add_adapters_weight_grads(adapted: AdaptedExperts, x: Tensor, grad: Tensor, grad_low: Tensor, slots: _Slots):
    """Add the adapters' gradients for `grad` [rows, out] (contiguous) of their delta of `x` [rows, in] into their
    buffers: each dA_e = grad_low_e^T x_e, dB_e = grad_e^T (scale x_e A_e^T) (`grad_low`: `adapters_input_grad`'s)."""
    down, up = adapted.down, adapted.up
    a_in_out = down.value.transpose(1, 2)
    _add_grouped_weight_grad(x, a_in_out, grad_low, slots, down.grad.transpose(1, 2))
    low = _grouped_matmul(x, a_in_out, slots) * adapted.scale
    _add_grouped_weight_grad(low, up.value.transpose(1, 2), grad, slots, up.grad.transpose(1, 2))


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


def _to_rows(h: Tensor, slots: _Slots) -> Tensor:
    """[rows, d]: each token's row of h [tokens, d] copied to its choices' rows, x[i] = h[token[i]] (on CUDA by one
    kernel that reads h once, `expert_kernels.copy_to_rows`)."""
    if expert_kernels.copies_on(h):
        return expert_kernels.copy_to_rows(h, slots.inverse, slots.rows, slots.k)
    return h.index_select(0, slots.token)


class _Dispatch(torch.autograd.Function):
    """Each token's row copied to its expert rows: x[i] = h[token[i]]. Backward gathers the k rows'
    gradients back and sums them, with no atomics (index_add would collide k ways)."""

    @staticmethod
    def forward(ctx, h: Tensor, slots: _Slots) -> Tensor:
        ctx.slots = slots
        return _to_rows(h, slots)

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
        return _to_rows(grad, ctx.slots), None
