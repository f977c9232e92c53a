"""Render a megatrain Chrome trace (engine.trace or benchmarks/throughput.py --trace-dir) as a PNG
timeline: one row per stream (copy-in, compute, copy-out, and the GPU optimizer's where the trace has it) and
one for the CPU optimizer.

    python benchmarks/plot_trace.py trace.json docs/timeline.png --steps 1
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROWS = {  # track: its row's label
    "copy_in": "copy-in (H2D)",
    "compute": "compute",
    "gpu_optimizer": "GPU AdamW",
    "copy_out": "copy-out (D2H)",
    "optimizer": "CPU AdamW",
}
COLORS = {  # span kind: (color, legend)
    "copy_in": ("#4C72B0", "weights in"),
    "fwd": ("#55A868", "forward"),
    "bwd": ("#C44E52", "backward (recompute)"),
    "head": ("#8172B2", "head: loss + grad"),
    "grad_out": ("#DD8452", "grads out"),
    "adamw": ("#937860", "AdamW update"),
    "checkpoint": ("#64B5CD", "checkpoints out / in"),
    "products": ("#CCB974", "kept products out / in"),
}


def color(name: str) -> str:
    if name.startswith("fwd head"):
        return COLORS["head"][0]
    return COLORS.get(name.split()[0], ("#999999",))[0]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("trace", nargs="+", help="one trace, or one per rank (a panel each)")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=1, help="how many of the last steps to show")
    parser.add_argument("--title", default=None)
    args = parser.parse_args()
    fig, axes = plt.subplots(len(args.trace), 1, figsize=(14, 0.6 + 2.6 * len(args.trace)), squeeze=False)
    for index, (trace, ax) in enumerate(zip(args.trace, axes[:, 0])):
        draw(ax, json.loads(Path(trace).read_text())["traceEvents"], args.steps)
        if len(args.trace) > 1:
            ax.set_ylabel(f"rank {index}", rotation=0, labelpad=30)
    ax = axes[-1, 0]
    ax.set_xlabel("time (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in COLORS.values()]
    ax.legend(
        handles,
        [label for _, label in COLORS.values()],
        ncol=4,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.28),
        frameon=False,
    )
    axes[0, 0].set_title(args.title or Path(args.trace[0]).stem)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


def draw(ax, events: list, steps: int) -> None:
    """The last `steps` steps of one trace, one row per stream, time from the first step's start (spans running
    across it drawn from there: the CPU's AdamW often starts just before)."""
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    spans = sorted((e for e in events if e["ph"] == "X"), key=lambda e: e["ts"])
    # a step starts with the embedding's forward (its copy in may be missing: the table may live on the GPU)
    forward_starts = [e["ts"] for e in spans if e["name"] == "fwd embed" and tracks[e["tid"]] == "compute"]
    begin = forward_starts[-steps] if len(forward_starts) >= steps else spans[0]["ts"]
    shown = [e for e in spans if e["ts"] + e["dur"] > begin]
    end = max(e["ts"] + e["dur"] for e in shown)
    rows = [track for track in ROWS if track in tracks.values()]
    for row, track in enumerate(rows):
        for e in shown:
            if tracks[e["tid"]] == track:
                start = max(e["ts"], begin)
                ax.barh(
                    row,
                    (e["ts"] + e["dur"] - start) / 1e3,
                    left=(start - begin) / 1e3,
                    height=0.7,
                    color=color(e["name"]),
                    edgecolor="white",
                    linewidth=0.3,
                )
    ax.set_yticks(range(len(rows)), [ROWS[track] for track in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, (end - begin) / 1e3)


if __name__ == "__main__":
    main()
