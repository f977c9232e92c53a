"""The whole dense-120b at full precision on one H200, planned on the rates its first 2 layers ran at: the block's
and head's GPU rates measured at its shape and the host AdamW's rate in that same run
(`benchmarks/results/qlora-full-layers-h200.json`, from `benchmarks/run_qlora.sh OUT full-layers`), for hosts of
1.5 TiB (the published system's box) and 2 TiB, with and without clipping, 32k tokens a step of 4 x 4096.

    python benchmarks/full_precision_plans.py   # -> benchmarks/results/dense-120b-full-plans-h200.json and a table

Plans only: the box lent to us holds 2 of the 76 layers at full precision (16 B/param with clipping), not 76.
"""

import json
from dataclasses import asdict, replace
from pathlib import Path

from common import planned_row, table, write_results

from megatrain_plan import Rates

RESULTS = Path(__file__).parent / "results"
MEASURED = RESULTS / "qlora-full-layers-h200.json"
HOSTS_GIB = (1536, 2048)
CLIPS = (0.0, 1.0)
SEQ, MICRO_BATCH, TOKENS = 4096, 4, 32768


def measured_rates() -> Rates:
    """The rates the 2 layers were planned with (their block and head measured at this shape), with the host AdamW's
    rate as it ran in that step (parameters the CPU updated over its optimizer seconds)."""
    row = json.loads(MEASURED.read_text())["results"][0]
    cpu_adam = row["cpu_updated_params_b"] * 1e9 / row["time_split_s_per_step"]["optimizer"]
    return replace(
        Rates(**row["planning_rates"]),
        cpu_adam_params_per_s=round(cpu_adam, -7),
        source=f"{MEASURED.name} ({row['date']}): the block, the head and the host AdamW measured; PCIe defaults",
    )


def plan_row(rates: Rates, host_gib: int, clip: float) -> dict:
    """The planned step of the whole dense-120b at full precision on one H200 and a host of `host_gib` GiB."""
    overrides = [
        "model.preset=dense-120b",
        f"data.seq_len={SEQ}",
        f"train.batch_size={TOKENS // SEQ}",
        f"train.micro_batch_size={MICRO_BATCH}",
        f"train.grad_clip={clip}",
        "precision.compute_dtype=bfloat16",
        "device=cpu",
    ]
    return {"grad_clip": clip} | planned_row(overrides, rates, host_gib)


def main() -> None:
    rates = measured_rates()
    rows = [plan_row(rates, host, clip) for host in HOSTS_GIB for clip in CLIPS]
    print(table(rows, ["host_size_gib", "grad_clip", "host_memory_gib", "host_holds_it", "step_time_s", "bound"]))
    write_results(
        RESULTS / "dense-120b-full-plans-h200.json",
        {
            "benchmark": "The whole dense-120b at full precision on one H200, on its first layers' measured rates (plans)",
            "machine": {"device": "NVIDIA H200 (planned)", "gpu_memory_gib": 139.8},
            "commands": ["python benchmarks/full_precision_plans.py"],
            "notes": [
                "Plans only: one H200 (139.8 GiB), 32k tokens a step of 4 x 4096, fp32 masters and AdamW moments on "
                "the host; with clipping the gradients are held until the norm is known. host_holds_it: the host's "
                "budget holds the plan (refusal: the planner's words where it does not)."
            ],
            "rates": asdict(rates),
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()
