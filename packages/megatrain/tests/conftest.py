import os

import numpy as np
import pytest
import yaml

# plans from the default rates, the same on every machine (as the integration tests: tests/conftest.py)
os.environ.setdefault("MEGATRAIN_MEASURE_RATES", "0")


@pytest.fixture
def write_config(tmp_path):
    """Write a small CPU training config (tiny model, random tokens) and return its path."""

    def write(**sections):
        tokens = tmp_path / "tokens.npy"
        if not tokens.exists():
            np.save(tokens, np.random.default_rng(0).integers(0, 256, 4096).astype(np.int32))
        config = {
            "model": {"preset": "tiny-llama"},
            "data": {"tokens": str(tokens), "seq_len": 32, "shuffle": False},
            "train": {"steps": 3, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-3},
            "precision": {"compute_dtype": "float32"},
            "device": "cpu",
            "output_dir": str(tmp_path / "run"),
        }
        for section, values in sections.items():
            if isinstance(values, dict):
                config.setdefault(section, {}).update(values)
            else:
                config[section] = values
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write
