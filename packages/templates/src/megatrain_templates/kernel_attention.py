"""Masked attention by fused kernels called directly: flash attention's sliding window (Gemma 3's windowed
layers) and cuDNN's causal attention with gpt-oss' sink logits folded in (its full layers).

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

from collections.abc import Callable
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


def kernel_attention(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, scale: float, kernels: KernelPair
) -> Tensor:
    """Attention by `kernels` (a pair, see the module docstring; `flash_window` or `CUDNN_CAUSAL`), with per-head
    sink logits `sinks` [n_heads] folded in when given. Shapes as `causal_attention`."""
    return _KernelAttention.apply(q, k, v, sinks, scale, kernels)


def _sink_gate(lse: Tensor, sinks: Tensor) -> Tensor:  # [batch, heads, seq] fp32
    return torch.sigmoid(lse - upcast(sinks).view(1, -1, 1))


def _gated(out: Tensor, gate: Tensor) -> Tensor:
    return (out * gate.unsqueeze(-1)).to(out.dtype)


class _KernelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, scale: float, kernels: KernelPair):
        out, lse = kernels[0](q, k, v, scale)
        ctx.scale, ctx.kernels, ctx.has_sinks = scale, kernels, sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return _gated(out, _sink_gate(lse, sinks)) if ctx.has_sinks else out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        backward = ctx.kernels[1]
        if not ctx.has_sinks:
            return *backward(grad, q, k, v, out, lse, ctx.scale), None, None, None
        gate = _sink_gate(lse, sinks)
        row = (upcast(grad) * upcast(out)).sum(-1)  # rowsum(grad o out); the sink's path: see the module docstring
        grad_sinks = -(row * gate * (1 - gate)).sum((0, 2)).to(sinks.dtype)
        # the gated output again (the forward's, bit for bit) rather than kept from it
        grads = backward(_gated(grad, gate), q, k, v, _gated(out, gate), lse, ctx.scale)
        return *grads, grad_sinks, None, None


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
