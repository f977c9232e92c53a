"""Attention by fused kernels called directly: flash attention's sliding window (Gemma 3's windowed layers),
cuDNN's causal attention with gpt-oss' sink logits folded in (its full layers), and plain causal attention
whose output and log-sum-exp a forward keeps for the backward (`KeptAttention`).

A kernel pair is forward(q, k, v, scale) -> (out, lse) and backward(grad_out, q, k, v, out, lse, scale) ->
(dq, dk, dv), q/k/v/out [batch, heads, seq, head_dim] (k and v may have fewer heads), lse [batch, heads, seq]
in at least fp32. A sink s joins each row's softmax denominator without a value, so the output is the kernel's
times gate = sigmoid(lse - s). Its backward needs no kernel of its own: given the gradient times the gate and
the gated output in place of the output, the kernel's row term rowsum(grad' o out') is gate^2 rowsum(grad o
out), which is the output path's gate rowsum(grad o out) less the lse path's gate (1 - gate) rowsum(grad o
out).

Where they run rather than FlexAttention (`masked_attention` decides), measured on an H100 over 4 x 4096
tokens, forward + recompute + backward: a window of 1024 with heads of 256 (Gemma 3 4B), 2.6 against 3.9 ms
(at 128 and 64 FlexAttention's window is the faster, 4.3 against 5.4 ms and 2.3 against 2.6); full causal
attention with sinks, 64 heads of 64 (gpt-oss), 8.9 against 13.0 ms (a window of 128 with sinks stays with
FlexAttention: 4.1 against 5.1).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from .ops import upcast

KernelPair = tuple[Callable, Callable]


def flash_window_wins(q: Tensor) -> bool:
    """Whether flash attention's sliding window beats FlexAttention for q (and its k, v): half precision on
    an Ampere-or-newer GPU and heads wider than 128 (Gemma's 256), of which FlexAttention's generated kernel
    fits only small tiles in shared memory."""
    return _half_on_ampere(q) and 128 < q.shape[-1] <= 256 and torch.backends.cuda.flash_sdp_enabled()


def cudnn_fits(q: Tensor) -> bool:
    """Whether cuDNN's fused attention (cuDNN 9) takes q and its k, v."""
    return (
        _half_on_ampere(q)
        and q.shape[-1] <= 256
        and torch.backends.cuda.cudnn_sdp_enabled()
        and (torch.backends.cudnn.version() or 0) >= 90000
    )


def _half_on_ampere(q: Tensor) -> bool:
    return (
        q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and q.shape[-1] % 8 == 0
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


# a block's weights' entry for where its attention's results are kept (a `KeptAttention`), if anywhere
KEPT_ATTENTION = "kept_attention"
KEPT_ATTENTION_OUT = "attention out"  # (the product naming its output: kept where a forward kept the results)
_KEPT_NAMES = (KEPT_ATTENTION_OUT, "attention lse")


@dataclass(frozen=True)
class KeptAttention:
    """A forward's causal attention output and row log-sum-exp kept in `products`, a layer's kept products, for
    the backward's recompute to give them to the kernel's backward instead of running the forward kernel again:
    `keep` True, the forward puts them there; False, the recompute takes them from there. At Qwen2.5-7B's shape
    (16k tokens of 4096) that skips one cuDNN forward, about 1 ms a layer on an H200, for 7 KB a token
    (`bytes_per_token`)."""

    products: dict
    keep: bool

    def kernels(self, q: Tensor) -> KernelPair | None:
        """The kernel pair that takes q where this keeps (or a forward kept) the results; None: recompute."""
        if not (self.keep or KEPT_ATTENTION_OUT in self.products):
            return None
        if cudnn_fits(q):
            return CUDNN_CAUSAL
        return CPU_CAUSAL if q.device.type == "cpu" else None

    def results(self) -> tuple[Tensor, Tensor] | None:
        """(out, lse) where a forward kept them and this is the recompute, else None."""
        if self.keep or KEPT_ATTENTION_OUT not in self.products:
            return None
        return self.products[KEPT_ATTENTION_OUT], self.products[_KEPT_NAMES[1]]

    def put(self, out: Tensor, lse: Tensor) -> None:
        """Keep (out, lse) where this is the keeping forward."""
        if self.keep:
            self.products.update(zip(_KEPT_NAMES, (out, lse)))

    @staticmethod
    def bytes_per_token(n_heads: int, head_dim: int, element_size: int) -> int:
        """What `put` keeps a token: the output in the compute dtype, the log-sum-exp in at least fp32."""
        return n_heads * (head_dim * element_size + max(element_size, 4))


def kept_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None, kept: KeptAttention) -> Tensor | None:
    """Causal attention whose results `kept` keeps or gives (shapes as `causal_attention`); None where no kernel
    pair takes q or no forward kept them (the caller's own kernel then)."""
    kernels = kept.kernels(q)
    if kernels is None:
        return None
    return kernel_attention(q, k, v, None, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, kernels, kept)


def kernel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    scale: float,
    kernels: KernelPair,
    kept: KeptAttention | None = None,
) -> Tensor:
    """Attention by `kernels` (a pair, see the module docstring; `flash_window`, `CUDNN_CAUSAL` or `CPU_CAUSAL`),
    with per-head sink logits `sinks` [n_heads] folded in when given. Shapes as `causal_attention`. `kept`: where
    the kernel's results are kept, or taken from instead of running it."""
    return _KernelAttention.apply(q, k, v, sinks, scale, kernels, kept)


def _sink_gate(lse: Tensor, sinks: Tensor) -> Tensor:  # [batch, heads, seq] fp32
    return torch.sigmoid(lse - upcast(sinks).view(1, -1, 1))


def _gated(out: Tensor, gate: Tensor) -> Tensor:
    return (out * gate.unsqueeze(-1)).to(out.dtype)


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks: Tensor | None, scale: float, kernels: KernelPair, kept: KeptAttention | None):
        results = None if kept is None else kept.results()
        out, lse = kernels[0](q, k, v, scale) if results is None else results
        if kept is not None:
            kept.put(out, lse)
        ctx.scale, ctx.kernels, ctx.has_sinks = scale, kernels, sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return _gated(out, _sink_gate(lse, sinks)) if ctx.has_sinks else out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        backward = ctx.kernels[1]
        if not ctx.has_sinks:
            return *backward(grad, q, k, v, out, lse, ctx.scale), None, None, None, None
        gate = _sink_gate(lse, sinks)
        row = (upcast(grad) * upcast(out)).sum(-1)  # rowsum(grad o out); the sink's path: see the module docstring
        grad_sinks = -(row * gate * (1 - gate)).sum((0, 2)).to(sinks.dtype)
        # the gated output again (the forward's, bit for bit) rather than kept from it
        grads = backward(_gated(grad, gate), q, k, v, _gated(out, gate), lse, ctx.scale)
        return *grads, grad_sinks, None, None, None


def _flash_window_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int) -> tuple[Tensor, Tensor]:
    seq = q.shape[2]
    rows = (t.transpose(1, 2) for t in (q, k, v))  # the kernel's layout: [batch, seq, heads, head_dim]
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        *rows, None, None, seq, seq, 0.0, True, False, scale=scale, window_size_left=window - 1, window_size_right=0
    )  # the kernel's window: keys i - left .. i
    return out.transpose(1, 2), lse


def _flash_window_backward(grad_out, q, k, v, out, lse, scale: float, window: int):
    seq = q.shape[2]
    rows = (t.transpose(1, 2) for t in (grad_out.contiguous(), q, k, v, out))
    no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
    grads = torch.ops.aten._flash_attention_backward(
        *rows, lse, None, None, seq, seq, 0.0, True, *no_dropout,
        scale=scale, window_size_left=window - 1, window_size_right=0,
    )  # fmt: skip
    return tuple(g.transpose(1, 2) for g in grads)


def flash_window(window: int) -> KernelPair:
    """Flash attention's kernels over the last `window` keys (the query's own included)."""
    return partial(_flash_window_forward, window=window), partial(_flash_window_backward, window=window)


def _cudnn_causal_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale
    )
    return out, lse.squeeze(-1)


def _cudnn_causal_backward(grad_out, q, k, v, out, lse, scale: float):
    seq, unread = q.shape[2], torch.empty(0, device=q.device)  # no dropout: its seed and offset
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, q, k, v, out, lse.unsqueeze(-1), unread, unread, None, None, None, seq, seq, 0.0, True, scale=scale
    )


CUDNN_CAUSAL: KernelPair = (_cudnn_causal_forward, _cudnn_causal_backward)


def _cpu_causal_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    # (the kernel F.scaled_dot_product_attention runs on the CPU, bit for bit; k and v may have fewer heads)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)


def _cpu_causal_backward(grad_out, q, k, v, out, lse, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, True, scale=scale
    )


CPU_CAUSAL: KernelPair = (_cpu_causal_forward, _cpu_causal_backward)
