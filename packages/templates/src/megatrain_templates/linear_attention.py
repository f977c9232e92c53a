"""Gated DeltaNet, the linear-attention token mixer of Qwen3-Next and Qwen3.5 (three of every four layers), and
Mamba-2, Granite 4.0-H's (`Mamba2Shape`: the same chunked recurrence without the delta's correction).

Each value head keeps a [key_head_dim, value_head_dim] state S instead of a key-value cache. Per token, S decays
by exp(g), the delta rule moves it toward the token's value (S += beta * k (v - S^T k)^T) and the token reads
q^T S: a recurrence, computed here in chunks of 64 tokens (within a chunk as matmuls, between chunks the state
carried), as transformers' own PyTorch implementation computes it. A short causal convolution mixes the last
few tokens into q, k and v first. Packed documents restart both: the state does not cross into the next
document, nor do the convolution's taps, so a packed row computes what its documents would in rows of their own.
The mixer is an attention variant of the decoder block (`BlockShape.linear_attention`), with its parameters,
spans and forward here; the block's recompute-based backward differentiates it like any other.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import Documents
from .chunked_recurrence import KeptRecurrence, chunked_decayed_recurrence
from .layout import ParamSpec, Span, fused_span, span_of
from .ops import compiled_on_cuda, linear, upcast


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """The linear-attention half of a block: `n_key_heads` query/key heads of `key_head_dim`, each serving
    n_value_heads / n_key_heads consecutive value heads of `value_head_dim`."""

    n_key_heads: int
    n_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    # Qwen3-Next stores q, k, v and z as one `in_proj_qkvz` and b, a as one `in_proj_ba`, grouped by key head
    # (each key head's q and k, then its value heads' v, then their z); Qwen3.5 as in_proj_qkv, in_proj_z,
    # in_proj_b, in_proj_a. Either is one GEMM: the buffer keeps the published layout
    grouped_projections: bool = False
    chunk: int = 64  # tokens per chunk of the chunked form (transformers' and FLA's)

    def __post_init__(self):
        sizes = (self.n_key_heads, self.n_value_heads, self.key_head_dim, self.value_head_dim, self.conv_kernel)
        if min(sizes) <= 0 or self.n_value_heads % self.n_key_heads:
            raise ValueError(
                f"linear attention needs positive sizes and n_value_heads ({self.n_value_heads}) a multiple of "
                f"n_key_heads ({self.n_key_heads}); got {self}"
            )

    @property
    def key_dim(self) -> int:
        """Width of the keys (and queries) over all key heads: n_key_heads x key_head_dim."""
        return self.n_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of the values over all value heads: n_value_heads x value_head_dim."""
        return self.n_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the convolution mixes: q, k and v."""
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Mamba2Shape:
    """Granite 4.0-H's Mamba-2 mixer: `n_heads` heads of `head_dim` channels, each group of n_heads / n_groups
    heads reading one group's B (the keys) and C (the queries) of `state_dim`; each head's state is
    [state_dim, head_dim]."""

    n_groups: int
    n_heads: int
    state_dim: int
    head_dim: int
    conv_kernel: int = 4
    chunk: int = 64

    def __post_init__(self):
        sizes = (self.n_groups, self.n_heads, self.state_dim, self.head_dim, self.conv_kernel)
        if min(sizes) <= 0 or self.n_heads % self.n_groups:
            raise ValueError(f"Mamba-2 needs positive sizes and n_heads a multiple of n_groups; got {self}")

    @property
    def inner_dim(self) -> int:
        """Width of the SSM's inner activations over all heads: n_heads x head_dim."""
        return self.n_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the convolution mixes: x, B and C."""
        return self.inner_dim + 2 * self.n_groups * self.state_dim


def linear_attention_params(
    d_model: int, shape: "GatedDeltaNetShape | Mamba2Shape"
) -> tuple[tuple[ParamSpec, ...], ...]:
    """(matrices, norms and vectors) of a linear-attention half, Hugging Face names; the input projections
    adjacent (one GEMM), the convolution's taps decayed like a matrix, A_log, dt_bias (Mamba-2's convolution bias
    and D too: vectors) not."""
    d = d_model
    if isinstance(shape, Mamba2Shape):  # in_proj's rows: z (the gate), x|B|C (the convolution's channels), dt
        heads, out_width, norm_width = shape.n_heads, shape.inner_dim, shape.inner_dim
        inputs = (ParamSpec("mamba.in_proj.weight", (shape.inner_dim + shape.conv_dim + heads, d)),)
        extra = (("mamba.conv1d.bias", (shape.conv_dim,)), ("mamba.D", (heads,)))
    else:
        heads, out_width, norm_width, extra = shape.n_value_heads, shape.value_dim, shape.value_head_dim, ()
        if shape.grouped_projections:
            inputs = (
                ParamSpec("linear_attn.in_proj_qkvz.weight", (2 * shape.key_dim + 2 * shape.value_dim, d)),
                ParamSpec("linear_attn.in_proj_ba.weight", (2 * heads, d)),
            )
        else:
            inputs = (
                ParamSpec("linear_attn.in_proj_qkv.weight", (shape.conv_dim, d)),
                ParamSpec("linear_attn.in_proj_z.weight", (shape.value_dim, d)),
                ParamSpec("linear_attn.in_proj_b.weight", (heads, d)),
                ParamSpec("linear_attn.in_proj_a.weight", (heads, d)),
            )
    prefix = _module_of(shape)
    matrices = inputs + (
        ParamSpec(f"{prefix}.out_proj.weight", (d, out_width)),
        ParamSpec(f"{prefix}.conv1d.weight", (shape.conv_dim, 1, shape.conv_kernel)),
    )
    vectors = (
        ("input_layernorm.weight", (d,)),
        ("post_attention_layernorm.weight", (d,)),
        (f"{prefix}.norm.weight", (norm_width,)),
        (f"{prefix}.A_log", (heads,)),
        (f"{prefix}.dt_bias", (heads,)),
        *extra,
    )
    return matrices, tuple(ParamSpec(name, shape_of, weight_decay=False) for name, shape_of in vectors)


def _module_of(shape: "GatedDeltaNetShape | Mamba2Shape") -> str:
    """The mixer's module in the Hugging Face names: Qwen's `linear_attn`, Granite's `mamba`."""
    return "mamba" if isinstance(shape, Mamba2Shape) else "linear_attn"


def linear_attention_spans(params: tuple[ParamSpec, ...], shape: "GatedDeltaNetShape | Mamba2Shape") -> dict[str, Span]:
    """Where the linear-attention half's weights lie in a layout made with `linear_attention_params` (the
    convolution's taps as [conv_dim, kernel])."""
    prefix = _module_of(shape)
    inputs = [p.name for p in params if p.name.startswith(f"{prefix}.in_proj")]
    conv = span_of(params, f"{prefix}.conv1d.weight")
    spans = {
        "input_norm": span_of(params, "input_layernorm.weight"),
        "linear_in": fused_span(params, inputs),
        "linear_conv": Span(conv.offset, (shape.conv_dim, shape.conv_kernel)),
    }
    by_name = {"out": "out_proj.weight", "norm": "norm.weight", "A_log": "A_log", "dt_bias": "dt_bias"}
    if isinstance(shape, Mamba2Shape):
        by_name.update(conv_bias="conv1d.bias", D="D")
    return spans | {f"linear_{key}": span_of(params, f"{prefix}.{name}") for key, name in by_name.items()}


# spans of the mixer that are not GEMM operands: autograd differentiates them as leaves, like norms
LINEAR_ATTENTION_LEAVES = ("linear_conv",)
# the mixer's weights' entry for where its recurrence's results are kept (a `KeptRecurrence`), if anywhere
KEPT_RECURRENCE = "linear_kept_recurrence"


def kept_recurrence_bytes_per_token(shape: "GatedDeltaNetShape | Mamba2Shape", element_size: int) -> int:
    """What a forward of `shape`'s mixer keeps of its recurrence a token (`KeptRecurrence.bytes_per_token`)."""
    if isinstance(shape, Mamba2Shape):
        return KeptRecurrence.bytes_per_token(
            shape.n_heads, shape.state_dim, shape.head_dim, shape.chunk, False, element_size
        )
    heads, d_k, d_v = shape.n_value_heads, shape.key_head_dim, shape.value_head_dim
    return KeptRecurrence.bytes_per_token(heads, d_k, d_v, shape.chunk, True, element_size)


def linear_attention_mixer(
    shape: "GatedDeltaNetShape | Mamba2Shape", w: dict[str, Tensor], h: Tensor, documents: Documents | None, eps: float
) -> Tensor:
    """The linear-attention mixer of `shape`'s kind on the normed residual stream h."""
    mixer = mamba2 if isinstance(shape, Mamba2Shape) else gated_delta_net
    return mixer(shape, w, h, documents, eps)


def mamba2(shape: Mamba2Shape, w: dict[str, Tensor], h: Tensor, documents: Documents | None, eps: float) -> Tensor:
    """The Mamba-2 mixer on the normed residual stream h [batch, seq, d_model] -> [batch, seq, d_model], as
    transformers' GraniteMoeHybridMambaLayer computes it: the convolution (with its bias) and silu over x|B|C,
    dt = softplus(dt + dt_bias), the state-space recurrence by `chunked_ssd` plus D x, the gate's silu then an
    RMSNorm per group (`eps`), the output projection."""
    batch, seq, _ = h.shape
    z, xbc, dt = linear(h, w["linear_in"]).split([shape.inner_dim, shape.conv_dim, shape.n_heads], dim=-1)
    doc_ids = None if documents is None else documents.doc_ids
    xbc = F.silu(causal_conv(xbc, w["linear_conv"], doc_ids, w["linear_conv_bias"]))
    group_width = shape.n_groups * shape.state_dim
    x, b, c = xbc.split([shape.inner_dim, group_width, group_width], dim=-1)
    x = x.reshape(batch, seq, shape.n_heads, shape.head_dim)
    b, c = (t.reshape(batch, seq, shape.n_groups, shape.state_dim) for t in (b, c))
    dt = F.softplus(upcast(dt) + w["linear_dt_bias"])
    out = chunked_ssd(x, dt, -upcast(w["linear_A_log"]).exp(), b, c, doc_ids, shape.chunk, w.get(KEPT_RECURRENCE))
    out = out + upcast(w["linear_D"]).unsqueeze(-1) * upcast(x)
    out = gated_group_rms_norm(out.reshape(batch, seq, shape.inner_dim), z, w["linear_norm"], eps, shape.n_groups)
    return linear(out, w["linear_out"])


def gated_delta_net(
    shape: GatedDeltaNetShape, w: dict[str, Tensor], h: Tensor, documents: Documents | None, eps: float
) -> Tensor:
    """The mixer on the normed residual stream h [batch, seq, d_model] -> [batch, seq, d_model], as
    transformers' Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet compute it (`documents`: packed rows, see
    `packed_documents`; `eps`: the gated norm's)."""
    batch, seq, _ = h.shape
    qkv, z, b, a = _split_projections(shape, linear(h, w["linear_in"]))
    doc_ids = None if documents is None else documents.doc_ids
    qkv = F.silu(causal_conv(qkv, w["linear_conv"], doc_ids))
    q, k, v = qkv.split([shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
    q = q.reshape(batch, seq, shape.n_key_heads, shape.key_head_dim)
    k = k.reshape(batch, seq, shape.n_key_heads, shape.key_head_dim)
    v = v.reshape(batch, seq, shape.n_value_heads, shape.value_head_dim)
    log_decay = -upcast(w["linear_A_log"]).exp() * F.softplus(upcast(a) + w["linear_dt_bias"])
    out = chunked_gated_delta_rule(q, k, v, log_decay, b.sigmoid(), doc_ids, shape.chunk, w.get(KEPT_RECURRENCE))
    out = gated_rms_norm(out, z, w["linear_norm"], eps)
    return linear(out.reshape(batch, seq, shape.value_dim), w["linear_out"])


def _split_projections(shape: GatedDeltaNetShape, projected: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The one input GEMM's output [batch, seq, width] -> (q|k|v [batch, seq, conv_dim], z [batch, seq,
    n_value_heads, value_head_dim], b and a [batch, seq, n_value_heads])."""
    batch, seq, _ = projected.shape
    n_v, d_v = shape.n_value_heads, shape.value_head_dim
    if not shape.grouped_projections:
        qkv, z, b, a = projected.split([shape.conv_dim, shape.value_dim, n_v, n_v], dim=-1)
        return qkv, z.reshape(batch, seq, n_v, d_v), b, a
    per_key = n_v // shape.n_key_heads  # value heads per key head
    qkvz, ba = projected.split([2 * shape.key_dim + 2 * shape.value_dim, 2 * n_v], dim=-1)
    q, k, v, z = qkvz.reshape(batch, seq, shape.n_key_heads, -1).split(
        [shape.key_head_dim, shape.key_head_dim, per_key * d_v, per_key * d_v], dim=-1
    )
    b, a = ba.reshape(batch, seq, shape.n_key_heads, 2 * per_key).split([per_key, per_key], dim=-1)
    qkv = torch.cat([t.reshape(batch, seq, -1) for t in (q, k, v)], dim=-1)
    return qkv, z.reshape(batch, seq, n_v, d_v), b.reshape(batch, seq, n_v), a.reshape(batch, seq, n_v)


@compiled_on_cuda
def causal_conv(x: Tensor, taps: Tensor, doc_ids: Tensor | None, bias: Tensor | None = None) -> Tensor:
    """Depthwise causal convolution over the sequence: x [batch, seq, channels], taps [channels, kernel] (the
    last tap on the token itself), a bias per channel or none -> like x. A tap that would reach into an
    earlier document reads zero, as the row's start does. Summed in fp32 and rounded once, as the fused conv1d
    kernels accumulate. (silu stays apart: compiled in, it made the backward's taps reductions recompute it,
    and the step 1.7% slower on Qwen3.5-0.8B, H200.)"""
    kernel, seq = taps.shape[1], x.shape[1]
    x32, taps32 = upcast(x), upcast(taps)
    out = x32 * taps32[:, -1]
    if bias is not None:
        out = out + upcast(bias)
    for shift in range(1, min(kernel, seq)):
        earlier = x32[:, :-shift]
        if doc_ids is not None:
            earlier = earlier * (doc_ids[:, shift:] == doc_ids[:, :-shift]).unsqueeze(-1)
        out = out + F.pad(earlier * taps32[:, kernel - 1 - shift], (0, 0, shift, 0))
    return out.to(x.dtype)


@compiled_on_cuda
def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x rounded to the gate's dtype (as transformers' rule returns its output), RMS-normed over its last dim
    (weight after the cast, Llama's way), times silu(gate) in fp32, cast back: the mixer's output norm, per value
    head (x and gate [..., value_head_dim]; x in any layout, the result contiguous). The rounding and the layout
    change are this kernel's own: apart, they were a pass over the rule's fp32 output each way."""
    dtype = gate.dtype
    x32 = upcast(x.to(dtype))
    normed = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (upcast(normed) * F.silu(upcast(gate))).to(dtype).contiguous()


@compiled_on_cuda
def gated_group_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, groups: int) -> Tensor:
    """x * silu(gate) in fp32, RMS-normed over each of `groups` equal slices of its last dim, cast to the gate's
    dtype, then scaled by weight (Llama's way): Mamba-2's output norm (x and gate [..., inner_dim])."""
    gated = upcast(x) * F.silu(upcast(gate))
    grouped = gated.unflatten(-1, (groups, -1))
    normed = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
    return weight * normed.to(gate.dtype)


@compiled_on_cuda
def _unit_heads(x: Tensor, n_heads: int, scale: float) -> Tensor:
    """Queries or keys [batch, seq, n_key_heads, d] -> [batch, seq, n_heads, d] in at least fp32: each vector
    L2-normalised (eps 1e-6 under the root, as transformers' and FLA's l2norm) and times `scale`, each key head
    serving n_heads / n_key_heads consecutive heads. Laid out head-major ([batch, n_heads, seq, d] contiguous,
    as the chunked recurrence reads it): compiled, the copy is this kernel's own write."""
    x = upcast(x)
    unit = _per_value_head(x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6) * scale, n_heads)
    return unit.transpose(1, 2).contiguous().transpose(1, 2)


def chunked_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    beta: Tensor,
    doc_ids: Tensor | None = None,
    chunk: int = 64,
    kept: KeptRecurrence | None = None,
) -> Tensor:
    """The gated delta rule over whole rows, in fp32 (fp64 stays fp64).

    q, k: [batch, seq, n_key_heads, key_head_dim]; v: [batch, seq, n_value_heads, value_head_dim]; log_decay
    (g <= 0) and beta: [batch, seq, n_value_heads]; doc_ids: [batch, seq] (`Documents.doc_ids`) or None for one
    sequence per row. q and k are L2-normalised and q scaled by key_head_dim ** -0.5 here. Returns
    [batch, seq, n_value_heads, value_head_dim]: per token, with S (per value head, [key_head_dim,
    value_head_dim], zero at each row's and document's start) S <- exp(g) S; S <- S + k (beta (v - S^T k))^T;
    output S^T q.

    In chunks of `chunk` tokens: within one, the updates' mutual corrections are a unit lower-triangular
    system (the UT transform) solved at once, and the outputs a masked attention; between chunks only S is
    carried. A document that starts inside a chunk is masked out of everything before it: pairs across the
    start, the carried state's reach into the chunk and the carry out of it."""
    n_heads = v.shape[2]
    q, k = _unit_heads(q, n_heads, q.shape[-1] ** -0.5), _unit_heads(k, n_heads, 1.0)
    return chunked_decayed_recurrence(q, k, v, log_decay, beta, doc_ids, chunk, _came_in_half(v), kept)


def chunked_ssd(
    x: Tensor,
    dt: Tensor,
    a: Tensor,
    b: Tensor,
    c: Tensor,
    doc_ids: Tensor | None = None,
    chunk: int = 64,
    kept: KeptRecurrence | None = None,
) -> Tensor:
    """Mamba-2's state-space recurrence over whole rows, in fp32 (fp64 stays fp64), without its D x term.

    x: [batch, seq, n_heads, head_dim]; dt (> 0): [batch, seq, n_heads]; a (< 0): [n_heads]; b, c: [batch, seq,
    n_groups, state_dim], each group's serving n_heads / n_groups consecutive heads; doc_ids as in
    `chunked_gated_delta_rule`. Per token, with S (per head, [state_dim, head_dim], zero at each row's and
    document's start): S <- exp(dt a) S + b (dt x)^T; output S^T c. It is the gated delta rule's recurrence
    without the delta's correction (queries c, keys b, values dt x, log decay dt a), chunked alike."""
    dtype = torch.promote_types(upcast(x).dtype, torch.float32)
    n_heads = x.shape[2]
    values = x.to(dtype) * dt.unsqueeze(-1)
    q, k = (_per_value_head(t, n_heads).to(dtype) for t in (c, b))
    return chunked_decayed_recurrence(q, k, values, dt * a, None, doc_ids, chunk, _came_in_half(x), kept)


def _came_in_half(t: Tensor) -> bool:
    """Inputs in a half type: the recurrence's matmuls may round fp32 operands to TF32 (fp32 and fp64 inputs keep
    exact arithmetic, which their tests hold to 1e-5 and 1e-12)."""
    return t.dtype in (torch.bfloat16, torch.float16)


def _per_value_head(t: Tensor, n_heads: int) -> Tensor:
    """[batch, seq, n_key_heads, ...] -> [batch, seq, n_heads, ...]: each key head serves n_heads / n_key_heads
    consecutive heads."""
    return t if t.shape[2] == n_heads else t.repeat_interleave(n_heads // t.shape[2], dim=2)
