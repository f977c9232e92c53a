"""What several hosts would train, from the planner: for hosts of 512 GiB and 1.5 TiB, 1 to 64
of them with 8 H200s each, a replica of the state per host against the state split over the
hosts (engine.shard_across_hosts), the largest preset that fits and its planned step.

    python benchmarks/host_plans.py   # -> benchmarks/results/hosts-plans.json and a table

Plans only (no run): the rates are the H100 calibration of the dense-120b plans in
docs/scaling.md, the network an assumed 50 GB/s per host each way.
"""

from dataclasses import replace
from pathlib import Path

from common import table, write_results

from megatrain.config import load_config
from megatrain.planning import make_plan
from megatrain_plan import Rates

RATES = Rates(
    gpu_tflops=560.0,
    head_tflops=515.0,
    pcie_gbps=54.7,
    cpu_adam_params_per_s=5.04e9,
    disk_gbps=1.55,
    moe_gpu_tflops=300.0,
    network_gbps=50.0,
    source="H100 calibration of the dense-120b plans (scaling.md)",
)
CANDIDATES = ["qwen2.5-32b", "llama3.1-70b", "dense-120b", "qwen3-235b-a22b", "llama3.1-405b", "deepseek-v3", "kimi-k2"]
GPUS, SEQ, TOKENS_PER_GPU = 8, 4096, 16384  # per host; sequences; each GPU's share of a step
H200_MEMORY = int(139.8 * 2**30)


def plan(preset: str, host_gib: int, hosts: int, split: bool):
    rows = TOKENS_PER_GPU // SEQ * GPUS * hosts
    config = load_config(
        None,
        [
            f"model.preset={preset}",
            f"data.seq_len={SEQ}",
            f"train.batch_size={rows}",
            "train.micro_batch_size=1",
            "train.grad_clip=0",  # updates applied as gradients land: no full gradient copy in host memory
            "precision.compute_dtype=bfloat16",
            "device=cpu",
            f"engine.shard_across_hosts={str(split).lower()}",
        ],
    )
    return make_plan(config, rates=RATES, gpu_memory=H200_MEMORY, gpus=GPUS, hosts=hosts, host_memory=host_gib * 2**30)


def main() -> None:
    rows = []
    for host_gib in (512, 1536):
        for split in (False, True):
            for hosts in (1, 4, 16, 64):
                if split and hosts == 1:
                    continue
                fitting = [(p, plan(p, host_gib, hosts, split)) for p in CANDIDATES]
                fitting = [(p, x) for p, x in fitting if x.host_bytes <= 0.95 * x.host_available]
                if not fitting:
                    continue
                preset, best = max(fitting, key=lambda item: item[1].n_params)
                rows.append(
                    {
                        "host_gib": host_gib,
                        "state": "split" if split else "replica",
                        "hosts": hosts,
                        "gpus": GPUS * hosts,
                        # the bytes per parameter a host holds for this mode, and what that lets it hold
                        "host_bytes_per_param": round(best.host_bytes_per_param, 2),
                        "largest_params_b": round(0.95 * host_gib * 2**30 / best.host_bytes_per_param / 1e9),
                        "model": preset,
                        "params_b": round(best.n_params / 1e9, 1),
                        "host_memory_gib": round(best.host_bytes / 2**30),
                        "tokens_per_step": best.tokens_per_step,
                        "step_s": round(best.step_s, 1),
                        "tokens_per_s": round(best.tokens_per_s),
                        "model_tflops": round(best.model_tflops),
                        "network_gb_per_host": round(best.network_bytes / 1e9, 1),
                        "network_s": round(best.network_s, 1),
                        "bound": best.bound,
                        "seq_len": SEQ,
                    }
                )
    print(table(rows, list(rows[0])))
    write_results(
        Path(__file__).parent / "results" / "hosts-plans.json",
        {
            "benchmark": "The largest model 1-64 hosts of 512 GiB or 1.5 TiB (8 H200s each) would train: a replica per "
            "host or the state split over them",
            "machine": {"device": "NVIDIA H200 (planned: 8 per host)"},
            "commands": ["python benchmarks/host_plans.py"],
            "notes": [
                "largest_params_b: 95% of the host over the bytes per parameter it holds; the model is the largest of "
                "the candidates that fits. Split state keeps a whole bf16 copy per host (2 B/param), so capacity grows "
                "with hosts up to about host / 2 B. The command makes a plan per row (make_plan), 8 H200s per host, 16k "
                "tokens per GPU.",
                "Plans, not measurements.",
                "host_size_gib is the host's memory, host_memory_gib what the plan takes of it; 16k tokens per GPU per "
                "step in sequences of 4096.",
            ],
            "rates": replace(RATES).__dict__,
            "candidates": CANDIDATES,
            "plans": rows,
        },
    )


if __name__ == "__main__":
    main()
