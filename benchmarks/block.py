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


def profile_tables(step, rows: int = 30) -> tuple[str, str, str]:
    """The top `rows` CUDA kernels (by shape), the top host operators and the GPU's idle gaps (`gaps_between_kernels`) of
    three passes, printed and returned."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages(group_by_input_shape=True)
    table = averages.table(
        sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=40, max_shapes_column_width=70
    )
    host_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50)
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        prof.export_chrome_trace(trace.name)
        gaps = gaps_between_kernels(trace.name, passes=3)
    print(table, host_table, gaps, sep="\n")
    return table, host_table, gaps


def gaps_between_kernels(trace_path: str, passes: int, listed: int = 12) -> str:
    """Where the GPU idles between its kernels, copies and memsets in a profiler's chrome trace: the busy and idle
    time a pass, the idle by gap size, and the largest gaps with the work on either side (a gap after a host sync
    or a slow launch shows as the kernel that waited)."""
    import json

    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    work = sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )  # fmt: skip
    if not work:
        return "no GPU work in the trace"
    gaps, busy_until, before = [], work[0][1], work[0][2]
    for start, end, name in work[1:]:
        if start > busy_until:
            gaps.append((start - busy_until, before, name))
        if end > busy_until:
            busy_until, before = end, name
    span = (busy_until - work[0][0]) / passes
    idle = sum(g for g, _, _ in gaps) / passes
    sizes = [(0, 5), (5, 20), (20, 100), (100, float("inf"))]
    by_size = ", ".join(
        f"{low}-{high} us: {sum(g for g, _, _ in gaps if low <= g < high) / passes / 1e3:.3f} ms "
        f"({sum(1 for g, _, _ in gaps if low <= g < high) // passes} gaps)"
        for low, high in sizes
    )
    largest = "\n".join(
        f"  {g:8.1f} us  after {b[:70]}  before {a[:70]}" for g, b, a in sorted(gaps, reverse=True)[:listed]
    )
    return (
        f"GPU a pass: {span / 1e3:.3f} ms from first to last kernel, idle {idle / 1e3:.3f} ms between them "
        f"({len(work) // passes} kernels, copies and memsets)\nidle by gap: {by_size}\nlargest gaps:\n{largest}"
    )


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
            result["profile"], result["host_profile"], result["gpu_gaps"] = profile_tables(layer_pass)
    print(result)
    if args.out:
        write_results(Path(args.out), result)


if __name__ == "__main__":
    main()
