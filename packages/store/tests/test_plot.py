"""The loss plot of a run's metrics: a PNG with the panels its records call for; nothing without matplotlib."""

import importlib.util
import json

from megatrain_store.plot import plot_loss


def test_the_loss_plot_draws_what_the_records_hold(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [
        {"step": s, "loss": 2.0 / s, "reward": s / 10, "rewards/margins": 0.1 * s, "rewards/accuracies": 0.5}
        for s in range(1, 6)
    ]
    records += [{"step": 5, "val_loss": 0.5, "val_rewards/accuracies": 0.6}, {"step": 6, "loss": None, "skipped": 1}]
    metrics.write_text("".join(json.dumps(record) + "\n" for record in records))
    drawn = plot_loss(metrics, tmp_path / "loss.png")
    assert drawn == (importlib.util.find_spec("matplotlib") is not None)
    if drawn:  # (three panels, the loss, DPO's and GRPO's, side by side: 7 + 5 + 5 inches at 120 dpi)
        png = (tmp_path / "loss.png").read_bytes()
        assert png.startswith(b"\x89PNG") and int.from_bytes(png[16:20], "big") == (7 + 5 + 5) * 120
    else:
        assert not (tmp_path / "loss.png").exists()
