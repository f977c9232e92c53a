"""A measured throughput row planned again by this tree's planner, at the rates its run was planned with (the row's
`planning_rates`), on its GPU's memory and its host's budget: what a change to the cost model predicts for steps
already measured, without a GPU. Prints each row's measured step, the prediction its run made, this planner's, and
this plan's phases and placement beside the run's.

    python benchmarks/replan.py benchmarks/results/moe-parts-olmoe-32k-h100.json [--rows 1,2]

Plans only. A row the planner places otherwise than its run did (another count of kept or GPU-updated layers, say)
says so: its prediction is of another placement.
"""

import argparse
import json
import re
from pathlib import Path

from common import load_config, make_planner, table

from megatrain.config import model_config_of
from megatrain_plan import Rates
from megatrain_zoo import preset

# the placement counts a throughput row records, compared with the new plan's
COUNTS = ("kept_layers", "offloaded_layers", "held_layers", "gpu_updated_layers", "expert_parts", "sweeps")


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
    """`row` with this planner's prediction at its run's rates, bound and placement counts."""
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
    plan = planner.plan(planner.place(planner.step_tokens))
    ran = tuple(row.get(name) for name in COUNTS)
    now = (len(plan.placement.keeping), plan.offloaded_layers, plan.held_layers, plan.gpu_updated_layers)
    now += (len(planner.spec.expert_parts), plan.placement.sweeps)
    return {
        "model": row["model"] + (f", {row['adapter']}" if row.get("adapter") else ""),
        "parts": row.get("expert_parts") or "whole",
        "tokens": row["tokens_per_step"],
        "measured_s": row["step_time_s"],
        "run_planned_s": row["predicted_step_s"],
        "planned_now_s": round(plan.step_s, 3),
        "error_now": f"{plan.step_s / row['step_time_s'] - 1:+.1%}",
        "bound_now": plan.bound,
        "phases_now": " ".join(f"{k} {v:.3f}" for k, v in planner.phases(plan.placement).items() if v),
        "placement": "as run" if now == ran else f"now {now}, ran {ran} ({', '.join(COUNTS)})",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path)
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: every row with rates)")
    args = parser.parse_args()
    saved = json.loads(args.file.read_text())
    chosen = [int(i) for i in args.rows.split(",")] if args.rows else range(len(saved["results"]))
    rows = [replanned(saved["results"][i], saved["machine"]) for i in chosen if "planning_rates" in saved["results"][i]]
    print(table(rows, list(rows[0])) if rows else "no row of this file was planned at recorded rates")


if __name__ == "__main__":
    main()
