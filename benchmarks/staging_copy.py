"""How fast a layer's fp32 master weights reach the GPU as bf16 while the GPU computes: the engine's rhythm of
two weight slots (the next layer's weights copied in while a layer computes), each layer's compute a number of
32k-token MLP GEMMs, the weights cast on arrival through staging buffers of each size, against an fp32 copy
with no cast (the link's own rate) and a bf16 copy from host memory (`engine.wire_copy`).

A cast is a kernel: it waits for SMs behind the compute stream's GEMMs, so the staging ring's size decides
whether the copy engine waits for the casts. Needs a CUDA GPU.

    python benchmarks/staging_copy.py --out benchmarks/results/staging-copy-h100.json
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, table, write_results  # noqa: E402

from megatrain_sched import staging_buffers  # noqa: E402

SOURCES = 6  # distinct host layers the copies cycle through (no cache helps a copy, but the pages differ)
LAYERS = 30  # layers a measured pass runs


class Rhythm:
    """A pass over `LAYERS` layers of `layer_numel` weights, two slots, each layer's compute `gemms` GEMMs."""

    def __init__(self, layer_numel: int):
        self.device = torch.device("cuda")
        self.host = [torch.randn(layer_numel).pin_memory() for _ in range(SOURCES)]
        self.host_bf16 = [h.to(torch.bfloat16).pin_memory() for h in self.host]
        self.slots = [torch.empty(layer_numel, dtype=torch.bfloat16, device=self.device) for _ in range(2)]
        self.slots_fp32 = [torch.empty(layer_numel, device=self.device) for _ in range(2)]
        self.a = torch.randn(32768, 3584, dtype=torch.bfloat16, device=self.device)  # Qwen2.5-7B's MLP, 32k tokens
        self.b = torch.randn(3584, 18944, dtype=torch.bfloat16, device=self.device)
        self.compute, self.copy_in, self.cast = (torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream())

    def event(self, stream, timing=False):
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream)
        return event

    def fetch(self, layer: int, slot: int, way: str, staging: list, staging_free: list) -> torch.cuda.Event:
        """Queue one layer's copy into `slot` (after the slot's last reader); the event that marks it usable."""
        source = self.host[layer % SOURCES]
        if way in ("fp32, no cast", "bf16 wire copy"):
            target, source = (
                (self.slots_fp32[slot], source)
                if way == "fp32, no cast"
                else (self.slots[slot], self.host_bf16[layer % SOURCES])
            )
            with torch.cuda.stream(self.copy_in):
                target.copy_(source, non_blocking=True)
            return self.event(self.copy_in)
        chunk_numel = staging[0].numel()
        for start in range(0, source.numel(), chunk_numel):  # the engine's `_copy_weights`, its ring in a list
            buffer = self.ring = (self.ring + 1) % len(staging)
            if staging_free[buffer] is not None:
                self.copy_in.wait_event(staging_free[buffer])
            staged = staging[buffer][: min(chunk_numel, source.numel() - start)]
            with torch.cuda.stream(self.copy_in):
                staged.copy_(source[start : start + chunk_numel], non_blocking=True)
            self.cast.wait_event(self.event(self.copy_in))
            with torch.cuda.stream(self.cast):
                self.slots[slot][start : start + staged.numel()].copy_(staged)
            staging_free[buffer] = self.event(self.cast)
        self.copy_in.wait_stream(self.cast)
        return self.event(self.copy_in)

    def pass_ms(self, way: str, gemms: int, staging: list) -> float:
        """Milliseconds a layer of one pass, the next layer's copy queued before each layer's compute."""
        torch.cuda.synchronize()
        self.ring, staging_free, free, ready = 0, [None] * len(staging), [None, None], [None, None]
        start = self.event(self.compute, timing=True)
        ready[0] = self.fetch(0, 0, way, staging, staging_free)
        for layer in range(LAYERS):
            slot = layer % 2
            if layer + 1 < LAYERS:
                if free[1 - slot] is not None:
                    self.copy_in.wait_event(free[1 - slot])
                ready[1 - slot] = self.fetch(layer + 1, 1 - slot, way, staging, staging_free)
            self.compute.wait_event(ready[slot])
            for _ in range(gemms):
                torch.matmul(self.a, self.b)
            free[slot] = self.event(self.compute)
        end = self.event(self.compute, timing=True)
        end.synchronize()
        return start.elapsed_time(end) / LAYERS


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer-params", type=int, default=233_000_000, help="a layer's weights (Qwen2.5-7B's)")
    parser.add_argument("--gemms", default="0,2,3,4", help="GEMMs of a layer's compute, comma-separated")
    parser.add_argument("--out", default="benchmarks/results/staging-copy.json")
    args = parser.parse_args()
    rhythm = Rhythm(args.layer_params)
    engine_buffers, engine_numel = staging_buffers(args.layer_params)
    ways = {
        "fp32, no cast": [],
        "bf16 wire copy": [],
        "staging 2 x 128 MiB (before)": [torch.empty(2**25, device=rhythm.device) for _ in range(2)],
        f"staging {engine_buffers} x {engine_numel * 4 >> 20} MiB (the engine's ring)": [
            torch.empty(engine_numel, device=rhythm.device) for _ in range(engine_buffers)
        ],
    }
    rows = []
    for gemms in (int(g) for g in args.gemms.split(",")):
        for way, staging in ways.items():
            rhythm.pass_ms(way, gemms, staging)  # warm-up
            ms = min(rhythm.pass_ms(way, gemms, staging) for _ in range(3))
            rows.append(
                {
                    "system": "megatrain",
                    "model": "qwen2.5-7b",
                    "scope": f"a layer's weights copied in while the previous computes {gemms} 32k-token MLP GEMMs",
                    "tokens_per_step": None,
                    "step_time_s": None,
                    "tokens_per_s": None,
                    "model_tflops": None,
                    "engine": way,
                    "layer_params": args.layer_params,
                    "gemms_per_layer": gemms,
                    "ms_per_layer": round(ms, 2),
                    "fp32_gb_per_s": round(args.layer_params * 4 / ms / 1e6, 1),
                }
            )
            print(table(rows[-1:], ["gemms_per_layer", "engine", "ms_per_layer", "fp32_gb_per_s"]), flush=True)
    write_results(
        Path(args.out),
        {
            "benchmark": "a layer's fp32 weights to the GPU as bf16 under its neighbour's GEMMs: staging sizes",
            "machine": machine(),
            "commands": [" ".join(["python", *sys.argv])],
            "notes": [
                "fp32_gb_per_s: a layer's fp32 bytes over the milliseconds a layer took; the pass is as slow as "
                "the slower of the copies and the GEMMs (6.0 ms each on an H100)"
            ],
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
