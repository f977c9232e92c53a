"""Experiment trackers (`train.report_to`): TensorBoard, Weights & Biases and MLflow, each an optional
package. Each gets what metrics.jsonl gets, at the same steps (`train/<field>` for a step's record,
`val/<field>` for a validation's), and the run's config once at the start; the loop knows them only
through `open_trackers`, `Tracker.log` and `Tracker.close`.

Offline: TensorBoard writes to output_dir/tensorboard; W&B with `WANDB_MODE=offline` writes to
output_dir/wandb; MLflow, unless `MLFLOW_TRACKING_URI` names a server, to output_dir/mlflow.db."""

import importlib
import json
import os
from pathlib import Path

from .config import Config, ConfigError

# tracker name -> (the module it imports, the pip package that installs it)
PACKAGES = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


def check_trackers(config: Config) -> None:
    """Refuse, before any data or model is loaded, a tracker whose package is not installed."""
    for name in config.train.trackers:
        module, package = PACKAGES[name]
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ConfigError(f"train.report_to: {name} needs the {package} package: pip install {package}") from error


def scalars(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as tracker scalars: `train/<field>`, or `val/<field>` for validation fields
    (`val_loss` -> `val/loss`); flags as 0/1, non-finite values (null in the record) left out."""
    out = {}
    for key, value in record.items():
        if key == "step" or value is None or isinstance(value, str):
            continue
        name = f"val/{key.removeprefix('val_')}" if key.startswith("val_") else f"train/{key}"
        out[name] = float(value)
    return out


def flat_config(config: Config) -> dict[str, str]:
    """The config as `section.key` -> value text (MLflow's parameters)."""
    flat = {}
    for section, values in config.as_dict().items():
        for key, value in values.items() if isinstance(values, dict) else [("", values)]:
            flat[f"{section}.{key}" if key else section] = json.dumps(value) if not isinstance(value, str) else value
    return flat


class TensorBoard:
    def __init__(self, config: Config, out: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))
        self.writer.add_text("config", f"```\n{json.dumps(config.as_dict(), indent=2)}\n```")

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandB:
    def __init__(self, config: Config, out: Path):
        import wandb

        project = os.environ.get("WANDB_PROJECT", "megatrain")
        self.run = wandb.init(project=project, name=out.name, dir=str(out), config=config.as_dict())

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, config: Config, out: Path):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # (local, offline: a database in the run directory)
            mlflow.set_tracking_uri(f"sqlite:///{(out / 'mlflow.db').absolute()}")
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "megatrain"))
        self.run = mlflow.start_run(run_name=out.name)
        mlflow.log_params(flat_config(config))

    def log(self, record: dict) -> None:
        self.mlflow.log_metrics(scalars(record), step=record["step"])

    def close(self) -> None:
        self.mlflow.end_run()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def open_trackers(config: Config, out: Path) -> list:
    """One open tracker per name in train.report_to (and tensorboard where train.tensorboard is true)."""
    check_trackers(config)
    return [TRACKERS[name](config, out) for name in config.train.trackers]
