"""Training checkpoints: everything needed to continue a run exactly.

A checkpoint is a directory `step-NNNNNNNN/` holding the fp32 master weights
(`model.safetensors`, Hugging Face names), the AdamW moments (`optimizer.safetensors`)
and `manifest.json` (step, optimizer step count, config, file sizes and CRC32s). It is
written under a temporary name, every file fsynced, then renamed into place, so a
crash at any instant leaves the previous checkpoints intact and never a partial one
that looks complete. The data position and learning rate are functions of the step, so
the step restores them; resuming gives the same losses as a run that never stopped.

`save_checkpoint` writes a `TrainerState` (`Trainer.state_dict`); `resolve_resume` finds and verifies the
checkpoint a run continues from, once, and its `Resume.state()` is what `Trainer.load_state_dict` reads."""

import errno
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from megatrain_store import (
    StoreError,
    WeightsError,
    atomic_write_text,
    file_record,
    fsync_dir,
    write_safetensors,
)
from megatrain_store.checkpoints import (
    CHECKPOINT_FORMAT,
    CHECKPOINTS,
    MANIFEST,
    SaveError,
    clean_interrupted_saves,
    complete_checkpoints,
    entries_bytes,
    make_room,
    remove_checkpoint,
    step_of,
    verify_checkpoint,
)
from megatrain_store.progress import counting, progress
from megatrain_store.rundir import FINAL, RunLock, check_not_in_use, exported_step, newest_checkpoint
from megatrain_zoo import ModelConfig
from megatrain_zoo.hf_weights import WholeGroups, finite_checked, is_hf_directory, weights_fingerprint
from megatrain_zoo.peft import PEFT_CONFIG, is_model_directory

from .config import ConfigError

WEIGHTS_FILE = "model.safetensors"  # a checkpoint's fp32 master weights, by Hugging Face name
OPTIMIZER_FILE = "optimizer.safetensors"  # its optimizer state, each tensor as `STATE.name`


class NonFiniteError(RuntimeError):
    """Training produced non-finite losses or gradients several steps in a row, or a state to save holds them."""


@dataclass(frozen=True)
class TrainerState:
    """What continues a run exactly (`Trainer.state_dict` / `load_state_dict`): its counters, the model and config
    it is of, and its tensors by file: to save, (tensor name, Pending) entries in file order (the masters by Hugging
    Face name, each optimizer state as `STATE.name`, then what a run's step needs beside them, such as GRPO's rollout
    in use), loaded as they are written; read from a checkpoint, the files that hold them."""

    step: int
    optimizer_step: int
    bad_steps: int
    model: dict  # ModelConfig.as_dict()
    config: dict | None = None  # Config.as_dict(): the run's, to resume it with
    tensors: dict[str, list] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)
    source: Path | None = None  # the checkpoint it was read from
    base_fingerprint: str | None = None  # a LoRA checkpoint's base model as trained over (`weights_fingerprint`)
    writes: bool = True  # this process writes it (with several ranks, rank 0)
    sends_part: bool = False  # this process sends its host's part to the writer (where hosts split the state)


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run continues from, found and its manifest read and verified once (`resolve_resume`)."""

    directory: Path
    manifest: dict

    @property
    def step(self) -> int:
        return self.manifest["step"]

    def state(self) -> TrainerState:
        """The state the checkpoint holds, its tensors as the files that hold them."""
        manifest = self.manifest
        files = {name: self.directory / name for name in (WEIGHTS_FILE, OPTIMIZER_FILE)}
        return TrainerState(
            manifest["step"], manifest["optimizer_step"], manifest["bad_steps"], manifest["model"],
            manifest["config"], files=files, source=self.directory,
            base_fingerprint=manifest.get("base_fingerprint"),
        )  # fmt: skip


def resolve_resume(path: Path) -> Resume:
    """The checkpoint `--resume PATH` names (`find_checkpoint`), its files checked against its manifest; refused in
    one line where there is none or it is damaged (naming the checkpoint before it, where there is one)."""
    directory = find_checkpoint(path)
    try:
        return Resume(directory, verify_checkpoint(directory))
    except StoreError as damaged:
        check_not_in_use(Path(path), directory)  # (a live run rotating its checkpoints: that is the problem to name)
        earlier = [p for p in complete_checkpoints(directory.parent) if p.name < directory.name]
        fix = f"name the one before it, {earlier[-1]}" if earlier else "no checkpoint before it is left"
        raise WeightsError(f"{damaged}; {fix}") from None


def save_checkpoint(state: TrainerState, root: Path, keep_last: int = 2) -> Path:
    """Write a checkpoint of `state` (`Trainer.state_dict`) under `root`; keep the newest `keep_last`.
    With several ranks only rank 0 writes (its host's store holds every rank's updates; where hosts
    split the state, the other hosts' first ranks send it their parts group by group).

    Refused before anything is written, with `SaveError`, where the disk has no room for it (after the old
    checkpoints it replaces are removed); a write that fails (the disk filled meanwhile) leaves the previous
    checkpoints as they were and raises `SaveError`; a state holding NaN or Inf is never saved (`NonFiniteError`,
    naming the tensor)."""
    root = Path(root)
    final = root / f"step-{state.step:08d}"
    if not state.writes:
        if state.sends_part:
            for entries in state.tensors.values():
                WholeGroups.replay(entries)
        return final
    root.mkdir(parents=True, exist_ok=True)
    clean_interrupted_saves(root)
    make_room(root, sum(entries_bytes(entries) for entries in state.tensors.values()), keep_last, final.name)
    tmp = root / f".{final.name}.partial"
    try:
        _write_checkpoint(state, tmp, final.name)
    except OSError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        full = " (the disk is full)" if error.errno == errno.ENOSPC else ""
        raise SaveError(f"checkpoint {final} could not be written{full}: {error}") from error
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replaced = root / f".{final.name}.replaced"
    if final.exists():  # re-saving the same step: the old one is moved aside only once the new one is complete
        final.rename(replaced)
    tmp.rename(final)
    fsync_dir(root)
    shutil.rmtree(replaced, ignore_errors=True)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
        remove_checkpoint(old)
    return final


def _write_checkpoint(state: TrainerState, tmp: Path, name: str) -> None:
    """The files and manifest of checkpoint `name` in `tmp`, fsynced; refused (`NonFiniteError`) if any tensor holds
    NaN or Inf."""
    tmp.mkdir()
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "step": state.step,
        "optimizer_step": state.optimizer_step,
        "bad_steps": state.bad_steps,
        "n_params": ModelConfig(**state.model).n_params,
        "model": state.model,
        "config": state.config,
        "files": {},
    }
    model = (state.config or {}).get("model") or {}  # (a LoRA run knows its base: `check_same_weights`)
    if (model.get("adapter") or {}).get("type") and model.get("hf_dir"):
        manifest["base_fingerprint"] = weights_fingerprint(Path(model["hf_dir"]))
    offenders: list[str] = []
    bar = progress(total=sum(map(len, state.tensors.values())), desc=f"save {name}", unit="tensor", leave=False)
    for filename, tensors in state.tensors.items():
        write_safetensors(tmp / filename, counting(finite_checked(tensors, offenders), bar))
        manifest["files"][filename] = file_record(tmp / filename)
    bar.close()
    if offenders:
        raise NonFiniteError(
            f"the state at step {state.step} holds NaN or Inf ({len(offenders)} tensors: {offenders[0]}, ...); "
            "no checkpoint was written, the earlier ones are as they were"
        )
    atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2))
    fsync_dir(tmp)


def find_checkpoint(path: Path) -> Path:
    """The checkpoint to resume from: a step-NNNNNNNN directory itself, or the newest complete one of a
    run directory, its checkpoints/ folder, or the run of its final/ export (whose weights alone, without
    the optimizer state, cannot resume a run exactly)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    newest = newest_checkpoint(path)
    if newest is not None:
        return newest
    if not path.exists():
        raise ConfigError(f"no checkpoint at {path}: it does not exist; name a run's output_dir or a checkpoint in it")
    model = path / FINAL if (path / FINAL).exists() else path  # (a run that ended without a checkpoint: its model)
    if is_hf_directory(model):
        raise ConfigError(
            f"{model} holds a model's weights alone, without optimizer state or step, and its run has no checkpoint: "
            f"it cannot resume a run; start a new one from it with model.hf_dir: {model} and a new output_dir"
        )
    holder = RunLock(path).holder()
    if holder is not None:
        raise ConfigError(
            f"the run in {path} is still running ({holder}) and has written no checkpoint yet: stop it (SIGINT or "
            "SIGTERM writes one) and --resume it then, or wait for its first save (train.save_every)"
        )
    raise ConfigError(
        f"no checkpoint found at {path}: expected a step-NNNNNNNN directory with {MANIFEST} or an output_dir whose "
        "checkpoints/ folder holds one (a run stopped before its first checkpoint starts again with its own command)"
    )


def find_weights(path: Path) -> Path:
    """The weights to evaluate or convert at `path`: a checkpoint or a Hugging Face model directory itself
    (a run's final/ among them); in a run directory (or its checkpoints/ folder) the newest of its checkpoints
    and its final/ export."""
    path = Path(path)
    if (path / MANIFEST).exists() or is_model_directory(path):
        return path
    run = path.parent if path.name == CHECKPOINTS else path
    newest = newest_checkpoint(path)
    final = run / FINAL
    if is_model_directory(final) and (newest is None or _final_is_newer(final, newest)):
        return final
    if newest is not None:
        return newest
    what = "it does not exist" if not path.exists() else "it holds neither a checkpoint nor a final/ model"
    raise ConfigError(
        f"no weights at {path}: {what}; name a run's output_dir, a step-NNNNNNNN checkpoint "
        "or a Hugging Face model directory"
    )


def _final_is_newer(final: Path, checkpoint: Path) -> bool:
    """Whether a run's final/ export holds at least as many steps as `checkpoint` (by its trainer_state.json;
    by the files' times for an export written before it had one)."""
    step = exported_step(final)
    if step is not None:
        return step >= step_of(checkpoint)
    described = final / ("config.json" if (final / "config.json").exists() else PEFT_CONFIG)
    return described.stat().st_mtime >= (checkpoint / MANIFEST).stat().st_mtime


def run_config(weights: Path, manifest: dict | None = None) -> dict | None:
    """The training config (as `Config.as_dict`) of the run `weights` come from, its output_dir set to where
    the run directory is now: a checkpoint's manifest (`manifest`, where it has been read), or a run's config.json
    beside final/; None: unknown."""
    weights = Path(weights)
    if manifest is not None or (weights / MANIFEST).exists():
        values = dict((manifest or json.loads((weights / MANIFEST).read_text()))["config"])
        run = weights.parent.parent if weights.parent.name == CHECKPOINTS else None
        fallback = values.get("fallback_dir")
        if run is not None and fallback and Path(fallback).resolve() in (run.resolve(), run.resolve().parent):
            run = None  # (a checkpoint a save put in the run's fallback_dir: the run is where its output_dir says)
    else:
        run = weights.parent if weights.name == FINAL else None
        try:
            values = json.loads((run / "config.json").read_text()) if run is not None else None
        except (OSError, json.JSONDecodeError):
            values = None
        if not isinstance(values, dict) or "train" not in values:
            return None
    if run is not None:
        values["output_dir"] = str(run.resolve())  # (as a run writes it: a relative --resume is no change)
    return values


def check_same_model(directory: Path, saved: dict, current: ModelConfig) -> None:
    """Refuse a checkpoint whose model (its manifest's `saved`) is not `current`, naming what differs."""
    current = current.as_dict()
    unknown = sorted(set(saved) - set(current))
    if unknown:
        raise ConfigError(
            f"checkpoint {directory} was written by a newer megatrain (its model has {unknown}); upgrade to resume it"
        )
    # fields added to ModelConfig since the checkpoint was written take their defaults: what the model had then
    saved = ModelConfig(**saved).as_dict()
    if saved != current:
        changed = sorted(k for k, v in saved.items() if current[k] != v)
        raise ConfigError(
            f"checkpoint {directory} is for a different model (differs in {changed}); "
            "resume with the configuration it was written with"
        )
