"""Shared by every test directory of the repository: on a machine without CUDA, a plain `pytest` (CI's and nox's
CPU sessions deselect them with `-m "not gpu"`) skips the tests marked `gpu`, saying why. A run that selects them
(`-m gpu`: `nox -s gpu`, tests/gpu_lanes.sh) fails them instead (tests/conftest.py): a GPU suite that found no GPU
must never pass."""

import pytest


def pytest_collection_modifyitems(config, items):
    expression = config.getoption("markexpr") or ""
    if "gpu" in expression.replace("not gpu", ""):  # (the GPU tests asked for)
        return
    gpu_items = [item for item in items if item.get_closest_marker("gpu") or item.get_closest_marker("two_gpus")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run it there with `nox -s gpu`")
    for item in gpu_items:
        item.add_marker(skip)
