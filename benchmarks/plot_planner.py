"""Predicted against measured step time: the planner's newest prediction for every run in benchmarks/results
(the rows of the `planner-validation` table in docs/scaling.md).

    python benchmarks/plot_planner.py docs/planner-predicted-vs-measured.png
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from results_schema import load_rows  # noqa: E402
from tables import gpu, planner_validation  # noqa: E402


def kind(row: dict) -> str:
    """The legend entry of a run: its GPU and whether it is dense, a mixture of experts or on the disk tier."""
    if row.get("disk_gib"):
        return f"{gpu(row)}, disk tier"
    moe = row.get("active_params_b") and row["active_params_b"] < 0.9 * row.get("params_b", 0)
    return f"{gpu(row)}, {'mixture of experts' if moe else 'dense'}"


def main():
    out = sys.argv[1]
    rows = load_rows()
    runs = planner_validation(rows).sources
    fig, ax = plt.subplots(figsize=(6, 5.5))
    low = min(min(r["measured_step_s"], r["predicted_step_s"]) for r in runs) * 0.7
    high = max(max(r["measured_step_s"], r["predicted_step_s"]) for r in runs) * 1.4
    ax.plot([low, high], [low, high], color="gray", lw=1, label="prediction = measurement")
    ax.fill_between(
        [low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1], color="gray", alpha=0.15, label="within 10%"
    )
    for name in sorted({kind(r) for r in runs}):
        chosen = [r for r in runs if kind(r) == name]
        ax.scatter(
            [r["measured_step_s"] for r in chosen],
            [r["predicted_step_s"] for r in chosen],
            s=18,
            zorder=3,
            label=f"{name} ({len(chosen)} runs)",
        )
    ax.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high))
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("megatrain plan's prediction (s)")
    ax.set_title(f"Planner: predicted vs measured, newest prediction per run ({len(runs)} runs)", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
