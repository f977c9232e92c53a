"""Progress as a run shows it: a redirected run's log lines, and the saves, loads and exports that report theirs."""

import json

import megatrain_store.progress as progress_module
from megatrain.cli import main
from megatrain_optim import Schedule, lr_at


def test_a_redirected_training_run_logs_lines_not_a_redrawn_bar(write_config, capsys):
    assert main(["train", "--config", str(write_config())]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert any(line.startswith("train: 3/3 steps (100%), ") and "loss=" in line for line in err.splitlines()), err


def test_metrics_jsonl_logs_a_fine_tuning_learning_rate_to_eight_significant_digits(write_config, tmp_path):
    """metrics.jsonl had each float to six decimals: a learning rate of 2.74217e-05 logged as 2.7e-05."""
    train = {"steps": 4, "lr": 2.5e-5, "warmup_steps": 3, "schedule": "cosine", "min_lr_ratio": 0.1}
    assert main(["train", "--config", str(write_config(train=train))]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    schedule = Schedule(lr=2.5e-5, warmup_steps=3, total_steps=4, kind="cosine", min_lr_ratio=0.1)
    assert [row["lr"] for row in rows] == [float(f"{lr_at(step, schedule):.8g}") for step in range(4)]
    assert rows[0]["lr"] == 8.3333333e-06  # (six decimals: 8e-06)


def test_saving_loading_and_exporting_the_state_show_their_progress(write_config, tmp_path, capsys, monkeypatch):
    """Long for a large model (hundreds of GB), so each says how far it is: here a line per unit."""
    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)
    config = write_config(train={"save_every": 3})
    assert main(["train", "--config", str(config)]) == 0
    saved = capsys.readouterr().err.splitlines()
    assert main(["eval", "--config", str(config), "--checkpoint", str(tmp_path / "run/checkpoints/step-00000003")]) == 0
    assert main(["eval", "--config", str(config), "--checkpoint", str(tmp_path / "run/final")]) == 0
    loaded = capsys.readouterr().err.splitlines()

    def finished(lines, start):
        return [line for line in lines if line.startswith(start) and "(100%)" in line]

    assert finished(saved, "save step-00000003: ") and finished(saved, "write final: ")
    assert finished(loaded, "load step-00000003/model.safetensors: ") and finished(loaded, "load weights: ")
