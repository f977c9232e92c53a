"""The chunked recurrence (`chunked_recurrence`) as Triton kernels: its state pass, forward and backward, and the
chunk-local work on either side of it (forward: the UT transform, u and w before it, the output after it;
backward: the gradients by the states and corrected values before it, by the inputs after it).

The state pass is sequential over chunks but independent across heads and across the state's value columns
(delta_c's column j reads only S's column j), so each program owns one head's [d_k, BLOCK_V] slice of S, keeps
it in registers and walks the chunks: two small matmuls a chunk each way, instead of two to four launches a
chunk from a Python loop. The chunk-local kernels take one chunk of one head a program and keep its [C, C]
and [C, d_k] intermediates (decays, masks, scores, the UT system's gradient) in registers, where the eager
form wrote each to memory; the UT inverse, solved in 16-row blocks, works in its chunk's own [C, C] of the
output. fp32 in and out; the matmuls take fp32 operands exactly ("ieee"), or rounded to
TF32 where the inputs came in a half type.
"""

from typing import NamedTuple

import torch
from torch import Tensor


class Launch(NamedTuple):
    """How a kernel launches: the value columns a program takes at a time (the state pass's: owns; None for a
    kernel that takes none), the key columns at a time (None for a kernel that takes all at once; at most all),
    warps (None: `_state_warps`) and software-pipeline stages."""

    block_v: int | None
    key_step: int | None = None
    num_warps: int | None = 4
    num_stages: int = 3


# Each kernel's launch at Qwen3.5's shapes (d_k = d_v = 128, chunks of 64), the fastest of those
# `benchmarks/delta_kernels.py --sweep` times (`results/qwen3.5-delta-launches-h200.json`, an H200, the 0.8B's and
# the 27B's heads alike). The state pass keeps its [d_k, 64] fp32 slice of the state in registers (0.43 / 0.59 ms
# forward / backward for 64 heads of 64 chunks). The chunk-local kernels run out of registers before anything
# else: the backward through the UT transform is fastest at 4 warps and 32 keys a step (0.41 ms, against 0.99 at
# 8 warps), the backward's start at 1 stage (0.43 against 0.48).
LAUNCH = {
    "state_pass_forward": Launch(block_v=64, num_warps=None, num_stages=2),
    "state_pass_backward": Launch(block_v=64, num_warps=None, num_stages=2),
    "chunk_prepare": Launch(block_v=64),
    "chunk_backward_prepare": Launch(block_v=64, num_stages=1),
    "chunk_output": Launch(block_v=64),
    "chunk_backward_states": Launch(block_v=64, key_step=128, num_warps=8, num_stages=2),
    "chunk_backward_ut": Launch(block_v=None, key_step=32, num_warps=4, num_stages=1),
}


def runs_on(t: Tensor, chunk: int, d_k: int) -> bool:
    """Whether the kernels take a state pass over `t` (fp32 on CUDA) in chunks of `chunk` tokens with keys of
    `d_k`: a chunk a power of two that a matmul tile takes, keys up to the 128 measured (Qwen3.5's, Qwen3-Next's,
    Granite 4.0-H's state; at 256 a stage's loads alone would take 136 KB of shared memory)."""
    return t.is_cuda and t.dtype == torch.float32 and chunk in (16, 32, 64, 128) and d_k <= 128


def _state_warps(d_k: int, block_v: int) -> int:
    """Warps for a state pass program: at most 8, at least 16 of its state's elements a thread (8 elements a thread,
    at d_k 128 and 16 columns on 8 warps, crashed the state pass with an illegal address on an H100)."""
    return max(1, min(8, _pow2(d_k) * block_v // (16 * 32)))


def _launch(name: str, d_k: int) -> dict:
    """The launch arguments of kernel `name` (`LAUNCH`) at keys of `d_k`: warps, stages, and BLOCK_V and
    KEY_STEP where the kernel takes them."""
    launch = LAUNCH[name]
    warps = _state_warps(d_k, launch.block_v) if launch.num_warps is None else launch.num_warps
    arguments = dict(num_warps=warps, num_stages=launch.num_stages)
    if launch.block_v is not None:
        arguments["BLOCK_V"] = launch.block_v
    if launch.key_step is not None:
        arguments["KEY_STEP"] = min(launch.key_step, _pow2(d_k))
    return arguments


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def state_pass(w: Tensor | None, u: Tensor, k_end: Tensor, carry: Tensor, tf32: bool) -> tuple[Tensor, Tensor]:
    """As `chunked_recurrence.state_pass`: w, u, k_end [..., N, C, d], carry [..., N, 1, 1]."""
    lead, (n_chunks, chunk, d_v), d_k = u.shape[:-3], u.shape[-3:], k_end.shape[-1]
    u_, k_, w_, g = _per_head(u, k_end, w, carry)
    heads = u_.shape[0]
    states = u_.new_empty(heads, n_chunks, d_k, d_v)
    delta = u_ if w is None else torch.empty_like(u_)
    grid = (heads, -(-d_v // LAUNCH["state_pass_forward"].block_v))
    _kernels().state_pass_forward[grid](
        w_, u_, k_, g, states, delta, n_chunks, d_k, d_v,
        CHUNK=chunk, BLOCK_K=_pow2(d_k), HAS_W=w is not None, PRECISION=_precision(tf32),
        **_launch("state_pass_forward", d_k),
    )  # fmt: skip
    return states.reshape(*lead, n_chunks, d_k, d_v), delta.reshape(*lead, n_chunks, chunk, d_v)


def state_pass_backward(w, k_end, carry, d_states, d_delta, tf32: bool) -> tuple[Tensor, Tensor]:
    """As `chunked_recurrence.state_pass_backward`."""
    lead, (n_chunks, chunk, d_v), d_k = d_delta.shape[:-3], d_delta.shape[-3:], k_end.shape[-1]
    d_d, k_, w_, g = _per_head(d_delta, k_end, w, carry)
    d_s = d_states.reshape(-1, n_chunks, d_k, d_v).contiguous()
    heads = d_d.shape[0]
    d_delta_total, d_leaving = torch.empty_like(d_d), torch.empty_like(d_s)
    grid = (heads, -(-d_v // LAUNCH["state_pass_backward"].block_v))
    _kernels().state_pass_backward[grid](
        w_, k_, g, d_s, d_d, d_delta_total, d_leaving, n_chunks, d_k, d_v,
        CHUNK=chunk, BLOCK_K=_pow2(d_k), HAS_W=w is not None, PRECISION=_precision(tf32),
        **_launch("state_pass_backward", d_k),
    )  # fmt: skip
    return d_delta_total.reshape(d_delta.shape), d_leaving.reshape(*lead, n_chunks, d_k, d_v)


def chunk_prepare(k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor, docs, tf32: bool) -> tuple[Tensor, ...]:
    """As `chunked_recurrence._to_state_pass` with beta (shapes as `chunk_output`; v [batch, heads, N, C, d_v]):
    (u, w, k_end, carry [batch, heads, N, 1, 1], T = (I + L)^-1 [batch, heads, N, C, C] row-major)."""
    batch, heads, n_chunks, chunk, d_k = k.shape
    k, v, log_decay, beta = (t.contiguous() for t in (k, v, log_decay, beta))
    u, w, k_end = torch.empty_like(v), torch.empty_like(k), torch.empty_like(k)
    carry, ut_inverse = k.new_empty(batch, heads, n_chunks, 1, 1), k.new_empty(batch, heads, n_chunks, chunk, chunk)
    _kernels().chunk_prepare[(n_chunks, batch * heads)](
        k, v, log_decay, beta, _docs_or(docs, log_decay), ut_inverse, u, w, k_end, carry, n_chunks, heads, d_k,
        v.shape[-1], **_chunk_constants(chunk, d_k, docs, tf32), **_launch("chunk_prepare", d_k),
    )  # fmt: skip
    return u, w, k_end, carry, ut_inverse


def chunk_backward_prepare(q, k, log_decay, beta, ut_inverse, docs, d_out, tf32: bool) -> tuple[Tensor, ...]:
    """As `chunked_recurrence._back_to_state_pass` with beta (shapes as `chunk_prepare`; d_out like v): (w, k_end,
    carry, the gradient by the state entering each chunk [batch, heads, N, d_k, d_v], by the corrected values). The
    kernels read T row-major, as `chunk_prepare` leaves it (another layout is copied)."""
    batch, heads, n_chunks, chunk, d_k = k.shape
    q, k, log_decay, beta, ut_inverse, d_out = (t.contiguous() for t in (q, k, log_decay, beta, ut_inverse, d_out))
    d_v = d_out.shape[-1]
    w, k_end, d_delta = torch.empty_like(k), torch.empty_like(k), torch.empty_like(d_out)
    carry, d_states = k.new_empty(batch, heads, n_chunks, 1, 1), k.new_empty(batch, heads, n_chunks, d_k, d_v)
    _kernels().chunk_backward_prepare[(n_chunks, batch * heads)](
        q, k, log_decay, beta, ut_inverse, _docs_or(docs, log_decay), d_out, w, k_end, carry, d_states, d_delta,
        n_chunks, heads, d_k, d_v, **_chunk_constants(chunk, d_k, docs, tf32), **_launch("chunk_backward_prepare", d_k),
    )  # fmt: skip
    return w, k_end, carry, d_states, d_delta


def chunk_output(q: Tensor, k: Tensor, log_decay: Tensor, states: Tensor, delta: Tensor, docs, tf32: bool) -> Tensor:
    """As `chunked_recurrence._from_state_pass`: q, k [batch, heads, N, C, d_k], log_decay [batch, heads, N, C],
    states [batch, heads, N, d_k, d_v], delta [batch, heads, N, C, d_v]; docs: [batch, N * C] document ids, or
    None for one sequence per row."""
    batch, heads, n_chunks, chunk, d_k = q.shape
    d_v = delta.shape[-1]
    out = torch.empty_like(delta, memory_format=torch.contiguous_format)
    grid = (n_chunks, batch * heads, -(-d_v // LAUNCH["chunk_output"].block_v))
    _kernels().chunk_output[grid](
        q.contiguous(), k.contiguous(), log_decay.contiguous(), states.contiguous(), delta.contiguous(),
        _docs_or(docs, log_decay), out, n_chunks, heads, d_k, d_v,
        **_chunk_constants(chunk, d_k, docs, tf32), **_launch("chunk_output", d_k),
    )  # fmt: skip
    return out


def chunk_backward(q, k, v, log_decay, beta, ut_inverse, states, delta, d_out, d_u, d_leaving, docs, tf32: bool):
    """As `chunked_recurrence._back_from_state_pass` (shapes as `chunk_output`; v, d_out, d_u like delta; beta
    like log_decay or None; ut_inverse [batch, heads, N, C, C] or None; d_leaving like states): the gradients
    (by q, k, v, log_decay, beta or None). Two kernels where beta is given: one kernel's tiles for the UT
    transform's gradient too took 256 KB of shared memory with TF32 on Hopper."""
    batch, heads, n_chunks, chunk, d_k = q.shape
    has_beta, grid = beta is not None, (n_chunks, batch * heads)
    d_q, d_k_, d_v_, d_log_decay, d_beta = (
        None if t is None else torch.empty_like(t, memory_format=torch.contiguous_format)
        for t in (q, k, v, log_decay, beta)
    )
    d_w, d_t = (torch.empty_like(q), q.new_empty(*q.shape[:-1], chunk)) if has_beta else (None, None)
    q, k, v, log_decay, beta, ut_inverse, states, delta, d_out, d_u, d_leaving = (
        None if t is None else t.contiguous()
        for t in (q, k, v, log_decay, beta, ut_inverse, states, delta, d_out, d_u, d_leaving)
    )
    unread = log_decay  # the pointer for what beta None or docs None leave unread
    docs_ = _docs_or(docs, unread)
    constants = _chunk_constants(chunk, d_k, docs, tf32)
    _kernels().chunk_backward_states[grid](
        q, k, v, log_decay, *(unread if t is None else t for t in (beta, ut_inverse)), states, delta, d_out, d_u,
        d_leaving, docs_, d_q, d_k_, d_v_, d_log_decay, *(unread if t is None else t for t in (d_beta, d_w, d_t)),
        n_chunks, heads, d_k, v.shape[-1],
        HAS_BETA=has_beta, **constants, **_launch("chunk_backward_states", d_k),
    )  # fmt: skip
    if has_beta:
        _kernels().chunk_backward_ut[grid](
            k, log_decay, beta, ut_inverse, docs_, d_w, d_t, d_k_, d_log_decay, d_beta, n_chunks, heads, d_k,
            **constants, **_launch("chunk_backward_ut", d_k),
        )  # fmt: skip
    return d_q, d_k_, d_v_, d_log_decay, d_beta


def _chunk_constants(chunk: int, d_k: int, docs: Tensor | None, tf32: bool) -> dict:
    """The compile-time constants every chunk-local kernel takes."""
    return dict(CHUNK=chunk, BLOCK_K=_pow2(d_k), HAS_DOCS=docs is not None, PRECISION=_precision(tf32))


def _docs_or(docs: Tensor | None, unread: Tensor) -> Tensor:
    """The document ids for a chunk-local kernel (contiguous), or `unread` where there are none (HAS_DOCS False
    leaves the pointer unread)."""
    return unread if docs is None else docs.contiguous()


def _per_head(values: Tensor, k_end: Tensor, w: Tensor | None, carry: Tensor) -> tuple[Tensor, ...]:
    """The kernels' operands, contiguous with the heads (all leading dims) flattened: values [heads, N, C, d_v],
    k_end and w [heads, N, C, d_k] (w k_end's buffer where None: HAS_W leaves it unread), carry [heads, N]."""
    n_chunks = values.shape[-3]
    values, k_end = (t.reshape(-1, *t.shape[-3:]).contiguous() for t in (values, k_end))
    w = k_end if w is None else w.reshape(k_end.shape).contiguous()
    return values, k_end, w, carry.reshape(-1, n_chunks).contiguous()


def _precision(tf32: bool) -> str:
    return "tf32" if tf32 else "ieee"


def _kernels():
    """The kernels' module: Triton is imported only where a kernel runs."""
    from . import delta_triton

    return delta_triton
