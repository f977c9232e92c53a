"""The chunked recurrence's state pass (`chunked_recurrence.state_pass`) as Triton kernels, forward and backward.

The state pass is sequential over chunks but independent across heads and across the state's value columns
(delta_c's column j reads only S's column j), so each program owns one head's [d_k, BLOCK_V] slice of S, keeps
it in registers and walks the chunks: two small matmuls a chunk each way, instead of two to four launches a
chunk from a Python loop. fp32 in and out; the matmuls take fp32 operands exactly ("ieee"), or rounded to TF32
where the inputs came in a half type.
"""

import torch
from torch import Tensor

BLOCK_V = 32  # value columns a program owns: d_k x 32 fp32 of state in registers at 4 warps
# a chunk's loads in flight: three (Triton's default) took 240 KB of shared memory at d_k 128 with TF32 on Hopper
STAGES = 2


def runs_on(t: Tensor, chunk: int, d_k: int) -> bool:
    """Whether the kernels take a state pass over `t` (fp32 on CUDA) in chunks of `chunk` tokens with keys of
    `d_k`: a chunk a power of two that a matmul tile takes, keys up to the 128 measured (Qwen3.5's, Qwen3-Next's,
    Granite 4.0-H's state; at 256 a stage's loads alone would take 136 KB of shared memory)."""
    return t.is_cuda and t.dtype == torch.float32 and chunk in (16, 32, 64, 128) and d_k <= 128


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def state_pass(w: Tensor | None, u: Tensor, k_end: Tensor, carry: Tensor, tf32: bool) -> tuple[Tensor, Tensor]:
    """As `chunked_recurrence.state_pass`: w, u, k_end [..., N, C, d], carry [..., N, 1, 1]."""
    import triton

    lead, (n_chunks, chunk, d_v), d_k = u.shape[:-3], u.shape[-3:], k_end.shape[-1]
    u_, k_, w_, g = _per_head(u, k_end, w, carry)
    heads = u_.shape[0]
    states = u_.new_empty(heads, n_chunks, d_k, d_v)
    delta = u_ if w is None else torch.empty_like(u_)
    grid = (heads, triton.cdiv(d_v, BLOCK_V))
    _kernels()[0][grid](
        w_, u_, k_, g, states, delta, n_chunks, d_k, d_v,
        CHUNK=chunk, BLOCK_K=_pow2(d_k), BLOCK_V=BLOCK_V, HAS_W=w is not None, PRECISION=_precision(tf32),
        num_stages=STAGES,
    )  # fmt: skip
    return states.reshape(*lead, n_chunks, d_k, d_v), delta.reshape(*lead, n_chunks, chunk, d_v)


def state_pass_backward(w, k_end, carry, d_states, d_delta, tf32: bool) -> tuple[Tensor, Tensor]:
    """As `chunked_recurrence.state_pass_backward`."""
    import triton

    lead, (n_chunks, chunk, d_v), d_k = d_delta.shape[:-3], d_delta.shape[-3:], k_end.shape[-1]
    d_d, k_, w_, g = _per_head(d_delta, k_end, w, carry)
    d_s = d_states.reshape(-1, n_chunks, d_k, d_v).contiguous()
    heads = d_d.shape[0]
    d_delta_total, d_leaving = torch.empty_like(d_d), torch.empty_like(d_s)
    grid = (heads, triton.cdiv(d_v, BLOCK_V))
    _kernels()[1][grid](
        w_, k_, g, d_s, d_d, d_delta_total, d_leaving, n_chunks, d_k, d_v,
        CHUNK=chunk, BLOCK_K=_pow2(d_k), BLOCK_V=BLOCK_V, HAS_W=w is not None, PRECISION=_precision(tf32),
        num_stages=STAGES,
    )  # fmt: skip
    return d_delta_total.reshape(d_delta.shape), d_leaving.reshape(*lead, n_chunks, d_k, d_v)


def _per_head(values: Tensor, k_end: Tensor, w: Tensor | None, carry: Tensor) -> tuple[Tensor, ...]:
    """The kernels' operands, contiguous with the heads (all leading dims) flattened: values [heads, N, C, d_v],
    k_end and w [heads, N, C, d_k] (w k_end's buffer where None: HAS_W leaves it unread), carry [heads, N]."""
    n_chunks = values.shape[-3]
    values, k_end = (t.reshape(-1, *t.shape[-3:]).contiguous() for t in (values, k_end))
    w = k_end if w is None else w.reshape(k_end.shape).contiguous()
    return values, k_end, w, carry.reshape(-1, n_chunks).contiguous()


def _precision(tf32: bool) -> str:
    return "tf32" if tf32 else "ieee"


_KERNELS = None


def _kernels():
    """(forward, backward) kernels, defined on first use: Triton is imported only where a state pass runs on
    CUDA."""
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _define_kernels()
    return _KERNELS


def _define_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def forward(
        w_ptr, u_ptr, k_ptr, carry_ptr, states_ptr, delta_ptr, n_chunks, d_k, d_v,
        CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_W: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, CHUNK)
        ks = tl.arange(0, BLOCK_K)
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        k_in, v_in = ks < d_k, vs < d_v
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
        for c in range(n_chunks):
            chunk = head * n_chunks + c
            tl.store(states_ptr + (chunk * d_k + ks[:, None]) * d_v + vs[None, :], state, k_in[:, None] & v_in[None, :])
            rows_v = (chunk * CHUNK + rows[:, None]) * d_v + vs[None, :]
            rows_k = (chunk * CHUNK + rows[:, None]) * d_k + ks[None, :]
            delta = tl.load(u_ptr + rows_v, mask=v_in[None, :], other=0.0)
            if HAS_W:
                w = tl.load(w_ptr + rows_k, mask=k_in[None, :], other=0.0)
                delta -= tl.dot(w, state, input_precision=PRECISION)
                tl.store(delta_ptr + rows_v, delta, mask=v_in[None, :])
            keys = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
            state = state * tl.load(carry_ptr + chunk) + tl.dot(tl.trans(keys), delta, input_precision=PRECISION)

    @triton.jit
    def backward(
        w_ptr, k_ptr, carry_ptr, d_states_ptr, d_delta_ptr, d_delta_total_ptr, d_leaving_ptr, n_chunks, d_k, d_v,
        CHUNK: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_W: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        head = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, CHUNK)
        ks = tl.arange(0, BLOCK_K)
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        k_in, v_in = ks < d_k, vs < d_v
        state_mask = k_in[:, None] & v_in[None, :]
        d_leaving = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)  # by the state leaving chunk c
        for back in range(n_chunks):
            chunk = head * n_chunks + (n_chunks - 1 - back)
            states_at = (chunk * d_k + ks[:, None]) * d_v + vs[None, :]
            tl.store(d_leaving_ptr + states_at, d_leaving, state_mask)
            rows_v = (chunk * CHUNK + rows[:, None]) * d_v + vs[None, :]
            rows_k = (chunk * CHUNK + rows[:, None]) * d_k + ks[None, :]
            keys = tl.load(k_ptr + rows_k, mask=k_in[None, :], other=0.0)
            d_delta = tl.load(d_delta_ptr + rows_v, mask=v_in[None, :], other=0.0)
            d_delta += tl.dot(keys, d_leaving, input_precision=PRECISION)
            tl.store(d_delta_total_ptr + rows_v, d_delta, mask=v_in[None, :])
            entering = tl.load(d_states_ptr + states_at, mask=state_mask, other=0.0)
            d_leaving = entering + tl.load(carry_ptr + chunk) * d_leaving  # by the state entering chunk c
            if HAS_W:
                w = tl.load(w_ptr + rows_k, mask=k_in[None, :], other=0.0)
                d_leaving -= tl.dot(tl.trans(w), d_delta, input_precision=PRECISION)

    return forward, backward
