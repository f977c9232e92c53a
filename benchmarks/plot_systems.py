"""Bar chart of tokens/s per system, model and tokens per step from benchmark result files
(a zero bar = does not fit).

python benchmarks/plot_systems.py docs/systems-h100.png benchmarks/results/baselines-h100.json ... \
    --tokens 131072 --title "One H100 80 GB, 126 GiB RAM"
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SYSTEMS = {
    "megatrain": "megatrain (host memory)",
    "pytorch-gpu": "plain PyTorch (all on GPU)",
    "deepspeed-zero3-offload": "DeepSpeed ZeRO-3 offload",
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--tokens", default=None, help="only these tokens per step (comma-separated)")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    wanted = {int(t) for t in args.tokens.split(",")} if args.tokens else None
    best: dict[tuple[str, str], float] = {}
    params: dict[str, float] = {}
    for path in args.inputs:
        for row in json.loads(Path(path).read_text())["results"]:
            if wanted and row.get("tokens_per_step", min(wanted)) not in wanted:  # "does not fit" rows may have none
                continue
            point = f"{row['model']}, {row.get('tokens_per_step', min(wanted or [0])) // 1024}k tokens/step"
            params.setdefault(point, row.get("params_b", 0) or 0)
            key = (point, row["system"])
            if row.get("tokens_per_s"):
                best[key] = max(best.get(key, 0), row["tokens_per_s"])
            elif row.get("fits") is False:
                best.setdefault(key, 0)
    models = sorted(params, key=lambda m: (params[m], int(m.split(", ")[1].split("k")[0])))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(SYSTEMS)
    for i, (system, label) in enumerate(SYSTEMS.items()):
        values = [best.get((m, system)) for m in models]
        bars = ax.bar([x + i * width for x in range(len(models))], [v or 0 for v in values], width, label=label)
        for bar, value in zip(bars, values):
            text = "not run" if value is None else f"{value:,.0f}" if value else "does not fit"
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                max(value or 0, 300),
                text,
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=0 if value else 90,
                color="black" if value is not None else "gray",
            )
    ax.set_xticks([x + width for x in range(len(models))], [m.replace(", ", "\n") for m in models], fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{args.title}: training throughput, full-precision AdamW".lstrip(": "))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
