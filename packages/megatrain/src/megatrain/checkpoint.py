"""Training checkpoints: everything needed to continue a run exactly.

A checkpoint is a directory `step-NNNNNNNN/` holding the fp32 master weights
(`model.safetensors`, Hugging Face names), the AdamW moments (`optimizer.safetensors`)
and `manifest.json` (step, optimizer step count, config, file sizes and CRC32s). It is
written under a temporary name, every file fsynced, then renamed into place, so a
crash at any instant leaves the previous checkpoints intact and never a partial one
that looks complete. The data position and learning rate are functions of the step, so
the step restores them; resuming gives the same losses as a run that never stopped.
"""

import json
import shutil
import zlib
from pathlib import Path

from megatrain_store import StoreError, atomic_write_text, fsync_dir, write_safetensors
from megatrain_zoo import ModelConfig

from .config import ConfigError
from .hf_io import WholeGroups, load_groups

MANIFEST = "manifest.json"
FORMAT = 1


def file_crc32(path: Path, chunk: int = 64 * 2**20) -> int:
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def checkpoint_entries(trainer) -> dict[str, list]:
    """File name -> (tensor name, Pending) in file order: the masters by Hugging Face name, then each
    optimizer state as `STATE.name`; gathered a group at a time where hosts split the state."""
    whole = trainer.whole_groups()
    optimizer = [entry for state in trainer.store.state_names for entry in whole.entries(f"state.{state}", f"{state}.")]
    return {"model.safetensors": whole.entries("master"), "optimizer.safetensors": optimizer}


def save_checkpoint(trainer, root: Path, keep_last: int = 2) -> Path:
    """Write a checkpoint of `trainer` at its current step under `root`; keep the newest `keep_last`.
    With several ranks only rank 0 writes (its host's store holds every rank's updates; where hosts
    split the state, the other hosts' first ranks send it their parts group by group)."""
    trainer.sync_store()
    root = Path(root)
    if not trainer.is_main:
        if trainer.store_is_split and trainer.ranks.is_local_main:
            for entries in checkpoint_entries(trainer).values():
                WholeGroups.replay(entries)
        return root / f"step-{trainer.step_index:08d}"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{trainer.step_index:08d}"
    for stale in root.glob(".step-*.partial"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".{final.name}.partial"
    tmp.mkdir()
    files = checkpoint_entries(trainer)
    manifest = {
        "format": FORMAT,
        "step": trainer.step_index,
        "optimizer_step": trainer.optimizer.step_count,
        "bad_steps": trainer.bad_steps,
        "n_params": trainer.model_config.n_params,
        "model": trainer.model_config.as_dict(),
        "config": trainer.config.as_dict(),
        "files": {},
    }
    for filename, tensors in files.items():
        write_safetensors(tmp / filename, tensors)
        manifest["files"][filename] = {"bytes": (tmp / filename).stat().st_size, "crc32": file_crc32(tmp / filename)}
    atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=2))
    fsync_dir(tmp)
    if final.exists():  # re-saving the same step: replace it only once the new one is complete
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(root)
    for old in sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep_last]:
        shutil.rmtree(old)
    return final


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or the newest complete one under a run's checkpoints/ folder."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    for root in (path, path / "checkpoints"):
        candidates = sorted(p for p in root.glob("step-*") if (p / MANIFEST).exists())
        if candidates:
            return candidates[-1]
    raise ConfigError(
        f"no checkpoint found at {path}: expected a step-NNNNNNNN directory with {MANIFEST} "
        "or an output_dir whose checkpoints/ folder holds one"
    )


def verify_checkpoint(directory: Path) -> dict:
    """Read and check the manifest and every file's size and CRC32; raise naming the damaged file."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise StoreError(f"{directory / MANIFEST} is unreadable ({error}); the checkpoint is damaged") from error
    if manifest.get("format") != FORMAT:
        raise StoreError(f"{directory} has checkpoint format {manifest.get('format')}, this megatrain reads {FORMAT}")
    for filename, expected in manifest["files"].items():
        path = directory / filename
        if not path.exists():
            raise StoreError(f"checkpoint file {path} is missing")
        if path.stat().st_size != expected["bytes"]:
            raise StoreError(
                f"checkpoint file {path} has {path.stat().st_size} bytes, the manifest says "
                f"{expected['bytes']}: the file is truncated or was replaced"
            )
        if file_crc32(path) != expected["crc32"]:
            raise StoreError(f"checkpoint file {path} fails its CRC32 check: the file is corrupt")
    return manifest


def load_checkpoint(trainer, directory: Path) -> dict:
    """Restore weights, moments (when the trainer holds them) and step from a verified checkpoint into `trainer`."""
    directory = find_checkpoint(directory)
    manifest = verify_checkpoint(directory)
    current = trainer.model_config.as_dict()
    unknown = sorted(set(manifest["model"]) - set(current))
    if unknown:
        raise ConfigError(
            f"checkpoint {directory} was written by a newer megatrain (its model has {unknown}); upgrade to resume it"
        )
    # fields added to ModelConfig since the checkpoint was written take their defaults: what the model had then
    saved = ModelConfig(**manifest["model"]).as_dict()
    if saved != current:
        changed = sorted(k for k, v in saved.items() if current[k] != v)
        raise ConfigError(
            f"checkpoint {directory} is for a different model (differs in {changed}); "
            "resume with the configuration it was written with"
        )
    trainer.finish_updates()
    if trainer.ranks is None or trainer.ranks.is_local_main:  # one copy of the state (or of its part) per host
        load_groups(trainer.store, [directory / "model.safetensors"])
        for state in trainer.store.state_names:  # a trainer made for evaluation holds none
            load_groups(trainer.store, [directory / "optimizer.safetensors"], f"state.{state}", f"{state}.")
    if trainer.sync is not None:
        trainer.sync.barrier()
    trainer.restore_step(manifest["step"])
    if trainer.optimizer is not None:
        trainer.optimizer.step_count = manifest["optimizer_step"]
    trainer.bad_steps = manifest["bad_steps"]
    return manifest
