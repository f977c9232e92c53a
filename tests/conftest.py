import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# plans from the default rates, the same on every machine (a GPU test that wants them measured says so)
os.environ.setdefault("MEGATRAIN_MEASURE_RATES", "0")


def pytest_runtest_setup(item):
    # A GPU test that cannot reach a GPU fails: it must never pass silently.
    if item.get_closest_marker("gpu") and not torch.cuda.is_available():
        pytest.fail("this test needs a CUDA GPU; run it with `nox -s gpu` on a GPU machine")
    if item.get_closest_marker("two_gpus") and torch.cuda.device_count() < 2:
        pytest.fail(f"this test needs two CUDA GPUs and sees {torch.cuda.device_count()}; run it on a machine with two")
