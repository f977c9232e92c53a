"""Bar chart of tokens/s per system and model from benchmark result files (a missing bar = does not fit).

python benchmarks/plot_systems.py docs/systems-h100.png benchmarks/results/throughput-h100.json ...
"""

import json
import sys
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
    out, *inputs = sys.argv[1:]
    best: dict[tuple[str, str], float] = {}
    params: dict[str, float] = {}
    tokens = 131072
    for path in inputs:
        for row in json.loads(Path(path).read_text())["results"]:
            key = (row["model"], row["system"])
            params.setdefault(row["model"], row.get("params_b", 0) or 0)
            if row.get("tokens_per_step") == tokens and row.get("tokens_per_s"):
                best[key] = max(best.get(key, 0), row["tokens_per_s"])
            elif row.get("fits") is False:
                best.setdefault(key, 0)
    models = sorted(params, key=lambda m: params.get(m, 0))
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
    ax.set_xticks([x + width for x in range(len(models))], [f"{m}\n{params[m]:.1f}B" for m in models])
    ax.set_ylabel(f"tokens/s ({tokens // 1024}k tokens per step)")
    ax.set_title("One H100 80 GB, 126 GiB RAM: training throughput, full precision AdamW")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
