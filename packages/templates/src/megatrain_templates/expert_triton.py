"""The Triton kernel behind `expert_kernels` (imported only where it runs: on CUDA, or under Triton's CPU
interpreter)."""

import triton
import triton.language as tl

try:  # (TMA's descriptors: Triton 3.4 on; None before, where the kernel reads every row by masked loads)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None


@triton.jit
def grouped_weight_grad_into(
    a_ptr, b_ptr, c_ptr, ends_ptr, m, n, stride_a, stride_b, stride_ce, stride_cm, stride_cn, a_desc, b_desc,
    a_rows_ptr, b_rows_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
    GATHER_A: tl.constexpr, GATHER_B: tl.constexpr,
):  # fmt: skip
    """c[e] += a[rows of e]^T @ b[rows of e] for the [BLOCK_M, BLOCK_N] tile `program_id(0)` of expert
    `program_id(1)`: a [rows, m] and b [rows, n] row-major, the rows grouped by expert (expert e's end row at
    ends[e]), c [experts, m, n] fp32 of any strides. The product accumulates in fp32 registers and is added to c
    once: no half-precision product is rounded, written and read back. `TMA`: an expert's whole BLOCK_K row
    chunks are read by the tensor-memory accelerator through `a_desc`, `b_desc` (its last, partial chunk by
    masked loads: the rows after it are the next expert's). `GATHER_A`: row i of a is a's row a_rows[i] (the
    tokens' rows read where they are, no [rows, m] copy of them made; by pointer loads, TMA reading only b);
    `GATHER_B` as much for b."""
    expert = tl.program_id(1)
    end = tl.load(ends_ptr + expert).to(tl.int64)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
    if end == start:  # no rows: nothing to add
        return
    tiles_n = tl.cdiv(n, BLOCK_N)
    m0, n0 = (tl.program_id(0) // tiles_n) * BLOCK_M, (tl.program_id(0) % tiles_n) * BLOCK_N
    ms, ns = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N)
    m_in, n_in = ms < m, ns < n
    at = c_ptr + expert.to(tl.int64) * stride_ce + ms[:, None].to(tl.int64) * stride_cm + ns[None, :] * stride_cn
    mask = m_in[:, None] & n_in[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    masked_from = start
    if TMA:  # (a descriptor's coordinates are int32: fewer rows than that, as the ends are)
        masked_from = start + (end - start) // BLOCK_K * BLOCK_K
        for first in range(start.to(tl.int32), masked_from.to(tl.int32), BLOCK_K):
            rows = first + tl.arange(0, BLOCK_K).to(tl.int64)
            if GATHER_A:
                a = _chunk(a_ptr, a_rows_ptr, rows, rows < end, ms, m_in, stride_a, True)
            else:
                a = a_desc.load([first, m0])
            if GATHER_B:
                b = _chunk(b_ptr, b_rows_ptr, rows, rows < end, ns, n_in, stride_b, True)
            else:
                b = b_desc.load([first, n0])
            acc = tl.dot(tl.trans(a), b, acc)
    for first in range(masked_from, end, BLOCK_K):
        rows = first + tl.arange(0, BLOCK_K).to(tl.int64)
        in_rows = rows < end
        a = _chunk(a_ptr, a_rows_ptr, rows, in_rows, ms, m_in, stride_a, GATHER_A)
        b = _chunk(b_ptr, b_rows_ptr, rows, in_rows, ns, n_in, stride_b, GATHER_B)
        acc = tl.dot(tl.trans(a), b, acc)
    tl.store(at, tl.load(at, mask=mask) + acc, mask=mask)


@triton.jit
def _chunk(ptr, rows_ptr, rows, in_rows, columns, in_columns, stride, GATHER: tl.constexpr):
    """The [rows, columns] chunk of a row-major operand by masked loads; `GATHER`: row i read from the operand's
    row rows_ptr[i]."""
    if GATHER:
        rows = tl.load(rows_ptr + rows, mask=in_rows, other=0).to(tl.int64)
    at = ptr + rows[:, None] * stride + columns[None, :]
    return tl.load(at, mask=in_rows[:, None] & in_columns[None, :], other=0.0)
