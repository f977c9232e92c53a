"""SwiGLU, silu(gate) * up of a [..., 2 * d_ff] projection, by two Triton kernels on CUDA. Compiled by Inductor, its
backward wrote the two halves' gradients as one concatenated output, each element of which read its half's inputs
(the gate and the output's gradient twice): on Qwen2.5-7B's [16384, 2 * 18944] 1.6 ms, against the 0.65 ms its five
passes over [16384, 18944] take at the H200's memory bandwidth. Here each program reads a row's columns of gate, up
and the gradient once and writes both halves' gradients."""

import torch
from torch import Tensor

# the columns a program owns: wide enough for full memory transactions, few enough programs per row to be many rows'
BLOCK, WARPS = 1024, 4


def runs_on(gate_up: Tensor) -> bool:
    """Whether the kernels run `gate_up`: a CUDA tensor in a floating type Triton loads."""
    return gate_up.is_cuda and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32)


def swiglu_forward(gate_up: Tensor) -> Tensor:
    from . import swiglu_triton

    d_ff = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * d_ff)
    out = gate_up.new_empty(*gate_up.shape[:-1], d_ff)
    if rows:
        grid = (rows, -(-d_ff // BLOCK))
        swiglu_triton.swiglu_forward[grid](gate_up, out, d_ff, BLOCK=BLOCK, num_warps=WARPS)
    return out


def swiglu_backward(gate_up: Tensor, grad: Tensor) -> Tensor:
    from . import swiglu_triton

    d_ff = gate_up.shape[-1] // 2
    rows = gate_up.numel() // (2 * d_ff)
    grad_gate_up = torch.empty_like(gate_up)
    if rows:
        grid = (rows, -(-d_ff // BLOCK))
        swiglu_triton.swiglu_backward[grid](
            gate_up, grad.contiguous(), grad_gate_up, d_ff, BLOCK=BLOCK, num_warps=WARPS
        )
    return grad_gate_up


class SwiGLU(torch.autograd.Function):
    """silu(gate) * up for a contiguous gate_up [..., 2 * d_ff] (gate first), both ways by the kernels."""

    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        return swiglu_forward(gate_up)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        return swiglu_backward(gate_up, grad)
