"""megatrain: full-precision training of very large LLMs on one GPU, the model in host memory.

The public names load on first use (PEP 562), so that the `megatrain` command starts without torch
and imports it where Ctrl-C or a missing package ends in one line."""

import importlib

__version__ = "0.2.0"

_PUBLIC = {
    "Config": "config",
    "ConfigError": "config",
    "load_config": "config",
    "NonFiniteError": "checkpoint",
    "StepBatch": "step",
    "StepMetrics": "trainer",
    "Trainer": "trainer",
}

__all__ = sorted(_PUBLIC) + ["__version__"]


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'megatrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
