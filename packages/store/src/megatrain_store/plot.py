"""The loss plot of a run's metrics (the JSON lines `io.write_jsonl` writes, one record a step or evaluation):
drawn beside the panels its records call for. matplotlib is optional: without it nothing is drawn."""

import json
from pathlib import Path


def plot_loss(metrics_path: Path, out_path: Path) -> bool:
    """Loss curve PNG from metrics.jsonl, beside the experts' load balance for a MoE run, the rewards' accuracy
    and margin for a DPO run, the completions' mean reward for a GRPO run; False when matplotlib is not installed."""
    try:  # (a Figure of its own, drawn by Agg: pyplot's global state and import, 0.6 s a run, are not needed)
        from matplotlib.figure import Figure
    except ImportError:
        return False
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in records if r.get("loss") is not None and not r.get("skipped")]
    evals = [r for r in records if "val_loss" in r]
    panels = [_plot_balance] if any("router_max_violation" in r for r in rows) else []
    panels += [_plot_rewards] if any("rewards/margins" in r for r in rows) else []
    panels += [_plot_grpo_reward] if any("reward" in r for r in rows) else []
    fig = Figure(figsize=(7 + 5 * len(panels), 4))
    axes = fig.subplots(1, 1 + len(panels), squeeze=False)
    for panel, ax in zip(panels, axes[0][1:]):
        panel(ax, rows, evals)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    ax = axes[0][0]
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="training")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)" if not panels or panels[-1] is _plot_balance else "loss")
    ax.set_title("megatrain loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    return True


def _plot_balance(ax, rows: list[dict], evals: list[dict]) -> None:
    balance = [r for r in rows if "router_max_violation" in r]
    ax.plot([r["step"] for r in balance], [r["router_max_violation"] for r in balance])
    ax.set_ylabel("worst layer's max expert load / mean - 1")
    ax.set_title("expert load balance (MaxVio; 0: even)")


def _plot_grpo_reward(ax, rows: list[dict], evals: list[dict]) -> None:
    """GRPO: the step's completions' mean reward, and its mean over the last 10 steps."""
    scored = [r for r in rows if "reward" in r]
    steps, rewards = [r["step"] for r in scored], [r["reward"] for r in scored]
    ax.plot(steps, rewards, alpha=0.4, label="step")
    window = [sum(rewards[max(0, i - 9) : i + 1]) / len(rewards[max(0, i - 9) : i + 1]) for i in range(len(rewards))]
    ax.plot(steps, window, label="mean of 10 steps")
    ax.set_ylabel("reward")
    ax.set_title("completions' mean reward")
    ax.legend()


def _plot_rewards(ax, rows: list[dict], evals: list[dict]) -> None:
    """DPO: how often the chosen completion's implicit reward beats the rejected one's, and by how much."""
    pairs = [r for r in rows if "rewards/margins" in r]
    steps = [r["step"] for r in pairs]
    ax.plot(steps, [r["rewards/accuracies"] for r in pairs], label="accuracy (training)")
    ax.plot(steps, [r["rewards/margins"] for r in pairs], label="margin (training)")
    held_out = [r for r in evals if "val_rewards/accuracies" in r]
    if held_out:
        ax.plot(
            [r["step"] for r in held_out],
            [r["val_rewards/accuracies"] for r in held_out],
            "o-",
            label="accuracy (validation)",
        )
    ax.set_title("rewards: chosen against rejected")
    ax.legend()
