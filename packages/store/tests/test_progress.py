import io

import pytest
from tqdm import tqdm

import megatrain_store.progress as progress_module
from megatrain_store.progress import LOG_INTERVAL_S, LineProgress, progress, size_text


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


def test_sizes_are_mib_below_a_gib_and_gib_from_one_on():
    assert (
        size_text(3 * 2**20) == "3.0 MiB" and size_text(2**30) == "1.00 GiB" and size_text(5 * 2**30 // 2) == "2.50 GiB"
    )
