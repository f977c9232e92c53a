"""One linear-attention (Gated DeltaNet) layer's mixer on the GPU at a preset's shape, beside the softmax
attention of the same model's full-attention layers: the chunked delta rule alone, the whole mixer
(projections, convolution, rule, gated norm, output projection), its GEMMs alone, and causal SDPA; each as the
engine runs a layer (forward, the recompute's forward, backward).

    python benchmarks/linear_attention.py --model qwen3.5-27b --seq-len 4096 --micro-batch 4 --out la.json
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, table, write_results  # noqa: E402

from megatrain_templates import linear_attention as la  # noqa: E402
from megatrain_zoo import linear_attention_flops_per_token, preset  # noqa: E402
from megatrain_zoo.config import LINEAR_ATTENTION_ARCHITECTURES  # noqa: E402
from megatrain_zoo.model import block_shape  # noqa: E402


def engine_pass(forward, inputs: list[torch.Tensor]):
    """forward without autograd (the forward pass), then with it and backward (the recompute-based backward)."""

    def run():
        with torch.no_grad():
            forward(*inputs)
        out = forward(*inputs)
        out.backward(torch.ones_like(out))

    return run


def random_inputs(shapes, dtype=torch.bfloat16):
    return [torch.randn(s, device="cuda", dtype=dtype).requires_grad_() for s in shapes]


def mixer_weights(model, shape) -> dict:
    """One Gated DeltaNet layer's weights (bf16, its fp32 decay parameters), requiring grad."""
    d, n_v = model.d_model, shape.n_value_heads
    in_width = 2 * shape.key_dim + 2 * shape.value_dim + 2 * n_v
    weights = {
        "linear_in": torch.randn(in_width, d, device="cuda", dtype=torch.bfloat16) * d**-0.5,
        "linear_out": torch.randn(d, shape.value_dim, device="cuda", dtype=torch.bfloat16) * shape.value_dim**-0.5,
        "linear_conv": torch.randn(shape.conv_dim, shape.conv_kernel, device="cuda", dtype=torch.bfloat16) * 0.3,
        "linear_norm": torch.ones(shape.value_head_dim, device="cuda", dtype=torch.bfloat16),
        "linear_A_log": torch.rand(n_v, device="cuda").log(),
        "linear_dt_bias": torch.ones(n_v, device="cuda"),
    }
    return {name: w.requires_grad_() for name, w in weights.items()}


def parts(model, shape, mb: int, seq: int):
    """Each part to time, its inputs made when it comes: (name, the engine's passes over it, its FLOPs)."""
    tokens, n_v, d = mb * seq, shape.n_value_heads, model.d_model
    rule_flops = linear_attention_flops_per_token(model) * tokens
    q, k = random_inputs([(mb, seq, shape.n_key_heads, shape.key_head_dim)] * 2)
    (v,) = random_inputs([(mb, seq, n_v, shape.value_head_dim)])
    log_decay = (-torch.rand(mb, seq, n_v, device="cuda") * 0.5).requires_grad_()
    beta = torch.rand(mb, seq, n_v, device="cuda").requires_grad_()
    yield "delta rule", engine_pass(la.chunked_gated_delta_rule, [q, k, v, log_decay, beta]), rule_flops
    weights = mixer_weights(model, shape)
    gemm_flops = 6 * tokens * d * (weights["linear_in"].shape[0] + shape.value_dim)
    (h,) = random_inputs([(mb, seq, d)])
    mixer = engine_pass(lambda x: la.gated_delta_net(shape, weights, x, None, model.rms_eps), [h])
    yield "mixer (projections, convolution, rule, norm)", mixer, gemm_flops + rule_flops
    x_in, x_out = random_inputs([(tokens, d), (tokens, shape.value_dim)])

    def gemms(a, b):
        return F.linear(a, weights["linear_in"]).sum() + F.linear(b, weights["linear_out"]).sum()

    yield "mixer's GEMMs alone", engine_pass(gemms, [x_in, x_out]), gemm_flops
    full = block_shape(model, next(i for i in range(model.n_layers) if not model.layer_is_linear(i)))
    sq, sk, sv = random_inputs(
        [(mb, model.n_heads, seq, model.head_dim)] + [(mb, model.n_kv_heads, seq, model.head_dim)] * 2
    )
    sdpa = engine_pass(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True),
                       [sq, sk, sv])  # fmt: skip
    yield (
        f"causal SDPA of a full-attention layer ({full.n_heads} heads)",
        sdpa,
        6 * mb * model.n_heads * model.head_dim * seq * seq,
    )


def measured_row(name: str, run, flops: float, mb: int, seq: int) -> dict:
    """The part's row, as the docs' parts table reads it (printed as it comes)."""
    ms = time_ms(run, repeats=5)
    row = {"what": name, "timed_ms": round(ms, 2), "tflops": round(flops / ms / 1e9, 1)}
    print(table([row], list(row)), flush=True)
    scope = name if name.startswith("causal SDPA") else f"one Gated DeltaNet layer: {name}"
    return row | {"scope": scope, "step_time_s": round(ms / 1e3, 6), "tokens_per_step": mb * seq, "seq_len": seq,
                  "micro_batch_seqs": mb}  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3.5-27b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = preset(args.model)
    if not model.linear_attention_layers or model.arch not in LINEAR_ATTENTION_ARCHITECTURES:
        parser.error(
            f"{args.model} has no Gated DeltaNet layers (Qwen3.5, Qwen3-Next: {LINEAR_ATTENTION_ARCHITECTURES})"
        )
    shape = block_shape(model, model.linear_attention_layers[0]).linear_attention
    mb, seq = args.micro_batch, args.seq_len
    rows = [measured_row(name, run, flops, mb, seq) for name, run, flops in parts(model, shape, mb, seq)]
    print(table(rows, ["what", "timed_ms", "tflops"]))
    if args.out:
        arguments = vars(args) | {"out": str(args.out)}
        payload = {"benchmark": "linear_attention", "machine": machine(), "args": arguments, "results": rows}
        write_results(args.out, payload)


if __name__ == "__main__":
    main()
