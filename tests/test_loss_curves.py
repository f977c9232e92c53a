"""bf16 training: megatrain's loss curve follows plain PyTorch autocast + AdamW on real text."""

import pytest
from loss_curves import loss_curves


def assert_within(ours, theirs, after, rel):
    assert theirs[-1] < theirs[0] - 1.0  # the run learned something, so the comparison means something
    worst = max(abs(a - b) / b for a, b in list(zip(ours, theirs))[after:])
    assert worst < rel, f"largest relative loss difference after step {after}: {worst:.4f}"


def test_bf16_loss_curve_cpu(tmp_path):
    """CPU twin of the GPU test: fewer, smaller steps."""
    ours, theirs = loss_curves("cpu", "bfloat16", steps=40, batch_size=4, seq_len=64, workdir=tmp_path)
    assert_within(ours, theirs, after=10, rel=0.01)


@pytest.mark.gpu
def test_bf16_loss_curve_gpu(tmp_path):
    ours, theirs = loss_curves("cuda", "bfloat16", steps=200, batch_size=16, seq_len=256, workdir=tmp_path)
    assert_within(ours, theirs, after=20, rel=0.01)
