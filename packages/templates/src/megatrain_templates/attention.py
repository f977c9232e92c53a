"""Causal self-attention over whole rows, or over several documents packed into each row.

Packed rows keep documents apart: a token attends only to earlier tokens of its own
document and its rotary position restarts at each document, so a packed step computes
exactly what the same documents in rows of their own would. The pipeline builds one
`Documents` per micro-batch and hands it to every layer, which also shares its mask.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from .kernel_attention import (
    CUDNN_CAUSAL,
    KeptAttention,
    cudnn_fits,
    flash_window,
    flash_window_wins,
    kept_causal_attention,
    kernel_attention,
)

# FlexAttention kernels exist for these on CUDA; elsewhere (the CPU, float64) a dense mask is used.
_FLEX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Documents:
    """How a micro-batch's rows are laid out: which document each token belongs to (from position
    ids), and which tokens are padding.

    position_ids: [batch, seq] int64; a position of 0 starts a new document (padding at the end of
    a row is a document of its own, which no target ever sees); None: one sequence per row.
    valid: [batch, seq] bool, False for padding (transformers' attention_mask), or None: no padding.
    Padding changes no real token's output (it only ever follows them); the MoE routing statistics
    leave it out, as transformers' load-balancing loss does."""

    def __init__(self, position_ids: Tensor | None, valid: Tensor | None = None):
        if position_ids is not None and position_ids.ndim != 2:
            raise ValueError(f"position_ids must be [batch, seq], got shape {tuple(position_ids.shape)}")
        self.position_ids, self.valid = position_ids, valid
        self.doc_ids = None if position_ids is None else (position_ids == 0).cumsum(-1)
        self._masks: dict = {}

    def to(self, device: torch.device, non_blocking: bool = False) -> "Documents":
        """A copy with its tensors on `device` (the mask cache is not carried)."""
        moved = (
            None if t is None else t.to(device, non_blocking=non_blocking) for t in (self.position_ids, self.valid)
        )
        return Documents(*moved)

    def rope_tables(self, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """cos/sin [seq, head_dim] for positions 0..seq-1 -> [batch, 1, seq, head_dim] at each token's position."""
        return cos[self.position_ids].unsqueeze(1), sin[self.position_ids].unsqueeze(1)

    def dense_mask(self) -> Tensor:
        """[batch, 1, seq, seq] bool: query i may attend key j (same document, j <= i)."""
        if "dense" not in self._masks:
            seq = self.doc_ids.shape[1]
            causal = torch.ones(seq, seq, dtype=torch.bool, device=self.doc_ids.device).tril()
            same = self.doc_ids.unsqueeze(2) == self.doc_ids.unsqueeze(1)
            self._masks["dense"] = (same & causal).unsqueeze(1)
        return self._masks["dense"]

    def block_mask(self, window: int | None = None, chunk: int | None = None):
        """The FlexAttention block mask of `dense_mask` (only blocks holding a pair of one document are
        visited), limited to the last `window` positions, or to the query's `chunk`, when given."""
        if ("block", window, chunk) not in self._masks:
            self._masks["block", window, chunk] = _block_mask(
                self.doc_ids.shape[1], window, self.doc_ids.device, self.doc_ids, chunk, self.position_ids
            )
        return self._masks["block", window, chunk]


def packed_documents(documents: Documents | None) -> Documents | None:
    """`documents` when its rows pack several documents (attention must stay inside each), else None."""
    return documents if documents is not None and documents.position_ids is not None else None


def token_positions(documents: Documents | None, seq: int, device) -> Tensor:
    """[batch, seq] (or [1, seq] for one sequence per row) int64: each token's position in its document."""
    if documents is None:
        return torch.arange(seq, device=device).unsqueeze(0)
    return documents.position_ids


_FLEX = None
_ROW_MASKS: dict = {}  # (seq, window, chunk, device) -> block mask of one sequence per row, shared by every batch


def _block_mask(
    seq: int,
    window: int | None,
    device,
    doc_ids: Tensor | None = None,
    chunk: int | None = None,
    position_ids: Tensor | None = None,
):
    """FlexAttention block mask: causal, within `window` positions if given, within the query's chunk of
    `chunk` positions if given, within a document if `doc_ids` (whose positions are `position_ids`)."""

    def allowed(b, h, q, kv):
        keep = q >= kv
        if window is not None:
            keep = keep & (q - kv < window)
        if doc_ids is not None:
            keep = keep & (doc_ids[b, q] == doc_ids[b, kv])
        if chunk is not None and position_ids is not None:
            keep = keep & (position_ids[b, q] // chunk == position_ids[b, kv] // chunk)
        elif chunk is not None:
            keep = keep & (q // chunk == kv // chunk)
        return keep

    batch = None if doc_ids is None else doc_ids.shape[0]
    return _flex_kernels()[1](allowed, batch, None, seq, seq, device=device)


def _flex_kernels():
    """(flex_attention, create_block_mask), compiled once: eager FlexAttention is a slow reference, and an
    eager block mask would materialise [batch, seq, seq]."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _FLEX = torch.compile(flex_attention), torch.compile(create_block_mask)
    return _FLEX


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    documents: Documents | None = None,
    scale: float | None = None,
    kept: KeptAttention | None = None,
) -> Tensor:
    """q: [batch, n_heads, seq, head_dim], k/v: [batch, n_kv_heads, seq, head_dim] -> like q; scores
    scaled by `scale` (None: head_dim ** -0.5).

    Without `documents` (see `packed_documents`) every row is one causal sequence, and `kept` keeps (or gives)
    the kernel's results where a kernel pair takes q; with them, attention stays inside each document
    (FlexAttention on CUDA, a dense boolean mask elsewhere)."""
    gqa = q.shape[1] != k.shape[1]
    if documents is None:
        attn = None if kept is None else kept_causal_attention(q, k, v, scale, kept)
        if attn is not None:
            return attn
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)
    if q.is_cuda and q.dtype in _FLEX_DTYPES:
        return _flex_kernels()[0](q, k, v, block_mask=documents.block_mask(), enable_gqa=gqa, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.dense_mask(), enable_gqa=gqa, scale=scale)


def chunked_causal_attention(q: Tensor, k: Tensor, v: Tensor, chunk: int, scale: float | None = None) -> Tensor:
    """Causal attention within chunks of `chunk` positions (Llama 4) of rows that are one sequence each; shapes
    and `scale` as `causal_attention`. The chunks are independent sequences, so they become rows of their own
    for the fused kernel, with no mask (a FlexAttention mask's first compilation at a 16k-token row took
    minutes); a last, shorter chunk is one more call."""
    batch, _, seq, _ = q.shape
    n_chunks = seq // chunk
    whole = n_chunks * chunk
    gqa = q.shape[1] != k.shape[1]

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa, scale=scale)

    def as_rows(t: Tensor) -> Tensor:  # [batch, heads, whole, dim] -> [batch * n_chunks, heads, chunk, dim]
        return t[:, :, :whole].unflatten(2, (n_chunks, chunk)).transpose(1, 2).flatten(0, 1)

    out = attend(as_rows(q), as_rows(k), as_rows(v)).unflatten(0, (batch, n_chunks)).transpose(1, 2).flatten(2, 3)
    if whole == seq:
        return out
    return torch.cat([out, attend(q[:, :, whole:], k[:, :, whole:], v[:, :, whole:])], dim=2)


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None = None,
    window: int | None = None,
    documents: Documents | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    chunk: int | None = None,
) -> Tensor:
    """Causal attention with what the fused kernels lack: keys limited to the last `window` positions
    (gpt-oss, Gemma) or to the query's chunk of `chunk` positions (Llama 4: positions c * chunk to (c + 1) *
    chunk - 1 of a document attend only among themselves), per-head sink logits `sinks` [n_heads] that join
    each softmax's denominator without contributing a value (gpt-oss), scores soft-capped to (-softcap,
    softcap) by softcap * tanh(score / softcap) after scaling (Gemma 2). Shapes, `documents` and `scale` as
    `causal_attention`. On CUDA, over rows of one sequence each, a window alone with Gemma's wide heads is
    flash attention's own sliding window and sinks alone are cuDNN's causal attention with the sinks folded in
    (`kernel_attention`); the rest is FlexAttention (only the blocks inside the window or chunk are visited),
    the cap as its score modification and the sinks folded in through its log-sum-exp; elsewhere written out
    (scores materialised, [batch, n_heads, seq, seq]) as transformers' eager implementation does."""
    batch, n_heads, seq, head_dim = q.shape
    scale = head_dim**-0.5 if scale is None else scale
    no_cap_chunk_or_documents = softcap is None and chunk is None and documents is None
    if no_cap_chunk_or_documents and window is not None and sinks is None and flash_window_wins(q):
        return kernel_attention(q, k, v, None, scale, flash_window(window))
    if no_cap_chunk_or_documents and window is None and sinks is not None and cudnn_fits(q):
        return kernel_attention(q, k, v, sinks, scale, CUDNN_CAUSAL)
    if q.is_cuda and q.dtype in _FLEX_DTYPES:
        return _flex_masked(q, k, v, sinks, window, documents, scale, softcap, chunk)
    repeat = n_heads // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    position = torch.arange(seq, device=q.device)
    distance = position.unsqueeze(1) - position.unsqueeze(0)  # query - key
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    if chunk is not None:
        chunk_of = token_positions(documents, seq, q.device) // chunk
        allowed = allowed & (chunk_of.unsqueeze(-1) == chunk_of.unsqueeze(-2)).unsqueeze(1)
    if documents is not None:
        allowed = allowed & documents.dense_mask()
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, n_heads, 1, 1).expand(batch, n_heads, seq, 1)
        scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = scores.softmax(dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    return probs.to(v.dtype) @ v


_SOFTCAPS: dict = {}  # cap -> FlexAttention score_mod, one function per cap so the compiled kernel is reused


def _softcap_score_mod(softcap: float):
    if softcap not in _SOFTCAPS:

        def capped(score, batch, head, q_index, kv_index):
            return torch.tanh(score / softcap) * softcap

        _SOFTCAPS[softcap] = capped
    return _SOFTCAPS[softcap]


def _flex_masked(q, k, v, sinks, window, documents, scale, softcap, chunk):
    """A sink logit s joins the softmax's denominator, so the output is the sink-free one times
    Z / (Z + e^s) = sigmoid(lse - s), lse = log Z; FlexAttention returns lse and differentiates through it."""
    from torch.nn.attention.flex_attention import AuxRequest

    seq = q.shape[2]
    if documents is not None:
        mask = documents.block_mask(window, chunk)
    else:
        key = (seq, window, chunk, str(q.device))
        if key not in _ROW_MASKS:
            _ROW_MASKS[key] = _block_mask(seq, window, q.device, chunk=chunk)
        mask = _ROW_MASKS[key]
    out, aux = _flex_kernels()[0](
        q,
        k,
        v,
        score_mod=None if softcap is None else _softcap_score_mod(softcap),
        block_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        return_aux=AuxRequest(lse=True),
    )
    if sinks is None:
        return out
    lse = aux.lse  # [batch, n_heads, seq], fp32
    return out * torch.sigmoid(lse - sinks.float().view(1, -1, 1)).unsqueeze(-1).to(out.dtype)
