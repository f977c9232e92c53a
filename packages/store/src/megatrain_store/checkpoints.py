"""A folder of checkpoints: step-NNNNNNNN directories, each written whole (to a temporary name, fsynced, renamed)
with its manifest last, so that one without its manifest is damaged; the newest whole one; the room a save needs
on the disk, made by removing what `keep_last` would remove anyway."""

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from .errors import StoreError
from .io import check_files
from .progress import size_text

MANIFEST = "manifest.json"
CHECKPOINT_FORMAT = 1  # a manifest's "format": the one this megatrain writes and reads
CHECKPOINTS = "checkpoints"  # a run directory's checkpoints folder


class SaveError(RuntimeError):
    """A checkpoint or model could not be saved (no room on the disk, a write failed); the message says
    which, where, and what was kept."""


# what an exported model's files take beside its weights, at most (config, tokenizer, chat template): counted with them
EXPORT_FILES_BYTES = 2**20


def free_bytes(path: Path) -> int:
    """Bytes free on the disk that holds `path` (or would hold it: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def check_room(directory: Path, needed: int, what: str) -> None:
    """Refuse (`SaveError`) to write `needed` bytes of `what` into `directory` where its disk has less free."""
    free = free_bytes(directory)
    if free < needed:
        raise SaveError(
            f"{what} needs {size_text(needed)} in {directory}, whose disk has {size_text(free)} free; free space there "
            "or write it to another disk"
        )


def step_of(checkpoint: Path) -> int:
    """The step a step-NNNNNNNN directory's name says."""
    return int(checkpoint.name.split("-")[1])


def complete_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("step-*") if (p / MANIFEST).exists())


def newest_complete(root: Path) -> Path | None:
    """The newest checkpoint under `root` that has its manifest, said on stderr (rank 0) where newer ones lack it:
    a save writes the manifest last and renames a whole checkpoint into place, so one without is damaged (its
    manifest deleted), and resuming an older step is no silent choice."""
    complete = complete_checkpoints(root)
    newest = complete[-1] if complete else None
    damaged = [p for p in sorted(root.glob("step-*")) if p.is_dir() and (newest is None or p.name > newest.name)]
    damaged = [p for p in damaged if not (p / MANIFEST).exists()]
    if damaged and os.environ.get("RANK", "0") == "0":
        using = f"using {newest.name}, the newest whole one" if newest else "no whole checkpoint is left"
        print(
            f"megatrain: warning: {', '.join(p.name for p in damaged)} in {root} has no {MANIFEST} (deleted or "
            f"damaged), so it is skipped: {using}; restore its {MANIFEST}, or remove the directory",
            file=sys.stderr,
        )
    return newest


def remove_checkpoint(path: Path) -> None:
    """Delete checkpoint `path`, its manifest first: a reader never takes a half-deleted one for whole (a
    `--resume` beside the run rotating it read the manifest, then missed the files)."""
    (path / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(path)


def checkpoints_to_come(root: Path, keep_last: int, saves: int) -> int:
    """How many more checkpoints the disk under `root` holds at once, over the ones there now, by the end of
    `saves` saves that keep the newest `keep_last`: a save writes its copy beside the newest (`make_room`)."""
    if saves <= 0:
        return 0
    existing = len(complete_checkpoints(root)) if root.exists() else 0
    return max(0, min(max(2, keep_last), existing + saves) - existing)


def make_room(root: Path, needed: int, keep_last: int, name: str) -> list[str]:
    """Room for `needed` bytes in `root` before a checkpoint `name` is written: the old checkpoints this save
    would delete afterwards anyway (all but the newest keep_last - 1) go first, oldest first, as long as room
    is short, so a nearly full disk can still take the next save. The newest stays until the new one is
    whole. Returns the names removed; raises `SaveError` (nothing removed) where even that is not enough."""
    free = free_bytes(root)
    if free >= needed:
        return []
    old = sorted(p for p in root.glob("step-*") if p.is_dir() and p.name != name)
    going = old[: max(0, len(old) - (keep_last - 1))][: max(0, len(old) - 1)]  # (never the newest)
    freed = sum(f.stat().st_size for p in going for f in p.rglob("*") if f.is_file())
    if free + freed < needed:
        also = f" ({size_text(free + freed)} with {', '.join(p.name for p in going)} removed)" if going else ""
        kept = "the newest checkpoint stays until the new one is whole" + (
            f", and train.keep_last: {keep_last} keeps {keep_last - 1} more" if keep_last > 1 else ""
        )
        raise SaveError(
            f"checkpoint {name} needs {size_text(needed)} in {root}, whose disk has {size_text(free)} free{also} "
            f"({kept}); free space there"
        )
    removed = []
    for path in going:
        remove_checkpoint(path)
        removed.append(path.name)
        if free_bytes(root) >= needed:
            break
    return removed


def entries_bytes(entries: list) -> int:
    """Bytes of safetensors files holding `entries` ((name, tensor or Pending) pairs), headers included."""
    return sum(p.numel() * p.element_size() + 160 + len(name) for name, p in entries) + 4096


def clean_interrupted_saves(root: Path) -> None:
    """What saves killed midway left in `root` (the run lock keeps other runs out): a partial checkpoint goes; a
    re-saved step's old copy, moved aside until the new one took its name, goes where that happened, else it is
    put back (the save was killed between its two renames)."""
    for stale in root.glob(".step-*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    for aside in root.glob(".step-*.replaced"):
        original = root / aside.name[1 : -len(".replaced")]
        if original.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            aside.rename(original)


def fallback_checkpoints(fallback_dir: str | Path, out: Path) -> Path:
    """Where the run whose output_dir is `out` saves when that disk refuses: a folder of its own in fallback_dir, so
    that runs sharing one rotate (train.keep_last), clean up and replace only their own checkpoints."""
    out = Path(out).resolve()
    return Path(fallback_dir) / f"{out.name}-{hashlib.sha256(str(out).encode()).hexdigest()[:8]}" / CHECKPOINTS


def manifest_output_dir(checkpoint: Path) -> Path | None:
    """The output_dir of the run that wrote `checkpoint`, as its manifest names it (None: unknown)."""
    try:
        return Path(json.loads((checkpoint / MANIFEST).read_text())["config"]["output_dir"]).resolve()
    except (OSError, ValueError, KeyError, TypeError):
        return None


def verify_checkpoint(directory: Path) -> dict:
    """Read and check the manifest and every file's size and CRC32; raise naming the damaged file."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise StoreError(f"{directory / MANIFEST} is unreadable ({error}); the checkpoint is damaged") from error
    if not isinstance(manifest, dict):
        raise StoreError(
            f"{directory / MANIFEST} holds no manifest (a JSON {type(manifest).__name__}); the checkpoint is damaged"
        )
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise StoreError(
            f"{directory} has checkpoint format {manifest.get('format')}, this megatrain reads {CHECKPOINT_FORMAT}"
        )
    check_files(directory, manifest["files"])
    return manifest
