"""Predicted vs measured step time from benchmarks/results/planner-h100.json, scaling-h100.json and the 32B run.

python benchmarks/plot_planner.py docs/planner-predicted-vs-measured.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def main():
    out = sys.argv[1]
    points = [
        (f"{r['model']} (H100, {r['tokens_per_step'] // 1024}k)", r["predicted_step_s"], r["measured_step_s"])
        for name in ("planner-h100.json", "scaling-h100.json")
        for r in json.loads((RESULTS / name).read_text())["validation"]
    ]
    big = json.loads((RESULTS / "largest-qwen2.5-32b-h200.json").read_text())
    points.append(("qwen2.5-32b (H200)", big["planner_prediction"]["step_s"], big["results"][0]["step_time_s"]))
    fig, ax = plt.subplots(figsize=(5.5, 5))
    top = max(max(p, m) for _, p, m in points) * 1.15
    ax.plot([0, top], [0, top], color="gray", lw=1, label="prediction = measurement")
    ax.fill_between([0, top], [0, top * 0.85], [0, top * 1.15], color="gray", alpha=0.12, label="within 15%")
    for name, predicted, measured in points:  # named in the legend: close points would overlap as labels
        ax.scatter(measured, predicted, zorder=3, label=f"{name}: {(predicted - measured) / measured:+.1%}")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("megatrain plan --calibrate prediction (s)")
    ax.set_title("Planner: predicted vs measured step time")
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
