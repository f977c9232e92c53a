"""Shared by every test directory of the repository: tests marked `gpu` are skipped, saying why, on a machine without
CUDA (`nox` deselects them; plain `pytest` on a CPU machine would fail them on their first CUDA call)."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") or item.get_closest_marker("two_gpus")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run it there with `nox -s gpu`")
    for item in gpu_items:
        item.add_marker(skip)
