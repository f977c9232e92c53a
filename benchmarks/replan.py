"""A measured throughput row planned again by this tree's planner, at the rates its run was planned with (the row's
`planning_rates`), on its GPU's memory and its host's budget: what a change to the cost model predicts for steps
already measured, without a GPU. Prints each row's measured step, the prediction its run made, this cost model's of
the placement the run executed (the row's `placement`: the cost model alone, whatever the planner would choose now),
and, where this planner places the step otherwise, its own choice's prediction and placement counts.

    python benchmarks/replan.py benchmarks/results/moe-parts-olmoe-32k-h100.json [--rows 1,2]

Plans only.
"""

import argparse
import json
import re
from pathlib import Path

from common import load_config, make_planner, table

from megatrain.config import model_config_of
from megatrain_plan import Rates
from megatrain_sched.placement import Placement
from megatrain_zoo import preset


def overrides(row: dict) -> list[str]:
    """The config settings of the run that measured `row` (`benchmarks/throughput.py`'s), as `--set` pairs."""
    if row.get("doc_len"):
        raise SystemExit(f"{row['model']}: rows of packed documents (doc_len) are not replanned here")
    settings = [
        f"model.preset={row['model']}",
        f"model.implementation={row.get('implementation', 'native')}",
        f"data.seq_len={row['seq_len']}",
        f"train.batch_size={row['tokens_per_step'] // row['seq_len']}",
        f"train.micro_batch_size={row['micro_batch_seqs']}",
        f"train.grad_clip={row.get('grad_clip') or 0.0}",
        f"engine.n_slots={row.get('n_slots', 2)}",
        f"engine.wire_copy={str(bool(row.get('wire_copy'))).lower()}",
        "precision.compute_dtype=bfloat16",
        "device=cpu",
    ]
    lora = re.match(r"lora r=(\d+) \S+(?: over (\w+))?", row.get("adapter") or "")
    if lora:
        rank, base = int(lora[1]), lora[2]
        settings += ["model.adapter.type=lora", f"model.adapter.r={rank}", f"model.adapter.alpha={2.0 * rank}"]
        settings += [f"model.adapter.base_dtype={base}"] if base else []
    if row.get("expert_parts"):
        experts = preset(row["model"]).n_experts
        settings.append(f"engine.experts_per_stage={-(-experts // row['expert_parts'])}")
    return settings


def host_budget_gib(row: dict, machine: dict) -> float:
    """The host memory the run planned with: its MemAvailable less its margin, else the machine's memory."""
    budget = re.match(r"MemAvailable ([\d.]+) GiB less a ([\d.]+) GiB margin", row.get("host_budget", ""))
    return float(budget[1]) - float(budget[2]) if budget else machine["host_memory_gib"]


def replanned(row: dict, machine: dict) -> dict:
    """`row` with this cost model's prediction of the placement its run executed, at its run's rates, and this
    planner's own placement where that differs (its prediction and placement counts)."""
    config = load_config(None, overrides(row))
    model = model_config_of(config)
    layers = re.match(r"first (\d+) layers", row.get("scope", ""))
    if layers:
        model = model.first_layers(int(layers[1]))
    planner = make_planner(
        config,
        model,
        rates=Rates(**row["planning_rates"]),
        gpu_memory=int(machine["gpu_memory_gib"] * 2**30),
        host_memory=int(host_budget_gib(row, machine) * 2**30),
    )
    as_run = planner.plan(Placement.from_dict(row["placement"]), compute_bound=False)
    placed = planner.place(planner.step_tokens)
    own = as_run if _same_choices(placed, as_run.placement) else planner.plan(placed, compute_bound=False)
    return {
        "model": row["model"] + (f", {row['adapter']}" if row.get("adapter") else ""),
        "parts": row.get("expert_parts") or "whole",
        "tokens": row["tokens_per_step"],
        "measured_s": row["step_time_s"],
        "run_planned_s": row["predicted_step_s"],
        "planned_as_run_s": round(as_run.step_s, 3),
        "error_as_run": f"{as_run.step_s / row['step_time_s'] - 1:+.1%}",
        "bound": as_run.bound,
        "phases": " ".join(f"{k} {v:.3f}" for k, v in planner.phases(as_run.placement).items() if v),
        "placed_now": "as run" if own is as_run else f"{own.step_s:.3f} s: {counts(own)}, ran {counts(as_run)}",
    }


def counts(plan) -> str:
    """A plan's placement in counts of layers (those a throughput row records)."""
    placement = plan.placement
    return (
        f"kept {len(placement.keeping)} offloaded {plan.offloaded_layers} held {plan.held_layers} "
        f"GPU-updated {plan.gpu_updated_layers} copied {len(placement.copied)} sweeps {placement.sweeps}"
    )


def _same_choices(one: Placement, other: Placement) -> bool:
    """Whether two placements make the same choices (a recorded one's byte counts aside)."""
    fields = ("stages", "sweeps", "experts_per_stage", "wire_copy", "first_disk_group")
    return all(getattr(one, f) == getattr(other, f) for f in fields) and tuple(one.parked) == tuple(other.parked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: every row with rates)")
    args = parser.parse_args()
    saved = json.loads(args.file.read_text())
    chosen = [int(i) for i in args.rows.split(",")] if args.rows else range(len(saved["results"]))
    rows = [
        replanned(saved["results"][i], saved["machine"])
        for i in chosen
        if "planning_rates" in saved["results"][i] and "placement" in saved["results"][i]
    ]
    print(table(rows, list(rows[0])) if rows else "no row of this file was planned at recorded rates")


if __name__ == "__main__":
    main()
