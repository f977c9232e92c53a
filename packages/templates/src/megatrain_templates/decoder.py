"""The decoder block template: pre-norm attention + SwiGLU MLP, Llama/Qwen/Mistral style.

`forward` runs the block on weights bound from a flat buffer; `backward` recomputes the
forward from the checkpointed input under a graph that lives only inside the call and
accumulates weight gradients into a flat fp32 buffer in place.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import Documents, causal_attention, packed_documents, windowed_attention_with_sinks
from .layout import KeptGraph, ParamSpec, Span, accumulate, check_buffers, fused_span, leaf, span_of, total_numel
from .ops import RopeConfig, apply_rope, apply_rope_interleaved, rms_norm, rope_cos_sin, swiglu


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
        return self.qk_nope_head_dim + self.qk_rope_head_dim


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

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.qk_norm_scope not in ("head", "full"):
            raise ValueError(f"qk_norm_scope must be 'head' or 'full', got {self.qk_norm_scope!r}")

    @property
    def rope_config(self) -> RopeConfig:
        return self.rope or RopeConfig(head_dim=self.head_dim)


def attention_params(shape: BlockShape) -> tuple[tuple[ParamSpec, ...], tuple[ParamSpec, ...]]:
    """(matrices, norms and biases) of the attention half of a block, Hugging Face names.

    q, k and v are adjacent so that they are one GEMM; the second tuple takes no weight decay."""
    if shape.mla is not None:
        return _mla_params(shape)
    d, q_out, kv_out = shape.d_model, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim
    matrices = (
        ParamSpec("self_attn.q_proj.weight", (q_out, d)),
        ParamSpec("self_attn.k_proj.weight", (kv_out, d)),
        ParamSpec("self_attn.v_proj.weight", (kv_out, d)),
        ParamSpec("self_attn.o_proj.weight", (d, q_out)),
    )
    small = [
        ParamSpec("input_layernorm.weight", (d,), weight_decay=False),
        ParamSpec("post_attention_layernorm.weight", (d,), weight_decay=False),
    ]
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
    mlp = (
        ParamSpec("mlp.gate_proj.weight", (shape.d_ff, d)),
        ParamSpec("mlp.up_proj.weight", (shape.d_ff, d)),
        ParamSpec("mlp.down_proj.weight", (d, shape.d_ff)),
    )
    return matrices + mlp + small


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
    else:
        spans = {
            "qkv_weight": fused_span(
                params, ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]
            ),
            "o_weight": span_of(params, "self_attn.o_proj.weight"),
            "input_norm": span_of(params, "input_layernorm.weight"),
        }
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
    if any(p.name == "post_attention_layernorm.weight" for p in params):  # a split MoE layer keeps it with the router
        spans["post_norm"] = span_of(params, "post_attention_layernorm.weight")
    return spans


class DecoderBlock:
    """Stateless decoder block. `groups` is one flat buffer's layout."""

    def __init__(self, shape: BlockShape):
        self.shape = shape
        params = block_params(shape)
        self.groups: tuple[tuple[ParamSpec, ...], ...] = (params,)
        self.numel = total_numel(params)
        self._spans: dict[str, Span] = {
            **attention_spans(shape, params),
            "gate_up_weight": fused_span(params, ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
            "down_weight": span_of(params, "mlp.down_proj.weight"),
        }
        self._rope_cache: dict[tuple, tuple[Tensor, Tensor]] = {}

    def _rope(self, seq_len: int, device, dtype) -> tuple[Tensor, Tensor]:
        key = (seq_len, str(device), dtype)
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_cos_sin(self.shape.rope_config, seq_len, device, dtype)
        return self._rope_cache[key]

    def _attention(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> Tensor:
        """x + attention(input_norm(x)): the residual stream after the attention half."""
        documents = packed_documents(documents)  # padding alone changes nothing here
        if self.shape.mla is not None:
            return self._latent_attention(w, x, documents)
        s = self.shape
        batch, seq, _ = x.shape
        h = rms_norm(x, w["input_norm"], s.rms_eps)
        qkv = F.linear(h, w["qkv_weight"], w.get("qkv_bias"))
        q, k, v = qkv.split([s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_kv_heads * s.head_dim], dim=-1)
        if s.qk_norm and s.qk_norm_scope == "full":
            q = rms_norm(q, w["q_norm"], s.rms_eps)
            k = rms_norm(k, w["k_norm"], s.rms_eps)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        q = q.reshape(batch, seq, s.n_heads, s.head_dim)
        k = k.reshape(batch, seq, s.n_kv_heads, s.head_dim)
        v = v.reshape(batch, seq, s.n_kv_heads, s.head_dim).transpose(1, 2)
        if s.qk_norm and s.qk_norm_scope == "head":
            q = rms_norm(q, w["q_norm"], s.rms_eps)
            k = rms_norm(k, w["k_norm"], s.rms_eps)
        cos, sin = self._rope(seq, x.device, x.dtype)
        if documents is not None:
            cos, sin = documents.rope_tables(cos, sin)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        if s.sinks or s.sliding_window is not None:
            attn = windowed_attention_with_sinks(q, k, v, w.get("sinks"), s.sliding_window, documents)
        else:
            attn = causal_attention(q, k, v, documents)
        out = attn.transpose(1, 2).reshape(batch, seq, s.n_heads * s.head_dim)
        return x + F.linear(out, w["o_weight"], w.get("o_bias"))

    def _latent_attention(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> Tensor:
        """Multi-head latent attention as transformers' DeepSeek-V2: queries (optionally through a
        normed low-rank latent), a normed latent for every head's key and value, one shared rotary
        key head, rotary embedding on interleaved pairs."""
        s, m = self.shape, self.shape.mla
        batch, seq, _ = x.shape
        h = rms_norm(x, w["input_norm"], s.rms_eps)
        if m.q_lora_rank:
            q = F.linear(rms_norm(F.linear(h, w["q_a_proj"]), w["q_a_layernorm"], m.latent_eps), w["q_b_proj"])
        else:
            q = F.linear(h, w["q_proj"])
        q_nope, q_rot = (
            q.view(batch, seq, s.n_heads, m.qk_head_dim)
            .transpose(1, 2)
            .split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        )
        latent, k_rot = F.linear(h, w["kv_a_proj_with_mqa"]).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, w["kv_a_layernorm"], m.latent_eps)
        cos, sin = self._rope(seq, x.device, torch.float32)
        half = m.qk_rope_head_dim // 2
        cos, sin = cos[:, :half], sin[:, :half]
        if documents is not None:
            cos, sin = documents.rope_tables(cos, sin)
        q_rot = apply_rope_interleaved(q_rot, cos, sin)
        k_rot = apply_rope_interleaved(k_rot.unsqueeze(1), cos, sin)
        kv = F.linear(latent, w["kv_b_proj"]).view(batch, seq, s.n_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, s.n_heads, -1, -1)], dim=-1)
        mask = None if documents is None else documents.dense_mask()
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=m.softmax_scale)
        return x + F.linear(attn.transpose(1, 2).reshape(batch, seq, s.n_heads * m.v_head_dim), w["o_proj"])

    def _up_to_mlp_output(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> tuple[Tensor, Tensor]:
        """Everything but the last GEMM: returns (x after attention, silu(gate) * up)."""
        x = self._attention(w, x, documents)
        return x, swiglu(F.linear(rms_norm(x, w["post_norm"], self.shape.rms_eps), w["gate_up_weight"]))

    def _block(self, w: dict[str, Tensor], x: Tensor, documents: Documents | None) -> Tensor:
        x, mlp_hidden = self._up_to_mlp_output(w, x, documents)
        return x + F.linear(mlp_hidden, w["down_weight"])

    def forward(self, weights: list[Tensor], hidden: Tensor, documents: Documents | None = None) -> Tensor:
        """hidden: [batch, seq, d_model] in the compute dtype -> same shape; `documents`: packed rows."""
        check_buffers(weights, self.groups, "DecoderBlock.forward")
        return self._block(self._views(weights[0]), hidden, documents)

    def forward_kept(
        self, weights: list[Tensor], hidden: Tensor, documents: Documents | None = None
    ) -> tuple[Tensor, KeptGraph]:
        """`forward`, keeping its autograd graph for `backward_kept` instead of a checkpoint to recompute
        from: about `kept_bytes_per_token` bytes of GPU memory per token until then."""
        check_buffers(weights, self.groups, "DecoderBlock.forward_kept")
        graph = KeptGraph(weights)
        leaves = {name: leaf(weights[0], span) for name, span in self._spans.items()}
        x = hidden.detach().requires_grad_(True)
        with graph.recording():
            out = self._block(leaves, x, documents)
        graph.keep(out, [x, *leaves.values()])
        return out.detach(), graph

    def backward_kept(self, weights: list[Tensor], graph: KeptGraph, grad_out: Tensor, grads: list[Tensor]) -> Tensor:
        """`backward` through the graph `forward_kept` kept, with the weights streamed in again."""
        check_buffers(weights, self.groups, "DecoderBlock.backward_kept")
        grad_in, *grad_leaves = graph.backward(weights, grad_out)
        for name, grad in zip(self._spans, grad_leaves):
            accumulate(grads[0], self._spans[name], grad)
        return grad_in

    def kept_bytes_per_token(self, element_size: int) -> int:
        """GPU bytes per token that `forward_kept` holds until the backward, an upper estimate: the
        normed inputs, q/k/v (rotated and not), the attention output (and its reshaped copy), the MLP's
        input, gate/up and activation, in the compute dtype (`element_size` bytes). (Qwen2.5-7B on an
        H100: 167 KB estimated, 149 KB measured; compiled kernels save less than eager ones.)"""
        s = self.shape
        if s.mla is not None:
            q_width = s.n_heads * s.mla.qk_head_dim
            kv_width = s.n_heads * (s.mla.qk_head_dim + s.mla.v_head_dim) // 2 + s.mla.kv_lora_rank
        else:
            q_width, kv_width = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        planes = 3 * s.d_model + 4 * q_width + 3 * kv_width + 3 * s.d_ff
        return planes * element_size

    def _views(self, buffer: Tensor) -> dict[str, Tensor]:
        """Every parameter of the block as a view of its flat weight buffer."""
        return {name: span.view(buffer) for name, span in self._spans.items()}

    def backward(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        grad_out: Tensor,
        grads: list[Tensor],
        documents: Documents | None = None,
    ) -> Tensor:
        """Recompute from the block input `hidden`, add weight gradients into `grads[0]`
        (flat, fp32) and return the gradient w.r.t. `hidden`.

        The recompute stops before the MLP's down projection: its output is not needed for
        any gradient, so that GEMM (about a quarter of a block's matmul work) is skipped and
        its two backward GEMMs are done here by hand."""
        check_buffers(weights, self.groups, "DecoderBlock.backward")
        leaves = {name: leaf(weights[0], span) for name, span in self._spans.items() if name != "down_weight"}
        down = self._spans["down_weight"].view(weights[0])
        x = hidden.detach().requires_grad_(True)
        with torch.enable_grad():
            after_attention, mlp_hidden = self._up_to_mlp_output(leaves, x, documents)
        grad_mlp_hidden = grad_out @ down  # [batch, seq, d_ff]
        grad_down = grad_out.reshape(-1, grad_out.shape[-1]).T @ mlp_hidden.detach().reshape(-1, mlp_hidden.shape[-1])
        accumulate(grads[0], self._spans["down_weight"], grad_down)
        # the residual passes grad_out straight to after_attention; autograd adds the MLP path
        grad_in, *grad_leaves = torch.autograd.grad(
            [after_attention, mlp_hidden], [x, *leaves.values()], [grad_out, grad_mlp_hidden]
        )
        for name, grad in zip(leaves, grad_leaves):
            accumulate(grads[0], self._spans[name], grad)
        return grad_in
