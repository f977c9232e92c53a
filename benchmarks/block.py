"""One decoder block on the GPU: the template's forward and its recompute + backward (with `--kept`, its forward
keeping its matmul products, with `--extras` its attention's results too, and the backward from them), by
attention backend, to show what a layer can reach; with `--profile`, where the time goes (the profiler's top CUDA
kernels).

    python benchmarks/block.py --model qwen2.5-7b --tokens 16384 --seq-len 2048 [--kept [--extras]] [--profile]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, write_results  # noqa: E402

from megatrain_templates import DecoderBlock  # noqa: E402
from megatrain_zoo import block_shape, preset  # noqa: E402


def time_ms(fn, repeats=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def profile_tables(step) -> tuple[str, str]:
    """The top CUDA kernels (by shape) and the top host operators of three passes, printed and returned."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages(group_by_input_shape=True)
    table = averages.table(
        sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=40, max_shapes_column_width=70
    )
    host_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50)
    print(table, host_table, sep="\n")
    return table, host_table


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--kept", action="store_true", help="the forward keeps its matmul products for the backward")
    parser.add_argument("--extras", action="store_true", help="with --kept, its attention's results too")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of the default backend")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = preset(args.model)
    block = DecoderBlock(block_shape(config))
    weights = [torch.randn(block.numel, device="cuda", dtype=torch.bfloat16) * 0.02]
    grads = [torch.zeros(block.numel, device="cuda", dtype=torch.float32)]
    x = torch.randn(args.tokens // args.seq_len, args.seq_len, config.d_model, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    matmul_params = config.matmul_params - config.vocab_size * config.d_model
    flops_fwd = (
        2 * matmul_params / config.n_layers + 2 * args.seq_len * config.n_heads * config.head_dim
    ) * args.tokens

    from torch.nn.attention import SDPBackend, sdpa_kernel

    variants = {
        "default": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
        "flash": [SDPBackend.FLASH_ATTENTION],
        "cudnn": [SDPBackend.CUDNN_ATTENTION],
    }
    result = {"machine": machine(), "model": args.model, "tokens": args.tokens, "seq_len": args.seq_len, "variants": {}}
    result["kept_products"], result["extras"] = args.kept, args.extras

    def backward():  # what the layer runs after its plain forward; with --kept the forward that keeps is timed in
        if not args.kept:
            return block.backward(weights, x, grad_out, grads)
        _, products = block.forward_keeping_products(weights, x, extras=args.extras)
        return block.backward(weights, x, grad_out, grads, products=products)

    def layer_pass():  # a step's work for the layer: its forward, then (recompute +) backward
        if not args.kept:
            block.forward(weights, x)
        backward()

    for label, backends in variants.items():
        try:
            with sdpa_kernel(backends):
                fwd = time_ms(lambda: block.forward(weights, x))
                bwd = time_ms(backward) - (fwd if args.kept else 0.0)  # (--kept: its forward counted once)
        except RuntimeError as error:
            result["variants"][label] = {"error": str(error).splitlines()[0][:160]}
            continue
        result["variants"][label] = {
            "forward_ms": round(fwd, 3),
            "recompute_backward_ms": round(bwd, 3),
            "forward_tflops": round(flops_fwd / fwd / 1e9, 1),
            # model TFLOPS of a layer: 6N per token credited over forward + (recompute + backward)
            "model_tflops_ceiling": round(3 * flops_fwd / (fwd + bwd) / 1e9, 1),
        }
        print(label, result["variants"][label], flush=True)
    if args.profile:
        with sdpa_kernel(variants["default"]):
            result["profile"], result["host_profile"] = profile_tables(layer_pass)
    print(result)
    if args.out:
        write_results(Path(args.out), result)


if __name__ == "__main__":
    main()
