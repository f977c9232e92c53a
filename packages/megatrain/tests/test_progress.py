import io

import pytest
from tqdm import tqdm

import megatrain_store.progress as progress_module
from megatrain.cli import main
from megatrain_store.progress import LOG_INTERVAL_S, LineProgress, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic of the progress module, moved by hand."""
    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    return now


def test_a_terminal_gets_tqdms_bar_and_a_file_whole_lines():
    assert isinstance(progress(total=3, desc="train", unit="step", file=Terminal()), tqdm)
    assert isinstance(progress(total=3, desc="train", unit="step", file=io.StringIO()), LineProgress)


def test_a_log_gets_a_line_every_interval_then_a_last_one(clock):
    out = io.StringIO()
    bar = progress(total=10, initial=2, desc="train", unit="step", file=out)
    for step in range(8):
        clock[0] += 12.0  # 12 s steps: a line after the 3rd and the 6th (36 and 72 s), the last on close
        bar.set_postfix(loss=f"{3 - step / 10:.4f}", tok_s="1,024")
        bar.update(1)
    bar.close()
    bar.close()  # (a second close, as a stopped run's, writes nothing)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines() == [
        "train: 5/10 steps (50%), 12 s/step, elapsed 00:36, eta 01:00, loss=2.8000 tok_s=1,024",
        "train: 8/10 steps (80%), 12 s/step, elapsed 01:12, eta 00:24, loss=2.5000 tok_s=1,024",
        "train: 10/10 steps (100%), 12 s/step, elapsed 01:36, loss=2.3000 tok_s=1,024",
    ]


def test_short_work_that_is_not_kept_writes_nothing_and_long_work_says_when_it_ended(clock):
    out = io.StringIO()
    assert list(progress(range(3), desc="tokenize text", unit="batch", leave=False, file=out)) == [0, 1, 2]
    assert out.getvalue() == ""

    def slow(n):
        for i in range(n):
            clock[0] += LOG_INTERVAL_S / 2
            yield i

    assert len(list(progress(slow(4), total=4, desc="tokenize text", unit="batch", leave=False, file=out))) == 4
    assert out.getvalue().splitlines() == [
        "tokenize text: 2/4 batches (50%), 15 s/batch, elapsed 00:30, eta 00:30",
        "tokenize text: 4/4 batches (100%), 15 s/batch, elapsed 01:00",
    ]


def test_fast_units_are_counted_per_second_and_an_unknown_total_by_count(clock):
    bar = LineProgress(None, total=None, desc="eval", unit="pair", initial=0, leave=True, file=io.StringIO())
    bar.update(500)
    assert bar.line(clock[0] + 2.0) == "eval: 500 pairs, 250 pair/s, elapsed 00:02"


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
