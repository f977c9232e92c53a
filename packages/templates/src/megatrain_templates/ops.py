"""The numerical building blocks shared by the templates, written to match Hugging Face Llama/Qwen."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import swiglu_kernels
from .layout import BoundWeight, ProductKeeper, add_matmul_
from .lora import LOW_RANK, Adapted, dropout_noise

IGNORE_INDEX = -100


def upcast(x: Tensor) -> Tensor:
    """x in at least fp32: half types go to fp32, fp32 and fp64 stay."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


# Elementwise work between the GEMMs (norms, rotary embedding, the experts' activation) is
# compiled by Inductor on CUDA into one kernel each way instead of five to ten; eager elsewhere,
# and everywhere after `set_compile(False)` (engine.compile). Not fullgraph: past torch's recompile
# limit a shape falls back to eager instead of failing.
_compile = True
RECOMPILE_LIMIT = 32


def set_compile(enabled: bool) -> None:
    """Whether the templates compile their elementwise work on CUDA (the default) or run it eagerly, for every
    template of this process from the next call on; a run sets it from engine.compile."""
    global _compile
    _compile = enabled


def compiling() -> bool:
    """Whether the templates compile their elementwise work on CUDA (`set_compile`)."""
    return _compile


def compile_once(fn: Callable, backend: str = "inductor", dynamic: bool | None = None) -> Callable:
    """torch.compile(fn, backend=backend, dynamic=dynamic), with room for RECOMPILE_LIMIT graphs a function: one
    per width, rank and autograd mode it meets. Gemma's RMSNorm meets more than torch's default of 8 (six norms per
    layer, 3-D and per head, forward and recompute, the head's) and fell back to eager past them.

    The floats a function takes (an eps, a scale, an offset) are a model's constants, compiled in. Left to torch, the
    second value a function met became a 0-dim host tensor input, and with it Inductor built a C++ kernel for the
    host: Qwen3.5's query and key scales (`_unit_heads`) cost 36 s (warm caches) to 56 s of host-compiler checks
    in the rate measurement on an H200 machine, every process. Both settings are Dynamo's, process-wide (a
    `config.patch` around each call cost 6 us a call, on the path of every compiled kernel)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.specialize_float = True
    return torch.compile(fn, backend=backend, dynamic=dynamic)


def compiled_on_cuda(fn: Callable, eager: Callable | None = None) -> Callable:
    """`fn`, run through torch.compile when its first argument is a CUDA tensor (compiled on first use);
    elsewhere `eager` (same arguments and result) or `fn` itself.

    The first argument's last dim (a norm's width, a head's, the experts' 2 * d_ff) stays static: it is
    what the kernels reduce or pair over. Left to torch, the second width one function meets (a latent
    attention layer's 512-wide latent beside its 2048-wide hidden state, Qwen3's per-head q/k norms)
    recompiles it for any width, and that RMSNorm took 7.3 ms forward + backward on [16384, 512] against
    0.76 ms compiled for its width (H100); the rows may still become dynamic."""
    compiled = None

    def run(x: Tensor, *args):
        nonlocal compiled
        if not (_compile and x.is_cuda):
            return (eager or fn)(x, *args)
        if compiled is None:
            compiled = compile_once(fn)
        torch._dynamo.mark_static(x, x.dim() - 1)
        return compiled(x, *args)

    run.__doc__, run.__name__ = fn.__doc__, fn.__name__
    return run


class _LinearIntoGrad(torch.autograd.Function):
    """F.linear whose backward adds the weight's gradient into `bound.grad`."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, bound: BoundWeight) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.bound = bound
        if bound.product is not None:
            return bound.product.view_as(bound.product)  # a new tensor for autograd to own, not a copy
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        if ctx.bound.grad is not None:  # (a frozen weight's gradient is not wanted)
            add_matmul_(ctx.bound.grad, grad_2d.T, x.reshape(-1, x.shape[-1]))
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        grad_bias = grad_2d.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None


def linear(x: Tensor, weight: "Tensor | BoundWeight | ProductKeeper | Adapted", bias: Tensor | None = None) -> Tensor:
    """F.linear; a `BoundWeight`'s gradient goes straight into its gradient buffer in backward (and its
    kept product, where it has one, stands for the GEMM); a `ProductKeeper` keeps the product; an `Adapted`
    weight adds its LoRA adapters' delta (`adapted_linear`)."""
    if isinstance(weight, Adapted):
        return adapted_linear(x, weight, bias)
    if isinstance(weight, BoundWeight):
        return _LinearIntoGrad.apply(x, weight.value, bias, weight)
    if isinstance(weight, ProductKeeper):
        return weight.put(F.linear(x, weight.value, bias))
    return F.linear(x, weight, bias)


def adapted_linear(x: Tensor, adapted: Adapted, bias: Tensor | None = None) -> Tensor:
    """x W^T + b + (scale * x A^T) B^T for each adapted member of a fused matrix W (its rows first..stop): PEFT's
    LoRA layer, with the scale applied to the r-wide low-rank product instead of the output (cheaper; equal up to
    rounding). Bound for a backward (`BoundWeight`s), the gradients of W (where it trains), A and B go into their
    buffers, and the forward's kept products (the base's and `Adapted.low`) stand for the whole forward; a
    `ProductKeeper` base keeps both. With dropout (`Adapted.dropout`) each member's A sees x times its own mask
    (`dropout_noise`, drawn again from its seed in the backward) and the base sees x, as PEFT computes."""
    if isinstance(adapted.down, BoundWeight):
        return _AdaptedLinear.apply(x, bias, adapted)
    keeper = adapted.base if isinstance(adapted.base, ProductKeeper) else None
    out, low = _adapted_forward(x, adapted.base if keeper is None else keeper.value, bias, adapted)
    if keeper is not None and keeper.keeps():
        keeper.products[keeper.name], keeper.products[keeper.name + LOW_RANK] = out, low
    return out


def _value(weight: "Tensor | BoundWeight") -> Tensor:
    return weight.value if isinstance(weight, BoundWeight) else weight


def _adapted_forward(x: Tensor, base: Tensor | None, bias: Tensor | None, adapted: Adapted) -> tuple[Tensor, Tensor]:
    """(the adapted product [..., rows], the scaled low-rank product scale * x A^T [..., members * r]); no base: the
    adapters' delta alone. Each member's B adds into its rows inside its GEMM (no delta tensor of the output's size)."""
    low = _low_rank(x, _value(adapted.down), adapted)
    out = x.new_zeros(*x.shape[:-1], adapted.rows) if base is None else F.linear(x, _value(base), bias)
    out_2d, low_2d, r = out.view(-1, adapted.rows), low.view(-1, low.shape[-1]), adapted.rank
    for index, (up, first, stop) in enumerate(adapted.ups):
        out_2d[:, first:stop].addmm_(low_2d[:, index * r : (index + 1) * r], _value(up).T)
    return out, low


def _low_rank(x: Tensor, down: Tensor, adapted: Adapted) -> Tensor:
    """scale * x A^T [..., members * r] (one GEMM for every member's A); with dropout, each member's A times its own
    dropped x."""
    if not adapted.dropout:
        return F.linear(x, down) * adapted.scale
    r = adapted.rank
    lows = [  # (the dropped input made in the noise's memory: one [tokens, in] tensor at a time)
        F.linear(dropout_noise(x, adapted.dropout, seed).mul_(x), down[index * r : (index + 1) * r])
        for index, seed in enumerate(adapted.seeds)
    ]
    return (lows[0] if len(lows) == 1 else torch.cat(lows, dim=-1)) * adapted.scale


def _low_rank_backward(x: Tensor, grad_low: Tensor, adapted: Adapted) -> Tensor:
    """Add dA = grad_low^T x (each member's through its mask, drawn again) into A's gradient buffer; return the
    low-rank path's gradient of x [tokens, in] for grad_low [tokens, members * r] (the scale applied)."""
    down, x_2d = adapted.down, x.reshape(-1, x.shape[-1])
    if not adapted.dropout:
        add_matmul_(down.grad, grad_low.T, x_2d)  # dA = (scale g B)^T x
        return grad_low @ down.value
    r, grad_x = adapted.rank, None
    for index, seed in enumerate(adapted.seeds):
        rows = slice(index * r, (index + 1) * r)
        noise = dropout_noise(x, adapted.dropout, seed).view(-1, x.shape[-1])
        add_matmul_(down.grad[rows], grad_low[:, rows].T, x_2d * noise)  # dA = (scale g B)^T (x * noise)
        part = (grad_low[:, rows] @ down.value[rows]).mul_(noise)
        grad_x = part if grad_x is None else grad_x.add_(part)
    return grad_x


class _AdaptedLinear(torch.autograd.Function):
    """`adapted_linear` whose backward adds the gradients of the base (where it trains: `BoundWeight.grad`), of each
    A and B into their buffers, and returns the input's (and the bias')."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, adapted: Adapted) -> Tensor:
        base = adapted.base
        if isinstance(base, BoundWeight) and base.product is not None and adapted.low is not None:
            out, low = base.product.view_as(base.product), adapted.low  # (a new tensor for autograd to own)
        else:
            out, low = _adapted_forward(x, base, bias, adapted)
        ctx.save_for_backward(x, low)
        ctx.adapted = adapted
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, low = ctx.saved_tensors
        adapted, r = ctx.adapted, ctx.adapted.rank
        grad_2d, x_2d, low_2d = (t.reshape(-1, t.shape[-1]) for t in (grad_out, x, low))
        grad_lows = []
        for index, (up, first, stop) in enumerate(adapted.ups):
            grad_rows = grad_2d[:, first:stop]
            add_matmul_(up.grad, grad_rows.T, low_2d[:, index * r : (index + 1) * r])  # dB = g^T (scale x A^T)
            grad_lows.append(grad_rows @ up.value)
        grad_low = (grad_lows[0] if len(grad_lows) == 1 else torch.cat(grad_lows, dim=1)) * adapted.scale
        grad_x = _low_rank_backward(x, grad_low, adapted)
        base = adapted.base
        if base is not None:  # (a view: a frozen base's, bound without a gradient)
            if isinstance(base, BoundWeight) and base.grad is not None:
                add_matmul_(base.grad, grad_2d.T, x_2d)
            grad_x = grad_x.addmm_(grad_2d, _value(base))
        grad_bias = grad_2d.sum(0) if ctx.needs_input_grad[1] else None
        return grad_x.view_as(x), grad_bias, None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (as Hugging Face does)."""
    input_dtype = x.dtype
    x32 = upcast(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(input_dtype)


rms_norm = compiled_on_cuda(_rms_norm)


def _add_rms_norm(x: Tensor, branch: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = x + branch
    return summed, _rms_norm(summed, weight, eps)


# compiled: one kernel each way where eager's residual add, its norm, and in the backward the sum of the residual's
# gradient and the norm's are three (Qwen2.5-7B's adds alone: 17.8 ms of a 2.73 s step at 32k tokens, H200)
add_rms_norm = compiled_on_cuda(_add_rms_norm)
add_rms_norm.__doc__ = """(x + branch, `rms_norm` of it): a residual add and the norm that reads its sum."""


@compiled_on_cuda
def rms_normalized(x: Tensor, eps: float) -> Tensor:
    """RMSNorm with no weight, in fp32 and cast back: Llama 4's `L2Norm` of queries and keys."""
    x32 = upcast(x)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@compiled_on_cuda
def rms_norm_scaled_in_fp32(x: Tensor, weight: Tensor, eps: float, offset: float) -> Tensor:
    """RMSNorm scaled by (offset + weight) in fp32 before the cast back, where `rms_norm` casts first: OLMo 2's
    (offset 0) and Gemma's (offset 1, so that a weight of zero is the identity scale)."""
    x32 = upcast(x)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (offset + upcast(weight))).to(x.dtype)


# How a norm applies its weight: Llama's (normed in fp32, cast, times the weight), OLMo 2's (times the weight in
# fp32, then cast), Gemma's (times 1 + weight in fp32)
NORM_SCALES = ("cast_first", "fp32", "one_plus_fp32")


def rms_norm_as(scale: str, x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x with `weight` applied the `scale` way (NORM_SCALES)."""
    if scale == "cast_first":
        return rms_norm(x, weight, eps)
    return rms_norm_scaled_in_fp32(x, weight, eps, 1.0 if scale == "one_plus_fp32" else 0.0)


def swiglu(gate_up: Tensor, weight: Tensor | None = None) -> Tensor:
    """silu(gate) * up for gate_up [..., 2 * d_ff] (gate first), times `weight` [..., 1] where given (a MoE expert
    row's routing weight). Eager, the halves are strided views and the silu, the product, their backward and the
    cat of the two gradients are five passes over [tokens, d_ff]: on a 7B step at 128k tokens 1.6 s of the GPU's
    13.6, against 0.6 s compiled; on CUDA (unless `set_compile(False)`) two Triton kernels do it, one each way
    (`swiglu_kernels`)."""
    if _compile and swiglu_kernels.runs_on(gate_up):
        return swiglu_kernels.SwiGLU.apply(gate_up, weight)
    return swiglu_written_out(gate_up, weight)


def swiglu_output_and_backward(
    gate_up: Tensor, grad: Tensor, weight: Tensor | None = None, overwrite: bool = False
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(`swiglu(gate_up, weight)`, the gradients of gate_up and of `weight` (None where not given) for the output's
    gradient `grad`), outside autograd: for a backward that makes `grad` before it needs the output (the next GEMM's
    weight gradient), so that the recompute need not run the forward. One Triton kernel where `swiglu` runs them.
    `overwrite`: gate_up's gradient is written over gate_up (where contiguous), whose values the caller no longer needs:
    the backward's fullest moment then holds one buffer of its size, not two (1.2 GiB at Qwen2.5-7B's 16k tokens).
    Its version counter stays: gate_up may be a kept product, a view made in a custom Function, which autograd
    refuses to go back through once moved. The callers' graphs save their projections' inputs, not outputs."""
    if _compile and swiglu_kernels.runs_on(gate_up):
        return swiglu_kernels.swiglu_output_and_backward(
            gate_up.contiguous(), grad, None if weight is None else weight.contiguous(), overwrite
        )
    inputs = [t.detach().requires_grad_(True) for t in (gate_up, weight) if t is not None]
    with torch.enable_grad():
        out = swiglu_written_out(*inputs)
    grad_gate_up, *grad_weight = torch.autograd.grad(out, inputs, grad)
    if overwrite:  # (here too, as the kernel does: a graph that read gate_up afterwards fails the CPU's tests)
        grad_gate_up = gate_up.data.copy_(grad_gate_up)
    return out.detach(), grad_gate_up, (grad_weight or [None])[0]


def swiglu_written_out(gate_up: Tensor, weight: Tensor | None = None) -> Tensor:
    """`swiglu` as torch operations: what it runs off CUDA (and what Inductor compiled before the kernels)."""
    gate, up = gate_up.chunk(2, dim=-1)
    out = F.silu(gate) * up
    return out if weight is None else out * weight


@compiled_on_cuda
def geglu(gate_up: Tensor) -> Tensor:
    """gelu(gate) * up with gelu's tanh approximation (Gemma's `gelu_pytorch_tanh`), gate_up as `swiglu`'s."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@compiled_on_cuda
def geglu_exact(gate_up: Tensor) -> Tensor:
    """gelu(gate) * up with the exact (erf) gelu, gate_up as `swiglu`'s."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


GATED_ACTIVATIONS = {"silu": swiglu, "gelu_tanh": geglu, "gelu": geglu_exact}  # by BlockShape.activation


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `scaling` is a Hugging Face `rope_scaling` dict or None."""

    head_dim: int
    theta: float = 10000.0
    scaling: tuple[tuple[str, object], ...] | None = None  # frozen form of the dict

    def __post_init__(self):
        kind = self.scaling_dict.get("rope_type", self.scaling_dict.get("type", "default"))
        if kind not in ("default", "llama3", "linear", "yarn", "longrope"):
            raise ValueError(
                f"rope_scaling type {kind!r} is not supported; use 'default', 'llama3', 'linear', 'yarn' or 'longrope' "
                "(or remove rope_scaling for training at the model's native context length)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def scaling_dict(self) -> dict:
        """`scaling` (Hugging Face's `rope_scaling` as key-value pairs) as a dict; empty for none."""
        return dict(self.scaling or ())


def rope_inv_freq(config: RopeConfig, seq_len: int | None = None) -> Tensor:
    """Inverse frequencies [head_dim / 2] in fp32, including Llama-3 / linear / YaRN scaling, and LongRoPE's,
    whose per-frequency factors are its long ones for sequences longer than the original context (`seq_len`)."""
    dim = config.head_dim
    theta_powers = config.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    scaling = config.scaling_dict
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "longrope":
        longer = seq_len is not None and seq_len > scaling["original_max_position_embeddings"]
        factors = torch.tensor(scaling["long_factor" if longer else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta_powers)
    inv_freq = 1.0 / theta_powers
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, config)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(inv_freq: Tensor, config: RopeConfig) -> Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: each frequency is interpolated (divided by
    `factor`), kept, or blended, by how many turns it makes over the original context."""
    scaling, dim, base = config.scaling_dict, config.head_dim, config.theta
    factor = float(scaling["factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies keep their value), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(config: RopeConfig) -> float:
    """The factor YaRN and LongRoPE apply to cos and sin (1 for every other kind)."""
    scaling = config.scaling_dict
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if kind == "longrope":  # the context's stretch over its original length
        original = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return yarn_mscale(factor, scaling["mscale"]) / yarn_mscale(factor, scaling["mscale_all_dim"])
    return yarn_mscale(factor)


def rope_cos_sin(config: RopeConfig, seq_len: int, device, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables [seq_len, head_dim] for positions 0..seq_len-1."""
    inv_freq = rope_inv_freq(config, seq_len).to(device)
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    factor = rope_attention_factor(config)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [batch, heads, seq, head_dim]; cos/sin: [seq, head_dim]."""
    return x * cos + rotate_half(x) * sin


apply_rope = compiled_on_cuda(_apply_rope)


def _rotary_heads(
    qkv: Tensor, cos: Tensor, sin: Tensor, norms: tuple[Tensor, Tensor] | None, n_heads: int, n_kv_heads: int,
    eps: float, norm_over_heads: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    batch, seq, width = qkv.shape
    head_dim = width // (n_heads + 2 * n_kv_heads)
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], dim=-1)
    if norms is not None and norm_over_heads:
        q, k = _rms_norm(q, norms[0], eps), _rms_norm(k, norms[1], eps)
    q, k = q.reshape(batch, seq, n_heads, head_dim), k.reshape(batch, seq, n_kv_heads, head_dim)
    if norms is not None and not norm_over_heads:
        q, k = _rms_norm(q, norms[0], eps), _rms_norm(k, norms[1], eps)
    # the tables broadcast over the heads of [batch, seq, heads, head_dim]
    cos, sin = (cos.unsqueeze(1), sin.unsqueeze(1)) if cos.dim() == 2 else (cos.transpose(1, 2), sin.transpose(1, 2))
    rotated = (_apply_rope(t, cos, sin) for t in (q, k))
    return *rotated, v.reshape(batch, seq, n_kv_heads, head_dim).clone()


# compiled: one kernel each way. Eager, each of q and k took a rotary kernel (and a norm's) each way, and the
# backward a copy of each rotated gradient back into the token-major layout and a cat of the three into qkv's:
# Qwen2.5-7B's copies and cats 30 ms of a 2.73 s step at 32k tokens (H200)
rotary_heads = compiled_on_cuda(_rotary_heads)
rotary_heads.__doc__ = """(q, k, v) as [batch, seq, heads, head_dim] from the [batch, seq, (n_heads + 2 n_kv_heads) *
head_dim] projection `qkv`: q and k RMS-normed where `norms` (their weights) are given (each head alone, or over all
heads with `norm_over_heads`), then rotated by cos/sin ([seq, head_dim], or [batch, 1, seq, head_dim] per token); v
a copy, so that the backward writes qkv's gradient whole."""


def apply_rope_in_fp32(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rope` in fp32 and cast back, as the interleaved form (the rotary part of latent attention)."""
    return apply_rope(upcast(x), cos, sin).to(x.dtype)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's complex-number form),
    in fp32 and cast back. x: [batch, heads, seq, dim]; cos/sin: [seq, dim / 2] or [batch, 1, seq, dim / 2]."""
    x32 = upcast(x)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)
