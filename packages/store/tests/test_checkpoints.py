"""A folder of checkpoints: the newest whole one (a damaged newer one skipped aloud), and the room a save makes by
removing what keep_last would remove anyway, oldest first, never the newest; refused where even that is short."""

import json
import re

import pytest

import megatrain_store.checkpoints as checkpoints
from megatrain_store import StoreError, file_record
from megatrain_store.checkpoints import (
    CHECKPOINT_FORMAT,
    MANIFEST,
    SaveError,
    check_room,
    checkpoints_to_come,
    make_room,
    newest_complete,
    step_of,
    verify_checkpoint,
)


def folder_of(root, steps, damaged=()):
    for step in steps:
        directory = root / f"step-{step:08d}"
        directory.mkdir(parents=True)
        (directory / "model.safetensors").write_bytes(b"x" * 1000)
        if step not in damaged:
            (directory / MANIFEST).write_text("{}")
    return root


def test_the_newest_whole_checkpoint_and_a_damaged_one_said(tmp_path, capsys):
    root = folder_of(tmp_path / "checkpoints", [2, 4, 6], damaged=[6])
    assert step_of(newest_complete(root)) == 4
    assert "step-00000006" in capsys.readouterr().err
    assert newest_complete(tmp_path / "none") is None


def test_room_is_made_oldest_first_and_never_from_the_newest(tmp_path, monkeypatch):
    root = folder_of(tmp_path / "checkpoints", [2, 4, 6])
    free = {"bytes": 500}
    monkeypatch.setattr(checkpoints, "free_bytes", lambda path: free["bytes"] + 1000 * (3 - len(list(root.iterdir()))))
    assert make_room(root, 1400, keep_last=1, name="step-00000008") == ["step-00000002"]
    with pytest.raises(SaveError, match="needs .*the newest checkpoint stays until the new one is whole"):
        make_room(root, 10_000, keep_last=1, name="step-00000008")
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]  # (a refusal removes none)
    with pytest.raises(SaveError, match="whose disk has"):
        check_room(root, 10**18, "the model")


@pytest.mark.parametrize(
    "existing, keep_last, saves, more",
    [
        ([], 2, 0, 0),  # no save to come
        ([], 1, 5, 2),  # the newest stays until the next is whole: two at once even keeping one
        ([], 2, 1, 1),  # one save: one copy
        ([], 4, 10, 4),  # keep_last of them
        ([2, 4], 4, 1, 1),  # those there stay: one more
        ([2, 4, 6], 3, 2, 0),  # a full rotation: each save takes the room of one it removes
        ([2], 1, 3, 1),
    ],
)
def test_the_checkpoints_a_run_adds_to_its_disk_at_once(tmp_path, existing, keep_last, saves, more):
    """What the start-of-run room check counts: keep_last copies, or two (a save beside the newest), as many as
    the saves to come make, less the ones already there (rotated)."""
    root = folder_of(tmp_path / "checkpoints", existing)
    assert checkpoints_to_come(root, keep_last, saves) == more


def test_a_run_refused_the_lock_leaves_the_lock_file_of_the_run_that_holds_it(tmp_path, monkeypatch):
    """Two runs starting at once: the one refused took back the lock file it saw missing, which the other had made
    and locked between that look and its open; a third run then took the directory beside the first."""
    import builtins

    import megatrain_store.rundir as rundir
    from megatrain_store.rundir import RunDirError, RunLock

    holder, refused = RunLock(tmp_path), RunLock(tmp_path)

    def open_after_the_other_run_took_it(path, mode="r", *args, **kwargs):
        monkeypatch.setattr(rundir, "open", builtins.open, raising=False)
        holder.acquire()
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(rundir, "open", open_after_the_other_run_took_it, raising=False)
    with pytest.raises(RunDirError, match="in use by another run"):
        refused.acquire()
    refused.release(refused=True)
    assert holder.path.exists()
    with pytest.raises(RunDirError, match="in use by another run"):
        RunLock(tmp_path).acquire()
    holder.release()


@pytest.mark.parametrize(
    "damage, said",
    [
        (lambda d: (d / MANIFEST).unlink(), "is unreadable"),
        (lambda d: (d / MANIFEST).write_text("[1, 2]"), "holds no manifest (a JSON list)"),
        (lambda d: (d / MANIFEST).write_text(json.dumps({"format": 99, "files": {}})), "checkpoint format 99"),
        (lambda d: (d / "model.safetensors").write_bytes(b"y" * 1000), "model.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"x" * 999), "model.safetensors"),
    ],
)
def test_a_checkpoint_is_verified_against_its_manifest(tmp_path, damage, said):
    """`verify_checkpoint` returns a whole checkpoint's manifest and refuses each damage naming it: the manifest
    missing or not an object, another format, a file whose bytes or size differ from the ones recorded."""
    directory = tmp_path / "step-00000003"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"x" * 1000)
    manifest = {
        "format": CHECKPOINT_FORMAT,
        "step": 3,
        "files": {"model.safetensors": file_record(directory / "model.safetensors")},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest))
    assert verify_checkpoint(directory) == manifest
    damage(directory)
    with pytest.raises(StoreError, match=re.escape(said)):
        verify_checkpoint(directory)


def test_a_fallback_dir_on_output_dirs_disk_is_said(tmp_path, monkeypatch):
    """fallback_dir inside output_dir, or elsewhere on its disk, is made and written, and said: a save that disk
    refused for want of room cannot go there either (it was taken without a word); on another disk, nothing."""
    import megatrain_store.rundir as rundir
    from megatrain_store.rundir import prepare_fallback_dir

    out = tmp_path / "run"
    out.mkdir()
    said = prepare_fallback_dir(out / "fb", out)
    assert said.startswith(f"fallback_dir {out / 'fb'} is inside output_dir {out}: ") and (out / "fb").is_dir()
    said = prepare_fallback_dir(tmp_path / "new" / "fb", out)
    assert f"is on the disk of output_dir {out}: " in said and said.endswith("on another disk, or leave it out")
    assert prepare_fallback_dir(tmp_path / "fb") is None  # (no output_dir to compare)
    monkeypatch.setattr(rundir, "_device", lambda path: hash(path.parts[-1]))  # (as if each were its own disk)
    assert prepare_fallback_dir(tmp_path / "other", out) is None


def test_an_optimizer_state_dir_that_cannot_be_written_says_why(tmp_path, monkeypatch):
    """engine.optimizer_state_dir under a file, on a read-only disk or without permission: one line saying it is not
    writable and why (it read as a disk with 0.0 GiB free); a writable one is made."""
    import errno
    import os
    from pathlib import Path

    from megatrain_store.rundir import RunDirError, check_state_dir

    (tmp_path / "afile").write_text("")
    with pytest.raises(
        RunDirError, match=re.escape(f"state is not writable ({tmp_path / 'afile'} is a file); set engine.")
    ):
        check_state_dir(tmp_path / "afile" / "state")
    for number in (errno.EROFS, errno.EACCES, errno.EPERM):

        def refused(path, *args, number=number, **kwargs):
            raise OSError(number, os.strerror(number), str(path))

        with monkeypatch.context() as patch:
            patch.setattr(Path, "mkdir", refused)
            with pytest.raises(RunDirError, match=rf"state is not writable \({os.strerror(number)}\); set engine"):
                check_state_dir(tmp_path / "state")
    check_state_dir(tmp_path / "made" / "state")
    assert (tmp_path / "made" / "state").is_dir() and not list((tmp_path / "made" / "state").iterdir())
