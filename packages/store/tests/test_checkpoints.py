"""A folder of checkpoints: the newest whole one (a damaged newer one skipped aloud), and the room a save makes by
removing what keep_last would remove anyway, oldest first, never the newest; refused where even that is short."""

import pytest

import megatrain_store.checkpoints as checkpoints
from megatrain_store.checkpoints import MANIFEST, SaveError, check_room, make_room, newest_complete, step_of


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
