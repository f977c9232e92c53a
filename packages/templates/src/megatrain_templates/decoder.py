"""The decoder block template: pre-norm attention + gated MLP, Llama/Qwen/Mistral style (and Gemma's
and OLMo 2's norms around or after both halves).

`forward` runs the block on weights bound from a flat buffer; `backward` recomputes the
forward from the checkpointed input under a graph that lives only inside the call and
accumulates weight gradients into a flat fp32 buffer in place.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import (
    Documents,
    causal_attention,
    chunked_causal_attention,
    masked_attention,
    packed_documents,
    token_positions,
)
from .chunked_recurrence import KeptRecurrence
from .kernel_attention import KEPT_ATTENTION, KEPT_ATTENTION_OUT, KeptAttention
from .layout import (
    BoundWeight,
    ParamSpec,
    ProductKeeper,
    Span,
    accumulate,
    add_matmul_,
    check_buffers,
    fused_span,
    leaf,
    span_of,
    total_numel,
)
from .linear_attention import (
    KEPT_RECURRENCE,
    LINEAR_ATTENTION_LEAVES,
    GatedDeltaNetShape,
    Mamba2Shape,
    kept_recurrence_bytes_per_token,
    linear_attention_mixer,
    linear_attention_params,
    linear_attention_spans,
)
from .lora import AdapterLayout, DropoutKey, Lora
from .ops import (
    GATED_ACTIVATIONS,
    NORM_SCALES,
    RopeConfig,
    add_rms_norm,
    apply_rope,
    apply_rope_in_fp32,
    apply_rope_interleaved,
    linear,
    rms_norm,
    rms_norm_as,
    rms_normalized,
    rope_cos_sin,
    rotary_heads,
    swiglu,
    swiglu_output_and_backward,
)
from .template import Template


@dataclass(frozen=True)
class MlaShape:
    """Multi-head latent attention (DeepSeek-V2): each head's key (non-rotary part) and value come
    from one shared low-rank latent; the rotary part of the key is one head shared by all."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # = BlockShape.head_dim, the rotary tables' width
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale squared where the model has it
    q_lora_rank: int = 0  # 0: queries straight from the hidden state
    latent_eps: float = 1e-6  # the latents' RMSNorm epsilon (transformers' default, not the model's)

    @property
    def qk_head_dim(self) -> int:
        """Width of a query's / key's head: its un-rotated part plus its rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


NORM_PLACEMENTS = ("pre", "sandwich", "post")


@dataclass(frozen=True)
class BlockShape:
    """Everything that fixes a decoder block's weights and arithmetic."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    rms_eps: float = 1e-6
    qkv_bias: bool = False
    qk_norm: bool = False
    rope: RopeConfig | None = None
    qk_norm_scope: str = "head"  # "head": one norm per head (Qwen3); "full": over all heads at once (OLMoE)
    clip_qkv: float | None = None  # clamp q, k and v to [-clip_qkv, clip_qkv] (OLMoE)
    o_bias: bool = False  # a bias on the output projection too (gpt-oss)
    sinks: bool = False  # a learned sink logit per head that takes attention probability but no value (gpt-oss)
    sliding_window: int | None = None  # attend only to the last `sliding_window` positions (gpt-oss' even layers)
    mla: MlaShape | None = None  # multi-head latent attention instead of q/k/v projections (DeepSeek-V2)
    # rotary embedding on adjacent pairs (x0, x1), (x2, x3), ... in fp32 (DeepSeek's latent attention, ERNIE
    # 4.5); else on Llama's halves
    rope_interleaved: bool = False
    # how the norms apply their weights (NORM_SCALES): Llama's "cast_first", OLMo 2's "fp32", Gemma's
    # "one_plus_fp32"; and where they are (NORM_PLACEMENTS): before attention and MLP ("pre"), before and on
    # their outputs, before each residual add ("sandwich": Gemma), on their outputs only ("post": OLMo 2)
    norm_scale: str = "cast_first"
    norm_placement: str = "pre"
    activation: str = "silu"  # the dense MLP's gate (GATED_ACTIVATIONS): silu (SwiGLU) or gelu_tanh (GeGLU)
    # Gemma: scores scaled by `softmax_scale` (its query_pre_attn_scalar ** -0.5); Gemma 2's soft-capped to
    # (-attn_softcap, attn_softcap)
    softmax_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    # Phi-3: q, k and v stored as one `qkv_proj`, gate and up as one `gate_up_proj` (the same bytes, one name)
    fused_projections: bool = False
    # Llama 4 (its "iRoPE"): layers with the rotary embedding (`rotary`) have their queries and keys RMS-normed
    # with no weight after it (`qk_rms_normalized`) and attend within chunks of `attention_chunk` positions;
    # the others ("NoPE") attend over everything, their queries scaled by position-dependent temperatures,
    # log(floor((position + 1) / floor_scale) + 1) * attn_scale + 1 (`attn_temperature`: (floor_scale,
    # attn_scale)). Its MLP module is `feed_forward`.
    rotary: bool = True
    qk_rms_normalized: bool = False
    attention_chunk: int | None = None
    attn_temperature: tuple[float, float] | None = None
    mlp_module: str = "mlp"
    # the dense MLP as one fused gate|up tensor and the down projection under names of their own (Granite 4.0's
    # shared_mlp.input_linear, shared_mlp.output_linear), in place of `mlp_module`'s
    mlp_names: tuple[str, str] | None = None
    # Qwen3-Next and Qwen3.5: linear attention (Gated DeltaNet) instead of softmax attention on this layer; on
    # the others, attention's output gated per element by sigmoid(gate), the gate a second half of each query
    # head's q_proj rows (query, then gate, per head)
    linear_attention: GatedDeltaNetShape | Mamba2Shape | None = None  # (Granite 4.0-H: Mamba-2)
    attn_output_gate: bool = False
    # Granite: attention's and the MLP's outputs scaled by `residual_scale` (its residual_multiplier) before
    # their residual adds
    residual_scale: float | None = None

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.qk_norm_scope not in ("head", "full"):
            raise ValueError(f"qk_norm_scope must be 'head' or 'full', got {self.qk_norm_scope!r}")
        if self.activation not in GATED_ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(GATED_ACTIVATIONS)}, got {self.activation!r}")
        if self.fused_projections and self.qkv_bias:
            raise ValueError("fused_projections (Phi-3's qkv_proj) has no q/k/v biases")
        if self.norm_scale not in NORM_SCALES or self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(
                f"norm_scale must be one of {NORM_SCALES} and norm_placement one of {NORM_PLACEMENTS}, got "
                f"{self.norm_scale!r} and {self.norm_placement!r}"
            )
        if self.mla is not None and (
            self.norm_placement != "pre" or self.norm_scale != "cast_first" or self.attn_softcap
        ):
            raise ValueError("latent attention (mla) has pre-norms of Llama's kind and no soft cap")
        if self.mla is not None and (
            not self.rotary or self.qk_rms_normalized or self.attention_chunk or self.attn_temperature
        ):
            raise ValueError("latent attention (mla) always rotates, with no chunks, temperatures or q/k RMS")
        if self.linear_attention is not None and (self.mla is not None or self.norm_placement != "pre"):
            raise ValueError("linear attention replaces softmax attention (not latent attention) in a pre-norm block")
        if self.attn_output_gate and (self.mla is not None or self.fused_projections or self.qkv_bias):
            raise ValueError("attn_output_gate is grouped-query attention's with q/k/v stored apart and no biases")

    def residual_add(self, x: Tensor, out: Tensor) -> Tensor:
        """x + out, out scaled by `residual_scale` where there is one."""
        return x + (out if self.residual_scale is None else out * self.residual_scale)

    @property
    def norms_its_residual_adds(self) -> bool:
        """Whether a residual add and the norm that reads its sum are one `add_rms_norm`: Llama's pre-norms, with no
        residual scale."""
        return self.norm_placement == "pre" and self.norm_scale == "cast_first" and self.residual_scale is None

    def add_and_norm(self, x: Tensor, branch: Tensor, weight: Tensor | None) -> tuple[Tensor, Tensor]:
        """(the residual stream after `branch`, its norm by `weight` as the next half reads it)."""
        if self.norms_its_residual_adds:
            return add_rms_norm(x, branch, weight, self.rms_eps)
        x = self.residual_add(x, branch)
        return x, x if self.norm_placement == "post" else self.norm(x, weight)

    @property
    def rotates_whole_heads(self) -> bool:
        """Whether q, k and v are one projection's, normed (Llama's way) or not and rotated whole, with nothing
        else between the projection and attention: what `rotary_heads` does in one kernel."""
        plain = (
            self.mla is None
            and self.linear_attention is None
            and not (self.attn_output_gate or self.clip_qkv is not None or self.qk_rms_normalized)
            and self.attn_temperature is None
        )
        rotated_whole = self.rotary and not self.rope_interleaved and self.rope_config.head_dim == self.head_dim
        return plain and rotated_whole and (not self.qk_norm or self.norm_scale == "cast_first")

    @property
    def rope_config(self) -> RopeConfig:
        """`rope`, or where None plain rotary embeddings over the whole `head_dim`."""
        return self.rope or RopeConfig(head_dim=self.head_dim)

    @property
    def normed_outputs(self) -> bool:
        """Whether attention's and the MLP's outputs are normed before their residual adds (Gemma, OLMo 2)."""
        return self.norm_placement != "pre"

    def norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """The block's RMSNorm of x with `weight` (and its epsilon, and its way of scaling)."""
        return rms_norm_as(self.norm_scale, x, weight, self.rms_eps)


def plain_causal_attention(shape: BlockShape) -> bool:
    """Whether the shape's attention is softmax attention over every earlier position, masked by nothing but
    causality (or documents): no window, chunk, sink or soft cap, and neither latent nor linear."""
    return (
        shape.mla is None
        and shape.linear_attention is None
        and not shape.sinks
        and shape.sliding_window is None
        and shape.attention_chunk is None
        and shape.attn_softcap is None
    )


def attention_params(shape: BlockShape) -> tuple[tuple[ParamSpec, ...], tuple[ParamSpec, ...]]:
    """(matrices, norms and biases) of the attention half of a block, Hugging Face names.

    q, k and v are adjacent so that they are one GEMM; the second tuple takes no weight decay."""
    if shape.mla is not None:
        return _mla_params(shape)
    if shape.linear_attention is not None:
        return linear_attention_params(shape.d_model, shape.linear_attention)
    d, q_out, kv_out = shape.d_model, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    if shape.fused_projections:
        projections = (ParamSpec("self_attn.qkv_proj.weight", (q_out + 2 * kv_out, d)),)
    else:
        projections = (
            ParamSpec("self_attn.q_proj.weight", (2 * q_out if shape.attn_output_gate else q_out, d)),
            ParamSpec("self_attn.k_proj.weight", (kv_out, d)),
            ParamSpec("self_attn.v_proj.weight", (kv_out, d)),
        )
    matrices = projections + (ParamSpec("self_attn.o_proj.weight", (d, q_out)),)
    # post_attention_layernorm: the MLP's input norm ("pre"), or the attention output's (the others)
    norms = (
        ("post_attention_layernorm",)
        if shape.norm_placement == "post"
        else ("input_layernorm", "post_attention_layernorm")
    )
    small = [ParamSpec(f"{name}.weight", (d,), weight_decay=False) for name in norms]
    if shape.qkv_bias:
        small += [
            ParamSpec("self_attn.q_proj.bias", (q_out,), weight_decay=False),
            ParamSpec("self_attn.k_proj.bias", (kv_out,), weight_decay=False),
            ParamSpec("self_attn.v_proj.bias", (kv_out,), weight_decay=False),
        ]
    if shape.o_bias:
        small.append(ParamSpec("self_attn.o_proj.bias", (d,), weight_decay=False))
    if shape.sinks:
        small.append(ParamSpec("self_attn.sinks", (shape.n_heads,), weight_decay=False))
    if shape.qk_norm:
        full = shape.qk_norm_scope == "full"
        small += [
            ParamSpec("self_attn.q_norm.weight", (q_out if full else shape.head_dim,), weight_decay=False),
            ParamSpec("self_attn.k_norm.weight", (kv_out if full else shape.head_dim,), weight_decay=False),
        ]
    return matrices, tuple(small)


def block_params(shape: BlockShape) -> tuple[ParamSpec, ...]:
    """Hugging Face names in buffer order: decayed matrices first (q, k, v adjacent and
    gate, up adjacent so each set is one GEMM), then norms and biases, which take no decay."""
    d = shape.d_model
    matrices, small = attention_params(shape)
    gate_up_names, down = _mlp_names(shape)
    gate_up = tuple(ParamSpec(name, (2 * shape.d_ff // len(gate_up_names), d)) for name in gate_up_names)
    mlp = gate_up + (ParamSpec(down, (d, shape.d_ff)),)
    # the MLP's own norms where the attention's output has one: before it (Gemma), and on its output
    norms = {"pre": (), "sandwich": ("pre_feedforward_layernorm", "post_feedforward_layernorm")}.get(
        shape.norm_placement, ("post_feedforward_layernorm",)
    )
    small += tuple(ParamSpec(f"{name}.weight", (d,), weight_decay=False) for name in norms)
    return matrices + mlp + small


def _mlp_names(shape: BlockShape) -> tuple[list[str], str]:
    """The dense MLP's gate and up projections, one fused tensor (Phi-3, Granite 4.0) or two, and its down
    projection."""
    if shape.mlp_names:
        return [f"{shape.mlp_names[0]}.weight"], f"{shape.mlp_names[1]}.weight"
    names = ["gate_up_proj"] if shape.fused_projections else ["gate_proj", "up_proj"]
    return [f"{shape.mlp_module}.{name}.weight" for name in names], f"{shape.mlp_module}.down_proj.weight"


def _mla_params(shape: BlockShape) -> tuple[tuple[ParamSpec, ...], tuple[ParamSpec, ...]]:
    d, heads, m = shape.d_model, shape.n_heads, shape.mla
    if m.q_lora_rank:
        queries = (
            ParamSpec("self_attn.q_a_proj.weight", (m.q_lora_rank, d)),
            ParamSpec("self_attn.q_b_proj.weight", (heads * m.qk_head_dim, m.q_lora_rank)),
        )
    else:
        queries = (ParamSpec("self_attn.q_proj.weight", (heads * m.qk_head_dim, d)),)
    matrices = queries + (
        ParamSpec("self_attn.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, d)),
        ParamSpec("self_attn.kv_b_proj.weight", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
        ParamSpec("self_attn.o_proj.weight", (d, heads * m.v_head_dim)),
    )
    small = [
        ParamSpec("input_layernorm.weight", (d,), weight_decay=False),
        ParamSpec("post_attention_layernorm.weight", (d,), weight_decay=False),
        ParamSpec("self_attn.kv_a_layernorm.weight", (m.kv_lora_rank,), weight_decay=False),
    ]
    if m.q_lora_rank:
        small.append(ParamSpec("self_attn.q_a_layernorm.weight", (m.q_lora_rank,), weight_decay=False))
    return matrices, tuple(small)


def attention_spans(shape: BlockShape, params: tuple[ParamSpec, ...]) -> dict[str, Span]:
    """Where the attention half's (fused) weights lie in a layout made with `attention_params`."""
    if shape.mla is not None:
        names = [p.name for p in params if p.name.startswith("self_attn.")]
        spans = {
            "input_norm": span_of(params, "input_layernorm.weight"),
            **{name.removeprefix("self_attn.").removesuffix(".weight"): span_of(params, name) for name in names},
        }
    elif shape.linear_attention is not None:
        spans = linear_attention_spans(params, shape.linear_attention)
    else:
        qkv = (
            ["self_attn.qkv_proj.weight"]
            if shape.fused_projections
            else ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
        )
        spans = {
            "qkv_weight": fused_span(params, qkv),
            "o_weight": span_of(params, "self_attn.o_proj.weight"),
        }
        if shape.norm_placement != "post":
            spans["input_norm"] = span_of(params, "input_layernorm.weight")
        if shape.qkv_bias:
            spans["qkv_bias"] = fused_span(
                params, ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
            )
        if shape.o_bias:
            spans["o_bias"] = span_of(params, "self_attn.o_proj.bias")
        if shape.sinks:
            spans["sinks"] = span_of(params, "self_attn.sinks")
        if shape.qk_norm:
            spans["q_norm"] = span_of(params, "self_attn.q_norm.weight")
            spans["k_norm"] = span_of(params, "self_attn.k_norm.weight")
    if shape.normed_outputs:  # Gemma's and OLMo 2's post_attention_layernorm is on the attention's output
        spans["attention_out_norm"] = span_of(params, "post_attention_layernorm.weight")
    elif any(p.name == "post_attention_layernorm.weight" for p in params):  # a split MoE layer keeps it elsewhere
        spans["post_norm"] = span_of(params, "post_attention_layernorm.weight")
    return spans


class DecoderBlock(Template):
    """Stateless decoder block. `groups` is one flat buffer's layout."""

    def __init__(self, shape: BlockShape, lora: Lora | None = None):
        self.shape = shape
        params = block_params(shape)
        self.groups: tuple[tuple[ParamSpec, ...], ...] = (params,)
        self.numel = total_numel(params)
        gate_up_names, down = _mlp_names(shape)
        self._spans: dict[str, Span] = {
            **attention_spans(shape, params),
            "gate_up_weight": fused_span(params, gate_up_names),
            "down_weight": span_of(params, down),
        }
        if shape.norm_placement == "sandwich":
            self._spans["post_norm"] = span_of(params, "pre_feedforward_layernorm.weight")
        if shape.normed_outputs:
            self._spans["mlp_out_norm"] = span_of(params, "post_feedforward_layernorm.weight")
        self._activation = GATED_ACTIVATIONS[shape.activation]
        # what autograd differentiates as leaves: norms, biases, the linear attention's convolution taps
        self._vectors = tuple(
            name for name, span in self._spans.items() if len(span.shape) == 1 or name in LINEAR_ATTENTION_LEAVES
        )
        # a norm on the MLP's output needs the down projection's product in the backward too
        self._recomputed_matrices = tuple(
            name
            for name in self._spans
            if name not in self._vectors and (name != "down_weight" or shape.normed_outputs)
        )
        self._keeps_attention = plain_causal_attention(shape)
        self._rope_cache: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._adapters = None if lora is None else self._adapt(lora)

    def _adapt(self, lora: Lora, extra: tuple[str, ...] = (), renames: dict | None = None) -> AdapterLayout:
        """LoRA adapters on the matrices `lora` targets (and on the spans `extra`, autograd's leaves otherwise), in
        a second group (the base's is then frozen); `renames` as `AdapterLayout`'s."""
        matrices = tuple(name for name in self._spans if name not in self._vectors) + extra
        adapters = AdapterLayout(lora, self.groups[0], self._spans, matrices, renames)
        self.groups = (self.groups[0], adapters.params)
        self.takes_dropout = lora.dropout > 0  # (its training passes are given `dropout=`, their masks' key)
        return adapters

    def _rope(self, seq_len: int, device, dtype) -> tuple[Tensor, Tensor]:
        key = (seq_len, str(device), dtype)
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_cos_sin(self.shape.rope_config, seq_len, device, dtype)
        return self._rope_cache[key]

    def _attention(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> Tensor:
        """x + attention(input_norm(x)): the residual stream after the attention half."""
        return self.shape.residual_add(x, self._attention_branch(w, x, documents))

    def _attention_and_norm(
        self, w: dict[str, Tensor], x: Tensor, documents: Documents | None
    ) -> tuple[Tensor, Tensor]:
        """(the residual stream after the attention half, its post-attention norm: the MLP's input)."""
        return self.shape.add_and_norm(x, self._attention_branch(w, x, documents), w.get("post_norm"))

    def _attention_branch(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> Tensor:
        """attention(input_norm(x)), as the residual stream adds it."""
        documents = packed_documents(documents)  # padding alone changes nothing here
        if self.shape.mla is not None:
            return self._latent_attention(w, x, documents)
        s = self.shape
        batch, seq, _ = x.shape
        h = x if s.norm_placement == "post" else s.norm(x, w["input_norm"])
        if s.linear_attention is not None:
            return linear_attention_mixer(s.linear_attention, w, h, documents, s.rms_eps)
        qkv = linear(h, w["qkv_weight"], w.get("qkv_bias"))
        q_width = s.n_heads * s.head_dim
        q, k, v, gate = self._heads(w, qkv, documents)
        # a window or chunk at least as long as the sequence masks nothing: the plain kernel then (Mistral's
        # 4096 window, Llama 4's 8192 chunks)
        window = s.sliding_window if s.sliding_window is not None and s.sliding_window < seq else None
        chunk = s.attention_chunk if s.attention_chunk is not None and s.attention_chunk < seq else None
        # chunks of rows holding one sequence each are rows of their own for the fused kernel; of packed rows
        # (chunks by each document's positions) a mask's work, as are sinks, windows and caps
        if s.sinks or window is not None or s.attn_softcap is not None or (chunk and documents is not None):
            attn = masked_attention(q, k, v, w.get("sinks"), window, documents, s.softmax_scale, s.attn_softcap, chunk)
        elif chunk is not None:
            attn = chunked_causal_attention(q, k, v, chunk, s.softmax_scale)
        else:
            attn = causal_attention(q, k, v, documents, s.softmax_scale, w.get(KEPT_ATTENTION))
        attn = attn.transpose(1, 2).reshape(batch, seq, q_width)
        if s.attn_output_gate:
            attn = attn * torch.sigmoid(gate.reshape(batch, seq, q_width))
        out = linear(attn, w["o_weight"], w.get("o_bias"))
        return s.norm(out, w["attention_out_norm"]) if s.normed_outputs else out

    def _heads(self, w: dict[str, Tensor], qkv: Tensor, documents: Documents | None) -> tuple[Tensor, ...]:
        """q, k, v ([batch, heads, seq, head_dim]) and the output gate (or None) of the projection `qkv`, with
        whatever the shape puts between them and attention: by `rotary_heads` where it does it all, else one
        operation at a time."""
        s = self.shape
        batch, seq, _ = qkv.shape
        if s.rotates_whole_heads:
            cos, sin = self._rope(seq, qkv.device, qkv.dtype)
            if documents is not None:
                cos, sin = documents.rope_tables(cos, sin)
            norms = (w["q_norm"], w["k_norm"]) if s.qk_norm else None
            heads = rotary_heads(qkv, cos, sin, norms, s.n_heads, s.n_kv_heads, s.rms_eps, s.qk_norm_scope == "full")
            return *(t.transpose(1, 2) for t in heads), None
        q_width, kv_width, gate = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, None
        q, k, v = qkv.split([2 * q_width if s.attn_output_gate else q_width, kv_width, kv_width], dim=-1)
        if s.attn_output_gate:  # each head's rows: its query, then its gate
            q, gate = q.reshape(batch, seq, s.n_heads, 2 * s.head_dim).chunk(2, dim=-1)
        if s.qk_norm and s.qk_norm_scope == "full":
            q = s.norm(q, w["q_norm"])
            k = s.norm(k, w["k_norm"])
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        q = q.reshape(batch, seq, s.n_heads, s.head_dim)
        k = k.reshape(batch, seq, s.n_kv_heads, s.head_dim)
        v = v.reshape(batch, seq, s.n_kv_heads, s.head_dim).transpose(1, 2)
        if s.qk_norm and s.qk_norm_scope == "head":
            q = s.norm(q, w["q_norm"])
            k = s.norm(k, w["k_norm"])
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if s.rotary:
            q, k = self._rotated(q, k, documents)
        if s.qk_rms_normalized:
            q, k = rms_normalized(q, s.rms_eps), rms_normalized(k, s.rms_eps)
        if s.attn_temperature is not None:
            floor_scale, attn_scale = s.attn_temperature
            position = token_positions(documents, seq, qkv.device).float()
            temperature = torch.log1p(torch.floor((position + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * temperature[:, None, :, None]).to(q.dtype)
        return q, k, v, gate

    def _rotated(self, q: Tensor, k: Tensor, documents: Documents | None) -> tuple[Tensor, Tensor]:
        """q and k ([batch, heads, seq, head_dim]) with the rotary embedding at each token's position."""
        s, seq = self.shape, q.shape[2]
        # on adjacent pairs in fp32, tables too (ERNIE 4.5, Llama 4); on halves with tables in the compute dtype
        cos, sin = self._rope(seq, q.device, torch.float32 if s.rope_interleaved else q.dtype)
        rotary = cos.shape[-1]
        if s.rope_interleaved:  # a pair shares one frequency: the tables' first half
            cos, sin = cos[:, : rotary // 2], sin[:, : rotary // 2]
        if documents is not None:
            cos, sin = documents.rope_tables(cos, sin)
        rope = apply_rope_interleaved if s.rope_interleaved else apply_rope
        if rotary < s.head_dim:  # partial rotary (GLM-4.5): the leading dims rotate, the rest pass
            q = torch.cat([rope(q[..., :rotary], cos, sin), q[..., rotary:]], dim=-1)
            k = torch.cat([rope(k[..., :rotary], cos, sin), k[..., rotary:]], dim=-1)
            return q, k
        return rope(q, cos, sin), rope(k, cos, sin)

    def _latent_attention(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> Tensor:
        """Multi-head latent attention as transformers' DeepSeek-V2/V3: queries (optionally through a
        normed low-rank latent), a normed latent for every head's key and value, one shared rotary
        key head, rotary embedding on interleaved pairs (or on halves)."""
        s, m = self.shape, self.shape.mla
        batch, seq, _ = x.shape
        h = rms_norm(x, w["input_norm"], s.rms_eps)
        if m.q_lora_rank:
            q = linear(rms_norm(linear(h, w["q_a_proj"]), w["q_a_layernorm"], m.latent_eps), w["q_b_proj"])
        else:
            q = linear(h, w["q_proj"])
        q_nope, q_rot = (
            q.view(batch, seq, s.n_heads, m.qk_head_dim)
            .transpose(1, 2)
            .split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        )
        latent, k_rot = linear(h, w["kv_a_proj_with_mqa"]).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w["kv_a_layernorm"], m.latent_eps)
        cos, sin = self._rope(seq, x.device, torch.float32)
        if s.rope_interleaved:
            half = m.qk_rope_head_dim // 2
            cos, sin = cos[:, :half], sin[:, :half]
        if documents is not None:
            cos, sin = documents.rope_tables(cos, sin)
        rope = apply_rope_interleaved if s.rope_interleaved else apply_rope_in_fp32
        q_rot = rope(q_rot, cos, sin)
        k_rot = rope(k_rot.unsqueeze(1), cos, sin)
        kv = linear(latent, w["kv_b_proj"]).view(batch, seq, s.n_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, s.n_heads, -1, -1)], dim=-1)
        mask = None if documents is None else documents.dense_mask()
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=m.softmax_scale)
        return linear(attn.transpose(1, 2).reshape(batch, seq, s.n_heads * m.v_head_dim), w["o_proj"])

    def _up_to_mlp_input(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> tuple[Tensor, Tensor]:
        """Everything before the MLP's activation: returns (x after attention, the gate|up projection)."""
        x, h = self._attention_and_norm(w, x, documents)
        return x, linear(h, w["gate_up_weight"])

    def _up_to_mlp_output(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> tuple[Tensor, Tensor]:
        """Everything but the last GEMM: returns (x after attention, activation(gate) * up)."""
        x, gate_up = self._up_to_mlp_input(w, x, documents)
        return x, self._activation(gate_up)

    def _mlp_by_hand(
        self,
        bound: dict,
        x: Tensor,
        documents: Documents | None,
        weights: list[Tensor],
        grads: list[Tensor],
        grad_out: Tensor,
        dropout: DropoutKey | None,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """The backward's recompute up to the MLP's activation, and the down projection's two GEMMs by hand (its
        weight gradient added into `grads[0]`): the outputs and their gradients that autograd takes from there.
        SwiGLU's output and its input's gradient come from one pass (`swiglu_output_and_backward`), made once the
        activation's gradient is: the recompute stops before the activation (not with adapters on the down
        projection, whose delta's graph starts at the activation)."""
        down = self._spans["down_weight"]
        adapted = self._adapters is not None and "down_weight" in self._adapters.adapted
        fused = self._activation is swiglu and not adapted
        recompute = self._up_to_mlp_input if fused else self._up_to_mlp_output
        with torch.enable_grad():
            after_attention, mlp_input = recompute(bound, x, documents)
        scale = self.shape.residual_scale
        grad_down_out = grad_out if scale is None else grad_out * scale
        grad_mlp_hidden = grad_down_out @ down.view(weights[0])  # [batch, seq, d_ff]
        if fused:
            # (over mlp_input, whose value no gradient reads: autograd needs only its graph from here)
            mlp_hidden, grad_mlp_input, _ = swiglu_output_and_backward(
                mlp_input.detach(), grad_mlp_hidden, overwrite=True
            )
        else:
            mlp_hidden, grad_mlp_input = mlp_input, grad_mlp_hidden
        if grads[0] is not None:
            add_matmul_(
                down.view(grads[0]),
                grad_down_out.reshape(-1, grad_out.shape[-1]).T,
                mlp_hidden.detach().reshape(-1, mlp_hidden.shape[-1]),
            )
        # the residual passes grad_out straight to after_attention; autograd adds the MLP path
        outputs, grad_outputs = [after_attention, mlp_input], [grad_out, grad_mlp_input]
        if adapted:
            with torch.enable_grad():  # the down projection's adapters: their delta's graph gives the rest
                down_adapters = self._adapters.adapters("down_weight", weights[1], grads[1], dropout=dropout)
                outputs.append(linear(mlp_hidden, down_adapters))
            grad_outputs.append(grad_down_out)
        return outputs, grad_outputs

    def _block(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> Tensor:
        x, mlp_hidden = self._up_to_mlp_output(w, x, documents)
        out = linear(mlp_hidden, w["down_weight"])
        return self.shape.residual_add(x, self.shape.norm(out, w["mlp_out_norm"]) if self.shape.normed_outputs else out)

    def forward(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        documents: Documents | None = None,
        dropout: DropoutKey | None = None,
    ) -> Tensor:
        """hidden: [batch, seq, d_model] in the compute dtype -> same shape; `documents`: packed rows; `dropout`: a
        training pass's key of the adapters' dropout masks (None: no dropout)."""
        check_buffers(weights, self.groups, "DecoderBlock.forward")
        return self._block(self._views(weights, dropout), hidden, documents)

    def forward_keeping_products(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        documents: Documents | None = None,
        extras: bool = False,
        dropout: DropoutKey | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`forward`, also returning the products of its matmuls that the backward would recompute (all
        but the MLP's down projection, which it does only under a norm): given to `backward` as `products`, they
        stand for those GEMMs, and the recompute is left with the norms, rotary embedding, attention and
        activation. `product_bytes_per_token` bytes per token: Qwen2.5-7B 92 KB, about 55% of what its whole
        autograd graph would hold (167 KB), and faster to go back through (H100, 16k tokens, forward + backward,
        the GEMMs' products alone: 45.9 ms, the whole graph 47.5, recomputing 53.5). Plain causal attention's
        output and log-sum-exp (`KeptAttention`), no larger, take the output projection's place where sequences
        are at least as long as the model is wide (`_results_stand_for_o`): the recompute then runs that GEMM
        instead of the attention's kernel. `extras` (kept where the device has room to spare:
        `extra_product_bytes_per_token`) keeps the rest too: a linear-attention layer's recurrence
        (`KeptRecurrence`), plain causal attention's results (7 KB a token at Qwen2.5-7B's shape for about 1 ms a
        layer at 16k tokens of 4096 on an H200; its layer pass 2% faster) or the output projection's product."""
        check_buffers(weights, self.groups, "DecoderBlock.forward_keeping_products")
        w, products = self._keeping_views(weights, hidden, extras, dropout)
        return self._block(w, hidden, documents), products

    @property
    def d_model(self) -> int:
        return self.shape.d_model

    def product_bytes_per_token(self, element_size: int) -> int:
        """GPU bytes per token that `forward_keeping_products` returns (in the compute dtype) without extras: where
        the attention's results may stand for the output projection's product (`_results_stand_for_o`, by the
        sequences' length), the larger of the two."""
        return self._kept_bytes_per_token(element_size, extras=False)

    def extra_product_bytes_per_token(self, element_size: int) -> int:
        """What `forward_keeping_products` keeps more a token with `extras`: a linear-attention layer's
        recurrence results (`KeptRecurrence`), plain causal attention's (`KeptAttention`) or, where those stand for
        it, the output projection's product; nothing elsewhere."""
        s = self.shape
        if s.linear_attention is not None:
            return kept_recurrence_bytes_per_token(s.linear_attention, element_size)
        return self._kept_bytes_per_token(element_size, extras=True) - self._kept_bytes_per_token(element_size, False)

    def _kept_bytes_per_token(self, element_size: int, extras: bool) -> int:
        """Bytes a token of matrices' products (their adapters' too) and attention's results a forward keeps."""
        s, adapters = self.shape, self._adapters
        widths = {
            name: self._product_width(name) + (0 if adapters is None else adapters.low_rank_width(name))
            for name in self._recomputed_matrices
        }
        matrices = sum(widths.values()) * element_size
        results = KeptAttention.bytes_per_token(s.n_heads, s.head_dim, element_size) if self._keeps_attention else 0
        if extras:
            return matrices + results
        if not self._results_stand_for_o():
            return matrices
        return max(matrices, matrices - widths["o_weight"] * element_size + results)

    def _product_width(self, name: str) -> int:
        """Elements a token of matrix `name`'s kept product."""
        return self._spans[name].shape[0]

    def _results_stand_for_o(self, seq_len: int | None = None) -> bool:
        """Whether a forward without extras keeps its attention's results (`KeptAttention`) in place of the output
        projection's product: where they are no larger a token (heads x head_dim no wider than its output; the
        log-sum-exp aside) and the sequences (`seq_len`; None: some length) at least as long as the model is wide.
        The backward's recompute then runs that projection's GEMM again (2 x d_model FLOPs a token for each of the
        heads' columns) where it would run the attention's forward kernel (2 x seq_len on average over a causal
        sequence): OLMoE-1B-7B's at 32k tokens of 4096, 0.36 ms where the kernel took 0.97 on an H100. With
        shorter sequences or a wider model the kernel is the cheaper to run again."""
        s = self.shape
        o_kept = self._keeps_attention and "o_weight" in self._recomputed_matrices
        no_larger = o_kept and s.n_heads * s.head_dim <= self._product_width("o_weight")
        return no_larger and (seq_len is None or seq_len >= s.d_model)

    def _views(self, weights: list[Tensor], dropout: DropoutKey | None = None) -> dict[str, Tensor]:
        """Every parameter of the block as a view of its flat weight buffer, adapted matrices with their adapters (and
        their dropout masks' key)."""
        views = {name: span.view(weights[0]) for name, span in self._spans.items()}
        return views if self._adapters is None else self._adapters.bind(views, weights[1], dropout=dropout)

    def _keeping_views(
        self, weights: list[Tensor], hidden: Tensor, extras: bool = False, dropout: DropoutKey | None = None
    ) -> tuple[dict[str, "Tensor | ProductKeeper"], dict[str, Tensor]]:
        """`_views` for a forward of `hidden`, the recomputed matrices wrapped to keep their products in the
        returned dict as a forward makes them (a base's product, not its adapters'); with `extras`, or where they
        stand for the output projection's product (`_results_stand_for_o`), its attention's kernel its results too
        (`KeptRecurrence`, `KeptAttention`)."""
        products: dict[str, Tensor] = {}
        # (where the attention's kernel keeps no results, as with packed documents, the projection's product is kept)
        results_for_o = not extras and self._results_stand_for_o(hidden.shape[1])
        unless = {"o_weight": KEPT_ATTENTION_OUT} if results_for_o else {}
        views = {
            name: ProductKeeper(span.view(weights[0]), name, products, unless.get(name))
            if name in self._recomputed_matrices
            else span.view(weights[0])
            for name, span in self._spans.items()
        }
        if self._adapters is not None:
            views = self._adapters.bind(views, weights[1], dropout=dropout)
        if extras or results_for_o:
            views.update(self._kept_results(products, keep=True))
        return views, products

    def _kept_results(self, products: dict[str, Tensor], keep: bool) -> dict:
        """Where the attention's kernel keeps its results in `products` (`keep`) or takes them from there: a
        linear-attention layer's recurrence (`KeptRecurrence`), plain causal attention (`KeptAttention`)."""
        kept = {}
        if self.shape.linear_attention is not None:
            kept[KEPT_RECURRENCE] = KeptRecurrence(products, keep=keep)
        if self._keeps_attention:
            kept[KEPT_ATTENTION] = KeptAttention(products, keep=keep)
        return kept

    def _bind(
        self,
        weights: list[Tensor],
        grads: list[Tensor | None],
        skip: tuple[str, ...] = (),
        products: dict[str, Tensor] | None = None,
        dropout: DropoutKey | None = None,
    ) -> tuple[dict[str, "Tensor | BoundWeight"], dict[str, Tensor]]:
        """The weights for a backward: (every parameter but `skip`, the autograd leaves among them).
        Matrices are bound to their span of the gradient buffer `grads[0]`, so their gradients are added into it
        inside the GEMM that makes them, and to their forward's product where `products` has it (as are a
        linear-attention layer's recurrence, `KeptRecurrence`, and plain causal attention's results,
        `KeptAttention`); norms and biases are leaves whose gradients autograd returns. A frozen base (`grads[0]`
        None) has no leaves and binds no gradient; its adapters bind theirs to `grads[1]`, with the forward's
        dropout key (`dropout`)."""
        products, (buffer, grad_flat) = products or {}, (weights[0], grads[0])
        vectors = [name for name in self._vectors if name not in skip]
        trained = grad_flat is not None
        leaves = {name: leaf(buffer, self._spans[name]) for name in vectors} if trained else {}
        fixed = {} if trained else {name: self._spans[name].view(buffer) for name in vectors}
        matrices = {
            name: BoundWeight(span.view(buffer), span.view(grad_flat) if trained else None, products.get(name))
            for name, span in self._spans.items()
            if name not in self._vectors and name not in skip
        }
        if self._adapters is not None:  # (a frozen base's vectors too: a MoE's router may be adapted)
            matrices = self._adapters.bind({**matrices, **fixed}, weights[1], grads[1], products, dropout)
        kept = self._kept_results(products, keep=False) if products else {}
        return {**leaves, **fixed, **matrices, **kept}, leaves

    def backward(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        grad_out: Tensor,
        grads: list[Tensor],
        documents: Documents | None = None,
        products: dict[str, Tensor] | None = None,
        dropout: DropoutKey | None = None,
    ) -> Tensor:
        """Recompute from the block input `hidden`, add weight gradients into `grads[0]`
        (flat, fp32) and return the gradient w.r.t. `hidden`; `products` (from
        `forward_keeping_products`) stand for the GEMMs that made them; `dropout`: the forward's key, whose
        masks the recompute draws again.

        The recompute stops before the MLP's down projection: its output is not needed for
        any gradient, so that GEMM (about a quarter of a block's matmul work) is skipped and
        its two backward GEMMs are done here by hand (unless a norm follows it: Gemma, OLMo 2)."""
        check_buffers(weights, self.groups, "DecoderBlock.backward")
        by_hand = not self.shape.normed_outputs  # a norm after the down projection needs its output
        skip = ("down_weight",) if by_hand else ()
        bound, leaves = self._bind(weights, grads, skip=skip, products=products, dropout=dropout)
        x = hidden.detach().requires_grad_(True)
        if by_hand:
            outputs, grad_outputs = self._mlp_by_hand(bound, x, documents, weights, grads, grad_out, dropout)
        else:
            with torch.enable_grad():
                outputs, grad_outputs = [self._block(bound, x, documents)], [grad_out]
        # (the bound matrices' gradients go into grads[0] as autograd passes them)
        grad_in, *grad_leaves = torch.autograd.grad(outputs, [x, *leaves.values()], grad_outputs)
        for name, grad in zip(leaves, grad_leaves):
            accumulate(grads[0], self._spans[name], grad)
        return grad_in
