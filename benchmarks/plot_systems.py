"""Bar chart of training throughput (tokens/s) per system on one GPU kind, from the newest rows of
benchmarks/results that `tables.py` would show: megatrain, plain PyTorch on the GPU and DeepSpeed ZeRO-3
offload (at micro-batch 16), with "does not fit" where a system could not train the model.

    python benchmarks/plot_systems.py docs/systems-h100.png --gpu H100 --tokens 131072 \\
        --models qwen2.5-3b,llama2-7b,qwen2.5-7b --title "One H100 80 GB, 126 GiB host"
"""

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from results_schema import load_rows  # noqa: E402
from tables import gpu, newest, steps, tokens  # noqa: E402

SYSTEMS = {  # system: (legend, the fields its rows must match)
    "megatrain": ("megatrain (all state in host memory)", {}),
    "pytorch-gpu": ("plain PyTorch (all on the GPU)", {}),
    "deepspeed-zero3-offload": ("DeepSpeed ZeRO-3 offload", {"micro_batch_seqs": 16}),
}


def throughput(rows: list[dict], system: str, model: str, kind: str, tokens_per_step: int) -> tuple[float | None, str]:
    """The newest tokens/s of a system on a model, GPU kind and step size, and the label of its bar."""
    match = SYSTEMS[system][1]
    measured = [r for r in steps(rows, system, model=model, tokens_per_step=tokens_per_step, **match) if gpu(r) == kind]
    if measured:
        row = newest(measured, lambda r: 0)[0]
        # rows that recorded only their step time: tokens per step over it
        value = row["tokens_per_s"] or row["tokens_per_step"] / row["step_time_s"]
        return value, f"{value:,.0f}\n{row['date'][:10]}"
    failed = [
        r for r in rows if r["system"] == system and r["model"] == model and r.get("fits") is False and gpu(r) == kind
    ]
    return (0.0, "does not fit") if failed else (None, "not run")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--gpu", default="H100", help="the GPU kind: H100, H200")
    parser.add_argument("--models", default="qwen2.5-3b,llama2-7b,qwen2.5-7b")
    parser.add_argument("--tokens", default="131072", help="tokens per step, comma-separated")
    parser.add_argument("--title", default="")
    args = parser.parse_args()
    rows = load_rows()
    points = [(m, int(t)) for m in args.models.split(",") for t in args.tokens.split(",")]
    fig, ax = plt.subplots(figsize=(2.6 * len(points) + 2, 4.2))
    width = 0.8 / len(SYSTEMS)
    top = 0.0
    for i, (system, (label, _)) in enumerate(SYSTEMS.items()):
        bars = [throughput(rows, system, m, args.gpu, t) for m, t in points]
        xs = [x + i * width for x in range(len(points))]
        ax.bar(xs, [value or 0 for value, _ in bars], width, label=label)
        top = max([top] + [value or 0 for value, _ in bars])
        for x, (value, text) in zip(xs, bars):
            ax.text(
                x,
                value or 0,
                text,
                ha="center",
                va="bottom",
                fontsize=7,
                color="black" if value else "gray",
                rotation=0 if value else 90,
            )
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(
        [x + width for x in range(len(points))], [f"{m}\n{tokens(t)} tokens/step" for m, t in points], fontsize=8
    )
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{args.title}: training throughput, full-precision AdamW".lstrip(": "))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
