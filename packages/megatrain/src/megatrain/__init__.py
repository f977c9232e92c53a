"""megatrain: full-precision training of very large LLMs on one GPU, the model in host memory."""

from .config import Config, ConfigError, load_config
from .data import TokenWindows, builtin_corpus, load_token_array
from .hf_io import export_hf, load_hf_weights
from .trainer import NonFiniteError, StepMetrics, Trainer

__all__ = [
    "Config",
    "ConfigError",
    "NonFiniteError",
    "StepMetrics",
    "TokenWindows",
    "Trainer",
    "builtin_corpus",
    "export_hf",
    "load_config",
    "load_hf_weights",
    "load_token_array",
]
