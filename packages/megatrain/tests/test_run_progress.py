"""Progress as a run shows it: a redirected run's log lines, and the saves, loads and exports that report theirs."""

import megatrain_store.progress as progress_module
from megatrain.cli import main


def test_a_redirected_training_run_logs_lines_not_a_redrawn_bar(write_config, capsys):
    assert main(["train", "--config", str(write_config())]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert any(line.startswith("train: 3/3 steps (100%), ") and "loss=" in line for line in err.splitlines()), err


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
