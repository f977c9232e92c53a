"""Plain nn.Module layers written the textbook way (separate projections, explicit
softmax attention, repeat_interleave for GQA), used only as the reference in tests."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """|ours - reference| / |reference| in float64."""
    return ((ours.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30)).item()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x if x.dtype == torch.float64 else x.float()
        return self.weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x, inv_freq):  # x: [b, h, s, d]
    pos = torch.arange(x.shape[2], dtype=torch.float32)
    ang = pos[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class RefBlock(nn.Module):
    def __init__(self, d, n_heads, n_kv, head_dim, d_ff, eps, inv_freq, qkv_bias=False, qk_norm=False):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.inv_freq = n_heads, n_kv, head_dim, inv_freq
        self.scale, self.softcap, self.window = 1 / math.sqrt(head_dim), None, float("inf")
        self.residual_scale = 1.0  # Granite's residual_multiplier
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj = nn.Linear(d, n_heads * head_dim, bias=qkv_bias)
        a.k_proj = nn.Linear(d, n_kv * head_dim, bias=qkv_bias)
        a.v_proj = nn.Linear(d, n_kv * head_dim, bias=qkv_bias)
        a.o_proj = nn.Linear(n_heads * head_dim, d, bias=False)
        if qk_norm:
            a.q_norm = RMSNorm(head_dim, eps)
            a.k_norm = RMSNorm(head_dim, eps)
        self.qk_norm = qk_norm
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.up_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.down_proj = nn.Linear(d_ff, d, bias=False)

    def attention(self, h):
        """o_proj of causal attention over h, keys within `window` positions, scores soft-capped by `softcap`."""
        b, s, _ = h.shape
        a = self.self_attn
        q = a.q_proj(h).view(b, s, self.n_heads, self.head_dim)
        k = a.k_proj(h).view(b, s, self.n_kv, self.head_dim)
        v = a.v_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = rope(q.transpose(1, 2), self.inv_freq), rope(k.transpose(1, 2), self.inv_freq)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = q @ k.transpose(-1, -2) * self.scale
        if self.softcap:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        position = torch.arange(s)
        distance = position[:, None] - position[None, :]
        hidden = (distance < 0) | (distance >= self.window)
        att = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ v
        return a.o_proj(att.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.input_layernorm(x)) * self.residual_scale
        return x + self.feed_forward(self.post_attention_layernorm(x)) * self.residual_scale

    def feed_forward(self, h):
        return self.mlp.down_proj(F.silu(self.mlp.gate_proj(h)) * self.mlp.up_proj(h))


class GemmaRMSNorm(RMSNorm):
    """Scales by (1 + weight), in fp32."""

    def forward(self, x):
        x32 = x if x.dtype == torch.float64 else x.float()
        return (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)).to(x.dtype)


class RefGemmaBlock(RefBlock):
    """Gemma 2/3: norms before and after attention and MLP, gelu(tanh) gate, scores scaled by `scale`,
    soft-capped by `softcap`, limited to the last `window` keys; per-head q/k norms with `qk_norm` (Gemma 3)."""

    def __init__(self, d, n_heads, n_kv, head_dim, d_ff, eps, inv_freq, qk_norm, scale, softcap, window):
        super().__init__(d, n_heads, n_kv, head_dim, d_ff, eps, inv_freq, qk_norm=qk_norm)
        self.scale, self.softcap, self.window = scale, softcap, window
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(d, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(d, eps)
        if qk_norm:
            self.self_attn.q_norm = GemmaRMSNorm(head_dim, eps)
            self.self_attn.k_norm = GemmaRMSNorm(head_dim, eps)

    def forward(self, x):
        x = x + self.post_attention_layernorm(self.attention(self.input_layernorm(x)))
        h = self.pre_feedforward_layernorm(x)
        mlp = self.mlp.down_proj(F.gelu(self.mlp.gate_proj(h), approximate="tanh") * self.mlp.up_proj(h))
        return x + self.post_feedforward_layernorm(mlp)


class RefPostNormBlock(RefBlock):
    """OLMo 2: norms on the attention's and the MLP's outputs only (none on their inputs)."""

    def __init__(self, d, n_heads, n_kv, head_dim, d_ff, eps, inv_freq):
        super().__init__(d, n_heads, n_kv, head_dim, d_ff, eps, inv_freq)
        del self.input_layernorm
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(self, x):
        x = x + self.post_attention_layernorm(self.attention(x))
        return x + self.post_feedforward_layernorm(self.feed_forward(x))


class RefGatedAttentionBlock(RefBlock):
    """Qwen3-Next's and Qwen3.5's softmax-attention layers: (1 + weight) norms (the per-head q/k norms too), and
    attention's output times sigmoid(gate) before o_proj, the gate each query head's second half of q_proj."""

    def __init__(self, d, n_heads, n_kv, head_dim, d_ff, eps, inv_freq):
        super().__init__(d, n_heads, n_kv, head_dim, d_ff, eps, inv_freq, qk_norm=True)
        self.self_attn.q_proj = nn.Linear(d, 2 * n_heads * head_dim, bias=False)
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(self, name, GemmaRMSNorm(d, eps))
        self.self_attn.q_norm, self.self_attn.k_norm = GemmaRMSNorm(head_dim, eps), GemmaRMSNorm(head_dim, eps)

    def attention(self, h):
        b, s, _ = h.shape
        a = self.self_attn
        q, gate = a.q_proj(h).view(b, s, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = a.k_proj(h).view(b, s, self.n_kv, self.head_dim)
        v = a.v_proj(h).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rope(a.q_norm(q).transpose(1, 2), self.inv_freq), rope(a.k_norm(k).transpose(1, 2), self.inv_freq)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2) * self.scale).masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
        return a.o_proj(att * torch.sigmoid(gate.reshape(b, s, -1)))


def delta_rule_recurrence(q, k, v, log_decay, beta):
    """The gated delta rule token by token (one sequence per row), q/k L2-normalised and q scaled here.
    q, k: [batch, seq, heads, d_k] (heads as v's), v: [batch, seq, heads, d_v], log_decay, beta: [batch, seq,
    heads] -> [batch, seq, heads, d_v]."""
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(q.shape[-1])
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    state = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])
    outputs = []
    for t in range(q.shape[1]):
        state = state * log_decay[:, t].exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * (v[:, t] - predicted))
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1)


class RefGatedDeltaNetBlock(nn.Module):
    """Qwen3.5's linear-attention layer the textbook way: F.conv1d over the sequence, the delta rule token by
    token, the output normed per value head and gated by silu(z); (1 + weight) norms around a SwiGLU MLP."""

    def __init__(self, d, n_k, n_v, d_k, d_v, kernel, d_ff, eps):
        super().__init__()
        self.n_k, self.n_v, self.d_k, self.d_v = n_k, n_v, d_k, d_v
        self.input_layernorm = GemmaRMSNorm(d, eps)
        self.post_attention_layernorm = GemmaRMSNorm(d, eps)
        a = self.linear_attn = nn.Module()
        channels = 2 * n_k * d_k + n_v * d_v
        a.in_proj_qkv = nn.Linear(d, channels, bias=False)
        a.in_proj_z = nn.Linear(d, n_v * d_v, bias=False)
        a.in_proj_b = nn.Linear(d, n_v, bias=False)
        a.in_proj_a = nn.Linear(d, n_v, bias=False)
        a.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=False, padding=kernel - 1)
        a.out_proj = nn.Linear(n_v * d_v, d, bias=False)
        a.norm = RMSNorm(d_v, eps)
        a.A_log = nn.Parameter(torch.zeros(n_v))
        a.dt_bias = nn.Parameter(torch.ones(n_v))
        self.mlp = SwiGLU(d, d_ff)

    def mixer(self, h):
        b, s, _ = h.shape
        a = self.linear_attn
        qkv = F.silu(a.conv1d(a.in_proj_qkv(h).transpose(1, 2))[..., :s]).transpose(1, 2)
        q, k, v = qkv.split([self.n_k * self.d_k, self.n_k * self.d_k, self.n_v * self.d_v], dim=-1)
        rep = self.n_v // self.n_k
        q = q.reshape(b, s, self.n_k, self.d_k).repeat_interleave(rep, 2)
        k = k.reshape(b, s, self.n_k, self.d_k).repeat_interleave(rep, 2)
        log_decay = -a.A_log.exp() * F.softplus(a.in_proj_a(h) + a.dt_bias)
        out = delta_rule_recurrence(q, k, v.reshape(b, s, self.n_v, self.d_v), log_decay, a.in_proj_b(h).sigmoid())
        out = a.norm(out) * F.silu(a.in_proj_z(h).reshape(b, s, self.n_v, self.d_v))
        return a.out_proj(out.reshape(b, s, -1))

    def forward(self, x):
        x = x + self.mixer(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def ssd_recurrence(x, dt, a, b, c):
    """Mamba-2's state-space recurrence token by token (one sequence per row), without D x. x: [batch, seq, heads,
    head_dim], dt: [batch, seq, heads], a: [heads], b, c: [batch, seq, heads, state_dim] (per head) -> like x."""
    state = x.new_zeros(x.shape[0], x.shape[2], b.shape[3], x.shape[3])
    outputs = []
    for t in range(x.shape[1]):
        state = state * (dt[:, t] * a).exp()[..., None, None]
        state = state + torch.einsum("bhn,bhp->bhnp", b[:, t], dt[:, t, :, None] * x[:, t])
        outputs.append(torch.einsum("bhnp,bhn->bhp", state, c[:, t]))
    return torch.stack(outputs, dim=1)


class RefMamba2Block(nn.Module):
    """Granite 4.0-H's Mamba-2 layer the textbook way: F.conv1d (with its bias) over the sequence, the
    recurrence token by token plus D x, silu(z) then an RMSNorm per group; Granite's residual multiplier."""

    def __init__(self, d, n_groups, n_heads, state_dim, head_dim, kernel, d_ff, eps, residual_scale):
        super().__init__()
        self.g, self.h, self.n, self.p, self.eps, self.residual_scale = (
            n_groups, n_heads, state_dim, head_dim, eps, residual_scale
        )  # fmt: skip
        inner = n_heads * head_dim
        channels = inner + 2 * n_groups * state_dim
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        m = self.mamba = nn.Module()
        m.in_proj = nn.Linear(d, inner + channels + n_heads, bias=False)
        m.conv1d = nn.Conv1d(channels, channels, kernel, groups=channels, bias=True, padding=kernel - 1)
        m.out_proj = nn.Linear(inner, d, bias=False)
        m.norm = nn.Module()
        m.norm.weight = nn.Parameter(torch.ones(inner))
        m.A_log = nn.Parameter(torch.zeros(n_heads))
        m.D = nn.Parameter(torch.ones(n_heads))
        m.dt_bias = nn.Parameter(torch.ones(n_heads))
        self.mlp = SwiGLU(d, d_ff)

    def mixer(self, hidden):
        batch, s, _ = hidden.shape
        m, inner = self.mamba, self.h * self.p
        z, xbc, dt = m.in_proj(hidden).split([inner, inner + 2 * self.g * self.n, self.h], dim=-1)
        xbc = F.silu(m.conv1d(xbc.transpose(1, 2))[..., :s]).transpose(1, 2)
        x, b, c = xbc.split([inner, self.g * self.n, self.g * self.n], dim=-1)
        x = x.reshape(batch, s, self.h, self.p)
        b, c = (t.reshape(batch, s, self.g, self.n).repeat_interleave(self.h // self.g, 2) for t in (b, c))
        y = ssd_recurrence(x, F.softplus(dt + m.dt_bias), -m.A_log.exp(), b, c) + m.D[:, None] * x
        gated = (y.reshape(batch, s, inner) * F.silu(z)).reshape(batch, s, self.g, -1)
        normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)
        return m.out_proj(m.norm.weight * normed.reshape(batch, s, inner))

    def forward(self, x):
        x = x + self.mixer(self.input_layernorm(x)) * self.residual_scale
        return x + self.mlp(self.post_attention_layernorm(x)) * self.residual_scale


class SwiGLU(nn.Module):
    def __init__(self, d, d_ff):
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.up_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class RefMoeBlock(RefBlock):
    """Every expert runs on every token; a dense [tokens, n_experts] matrix with zeros off the
    top-k weighs their outputs: no sorting, no grouping (a different algorithm from the template's)."""

    def __init__(self, d, n_heads, n_kv, head_dim, eps, inv_freq, n_experts, top_k, d_ff, shared_d_ff, norm_topk):
        super().__init__(d, n_heads, n_kv, head_dim, 1, eps, inv_freq)
        self.top_k, self.norm_topk = top_k, norm_topk
        self.mlp = nn.Module()
        self.mlp.gate = nn.Linear(d, n_experts, bias=False)
        self.mlp.experts = nn.ModuleList([SwiGLU(d, d_ff) for _ in range(n_experts)])
        if shared_d_ff:
            self.mlp.shared_expert = SwiGLU(d, shared_d_ff)
            self.mlp.shared_expert_gate = nn.Linear(d, 1, bias=False)
        self.probs = self.top_index = None

    def feed_forward(self, h):
        self.probs = self.mlp.gate(h).softmax(-1)
        top, self.top_index = self.probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        weights = torch.zeros_like(self.probs).scatter(-1, self.top_index, top)
        out = sum(weights[..., e : e + 1] * expert(h) for e, expert in enumerate(self.mlp.experts))
        if hasattr(self.mlp, "shared_expert"):
            out = out + torch.sigmoid(self.mlp.shared_expert_gate(h)) * self.mlp.shared_expert(h)
        return out

    def load_balancing_loss(self):
        """Switch-Transformer aux loss over this forward's tokens: n_experts * sum_e f_e * P_e."""
        n_experts = self.probs.shape[-1]
        probs = self.probs.reshape(-1, n_experts)
        picks = F.one_hot(self.top_index.reshape(-1), n_experts).sum(0).to(probs.dtype)
        return n_experts * (picks / probs.shape[0] * probs.mean(0)).sum()


def flatten_params(module: nn.Module, specs) -> torch.Tensor:
    """Pack a module's parameters into one flat buffer in the template's layout order."""
    named = dict(module.named_parameters())
    return torch.cat([named[spec.name].detach().reshape(-1) for spec in specs])


def unflatten_grads(flat: torch.Tensor, specs) -> dict:
    out, offset = {}, 0
    for spec in specs:
        out[spec.name] = flat[offset : offset + spec.numel].view(spec.shape)
        offset += spec.numel
    return out
