"""Expert load (the worst layer's MaxVio) and loss per step, one line per run, from a load-balancing results
file of benchmarks/results (rows with a per_step series, as benchmarks/load_balance.py measures them).

    python benchmarks/plot_load_balance.py benchmarks/results/load-balance-h100.json docs/load-balance-h100.png
"""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    source, out = sys.argv[1], sys.argv[2]
    runs = json.loads(Path(source).read_text())["results"]
    fig, (violation, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = [s["step"] for s in run["per_step"]]
        label = f"rate {run['router_bias_update_rate']:g}"
        if run.get("router_seq_aux_loss_coef"):
            label += f", sequence-wise loss {run['router_seq_aux_loss_coef']:g}"
        violation.plot(steps, [s["max_violation"] for s in run["per_step"]], label=label, linewidth=1)
        loss.plot(steps, [s["loss"] for s in run["per_step"]], label=label, linewidth=1)
    violation.set(xlabel="step", ylabel="worst layer's max load / mean load - 1", title="expert load (MaxVio)")
    violation.set_yscale("log")
    loss.set(xlabel="step", ylabel="training loss", title="loss")
    for ax in (violation, loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{runs[0]['model']}, {runs[0]['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
