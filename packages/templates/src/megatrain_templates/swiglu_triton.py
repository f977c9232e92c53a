"""The Triton kernels behind `swiglu_kernels` (imported only where they run: on CUDA, or under Triton's CPU
interpreter)."""

import triton
import triton.language as tl


@triton.jit
def swiglu_forward(gate_up_ptr, weight_ptr, out_ptr, d_ff, BLOCK: tl.constexpr, WEIGHTED: tl.constexpr):
    """out[row, j] = silu(gate[row, j]) * up[row, j] (times weight[row] where WEIGHTED) for the columns of block
    `program_id(1)` of row `program_id(0)`: gate_up [rows, 2 * d_ff] (gate first), out [rows, d_ff] row-major,
    weight [rows]; computed in fp32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < d_ff
    gate = tl.load(gate_up_ptr + row * 2 * d_ff + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * d_ff + d_ff + columns, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    if WEIGHTED:
        out = out * tl.load(weight_ptr + row).to(tl.float32)
    tl.store(out_ptr + row * d_ff + columns, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_backward(
    gate_up_ptr, grad_ptr, weight_ptr, grad_gate_up_ptr, weight_sums_ptr, out_ptr, d_ff,
    BLOCK: tl.constexpr, WEIGHTED: tl.constexpr, WRITE_OUT: tl.constexpr,
):  # fmt: skip
    """The gradients of gate and up from the output's `grad` [rows, d_ff], into grad_gate_up [rows, 2 * d_ff]: each
    input read once and each gradient written once, computed in fp32 and rounded once. WEIGHTED: the output was
    scaled by weight[row], whose gradient's part from this block's columns goes to weight_sums[row, block] (fp32).
    WRITE_OUT: the forward's output too, into out [rows, d_ff] (as `swiglu_forward` rounds it), for a backward
    whose recompute would otherwise have run the forward only to give the next GEMM's weight gradient its input."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < d_ff
    gate = tl.load(gate_up_ptr + row * 2 * d_ff + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * d_ff + d_ff + columns, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + row * d_ff + columns, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    if WRITE_OUT:
        out = silu * up
        if WEIGHTED:
            out = out * tl.load(weight_ptr + row).to(tl.float32)
        tl.store(out_ptr + row * d_ff + columns, out.to(out_ptr.dtype.element_ty), mask=mask)
    if WEIGHTED:
        tl.store(weight_sums_ptr + row * tl.num_programs(1) + tl.program_id(1), tl.sum(grad * silu * up))
        grad = grad * tl.load(weight_ptr + row).to(tl.float32)
    grad_gate = grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    grad_up = grad * silu
    element = grad_gate_up_ptr.dtype.element_ty
    tl.store(grad_gate_up_ptr + row * 2 * d_ff + columns, grad_gate.to(element), mask=mask)
    tl.store(grad_gate_up_ptr + row * 2 * d_ff + d_ff + columns, grad_up.to(element), mask=mask)
