"""A plain PyTorch decoder-only LM (nn.Module, autograd) with Hugging Face parameter names,
written independently of megatrain's templates: the reference for exactness tests."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatrain_templates import RopeConfig, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        x32 = x if x.dtype == torch.float64 else x.float()
        return self.weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
            self.k_norm = RMSNorm(c.head_dim, c.rms_eps)
        scaling = tuple(sorted(c.rope_scaling.items())) if c.rope_scaling else None
        self.inv_freq = rope_inv_freq(RopeConfig(c.head_dim, c.rope_theta, scaling))

    def rope(self, x):
        angles = torch.arange(x.shape[2], dtype=torch.float32, device=x.device)[:, None] * self.inv_freq.to(x.device)
        angles = torch.cat([angles, angles], -1)
        half = x.shape[-1] // 2
        return x * angles.cos().to(x.dtype) + torch.cat([-x[..., half:], x[..., :half]], -1) * angles.sin().to(x.dtype)

    def forward(self, x):
        c, (b, s, _) = self.c, x.shape
        q = self.q_proj(x).view(b, s, c.n_heads, c.head_dim)
        k = self.k_proj(x).view(b, s, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q.transpose(1, 2)), self.rope(k.transpose(1, 2))
        rep = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.down_proj = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.d_model, c.rms_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.rms_eps)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ReferenceLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.model.layers = nn.ModuleList([Layer(c) for _ in range(c.n_layers)])
        self.model.norm = RMSNorm(c.d_model, c.rms_eps)
        if not c.tie_embeddings:
            self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)

    def logits(self, input_ids):
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        x = self.model.norm(x)
        weight = self.model.embed_tokens.weight if self.config.tie_embeddings else self.lm_head.weight
        logits = x @ weight.T
        return logits if logits.dtype == torch.float64 else logits.float()

    def loss(self, input_ids, labels):
        """Mean cross-entropy over labels != -100 (labels already shifted to the next token)."""
        logits = self.logits(input_ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

    def load_named(self, weights: dict):
        own = dict(self.named_parameters())
        assert set(own) == set(weights), set(own) ^ set(weights)
        with torch.no_grad():
            for name, tensor in weights.items():
                own[name].copy_(tensor)


def reference_adamw(model: nn.Module, train) -> torch.optim.AdamW:
    """torch.optim.AdamW with megatrain's rule: no weight decay on norms and biases."""
    params = dict(model.named_parameters())
    no_decay = [p for n, p in params.items() if n.endswith("norm.weight") or n.endswith(".bias")]
    decay = [p for n, p in params.items() if not (n.endswith("norm.weight") or n.endswith(".bias"))]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=train.betas, eps=train.eps)
