"""The run directory (output_dir): made and checked writable, and free of another run's files, before anything is
loaded, and held by one run at a time (the room on its disk before a save: `checkpoints`); its newest checkpoint,
wherever its saves went.

The lock is an advisory `flock` on output_dir/.megatrain.lock, which the kernel releases however the
process ends: a run killed with -9 leaves the file (naming it) but not the lock, and the next run takes it
over and says so. A second run into a directory held by a live one refuses at once."""

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from .checkpoints import (
    CHECKPOINTS,
    complete_checkpoints,
    fallback_checkpoints,
    manifest_output_dir,
    newest_complete,
    step_of,
)
from .errors import StoreError
from .io import atomic_write_text

FINAL = "final"  # a run directory's exported model (weights alone)
LOCK = ".megatrain.lock"
# in a run's final/ export: the optimizer step its weights hold (the name and field the Hugging Face Trainer uses)
TRAINER_STATE = "trainer_state.json"


class RunDirError(StoreError):
    """output_dir cannot be a run's: a file, not writable, or held by another run; or another directory a run writes
    cannot be written (the user's setting to change)."""


def prepare_output_dir(out: Path) -> None:
    """Make output_dir, or refuse in one line where it cannot be (a file, a read-only disk, no permission)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise RunDirError(f"output_dir {out} is a file; set output_dir to a directory (new or a run's)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise RunDirError(
            f"output_dir {out} cannot be made ({error.strerror}); set output_dir to a writable directory"
        ) from error


def write_trainer_state(final: Path, step: int, steps: int) -> None:
    """Record in an export the optimizer step its weights hold (of `steps`, the run's train.steps)."""
    atomic_write_text(final / TRAINER_STATE, json.dumps({"global_step": step, "max_steps": steps}, indent=2))


def exported_step(final: Path) -> int | None:
    """The optimizer step a run's final/ export holds (its trainer_state.json), None where it says none."""
    try:
        return int(json.loads((final / TRAINER_STATE).read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def absolute_paths(text: str, separator: str | None = None, always: bool = False) -> str:
    """`text`'s paths (split at `separator`, if any) made absolute where they exist from here, or `always`; the rest
    (a hub name, `auto`) as written: a run's saved settings then name the same files from any directory."""
    parts = [part.strip() for part in text.split(separator)] if separator else [text]
    absolute = [str(Path(part).resolve()) if part and (always or Path(part).exists()) else part for part in parts]
    return (separator or "").join(absolute)


def prepare_fallback_dir(fallback: Path, out: Path | None = None) -> str | None:
    """Make fallback_dir and write a file there now, or refuse in one line: it is needed when output_dir's disk
    refuses a save (full), the worst moment to find it unwritable. Returns a warning where it lies on the disk of
    output_dir (`out`), or inside it: a save refused for want of room there finds none in it either. (A warning, not
    a refusal: the same file system is no proof of the same room, under directory quotas, and a config written for a
    host of two disks still runs on a machine of one.)"""
    fallback = Path(fallback)
    try:
        _write_probe(fallback)
    except OSError as error:
        raise RunDirError(
            f"fallback_dir {fallback} cannot be written ({error.strerror}); set fallback_dir to a writable directory "
            "on another disk, or leave it out"
        ) from error
    if out is None:
        return None
    fallback, out = fallback.resolve(), Path(out).resolve()
    if fallback.is_relative_to(out):
        where = f"is inside output_dir {out}"
    elif _device(fallback) == _device(out):
        where = f"is on the disk of output_dir {out}"
    else:
        return None
    return (
        f"fallback_dir {fallback} {where}: a save refused there for want of room cannot go to it either; set "
        "fallback_dir to a directory on another disk, or leave it out"
    )


def check_state_dir(state_dir: Path) -> None:
    """Make engine.optimizer_state_dir and write a file there now, or refuse in one line saying why it cannot be
    written: no permission, a read-only file system, a file on its path (its free space read 0 GiB of 0 and was
    reported as a want of room). The folders it makes stay, for the run's state files."""
    state_dir = Path(state_dir)
    try:
        _write_probe(state_dir)
    except OSError as error:
        in_the_way = error.errno in (errno.ENOTDIR, errno.EEXIST)
        why = f"{_file_on(state_dir)} is a file" if in_the_way else error.strerror or str(error)
        raise RunDirError(
            f"engine.optimizer_state_dir {state_dir} is not writable ({why}); set engine.optimizer_state_dir to a "
            "writable directory on a fast local disk"
        ) from error


def _write_probe(directory: Path) -> None:
    """Make `directory` and write a file there (removed): an OSError where it cannot be written."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".megatrain-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()


def _file_on(path: Path) -> Path:
    """The file on `path` (itself, or the folder a directory would need), where one is."""
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)


def _device(path: Path) -> int:
    """The device (file system) holding `path`, or its nearest existing folder."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.stat().st_dev


class RunLock:
    """One run at a time in a run directory: `acquire` at start, `release` at the end (or the process's)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.path = self.out / LOCK
        self._handle = None
        self._made_file = False  # (acquire made the lock file: a refused run takes it back)

    def acquire(self) -> str | None:
        """Take the directory, or raise `RunDirError` naming the run that holds it. Returns what to say, or
        None: that this run took over the lock of an earlier one that ended without releasing it (killed),
        or that the file system takes no locks (then nothing keeps a second run out)."""
        made_file = not self.path.exists()  # (this run's to take back only once it holds the lock: see release)
        try:
            handle = open(self.path, "a+")
        except OSError as error:
            raise RunDirError(
                f"output_dir {self.out} is not writable ({error.strerror}); set output_dir to a writable directory"
            ) from error
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle)
            handle.close()
            raise RunDirError(
                f"output_dir {self.out} is in use by another run ({holder}); wait for it to end, stop it, "
                "or set output_dir to another directory"
            ) from None
        except OSError as error:  # (a file system without locks)
            handle.close()
            self._made_file = made_file
            return f"{self.out} cannot be locked ({error.strerror}): make sure no other run writes there"
        self._made_file = made_file
        earlier = _read(handle)
        note = (
            f"took over {self.out} from a run that ended without releasing it ({_holder(handle)})" if earlier else None
        )
        handle.seek(0)
        handle.truncate()
        me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        handle.write(json.dumps(me | {"command": " ".join(sys.argv)}))
        handle.flush()
        self._handle = handle
        return note

    def holder(self) -> str | None:
        """The live run holding the directory, in words, or None where none does (a probe: nothing is taken)."""
        try:
            with open(self.path) as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (let go as the file closes)
                except BlockingIOError:
                    return _holder(handle)
        except OSError:  # (no lock file, unreadable, or a file system without locks: nothing to tell)
            pass
        return None

    def release(self, refused: bool = False, made_dir: bool = False) -> None:
        """Let the directory go (an empty lock file: the run ended as it should); `refused`: a run refused before it
        wrote anything takes back the lock file it made and, with `made_dir` and nothing else in it, the directory."""
        if refused and self._made_file:  # (before the lock goes: no other run takes it over first; a run refused the
            # lock never made the file: the run that holds it may have made it between this one's look and its open)
            self.path.unlink(missing_ok=True)
        if self._handle is not None:
            self._handle.seek(0)
            self._handle.truncate()
            self._handle.flush()
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None
        if refused and made_dir:
            try:
                self.out.rmdir()
            except OSError:  # (not empty: the data's cache, which the next run reuses)
                pass


def _read(handle) -> str:
    handle.seek(0)
    return handle.read().strip()


def _holder(handle) -> str:
    """The run a lock file names, in words."""
    try:
        who = json.loads(_read(handle))
        return f"pid {who['pid']} on {who['host']}, started {who['started']}: {who['command']}"
    except (ValueError, KeyError, TypeError):
        return "a run that did not say which"


def check_output_dir_free(out: Path, resume: Path | None, exported: bool) -> None:
    """Refuse (one line) to start a run in an output_dir that holds another run's checkpoints or final model: its
    metrics, checkpoints and export would be mixed with this run's, and a later --resume would pick whichever
    checkpoint is newest. Resuming a checkpoint of that run itself continues it. `exported`: out/final/ holds a
    model (a Hugging Face or PEFT directory)."""
    out = Path(out)
    check_no_other_files(out)
    checkpoints = complete_checkpoints(out / CHECKPOINTS)
    if not checkpoints and not exported:
        return
    if resume is not None and out.resolve() in (manifest_output_dir(resume), *Path(resume).resolve().parents):
        return  # (a checkpoint of this run: in it, or in its fallback_dir)
    held = [f"checkpoints up to {checkpoints[-1].name}"] if checkpoints else []
    step = exported_step(out / FINAL) if exported else None
    held += [f"its model in {FINAL}/" + ("" if step is None else f": finished at step {step}")] if exported else []
    if newest_checkpoint(out) is not None:
        more = "" if step is None else " --set train.steps=N (N above its last step)"
        then = f"continue it with --resume {out}{more}"
    else:  # (no checkpoint to resume: train.save_every saved none before the run ended)
        then = f"train on from its model with --set model.hf_dir={out / FINAL} and a new output_dir"
    raise RunDirError(
        f"output_dir {out} already holds a run ({', '.join(held)}); {then}, or set output_dir to a new directory "
        f"(or remove {out})"
    )


def check_no_other_files(out: Path) -> None:
    """Refuse an output_dir whose config.json is no megatrain run's (a model directory, another program's folder):
    the run writes its own config.json, metrics.jsonl and tokenizer/ there, over what the directory held."""
    try:
        written = json.loads((out / "config.json").read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        written = None
    if not (isinstance(written, dict) and {"model", "data", "train"} <= written.keys()):
        raise RunDirError(
            f"output_dir {out} holds a model or another program's files (its config.json is no megatrain run's), "
            "which a run would write over; set output_dir to a new directory"
        )


def newest_checkpoint(path: Path) -> Path | None:
    """The newest whole checkpoint `path` names: in a folder of checkpoints, or of a run directory (or its final/):
    in its checkpoints/ folder, or its fallback_dir's, where a save output_dir's disk refused went."""
    run = path.parent if path.name in (CHECKPOINTS, FINAL) else path
    found = [newest_complete(root) for root in dict.fromkeys([path, run / CHECKPOINTS])]
    found = [checkpoint for checkpoint in [*found, _newest_in_fallback(run)] if checkpoint is not None]
    return max(found, key=step_of, default=None)


def _newest_in_fallback(run: Path) -> Path | None:
    """The newest whole checkpoint of the run in `run` in the fallback_dir its config.json names: in the run's own
    folder there, or in the checkpoints/ folder runs shared before they had their own (a checkpoint's manifest names
    its run's output_dir)."""
    try:
        fallback = json.loads((run / "config.json").read_text()).get("fallback_dir")
    except (OSError, ValueError, AttributeError):
        return None
    if not fallback:
        return None
    roots = (fallback_checkpoints(fallback, run), Path(fallback) / CHECKPOINTS)
    ours = [
        checkpoint
        for root in roots
        for checkpoint in complete_checkpoints(root)
        if manifest_output_dir(checkpoint) == run.resolve()
    ]
    return max(ours, key=step_of, default=None)


def supersede_later(out: Path, step: int) -> Path | None:
    """Move what the run directory `out` holds of steps after `step` (a run resumed from a checkpoint that is not its
    newest: another line of training) to out/superseded/after-step-NNNNNNNN/: its later checkpoints and a final/ of a
    later step, so that train.keep_last, `--resume` and `eval` of the run see the line that goes on. Returns where
    they went; None where nothing was later."""
    later = [path for path in (out / CHECKPOINTS).glob("step-*") if path.is_dir() and step_of(path) > step]
    if not later:
        return None
    if (exported_step(out / FINAL) or 0) > step:
        later.append(out / FINAL)
    target = out / "superseded" / f"after-step-{step:08d}"
    for count in range(2, 1000):
        if not target.exists():
            break
        target = target.with_name(f"after-step-{step:08d}-{count}")
    (target / CHECKPOINTS).mkdir(parents=True)
    for path in later:
        os.replace(path, target / path.name if path.name == FINAL else target / CHECKPOINTS / path.name)
    return target


def check_steps_ahead(step: int, steps: int, out: Path) -> bool:
    """Refuse (one line) to resume, from a checkpoint of `step`, a run already at or past `steps`: nothing would
    train, and the export written at the end would replace a newer final/ with the checkpoint's older weights.
    True where the checkpoint holds the run's last step and final/ does not (a run killed while it exported): the
    resumed run trains nothing and finishes the export."""
    exported = exported_step(Path(out) / FINAL) or 0
    if steps == step and exported < step:
        return True
    if steps <= step or steps < exported:
        held = max(step, exported)
        finished = f"the run in {out} is finished ({FINAL}/ holds step {exported}): " if exported >= step else ""
        raise RunDirError(
            f"{finished}train.steps {steps} is not past step {held}, which {out} already holds; "
            f"set train.steps above {held} (--set train.steps=N) to train on"
        )
    return False


def check_not_in_use(path: Path, checkpoint: Path) -> None:
    """Refuse a checkpoint of a run directory another run holds (`RunLock`), whose checkpoints may change under it."""
    named = [path, checkpoint.parent.parent, manifest_output_dir(checkpoint)]
    for out in {Path(p).resolve() for p in named if p is not None}:
        holder = RunLock(out).holder()
        if holder is not None:
            raise RunDirError(
                f"output_dir {out} is in use by another run ({holder}); wait for it to end or stop it, then try again"
            )
