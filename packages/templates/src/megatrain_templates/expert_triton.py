"""The Triton kernel behind `expert_kernels` (imported only where it runs: on CUDA, or under Triton's CPU
interpreter)."""

import triton
import triton.language as tl


@triton.jit
def grouped_weight_grad_into(
    a_ptr, b_ptr, c_ptr, ends_ptr, m, n, stride_a, stride_b, stride_ce, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c[e] += a[rows of e]^T @ b[rows of e] for the [BLOCK_M, BLOCK_N] tile `program_id(0)` of expert
    `program_id(1)`: a [rows, m] and b [rows, n] row-major, the rows grouped by expert (expert e's end row at
    ends[e]), c [experts, m, n] fp32 of any strides. The product accumulates in fp32 registers and is added to c
    once: no half-precision product is rounded, written and read back."""
    expert = tl.program_id(1)
    end = tl.load(ends_ptr + expert).to(tl.int64)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    if end == start:  # no rows: nothing to add
        return
    tiles_n = tl.cdiv(n, BLOCK_N)
    ms = (tl.program_id(0) // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_in, n_in = ms < m, ns < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for first in range(start, end, BLOCK_K):
        rows = first + tl.arange(0, BLOCK_K).to(tl.int64)
        in_rows = rows < end
        a = tl.load(a_ptr + rows[:, None] * stride_a + ms[None, :], mask=in_rows[:, None] & m_in[None, :], other=0.0)
        b = tl.load(b_ptr + rows[:, None] * stride_b + ns[None, :], mask=in_rows[:, None] & n_in[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    at = c_ptr + expert.to(tl.int64) * stride_ce + ms[:, None].to(tl.int64) * stride_cm + ns[None, :] * stride_cn
    mask = m_in[:, None] & n_in[None, :]
    tl.store(at, tl.load(at, mask=mask) + acc, mask=mask)
