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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """c[e] += a[rows of e]^T @ b[rows of e] for the [BLOCK_M, BLOCK_N] tile `program_id(0)` of expert
    `program_id(1)`: a [rows, m] and b [rows, n] row-major, the rows grouped by expert (expert e's end row at
    ends[e]), c [experts, m, n] fp32 of any strides. The product accumulates in fp32 registers and is added to c
    once: no half-precision product is rounded, written and read back. `TMA`: an expert's whole BLOCK_K row
    chunks are read by the tensor-memory accelerator through `a_desc`, `b_desc` (its last, partial chunk by
    masked loads: the rows after it are the next expert's)."""
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
            a = a_desc.load([first, m0])
            b = b_desc.load([first, n0])
            acc = tl.dot(tl.trans(a), b, acc)
    for first in range(masked_from, end, BLOCK_K):
        rows = first + tl.arange(0, BLOCK_K).to(tl.int64)
        in_rows = rows < end
        a = tl.load(a_ptr + rows[:, None] * stride_a + ms[None, :], mask=in_rows[:, None] & m_in[None, :], other=0.0)
        b = tl.load(b_ptr + rows[:, None] * stride_b + ns[None, :], mask=in_rows[:, None] & n_in[None, :], other=0.0)
        acc = tl.dot(tl.trans(a), b, acc)
    tl.store(at, tl.load(at, mask=mask) + acc, mask=mask)


@triton.jit
def copy_to_rows(
    src_ptr, dst_ptr, rows_ptr, tokens, d, n_rows, stride_src,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """dst[rows[t * K + j]] = src[t] for each of the BLOCK_T tokens `program_id(0)` owns, j < K, in the BLOCK_D
    columns `program_id(1)` owns; a choice whose row is n_rows (an expert another stage holds) is not written.
    Each source row is read once and written K times, where a gather by each row's token reads it K times."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_in, c_in = ts < tokens, cols < d
    values = tl.load(src_ptr + ts[:, None] * stride_src + cols[None, :], mask=t_in[:, None] & c_in[None, :])
    for choice in tl.static_range(K):
        row = tl.load(rows_ptr + ts * K + choice, mask=t_in, other=n_rows).to(tl.int64)
        written = (row < n_rows)[:, None] & c_in[None, :]
        tl.store(dst_ptr + row[:, None] * d + cols[None, :], values, mask=written)
