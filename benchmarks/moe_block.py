"""One MoE decoder block on the GPU: forward and backward time and rate, recomputing or keeping its matmul
products (`--kept`), and where the time goes (the profiler's top CUDA kernels).

    python benchmarks/moe_block.py --model olmoe-1b-7b --tokens 16384 --seq-len 4096 [--layer N] [--kept] [--profile]
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from common import machine, write_results  # noqa: E402

from megatrain.rates import block_work  # noqa: E402
from megatrain_templates import MoeBlock  # noqa: E402
from megatrain_zoo import build_model, flops_per_token, preset  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="olmoe-1b-7b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--kept", action="store_true", help="the forward keeps its matmul products for the backward")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of forward + backward")
    parser.add_argument("--layer", type=int, default=None, help="which decoder layer (default: the first MoE layer)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = preset(args.model)
    spec = build_model(config)
    layer = args.layer if args.layer is not None else next(i for i in range(config.n_layers) if config.layer_is_moe(i))
    if not config.layer_is_moe(layer):
        sys.exit(f"layer {layer} of {args.model} is dense: pick a MoE layer with --layer")
    block: MoeBlock = spec.stages[layer + 1].template
    weights = [torch.randn(block.numel, device="cuda", dtype=torch.bfloat16) * 0.02]
    grads = [torch.zeros(block.numel, device="cuda", dtype=torch.float32)]
    x = torch.randn(args.tokens // args.seq_len, args.seq_len, config.d_model, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    # forward + recompute + backward, less the recompute's GEMMs where the products are kept
    work = block_work(config, args.seq_len, args.tokens, config.n_layers if args.kept else 0) / config.n_layers

    def step():
        if args.kept:
            _, products = block.forward_keeping_products(weights, x)
            block.backward(weights, x, grad_out, grads, products=products)
        else:
            block.forward(weights, x)
            block.backward(weights, x, grad_out, grads)

    # what model TFLOPS count of one layer: 6 x its active matmul parameters + attention, a token
    model_work = (flops_per_token(config, args.seq_len) - 6 * config.vocab_size * config.d_model) * args.tokens
    model_work /= config.n_layers
    fwd = time_ms(lambda: block.forward(weights, x))
    total = time_ms(step)
    result = {
        "machine": machine(),
        "model": args.model,
        "layer": layer,
        "tokens": args.tokens,
        "seq_len": args.seq_len,
        "kept_products": args.kept,
        "product_bytes_per_token": block.product_bytes_per_token(2) if args.kept else 0,
        "forward_ms": round(fwd, 3),
        "forward_recompute_backward_ms": round(total, 3),
        "hardware_tflops": round(work / total / 1e9, 1),
        "model_tflops_ceiling": round(model_work / total / 1e9, 1),
    }
    print(result, flush=True)
    if args.profile:
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
        result["profile"], result["host_profile"] = table, host_table
    if args.out:
        write_results(Path(args.out), result)


if __name__ == "__main__":
    main()
