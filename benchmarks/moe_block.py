"""One MoE decoder block on the GPU: forward and backward time and rate, recomputing or keeping its matmul
products (`--kept`; `--extras`: its attention's results too), and where the time goes (the profiler's top CUDA
kernels); with `--host`, the host's side of a pass: its time to issue the kernels while the GPU is busy
elsewhere, each call that waits for the device (with its stack), and the pass timed beside a CPU AdamW of
`--adamw-threads` threads, as the optimizer runs in a step.

    python benchmarks/moe_block.py --model olmoe-1b-7b --tokens 16384 --seq-len 4096 [--layer N] [--kept [--extras]]
        [--profile] [--host [--adamw-threads 16,15,14]]
"""

import argparse
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import profile_tables, time_ms  # noqa: E402
from common import machine, write_results  # noqa: E402

from megatrain_plan import block_work  # noqa: E402
from megatrain_templates import MoeBlock  # noqa: E402
from megatrain_zoo import build_model, flops_per_token, preset  # noqa: E402


def arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="olmoe-1b-7b")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--kept", action="store_true", help="the forward keeps its matmul products for the backward")
    parser.add_argument("--extras", action="store_true", help="with --kept, its attention's results too")
    parser.add_argument("--profile", action="store_true", help="print the top CUDA kernels of forward + backward")
    parser.add_argument("--profile-rows", type=int, default=30, help="with --profile: how many kernels it lists")
    parser.add_argument("--layer", type=int, default=None, help="which decoder layer (default: the first MoE layer)")
    parser.add_argument(
        "--host", action="store_true", help="the host's issue time, its waits, and the pass beside AdamW"
    )
    parser.add_argument("--adamw-threads", default="", help="with --host: CPU AdamW thread counts to time beside")
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def layer_work(config, seq_len: int, tokens: int, kept: bool) -> tuple[float, float]:
    """(the FLOPs the GPU does, the FLOPs model TFLOPS count) of one layer's pass over `tokens` tokens."""
    # forward + recompute + backward, less the recompute's GEMMs where the products are kept
    work = block_work(config, seq_len, tokens, config.n_layers if kept else 0) / config.n_layers
    # what model TFLOPS count of one layer: 6 x its active matmul parameters + attention, a token
    model_work = (flops_per_token(config, seq_len) - 6 * config.vocab_size * config.d_model) * tokens
    return work, model_work / config.n_layers


def main():
    args = arguments()
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
    work, model_work = layer_work(config, args.seq_len, args.tokens, args.kept)

    def step():
        if args.kept:
            _, products = block.forward_keeping_products(weights, x, extras=args.extras)
            block.backward(weights, x, grad_out, grads, products=products)
        else:
            block.forward(weights, x)
            block.backward(weights, x, grad_out, grads)

    fwd = time_ms(lambda: block.forward(weights, x))
    total = time_ms(step)
    result = {
        "machine": machine(),
        "model": args.model,
        **({"layer": layer} if args.layer is not None else {}),  # none: the first MoE layer, as the tables read it
        "tokens": args.tokens,
        "seq_len": args.seq_len,
        "kept_products": args.kept,
        "extras": args.extras,
        "product_bytes_per_token": block.product_bytes_per_token(2) if args.kept else 0,
        "forward_ms": round(fwd, 3),
        "forward_recompute_backward_ms": round(total, 3),
        "hardware_tflops": round(work / total / 1e9, 1),
        "model_tflops_ceiling": round(model_work / total / 1e9, 1),
    }
    if args.host:
        result |= host_side(step, [int(n) for n in args.adamw_threads.split(",") if n])
    print(result, flush=True)
    if args.profile:
        result["profile"], result["host_profile"], result["gpu_gaps"] = profile_tables(step, args.profile_rows)
    if args.out:
        write_results(Path(args.out), result)


def host_side(step, adamw_threads: list[int]) -> dict:
    """The host's side of `step`: `host_ms`, its time to issue one pass while the GPU sleeps (a pass that waits
    for the device takes the sleep's second); `device_waits`, each call in it that synchronises (the warnings of
    torch's sync debug mode, with the innermost frames of the stack); `beside_adamw_ms`, the pass's time while
    another thread runs the CPU AdamW on so many threads (the step's optimizer competes for the cores with the
    thread that issues the kernels)."""
    waits = []

    def keep(message, category, filename, lineno, file=None, line=None):
        waits.append(f"{message}\n" + "".join(traceback.format_stack()[:-2][-6:]))

    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the mode's own notice that it is a prototype, given when switched on
        torch.cuda.set_sync_debug_mode("warn")
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a spinning kernel: the host issues ahead of it
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = keep  # restored with the filters on leaving the block
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host_ms = (time.perf_counter() - start) * 1e3
    torch.cuda.synchronize()
    for wait in waits:
        print("device wait:", wait, flush=True)
    return {"host_ms": round(host_ms, 3), "device_waits": len(waits)} | {
        "beside_adamw_ms": {str(n): round(_beside_adamw(step, n), 3) for n in adamw_threads},
        "cpu_threads": torch.get_num_threads(),
    }


def _beside_adamw(step, threads: int) -> float:
    """The pass's time (ms) while another thread runs fused AdamW over 256M fp32 parameters on `threads` threads."""
    from megatrain_optim import adamw_update_

    p, g, m, v = (torch.full((256 * 2**20,), value) for value in (0.02, 1e-3, 1e-4, 1e-6))
    stop = threading.Event()

    def adamw():
        torch.set_num_threads(threads)  # this thread's parallel regions
        while not stop.is_set():
            adamw_update_(
                [p], [g], [m], [v], torch.tensor(1.0), lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1
            )

    worker = threading.Thread(target=adamw)
    worker.start()
    try:
        time.sleep(0.2)
        return time_ms(step)
    finally:
        stop.set()
        worker.join()


if __name__ == "__main__":
    main()
