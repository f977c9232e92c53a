"""The chunked form of a decayed linear recurrence, the arithmetic under Gated DeltaNet and Mamba-2, with its
backward written out.

Per token, a state S ([d_k, d_v] per head, zero at each row's and document's start) decays by exp(g), then
moves toward the token's value by the delta rule (S <- S + k (beta (v - S^T k))^T) or, without beta, adds
k v^T; the token reads S^T q. In chunks of C tokens, the updates inside a chunk are matmuls and only S is
carried from chunk to chunk (the state pass, the one sequential part).

Per chunk, with decayed the cumulative log decay from the chunk's start and Gamma[i, j] = exp(decayed_i -
decayed_j) for j <= i in one document (0 otherwise):
    L = strictly lower part of (beta k k^T) o Gamma; T = (I + L)^-1 (the UT transform)
    u = T (beta v);  w = T (beta k o exp(decayed))          (without beta: u = v, no w)
    state pass: delta = u - w S;  S <- exp(decayed_last) S + (k o exp(decayed_last - decayed))^T delta
    out = (q o exp(decayed)) S + ((q k^T) o Gamma) delta
A document that starts inside a chunk masks the carried state's reach into the chunk and the carry out of it.

The backward is written out rather than left to autograd: autograd kept a dozen [chunk, chunk] and [chunk,
d] intermediates a chunk alive and walked the state pass through per-chunk slices. The state pass runs as two
Triton kernels on CUDA (`delta_kernels`) and as a loop over chunks elsewhere. Inputs that came in bf16 (or
fp16) take TF32 matmuls on CUDA; fp32 and fp64 inputs keep full-precision arithmetic everywhere.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import delta_kernels
from .ops import compile_once, compiling


@dataclass(frozen=True)
class KeptRecurrence:
    """A forward's recurrence results (its output and what its backward reads: T, the states, the corrected
    values) kept in `products`, a layer's kept products, for the backward's recompute to skip the chunks and the
    state pass: `keep` True, the forward puts them there; False, the recompute takes them from there. At
    Qwen3.5-0.8B's shape (16k tokens) that skips 1.3 ms of kernels a layer (H200) for 36 KB a token
    (`bytes_per_token`)."""

    products: dict
    keep: bool

    def put(self, results: tuple) -> None:
        """Keep `results` (out, T or None, states, delta) where this is the keeping forward."""
        if self.keep:
            self.products.update((name, t) for name, t in zip(_KEPT_NAMES, results) if t is not None)

    def results(self) -> tuple | None:
        """(out, T or None, states, delta) where a forward kept them and this is the recompute, else None."""
        if self.keep or _KEPT_NAMES[0] not in self.products:
            return None
        return tuple(self.products.get(name) for name in _KEPT_NAMES)

    @staticmethod
    def bytes_per_token(heads: int, d_k: int, d_v: int, chunk: int, delta_rule: bool, element_size: int) -> int:
        """What `put` keeps a token (of whole chunks), in the arithmetic's dtype (at least fp32): the output and
        the corrected values, T's row where there is one (the delta rule), and a chunk's share of its state."""
        per_head = 2 * d_v + (chunk if delta_rule else 0) + -(-d_k * d_v // chunk)
        return heads * per_head * max(element_size, 4)


_KEPT_NAMES = ("recurrence out", "recurrence ut_inverse", "recurrence states", "recurrence delta")


class _ChunkMasks(NamedTuple):
    """Which pairs and reaches a chunk's arithmetic keeps: `causal` [..., C, C] (earlier or same token, same
    document); `reaches` [..., N, C] 1 where the state carried into the chunk reaches the token; `to_end` where
    the token's update reaches the chunk's end. None: all ones (one sequence per row)."""

    causal: Tensor
    reaches: Tensor | None = None
    to_end: Tensor | None = None


def chunked_decayed_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    beta: Tensor | None,
    doc_ids: Tensor | None,
    chunk: int,
    tf32: bool = False,
    kept: KeptRecurrence | None = None,
) -> Tensor:
    """The recurrence of this module's docstring. q, k: [batch, seq, heads, d_k], v: [batch, seq, heads, d_v] in
    the arithmetic's dtype; log_decay (<= 0), beta: [batch, seq, heads] (beta None: no delta correction);
    doc_ids: [batch, seq] or None (one sequence per row). Returns [batch, seq, heads, d_v]. `tf32`: matmuls
    on CUDA may round their fp32 operands to TF32 (for inputs that came in a half type). `kept`: where a forward
    keeps its results and a backward's recompute finds them (`KeptRecurrence`)."""
    dtype = q.dtype
    batch, seq, n_heads, _ = k.shape
    q, k, v, log_decay, beta = (None if t is None else _head_major(t, dtype) for t in (q, k, v, log_decay, beta))
    pad = -seq % chunk  # padding tokens (zero k, v, beta and decay) change nothing
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        log_decay = F.pad(log_decay, (0, pad))
        beta = None if beta is None else F.pad(beta, (0, pad))
        if doc_ids is not None:
            doc_ids = torch.cat([doc_ids, doc_ids[:, -1:].expand(-1, pad)], dim=1)
    n_chunks = (seq + pad) // chunk

    def chunked(t: Tensor) -> Tensor:  # [batch, heads, seq, ...] -> [batch, heads, n_chunks, chunk, ...]
        return t.reshape(batch, n_heads, n_chunks, chunk, *t.shape[3:])

    masks = _chunk_masks(doc_ids, batch, n_chunks, chunk, q.device)
    beta = None if beta is None else chunked(beta)
    out = _ChunkedRecurrence.apply(
        chunked(q), chunked(k), chunked(v), chunked(log_decay), beta, masks, doc_ids, tf32, kept
    )
    return out.reshape(batch, n_heads, n_chunks * chunk, -1)[:, :, :seq].transpose(1, 2)


def _head_major(t: Tensor, dtype: torch.dtype) -> Tensor:
    """[batch, seq, heads, ...] -> contiguous [batch, heads, seq, ...] in `dtype`: at most one copy, cast and
    transposed together (`to` alone returns a same-dtype view as it is)."""
    return t.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format).contiguous()


def _chunk_masks(doc_ids: Tensor | None, batch: int, n_chunks: int, chunk: int, device) -> _ChunkMasks:
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
    if doc_ids is None:
        return _ChunkMasks(causal)
    docs = doc_ids.reshape(batch, 1, n_chunks, chunk)
    before = torch.cat([torch.full_like(docs[..., :1, :1], -1), docs[..., :-1, -1:]], dim=2)  # previous token's
    return _ChunkMasks(causal & (docs.unsqueeze(-1) == docs.unsqueeze(-2)), docs == before, docs == docs[..., -1:])


class _Decays(NamedTuple):
    """A chunk's decays (shapes as `_ChunkedRecurrence`'s log_decay, [..., N, C], unless said)."""

    pairs: Tensor  # Gamma [..., N, C, C]: exp(decayed_i - decayed_j) where the pair is kept, else 0
    carried: Tensor  # the carried state's decay at each token (0 past a document's start)
    to_end: Tensor  # each token's update's decay to the chunk's end (0 where another document ends it)
    carry: Tensor  # [..., N, 1, 1]: the state's decay across the whole chunk


def _decays(log_decay: Tensor, causal: Tensor, reaches: Tensor | None, to_end: Tensor | None) -> _Decays:
    decayed = log_decay.cumsum(dim=-1)  # log of the decay from the chunk's start to each token
    last = decayed[..., -1:]
    pairs = (decayed.unsqueeze(-1) - decayed.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    carried, to_end_decay, carry = decayed.exp(), (last - decayed).exp(), last.exp()
    if reaches is not None:
        carried, to_end_decay, carry = carried * reaches, to_end_decay * to_end, carry * reaches[..., -1:]
    return _Decays(pairs, carried, to_end_decay, carry.unsqueeze(-1))


class _ChunkedRecurrence(torch.autograd.Function):
    """q, k: [batch, heads, N, C, d_k], v: [batch, heads, N, C, d_v], log_decay and beta (or None): [batch,
    heads, N, C] -> out like v; masks: `_ChunkMasks` of `docs` ([batch, N * C] document ids, or None). The
    forward and backward of the module docstring's per-chunk equations. On CUDA for inputs that came in a half
    type (`tf32`), the chunk-local work on either side of the state pass runs as Triton kernels
    (`delta_kernels`), except what comes before it without beta (Mamba-2's: elementwise), which runs as
    functions of tensors compiled by Inductor. fp32 inputs stay eager: Inductor's exp is not exact to fp32's last
    bits. `kept` (a `KeptRecurrence` or None): where the forward keeps its results, or takes a kept forward's."""

    @staticmethod
    def forward(ctx, q, k, v, log_decay, beta, masks: _ChunkMasks, docs: Tensor | None, tf32: bool, kept):
        # detached: the compiled functions would otherwise compile again for inputs that require grad
        q, k, v, log_decay, beta = (None if t is None else t.detach() for t in (q, k, v, log_decay, beta))
        results = None if kept is None else kept.results()
        if results is None:
            results = _ChunkedRecurrence._results(q, k, v, log_decay, beta, masks, docs, tf32)
            if kept is not None:
                kept.put(results)
        out, ut_inverse, states, delta = results
        ctx.save_for_backward(q, k, v, log_decay, beta, ut_inverse, states, delta)
        ctx.masks, ctx.docs, ctx.tf32 = masks, docs, tf32
        return out.view_as(out)  # (a kept output: a new tensor for autograd to own, not a copy)

    @staticmethod
    def _results(q, k, v, log_decay, beta, masks: _ChunkMasks, docs: Tensor | None, tf32: bool) -> tuple:
        """(out, T or None, the states entering each chunk, the corrected values)."""
        fast = tf32 and q.is_cuda
        fused = _fused(fast, q)
        with _matmul_precision(fast):
            if fused and beta is not None:
                u, w, k_end, carry, ut_inverse = delta_kernels.chunk_prepare(k, v, log_decay, beta, docs, tf32)
            else:
                u, w, k_end, carry, ut_inverse = _run(_to_state_pass, fast, k, v, log_decay, beta, *masks)
            states, delta = state_pass(w, u, k_end, carry, tf32)
            if fused:
                out = delta_kernels.chunk_output(q, k, log_decay, states, delta, docs, tf32)
            else:
                out = _run(_from_state_pass, fast, q, k, log_decay, *masks, states, delta)
        return out, ut_inverse, states, delta

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_out: Tensor):
        q, k, v, log_decay, beta, ut_inverse, states, delta = ctx.saved_tensors
        fast = ctx.tf32 and q.is_cuda
        fused = _fused(fast, q)
        d_out = d_out.contiguous()
        with _matmul_precision(fast):
            if fused and beta is not None:
                before_pass = delta_kernels.chunk_backward_prepare(
                    q, k, log_decay, beta, ut_inverse, ctx.docs, d_out, ctx.tf32
                )
            else:
                before_pass = _run(_back_to_state_pass, fast, q, k, log_decay, beta, ut_inverse, *ctx.masks, d_out)
            w, k_end, carry, d_states, d_delta = before_pass
            d_u, d_leaving = state_pass_backward(w, k_end, carry, states, d_states, d_delta, ctx.tf32)
            after_pass = (states, delta, d_out, d_u, d_leaving)
            if fused:
                grads = delta_kernels.chunk_backward(
                    q, k, v, log_decay, beta, ut_inverse, *after_pass, ctx.docs, ctx.tf32
                )
            else:
                grads = _run(_back_from_state_pass, fast, q, k, v, log_decay, beta, ut_inverse, *ctx.masks, *after_pass)
        return *grads, None, None, None, None


def _fused(fast: bool, q: Tensor) -> bool:
    """Whether the chunk-local kernels take the work on either side of the state pass (keys and chunks as the state
    pass's kernels take them)."""
    return fast and delta_kernels.runs_on(q, q.shape[-2], q.shape[-1])


_COMPILED: dict = {}


def _run(fn, fast: bool, *args):
    """fn(*args), compiled (once per function, on first use) where `fast`."""
    if not (fast and compiling()):
        return fn(*args)
    if fn not in _COMPILED:
        _COMPILED[fn] = compile_once(fn)
    return _COMPILED[fn](*args)


def _to_state_pass(k, v, log_decay, beta, causal, reaches, to_end):
    """The forward up to the state pass: (u, w, the keys decayed to the chunk's end, the chunk's carry, T)."""
    decays = _decays(log_decay, causal, reaches, to_end)
    ut_inverse = None if beta is None else _ut_inverse(k, beta, decays)
    u, w = _new_values_and_keys(k, v, beta, decays, ut_inverse)
    return u, w, k * decays.to_end.unsqueeze(-1), decays.carry, ut_inverse


def _from_state_pass(q, k, log_decay, causal, reaches, to_end, states, delta):
    """The output, from the state entering each chunk and the corrected values."""
    decays = _decays(log_decay, causal, reaches, to_end)
    return (q * decays.carried.unsqueeze(-1)) @ states + ((q @ k.transpose(-1, -2)) * decays.pairs) @ delta


def _back_to_state_pass(q, k, log_decay, beta, ut_inverse, causal, reaches, to_end, d_out):
    """The backward up to the state pass's: what it reads again (w, k_end, carry) and the gradients by the states
    and corrected values that the output's two terms give."""
    decays = _decays(log_decay, causal, reaches, to_end)
    _, w = _new_values_and_keys(k, None, beta, decays, ut_inverse)
    d_states = (q * decays.carried.unsqueeze(-1)).transpose(-1, -2) @ d_out
    d_delta = ((q @ k.transpose(-1, -2)) * decays.pairs).transpose(-1, -2) @ d_out
    return w, k * decays.to_end.unsqueeze(-1), decays.carry, d_states, d_delta


def _back_from_state_pass(
    q, k, v, log_decay, beta, ut_inverse, causal, reaches, to_end, states, delta, d_out, d_u, d_leaving
):
    """The gradients by q, k, v, log_decay and beta, given the state pass's (by u, and by the state leaving each
    chunk)."""
    decays = _decays(log_decay, causal, reaches, to_end)
    d_q_carried = d_out @ states.transpose(-1, -2)
    d_attention = d_out @ delta.transpose(-1, -2)
    scores = q @ k.transpose(-1, -2)
    d_pairs, d_scores = d_attention * scores, d_attention * decays.pairs  # d_pairs: through (q k^T) o Gamma
    d_k_end = delta @ d_leaving.transpose(-1, -2)
    d_carry = (states * d_leaving).sum(dim=(-1, -2))  # [..., N]
    d_q = d_scores @ k + d_q_carried * decays.carried.unsqueeze(-1)
    d_k = d_scores.transpose(-1, -2) @ q + d_k_end * decays.to_end.unsqueeze(-1)
    d_carried = (d_q_carried * q).sum(-1)
    d_to_end = (d_k_end * k).sum(-1)
    d_v, d_beta = d_u, None
    if beta is not None:
        d_w = -(d_u @ states.transpose(-1, -2))
        d_k_part, d_v, d_beta, d_carried_part, d_pairs_part = _ut_backward(k, v, beta, decays, ut_inverse, d_u, d_w)
        d_k, d_carried, d_pairs = d_k + d_k_part, d_carried + d_carried_part, d_pairs + d_pairs_part
    return d_q, d_k, d_v, _log_decay_backward(decays, d_pairs, d_carried, d_to_end, d_carry), d_beta


def _ut_inverse(k: Tensor, beta: Tensor, decays: _Decays) -> Tensor:
    """T = (I + L)^-1, L the strictly lower part of (beta k k^T) o Gamma: inverted once (C right-hand sides) and
    applied to both right-hand sides as GEMMs, a third of the triangular-solve work of solving for each."""
    system = ((k * beta.unsqueeze(-1)) @ k.transpose(-1, -2)) * decays.pairs  # solve_triangular reads below it
    eye = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device)
    return torch.linalg.solve_triangular(system, eye, upper=False, unitriangular=True)


def _new_values_and_keys(k, v, beta, decays: _Decays, ut_inverse) -> tuple[Tensor | None, Tensor | None]:
    """(u, w) of the module docstring; without beta (u, w) = (v, None); v None: u is not made."""
    if beta is None:
        return v, None
    u = None if v is None else ut_inverse @ (v * beta.unsqueeze(-1))
    return u, ut_inverse @ (k * (beta * decays.carried).unsqueeze(-1))


def _ut_backward(k, v, beta, decays: _Decays, ut_inverse, d_u, d_w):
    """Through u = T (beta v) and w = T (beta k o carried) and T = (I + L)^-1: the gradients by k, v, beta,
    the carried decay and Gamma."""
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    keys = k_beta * decays.carried.unsqueeze(-1)
    t_transposed = ut_inverse.transpose(-1, -2)
    d_v_beta, d_keys = t_transposed @ d_u, t_transposed @ d_w
    d_t = d_u @ v_beta.transpose(-1, -2) + d_w @ keys.transpose(-1, -2)
    # d(T) = -T d(L) T, so dL = -T^T dT T^T, of which only the strictly lower part is L's
    d_system = (-(t_transposed @ d_t @ t_transposed)).tril(-1)
    d_pairs = d_system * (k_beta @ k.transpose(-1, -2))
    d_kk = d_system * decays.pairs
    d_k_beta = d_kk @ k + d_keys * decays.carried.unsqueeze(-1)
    d_k = d_kk.transpose(-1, -2) @ k_beta + d_k_beta * beta.unsqueeze(-1)
    d_beta = (d_v_beta * v).sum(-1) + (d_k_beta * k).sum(-1)
    d_carried = (d_keys * k_beta).sum(-1)
    return d_k, d_v_beta * beta.unsqueeze(-1), d_beta, d_carried, d_pairs


def _log_decay_backward(decays: _Decays, d_pairs, d_carried, d_to_end, d_carry) -> Tensor:
    """The gradient by log_decay, given those by Gamma, the carried decay, the decay to the chunk's end and the
    whole chunk's: each is exp of a difference of cumulative sums, so each adds to the decayed positions it
    reads, and a reversed cumulative sum takes them back to the per-token log decays."""
    by_pairs = d_pairs * decays.pairs
    by_end = d_to_end * decays.to_end
    d_decayed = by_pairs.sum(-1) - by_pairs.sum(-2) + d_carried * decays.carried - by_end
    d_last = by_end.sum(-1) + d_carry * decays.carry.squeeze(-1).squeeze(-1)
    d_decayed = torch.cat([d_decayed[..., :-1], d_decayed[..., -1:] + d_last.unsqueeze(-1)], dim=-1)
    return d_decayed.flip(-1).cumsum(-1).flip(-1)


@contextmanager
def _matmul_precision(tf32: bool):
    """cuBLAS may round fp32 operands to TF32 inside (for inputs that came in a half type only)."""
    if not tf32:
        yield
        return
    # (the flag our GPU tests and most scripts set: torch refuses a mix of it and `fp32_precision`)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def state_pass(w: Tensor | None, u: Tensor, k_end: Tensor, carry: Tensor, tf32: bool = False):
    """The one sequential part: per chunk c (w, u, k_end [..., N, C, d]; carry [..., N, 1, 1]; S_0 = 0):
    delta_c = u_c - w_c S_c (u_c where w is None), S_{c+1} = carry_c S_c + k_end_c^T delta_c. Returns (S
    [..., N, d_k, d_v], the state entering each chunk; delta [..., N, C, d_v])."""
    if delta_kernels.runs_on(u, u.shape[-2], k_end.shape[-1]):
        return delta_kernels.state_pass(w, u, k_end, carry, tf32)
    lead, n_chunks = u.shape[:-3], u.shape[-3]
    u_, k_, g = _chunk_major(u), _chunk_major(k_end), _chunk_major(carry)
    w_ = None if w is None else _chunk_major(w)
    states = u_.new_empty(n_chunks, u_.shape[1], k_.shape[-1], u_.shape[-1])
    delta = u_ if w_ is None else torch.empty_like(u_)
    states[0].zero_()
    for c in range(n_chunks):
        if w_ is not None:
            torch.baddbmm(u_[c], w_[c], states[c], alpha=-1, out=delta[c])
        if c + 1 < n_chunks:  # the state leaving the last chunk is not read
            torch.baddbmm(states[c] * g[c], k_[c].transpose(1, 2), delta[c], out=states[c + 1])
    return _batch_major(states, lead), _batch_major(delta, lead)


def state_pass_backward(w, k_end, carry, states, d_states, d_delta, tf32: bool = False):
    """`state_pass` backward, given the loss's gradients by its outputs: (by delta, all paths: the gradient by
    u; by the state leaving each chunk [..., N, d_k, d_v]). The gradients by w, k_end and carry follow from
    these as batched GEMMs."""
    if delta_kernels.runs_on(states, k_end.shape[-2], k_end.shape[-1]):
        return delta_kernels.state_pass_backward(w, k_end, carry, d_states, d_delta, tf32)
    lead, n_chunks = states.shape[:-3], states.shape[-3]
    w_ = None if w is None else _chunk_major(w)
    k_, g, d_s, d_d = (_chunk_major(t) for t in (k_end, carry, d_states, d_delta))
    d_leaving = torch.empty_like(d_s)
    d_leaving[-1].zero_()
    d_delta_total = torch.empty_like(d_d)
    for c in reversed(range(n_chunks)):
        torch.baddbmm(d_d[c], k_[c], d_leaving[c], out=d_delta_total[c])
        if c > 0:
            entering = torch.addcmul(d_s[c], g[c], d_leaving[c])
            if w_ is None:
                d_leaving[c - 1] = entering
            else:
                torch.baddbmm(entering, w_[c].transpose(1, 2), d_delta_total[c], alpha=-1, out=d_leaving[c - 1])
    return _batch_major(d_delta_total, lead), _batch_major(d_leaving, lead)


def _chunk_major(t: Tensor) -> Tensor:
    """[*lead, n_chunks, ...] -> contiguous [n_chunks, prod(lead), ...]."""
    n_lead = t.dim() - 3
    return t.reshape(-1, *t.shape[n_lead:]).transpose(0, 1).contiguous()


def _batch_major(t: Tensor, lead) -> Tensor:
    """The inverse of `_chunk_major` (a view)."""
    return t.transpose(0, 1).reshape(*lead, *t.shape[:1], *t.shape[2:])
