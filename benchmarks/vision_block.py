"""One vision block of an image-text model on the GPU: a micro-batch's forward and recompute-backward time, its
model TFLOPS, and the host's time to issue it (a block whose GPU time is the host's is launch-bound), with its
attention in one varlen call (megatrain's path in half precision) beside transformers' call per window. With
`--profile`, the profiler's top operators by host time.

    python benchmarks/vision_block.py --model qwen2.5-vl-7b --images-per-row 2 --video-frames 8
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from block import time_ms  # noqa: E402
from image_text import MODELS, rows_with_media  # noqa: E402

from megatrain_templates import Media  # noqa: E402
from megatrain_zoo import image_text  # noqa: E402
from megatrain_zoo.generic import generic_model_config  # noqa: E402
from megatrain_zoo.model import build_model  # noqa: E402


def host_ms(fn, repeats: int = 10) -> float:
    """Milliseconds the host takes to issue `fn` (the GPU not waited for, unless the host is ahead of it)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued * 1e3 / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-vl-7b")
    parser.add_argument("--rows", type=int, default=1, help="rows in the micro-batch")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--images-per-row", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--video-frames", type=int, default=8)
    parser.add_argument("--block", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    hf = MODELS[args.model]
    spec = build_model(generic_model_config(hf, image_text=True))
    ids, _, rows, patches = rows_with_media(args, hf)
    media = Media.of_rows(ids, rows).to("cuda")
    block = spec.stages[1 + args.block].template
    weights = [torch.randn(block.numel, device="cuda", dtype=torch.bfloat16) * 0.02]
    grads = [torch.zeros(block.numel, device="cuda")]
    x = torch.randn(patches, block.skeleton.width, device="cuda", dtype=torch.bfloat16)
    v = hf["vision_config"]
    flops = 2 * patches * (4 * v["hidden_size"] ** 2 + 3 * v["hidden_size"] * v["intermediate_size"])
    registered = image_text._varlen_attention_registered()  # (registers it with transformers)
    for path, varlen in (("one varlen call", True), ("a call per window", False)):
        image_text._varlen_attention_registered = lambda varlen=varlen: varlen and registered

        def forward():
            block.forward(weights, x, media=media)

        def step():
            block.backward(weights, x, x, grads, media=media)

        forward_ms, step_ms = time_ms(forward), time_ms(step)
        print(
            f"{path}: {patches} patches, forward {forward_ms:.2f} ms ({flops / forward_ms / 1e9:.0f} TFLOPS, "
            f"issued in {host_ms(forward):.2f} ms), recompute + backward {step_ms:.2f} ms "
            f"({3 * flops / step_ms / 1e9:.0f} TFLOPS, issued in {host_ms(step):.2f} ms)",
            flush=True,
        )
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main()
