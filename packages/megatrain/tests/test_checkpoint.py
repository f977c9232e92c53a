"""Checkpoints: atomic, verified, and a resumed run continues exactly like an uninterrupted one."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import megatrain.checkpoint as checkpoint_module
import megatrain_store.checkpoints
from megatrain import Trainer
from megatrain.checkpoint import find_checkpoint, resolve_resume, run_config, save_checkpoint
from megatrain.cli import main
from megatrain.config import ConfigError, load_config
from megatrain_optim import EmbeddingRowsFirst
from megatrain_store import StoreError, WeightsError
from megatrain_store.checkpoints import SaveError, clean_interrupted_saves, fallback_checkpoints


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.parametrize(
    "grad_clip,batch_size,gpu_updated_layers",
    [
        (0.5, 4, 0),
        (0.0, 4, 0),
        (0.5, 1, 0),  # 32 tokens: steps update their embedding rows first
        (0.0, 1, 0),
        (0.5, 4, 1),  # the embedding's and first layer's state live on the device: saved from there, loaded there
        (0.0, 1, 1),
    ],
)
def test_resumed_run_is_bit_identical(write_config, tmp_path, grad_clip, batch_size, gpu_updated_layers, monkeypatch):
    rows_given = []
    first_rows = EmbeddingRowsFirst.rows
    monkeypatch.setattr(EmbeddingRowsFirst, "rows", lambda *a: rows_given.append(first_rows(*a)) or rows_given[-1])
    settings = {"steps": 6, "save_every": 2, "keep_last": 3, "grad_clip": grad_clip, "batch_size": batch_size}
    settings["micro_batch_size"] = min(2, batch_size)
    engine = {"engine": {"gpu_updated_layers": gpu_updated_layers}}
    full = write_config(train=settings, data={"shuffle": True}, output_dir=str(tmp_path / "full"), **engine)
    assert main(["train", "--config", str(full)]) == 0
    assert sorted(p.name for p in (tmp_path / "full/checkpoints").iterdir()) == [
        "step-00000002",
        "step-00000004",
        "step-00000006",
    ]

    resumed = write_config(train=settings, data={"shuffle": True}, output_dir=str(tmp_path / "resumed"), **engine)
    assert main(["train", "--config", str(resumed), "--resume", str(tmp_path / "full/checkpoints/step-00000004")]) == 0
    expected, got = losses(tmp_path / "full"), losses(tmp_path / "resumed")
    assert sorted(got) == [5, 6] and all(got[s] == expected[s] for s in got)  # exactly, not approximately
    a = load_file(str(tmp_path / "full/final/model.safetensors"))
    b = load_file(str(tmp_path / "resumed/final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    # (with a GPU-updated layer the untied table is updated on the device too: no rows to send)
    assert any(t is not None for t in rows_given) == (batch_size == 1 and not gpu_updated_layers)


def test_sigterm_checkpoints_and_resume_continues_exactly(write_config, tmp_path):
    settings = {"steps": 40, "grad_clip": 1.0}
    reference = write_config(train=settings, output_dir=str(tmp_path / "reference"))
    assert main(["train", "--config", str(reference)]) == 0

    interrupted = write_config(train=settings, output_dir=str(tmp_path / "run"))
    process = subprocess.Popen(
        [sys.executable, "-m", "megatrain.cli", "train", "--config", str(interrupted)],
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err  # 128 + SIGTERM, the shell's convention: not a finished run
    assert "SIGTERM received" in err
    stopped_at = find_checkpoint(tmp_path / "run")
    step = int(stopped_at.name.split("-")[1])
    assert 3 <= step < 40

    assert main(["train", "--config", str(interrupted), "--resume", str(tmp_path / "run")]) == 0
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")


def test_a_failed_run_drops_its_queued_updates_and_a_finished_one_applies_them(write_config, tmp_path, monkeypatch):
    """Waiting for a failed run's updates could wait on a rank that died or hung, for engine.rank_wait_s once more
    after the wait that failed (and then report that); a finished run's are applied before it closes."""
    closes, waits_after_failure, failed = [], [], []
    close, finish, step = Trainer.close, Trainer.finish_updates, Trainer.train_step

    def failing_step(self, *args, **kwargs):
        if self.step_index == 1 and "failing" in str(self.config.output_dir):
            failed.append(True)
            raise OSError(errno.EIO, "Input/output error", "the disk that went away")
        return step(self, *args, **kwargs)

    def recorded_finish(self):
        waits_after_failure.extend(failed)
        finish(self)

    monkeypatch.setattr(Trainer, "train_step", failing_step)
    monkeypatch.setattr(Trainer, "finish_updates", recorded_finish)
    monkeypatch.setattr(Trainer, "close", lambda self, abandon=False: (closes.append(abandon), close(self, abandon)))
    assert main(["train", "--config", str(write_config(output_dir=str(tmp_path / "finished")))]) == 0
    assert main(["train", "--config", str(write_config(output_dir=str(tmp_path / "failing")))]) == 1
    assert closes == [False, True] and failed and not waits_after_failure


def make_trainer(write_config, tmp_path, **train):
    return Trainer(load_config(write_config(train=train, output_dir=str(tmp_path / "t"))))


def test_crash_during_save_leaves_previous_checkpoint(write_config, tmp_path, monkeypatch):
    trainer = make_trainer(write_config, tmp_path)
    first = save_checkpoint(trainer.state_dict(), tmp_path / "ck")
    trainer.step_index = 7
    real_write = checkpoint_module.write_safetensors

    def dies_on_optimizer(path, tensors):
        if "optimizer" in path.name:
            raise OSError("disk full (simulated crash mid-save)")
        return real_write(path, tensors)

    monkeypatch.setattr(checkpoint_module, "write_safetensors", dies_on_optimizer)
    with pytest.raises(SaveError, match="step-00000007 could not be written: disk full"):
        save_checkpoint(trainer.state_dict(), tmp_path / "ck")
    assert find_checkpoint(tmp_path / "ck") == first  # the half-written one is invisible
    assert not (tmp_path / "ck" / "step-00000007").exists()
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [first.name]  # and gone
    trainer.load_state_dict(resolve_resume(tmp_path / "ck").state())
    assert trainer.step_index == 0


def test_damaged_checkpoints_are_refused(write_config, tmp_path):
    trainer = make_trainer(write_config, tmp_path)
    path = save_checkpoint(trainer.state_dict(), tmp_path / "ck")
    model_file = path / "model.safetensors"
    original = model_file.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(
        StoreError, match="fails its CRC32 check: the file is corrupt; no checkpoint before it is left$"
    ):
        trainer.load_state_dict(resolve_resume(path).state())
    trainer.step_index = 3
    later = save_checkpoint(trainer.state_dict(), tmp_path / "ck")
    (later / "model.safetensors").write_bytes(bytes(data))  # (the newest damaged: the one before it is named)
    with pytest.raises(WeightsError, match=f"name the one before it, {path}$"):
        resolve_resume(tmp_path / "ck")
    shutil.rmtree(later)
    model_file.write_bytes(bytes(data[:-100]))
    with pytest.raises(StoreError, match="model.safetensors has .* bytes.*truncated"):
        trainer.load_state_dict(resolve_resume(path).state())
    model_file.write_bytes(original)
    trainer.load_state_dict(resolve_resume(path).state())  # intact again: loads
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(StoreError, match="optimizer.safetensors is missing"):
        trainer.load_state_dict(resolve_resume(path).state())
    # a live run holds the directory (rotating its checkpoints as the resume reads them): that run is named
    from megatrain_store.rundir import RunLock

    live = RunLock(tmp_path / "ck")
    live.acquire()
    with pytest.raises(StoreError, match=f"output_dir {tmp_path / 'ck'} is in use by another run \\(pid {os.getpid()}"):
        resolve_resume(tmp_path / "ck")
    live.release()
    assert RunLock(tmp_path / "ck").holder() is None
    starting = (
        tmp_path / "starting"
    )  # a live run of no checkpoint yet: named, not sent to start again (it holds the lock)
    starting.mkdir()
    live = RunLock(starting)
    live.acquire()
    with pytest.raises(
        ConfigError, match=f"the run in {starting} is still running \\(pid {os.getpid()}.* no checkpoint yet"
    ):
        resolve_resume(starting)
    live.release()


def test_checkpoint_of_another_model_is_refused(write_config, tmp_path):
    path = save_checkpoint(make_trainer(write_config, tmp_path).state_dict(), tmp_path / "ck")
    other = Trainer(load_config(write_config(model={"preset": "tiny-qwen3"}, output_dir=str(tmp_path / "o"))))
    with pytest.raises(ConfigError, match="different model"):
        other.load_state_dict(resolve_resume(path).state())
    with pytest.raises(ConfigError, match="no checkpoint at .*nowhere: it does not exist"):
        find_checkpoint(tmp_path / "nowhere")


def test_checkpoint_of_an_older_megatrain_resumes_and_of_a_newer_one_is_refused(write_config, tmp_path):
    """A model field added since a checkpoint was written takes its default (what every model had then);
    a field this version does not know names the fix."""
    trainer = make_trainer(write_config, tmp_path)
    path = save_checkpoint(trainer.state_dict(), tmp_path / "ck")
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for added in ("rope_interleave", "router_scoring", "partial_rotary_factor"):  # fields added in session 15
        del manifest["model"][added]
    manifest_path.write_text(json.dumps(manifest))
    trainer.load_state_dict(resolve_resume(path).state())
    assert trainer.step_index == manifest["step"]
    manifest["model"]["a_field_from_the_future"] = 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"newer megatrain .*a_field_from_the_future"):
        trainer.load_state_dict(resolve_resume(path).state())
    trainer.close()


def test_keep_last(write_config, tmp_path):
    trainer = make_trainer(write_config, tmp_path)
    for step in range(1, 5):
        trainer.step_index = step
        save_checkpoint(trainer.state_dict(), tmp_path / "ck", keep_last=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000003", "step-00000004"]
    assert os.path.exists(tmp_path / "ck" / "step-00000004" / "manifest.json")


def test_resume_continues_in_the_runs_own_directory_with_its_config(write_config, tmp_path, monkeypatch, capsys):
    """`megatrain train --set train.steps=8 --resume RUN` (no --config): the run's own config and directory, the
    override said at start; metrics.jsonl then holds every step. A missing --resume path, and a train.steps the run
    is already at or past, are refused before any data is read, the run's final/ and metrics untouched."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--config", str(write_config(train={"steps": 4, "save_every": 2}))]) == 0
    capsys.readouterr()
    assert main(["train", "--set", "train.steps=8", "--resume", "run"]) == 0  # (relative: the same output_dir)
    err = capsys.readouterr().err
    assert f"resuming in {run} with the config of run/checkpoints/step-00000004; changed: train.steps 4 -> 8\n" in err
    assert sorted(losses(run)) == list(range(1, 9)) and not (tmp_path / "runs").exists()
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 8
    assert json.loads((run / "final" / "trainer_state.json").read_text())["global_step"] == 8

    (run / "checkpoints" / "step-00000008").rename(run / "checkpoints" / "gone")  # final/ (8) beyond step 6
    assert main(["train", "--set", "train.steps=9", "--resume", str(run)]) == 0
    assert "final/ holds step 8, newer than any checkpoint: steps 7-8 are trained again" in capsys.readouterr().err

    import megatrain.loop

    monkeypatch.setattr(megatrain.loop, "load_data", lambda *a, **k: pytest.fail("data was loaded"))
    assert main(["train", "--resume", str(tmp_path / "no-such-run")]) == 2
    assert "no checkpoint at" in capsys.readouterr().err
    held = {name: (run / name).read_bytes() for name in ("final/trainer_state.json", "metrics.jsonl")}
    for steps in (2, 8):  # not past final/'s step 9: nothing would train, and final/ would go back to step 8
        assert main(["train", "--set", f"train.steps={steps}", "--resume", str(run)]) == 2
        assert f"train.steps {steps} is not past step 9, which {run} already holds" in capsys.readouterr().err
    assert held == {name: (run / name).read_bytes() for name in held}


def test_a_finished_run_is_named_finished_by_both_ways_of_starting_it_again(write_config, tmp_path, capsys):
    """A run that ended (its final/ at its last step): its own command and --resume both say it is finished and how
    to train on (each named the other: "continue it with --resume" and "set train.steps above 2")."""
    config, run = write_config(train={"steps": 2, "save_every": 2}), tmp_path / "run"
    assert main(["train", "--config", str(config)]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 2
    assert (
        f"the run in {run} is finished (final/ holds step 2): train.steps 2 is not past step 2"
        in capsys.readouterr().err
    )
    assert main(["train", "--config", str(config)]) == 2
    assert (
        "its model in final/: finished at step 2); continue it with --resume "
        f"{run} --set train.steps=N (N above its last step)"
    ) in capsys.readouterr().err


def test_every_form_of_a_run_names_its_weights(write_config, tmp_path, capsys):
    """A run directory, its checkpoints/, a step-N and final/ work wherever weights or a checkpoint are asked
    for: eval and convert take the newest (final/ once written), --resume the newest checkpoint."""
    from megatrain.checkpoint import find_weights

    run = tmp_path / "run"
    assert main(["train", "--config", str(write_config(train={"steps": 4, "save_every": 2}))]) == 0
    step4, final = run / "checkpoints" / "step-00000004", run / "final"
    assert find_weights(run) == find_weights(run / "checkpoints") == final  # (final/ holds step 4 too)
    assert find_checkpoint(run) == find_checkpoint(run / "checkpoints") == find_checkpoint(final) == step4
    capsys.readouterr()
    for form in (run, run / "checkpoints", step4, final):
        assert main(["eval", "--checkpoint", str(form), "--batches", "1"]) == 0  # the run's own config and data
        result = json.loads(capsys.readouterr().out)
        assert result["val_tokens"] == 4 * 31 and result["source"].endswith("tokens.npy")
        assert main(["convert", str(form), str(tmp_path / "out" / form.name)]) == 0
        assert capsys.readouterr().out.startswith("wrote ")
        assert (tmp_path / "out" / form.name / "model.safetensors").exists()
    converted = load_file(str(tmp_path / "out" / "run" / "model.safetensors"))
    exported = load_file(str(final / "model.safetensors"))
    assert all(torch.equal(converted[k], v) for k, v in exported.items())
    (final / "trainer_state.json").write_text(json.dumps({"global_step": 2}))  # final/ older than step 4
    assert find_weights(run) == step4


def test_final_alone_cannot_resume(write_config, tmp_path, capsys):
    """A run that ended without a checkpoint (train.save_every 0), named by its final/ or its output_dir: one line
    naming its model to start a new run from, in a new output_dir (its own is taken)."""
    assert main(["train", "--config", str(write_config(train={"steps": 1}))]) == 0
    capsys.readouterr()
    for named in (tmp_path / "run" / "final", tmp_path / "run"):
        assert main(["train", "--resume", str(named)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        fix = f"start a new one from it with model.hf_dir: {tmp_path / 'run' / 'final'} and a new output_dir"
        assert len(err) == 1 and f"cannot resume a run; {fix}" in err[0], err


@pytest.mark.parametrize("save_every", [0, 2])
def test_sigint_checkpoints_then_exits_130(write_config, tmp_path, capsys, monkeypatch, save_every):
    """Ctrl-C during training: the step ends, its checkpoint is written, the exit code is 130, not 0. In a step that
    ends on train.save_every the checkpoint is written once (twice, the second replaced the first: a kill then lost
    both)."""
    import megatrain.loop

    real_step, real_save = Trainer.train_step, megatrain.loop.save_checkpoint
    saved = []

    def counted_save(*args, **kwargs):
        saved.append(real_save(*args, **kwargs))
        return saved[-1]

    monkeypatch.setattr(megatrain.loop, "save_checkpoint", counted_save)

    def interrupted_at_step_2(self, *args, **kwargs):
        metrics = real_step(self, *args, **kwargs)
        if self.step_index == 2:
            os.kill(os.getpid(), signal.SIGINT)  # (the run's handler turns it into a flag)
        return metrics

    monkeypatch.setattr(Trainer, "train_step", interrupted_at_step_2)
    assert main(["train", "--config", str(write_config(train={"steps": 5, "save_every": save_every}))]) == 130
    assert "SIGINT received; checkpoint" in capsys.readouterr().err
    assert find_checkpoint(tmp_path / "run").name == "step-00000002"
    assert [path.name for path in saved] == ["step-00000002"]
    assert not (tmp_path / "run" / "final").exists()


def test_a_resave_killed_between_its_renames_keeps_the_old_copy(tmp_path):
    """A step's checkpoint saved again is moved aside before the new one takes its name: what a save killed between
    the two renames leaves, the next save puts back; a partial one, or an old copy already replaced, goes."""
    root = tmp_path / "checkpoints"
    for name in (".step-00000003.replaced", ".step-00000004.replaced", "step-00000004", ".step-00000005.partial"):
        (root / name).mkdir(parents=True)
        (root / name / "manifest.json").write_text(name)
    clean_interrupted_saves(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003", "step-00000004"]
    assert (root / "step-00000003" / "manifest.json").read_text() == ".step-00000003.replaced"
    assert (root / "step-00000004" / "manifest.json").read_text() == "step-00000004"


def test_a_second_run_into_the_same_directory_is_refused_and_a_stale_lock_taken_over(write_config, tmp_path, capsys):
    from megatrain_store.rundir import LOCK, RunLock

    config = write_config(train={"steps": 1})
    (tmp_path / "run").mkdir()
    holder = RunLock(tmp_path / "run")
    assert holder.acquire() is None  # (another live run: its lock is held)
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"output_dir {tmp_path / 'run'} is in use by another run (pid {os.getpid()}" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    holder.release()

    # a run killed with -9 leaves its lock file naming it, but no lock: the next run takes over and says so
    (tmp_path / "run" / LOCK).write_text(json.dumps({"pid": 4242, "host": "h", "started": "then", "command": "x"}))
    assert main(["train", "--config", str(config)]) == 0
    assert "took over" in (err := capsys.readouterr().err) and "(pid 4242 on h, started then: x)" in err
    assert (tmp_path / "run" / LOCK).read_text() == ""  # released when the run ended


def small_disk(monkeypatch, root, capacity: int) -> None:
    """`root`'s disk holds `capacity` bytes: the room checked before a save, and a write past it fails with
    ENOSPC (after the file is written: it is removed), as on a real disk."""

    def used() -> int:
        return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())

    real_write = checkpoint_module.write_safetensors

    def write(path, tensors):
        size = real_write(path, tensors)
        if used() > capacity:
            path.unlink()
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return size

    monkeypatch.setattr(checkpoint_module, "write_safetensors", write)
    monkeypatch.setattr(megatrain_store.checkpoints, "free_bytes", lambda path: capacity - used())


def test_a_nearly_full_disk_saves_after_removing_what_the_save_lets_go(write_config, tmp_path, monkeypatch):
    """keep_last: 2 on a disk with room for 2.5 checkpoints: the oldest goes before the third is written (it went
    after, so no save could ever succeed again). keep_last: 1 with room for 1.5: refused before writing,
    saying how much is needed, the newest kept."""
    trainer = make_trainer(write_config, tmp_path)
    first = save_checkpoint(trainer.state_dict(), tmp_path / "probe")
    size = sum(f.stat().st_size for f in first.iterdir())
    root = tmp_path / "ck"
    small_disk(monkeypatch, root, int(2.5 * size))
    for step in (1, 2, 3):
        trainer.step_index = step
        save_checkpoint(trainer.state_dict(), root, keep_last=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"]

    root = tmp_path / "ck1"
    small_disk(monkeypatch, root, int(1.5 * size))
    save_checkpoint(trainer.state_dict(), root, keep_last=1)
    trainer.step_index = 4
    with pytest.raises(SaveError, match=r"step-00000004 needs .* MiB in .*, whose disk has .* MiB free \(the newest"):
        save_checkpoint(trainer.state_dict(), root, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000003"]
    trainer.close()


@pytest.mark.parametrize("fallback", [False, True])
def test_a_save_that_fails_says_what_is_lost_or_goes_to_fallback_dir(
    write_config, tmp_path, capsys, monkeypatch, fallback
):
    """Disk full (ENOSPC) at the second of two checkpoints: one line saying which steps are lost and how to
    continue, exit 1; with fallback_dir the checkpoint goes there and the run finishes."""
    real_write = checkpoint_module.write_safetensors

    def full_at_step_4(path, tensors):
        if "step-00000004" in str(path) and "fallback" not in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, tensors)

    monkeypatch.setattr(checkpoint_module, "write_safetensors", full_at_step_4)
    extra = {"fallback_dir": str(tmp_path / "fallback")} if fallback else {}
    config = write_config(train={"steps": 5, "save_every": 2}, **extra)
    assert main(["train", "--config", str(config)]) == (0 if fallback else 1)
    err = capsys.readouterr().err
    if fallback:
        assert "the checkpoint went to fallback_dir instead" in err
        assert f"warning: fallback_dir {tmp_path / 'fallback'} is on the disk of output_dir" in err  # (as it is here)
        assert (tmp_path / "run" / "final" / "model.safetensors").exists()
        # the run's newest checkpoint is the one in fallback_dir (in a folder of the run's own, which other runs
        # sharing fallback_dir do not rotate), and a run resumed from it stays in its output_dir
        newest = fallback_checkpoints(tmp_path / "fallback", tmp_path / "run") / "step-00000004"
        assert newest.parent.parent.parent == tmp_path / "fallback"
        assert find_checkpoint(tmp_path / "run") == newest
        assert run_config(newest)["output_dir"] == str(tmp_path / "run")
        shutil.rmtree(tmp_path / "run" / "final")  # (a run killed before its export: its newest step is in fallback)
        assert main(["train", "--resume", str(tmp_path / "run")]) == 0  # (refused: "already holds a run")
        assert f"with the config of {newest}" in capsys.readouterr().err
        return
    (line,) = [line for line in err.splitlines() if line.startswith("megatrain: SaveError")]
    assert "step-00000004 could not be written (the disk is full)" in line
    assert f"the steps since {tmp_path / 'run' / 'checkpoints' / 'step-00000002'} (2) are lost" in line
    assert "--resume" in line and "Traceback" not in err


@pytest.mark.parametrize("fallback", [False, True])
def test_a_final_export_that_fails_keeps_the_state_where_it_can(write_config, tmp_path, capsys, monkeypatch, fallback):
    """Disk full while writing final/ with save_every 0: the state goes to fallback_dir as a checkpoint (which
    converts to the model), or the line says the whole run is lost; final/ is not left half-written."""
    import megatrain.export as hf_io

    real_write = hf_io.write_safetensors

    def full_in_run(path, tensors, metadata=None):
        if str(tmp_path / "run") in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_write(path, tensors, metadata=metadata)

    monkeypatch.setattr(hf_io, "write_safetensors", full_in_run)
    extra = {"fallback_dir": str(tmp_path / "fallback")} if fallback else {}
    assert main(["train", "--config", str(write_config(train={"steps": 3}, **extra))]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatrain: SaveError")]
    assert f"the model could not be written to {tmp_path / 'run' / 'final'}" in line
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / ".final.partial").exists()
    if not fallback:
        assert "this run has no checkpoint: all its steps (3) are lost; set fallback_dir" in line
        return
    kept = fallback_checkpoints(tmp_path / "fallback", tmp_path / "run") / "step-00000003"
    assert f"the trained state (step 3) is in {kept} instead" in line
    assert main(["convert", str(kept), str(tmp_path / "model")]) == 0


def test_a_killed_exports_leftovers_neither_count_against_the_room_nor_hold_the_run(
    write_config, tmp_path, monkeypatch, capsys
):
    """An export killed midway: its staging folder is removed before the room the next export needs is counted (it
    was counted as taken, refusing the export on a disk that holds one copy); and a final/ holding the files moved
    before the kill but no model (its config.json moves last) is no run's model, so the run starts again (it was
    refused as "already holds a run", whose model it named)."""
    import megatrain.export as export

    stale = tmp_path / ".final.partial"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(bytes(1000))
    check_room = export.check_room
    monkeypatch.setattr(export, "check_room", lambda *args: stale.exists() and pytest.fail("the leftover counted"))
    export._write_staged(tmp_path / "final", [], lambda folder: (folder / "config.json").write_text("{}"))
    assert (tmp_path / "final" / "config.json").exists() and not stale.exists()
    monkeypatch.setattr(export, "check_room", check_room)

    config = write_config(train={"steps": 2})
    assert main(["train", "--config", str(config)]) == 0
    for name in ("config.json", "model.safetensors"):  # (a kill while the files moved: the tokenizer's came first)
        (tmp_path / "run" / "final" / name).unlink()
    capsys.readouterr()
    assert main(["train", "--config", str(config)]) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_a_final_export_without_room_is_refused_at_the_start_or_its_state_saved_in_the_fallback(
    write_config, tmp_path, capsys, monkeypatch
):
    """A disk that cannot hold the final model: without fallback_dir, refused in one line at the start (the run would
    have trained to the end and lost every step); with one, said at the start, then the export is refused before
    final/ is written, saying how much it needs, and the state goes to fallback_dir."""
    import megatrain.loop

    def free(path):  # (output_dir's disk: 0.1 MiB free; the fallback's: room)
        return 2**17 if str(path).startswith(str(tmp_path / "run")) else 2**40

    monkeypatch.setattr(megatrain_store.checkpoints, "free_bytes", free)
    monkeypatch.setattr(megatrain.loop, "free_bytes", free)
    assert main(["train", "--config", str(write_config(train={"steps": 1}))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"{tmp_path / 'run'}'s disk has 0.1 MiB free; the final model needs" in err[-1]
    assert err[-1].endswith("free space there, or set fallback_dir to a directory on another disk")
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
    config = write_config(train={"steps": 1}, fallback_dir=str(tmp_path / "fallback"))
    assert main(["train", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert f"warning: {tmp_path / 'run'}'s disk has 0.1 MiB free; the final model needs" in err
    assert (
        f"the model {tmp_path / 'run' / 'final'} needs" in err
        and f"MiB in {tmp_path / 'run'}, whose disk has 0.1 MiB free" in err
    )
    assert not (tmp_path / "run" / "final").exists() and list((tmp_path / "fallback").rglob("manifest.json"))


def test_the_start_of_run_room_warning_counts_the_checkpoints_kept_at_once(write_config, tmp_path, capsys, monkeypatch):
    """keep_last checkpoints are on the disk at once (two where one is kept: a save is written beside the newest)."""
    import megatrain.loop

    sizes = {}
    monkeypatch.setattr(megatrain.loop, "free_bytes", lambda path: 2**21)  # (the final model fits, not all of them)
    for keep_last, copies in ((3, "3 checkpoints"), (1, "2 checkpoints")):
        train = {"steps": 4, "save_every": 1, "keep_last": keep_last}
        config = write_config(train=train, output_dir=str(tmp_path / f"r{keep_last}"))
        assert main(["train", "--config", str(config)]) == 0
        line = next(line for line in capsys.readouterr().err.splitlines() if "'s disk has 2.0 MiB free" in line)
        assert f"the final model and {copies} need" in line and "before the run ends" in line
        sizes[keep_last] = float(line.split(" need ")[1].split(" MiB")[0]) - 1  # (less the export's 1 MiB of files)
    assert sizes[3] == pytest.approx(
        sizes[1] * (1 + 3 * 3) / (1 + 2 * 3), rel=0.05
    )  # (a checkpoint: 3 model sizes; 2 digits)


def test_a_run_into_a_model_or_another_programs_folder_is_refused_touching_nothing(write_config, tmp_path, capsys):
    """An output_dir holding a config.json that is no megatrain run's (the model the run starts from, a project's
    folder) was written over (the run's config.json over the model's), and the run exited 0."""
    from megatrain_store.rundir import LOCK

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (folder / "metrics.jsonl").write_text("mine\n")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert main(["train", "--config", str(write_config(train={"steps": 1}))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"output_dir {folder} holds a model or another program's files" in err[0], err
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before and not (folder / LOCK).exists()


def test_a_run_removes_what_killed_runs_left_half_written(write_config, tmp_path, capsys):
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()  # (its pid: a process no longer alive)
    (tmp_path / "run" / "cache").mkdir(parents=True)
    (tmp_path / "run" / "cache" / f".tokens.npy.tmp-{process.pid}").write_bytes(b"x" * 2**20)
    assert main(["train", "--config", str(write_config(train={"steps": 1}))]) == 0
    assert "megatrain: removed 1.0 MiB of files killed runs left half-written" in capsys.readouterr().err
    assert not list((tmp_path / "run").rglob("*.tmp-*"))


def test_an_export_of_non_finite_weights_is_refused_naming_the_group(write_config, tmp_path):
    from megatrain.checkpoint import NonFiniteError

    trainer = make_trainer(write_config, tmp_path)
    trainer.store.master(1)[3] = float("nan")
    with pytest.raises(NonFiniteError, match=r"the weights of layer0 hold NaN or Inf; nothing exported"):
        trainer.export(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    trainer.close()


def test_a_model_written_over_another_leaves_none_of_its_files(tmp_path):
    """Writing a model into another model's directory removes that model's files the new one does not write
    (shards, index, tokenizer, chat template, generation config); files that describe no model stay."""
    import torch
    from tokenizers import Tokenizer, models

    from megatrain.export import write_hf_directory
    from megatrain_store import Pending

    def entries(n: int) -> list:
        return [(f"w{i}", Pending((4,), torch.float32, lambda: torch.ones(4))) for i in range(n)]

    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        (tokenizer_dir / name).write_text("{}")
    Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(str(tokenizer_dir / "tokenizer.json"))
    out = tmp_path / "model"
    write_hf_directory(out, entries(3), {"model_type": "llama"}, tokenizer_dir / "tokenizer.json", shard_bytes=16)
    (out / "notes.txt").write_text("mine\n")
    assert len(list(out.glob("model-*.safetensors"))) == 3 and (out / "chat_template.jinja").exists()
    write_hf_directory(out, entries(1), {"model_type": "llama"}, None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


def test_a_model_whose_files_were_moving_when_killed_is_no_model(tmp_path, monkeypatch):
    """A kill while a model's files move in from beside it leaves a directory without config.json (which moves last,
    the old one gone first): eval or convert never read half of one model as the whole."""
    import torch

    import megatrain.export as export
    from megatrain_store import Pending
    from megatrain_zoo.hf_weights import is_hf_directory

    entries = [(f"w{i}", Pending((4,), torch.float32, lambda: torch.ones(4))) for i in range(3)]
    out = tmp_path / "final"
    export.write_hf_directory(out, entries, {"model_type": "llama"}, None, shard_bytes=16)
    moved, real_replace = [], os.replace

    def killed_after_two(source, target):
        if os.path.dirname(target) == str(out):  # (the moves into final/, not the staging's own atomic writes)
            if len(moved) == 2:
                raise KeyboardInterrupt  # (the kill)
            moved.append(os.path.basename(target))
        real_replace(source, target)

    monkeypatch.setattr(export.os, "replace", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        export.write_hf_directory(out, entries, {"model_type": "llama"}, None, shard_bytes=16)
    assert "config.json" not in moved and not is_hf_directory(out)


def test_a_newest_checkpoint_without_its_manifest_is_skipped_aloud(write_config, tmp_path):
    """`megatrain train --resume RUN` (a subprocess) where the newest checkpoint's manifest was deleted: a warning
    names it and the older checkpoint resumed instead."""
    assert main(["train", "--config", str(write_config(train={"steps": 2, "save_every": 1}))]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / "step-00000002" / "manifest.json").unlink()
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "train", "--resume", str(tmp_path / "run"), "--set", "train.steps=3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, process.stderr
    assert (
        f"megatrain: warning: step-00000002 in {checkpoints} has no manifest.json (deleted or damaged), so it is "
        "skipped: using step-00000001, the newest whole one; restore its manifest.json, or remove the directory"
    ) in process.stderr.splitlines()
    assert "megatrain: resumed from step 1" in process.stderr


def test_a_run_resumed_from_an_older_checkpoint_goes_on_as_that_line(write_config, tmp_path, capsys):
    """Resumed from step 2 of a run that went to step 6, with another learning rate: its later checkpoints and final/
    are moved aside (said), so that keep_last keeps the new line's, `--resume RUN` continues it, and the step after 2
    says the learning rate it takes beside the old schedule's."""
    config = write_config(train={"steps": 6, "save_every": 2, "keep_last": 3})
    assert main(["train", "--config", str(config)]) == 0
    run = tmp_path / "run"
    resume = ["train", "--resume", str(run / "checkpoints" / "step-00000002"), "--set", "train.lr=5e-4"]
    assert main(resume + ["--set", "train.steps=8", "--set", "train.keep_last=2"]) == 0
    err = capsys.readouterr().err
    moved = run / "superseded" / "after-step-00000002"
    assert f"the run's later steps (another line of it) were moved to {moved}" in err
    # (cosine to 0.1 x lr: 8 steps from 5e-4 where 6 from 1e-3 ran)
    assert "step 3 trains at lr 0.0004341 on the changed schedule, where the run's own had 0.000775" in err
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]
    assert json.loads((moved / "final" / "trainer_state.json").read_text())["global_step"] == 6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000006", "step-00000008"]
    assert all(run_config(p)["train"]["lr"] == 5e-4 for p in (run / "checkpoints").iterdir())
    assert sorted(losses(run)) == list(range(1, 9))


def test_a_run_of_an_earlier_version_resumed_on_another_schedule_says_its_rate(write_config, tmp_path, capsys):
    """A checkpoint of a version before train.decay_steps (its manifest's config lacks it) resumed as wsd: the old
    schedule is the one that version ran (the missing keys' defaults, not the new config's, which made a cosine with
    decay_steps and refused)."""
    config = write_config(train={"steps": 4, "save_every": 2})
    assert main(["train", "--config", str(config)]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000004"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for key in ("decay_steps", "decay_shape"):
        del manifest["config"]["train"][key]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    wsd = ["train.schedule=wsd", "train.decay_steps=2", "train.steps=8"]
    assert main(["train", "--resume", str(tmp_path / "run"), *(a for s in wsd for a in ("--set", s))]) == 0
    assert (
        "step 5 trains at lr 0.001 on the changed schedule, where the run's own had 0.0001" in capsys.readouterr().err
    )


def test_a_metrics_line_cut_short_does_not_stop_a_resume(write_config, tmp_path, capsys):
    """A kill or a full disk can leave metrics.jsonl's last line cut short: the resumed run leaves it out, saying so."""
    config = write_config(train={"steps": 4, "save_every": 2})
    assert main(["train", "--config", str(config)]) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 5, "lo')
    assert main(["train", "--resume", str(tmp_path / "run"), "--set", "train.steps=6"]) == 0
    assert "metrics.jsonl line 5 is no record (cut short?): left out" in capsys.readouterr().err
    assert sorted(losses(tmp_path / "run")) == list(range(1, 7))


def test_a_resumed_run_whose_text_changed_is_refused_and_goes_on_with_its_own_tokenizer(write_config, tmp_path, capsys):
    """A run on text with the tokenizer megatrain trains on it: resumed after the text changed, the tokenizer trained
    on it would give the ids other meanings; refused in one line naming the run's own, with which it goes on."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    config = write_config(data={"tokens": None, "text": str(text)}, train={"steps": 4, "save_every": 2})
    assert main(["train", "--config", str(config)]) == 0
    text.write_text("a different text, with other words in it: zebra, quartz, vixen. " * 400)
    run = tmp_path / "run"
    assert main(["train", "--resume", str(run), "--set", "train.steps=6"]) == 2
    kept = run / "tokenizer" / "tokenizer.json"
    assert "the run's text changed since it started" in capsys.readouterr().err and kept.exists()
    assert main(["train", "--resume", str(run), "--set", "train.steps=6", "--set", f"data.tokenizer={kept}"]) == 0


def test_a_run_of_relative_paths_resumes_and_exports_from_any_directory(write_config, tmp_path, monkeypatch, capsys):
    """Paths written relative to where the run started are saved absolute (config.json, checkpoints), so the run
    resumes and its model loads from another directory (its model.hf_dir was 'runs/default/final' as typed)."""
    monkeypatch.chdir(tmp_path)
    config = write_config(data={"tokens": "tokens.npy"}, output_dir="run", train={"steps": 2, "save_every": 2})
    assert main(["train", "--config", str(config)]) == 0
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["output_dir"] == str(tmp_path / "run") and saved["data"]["tokens"] == str(tmp_path / "tokens.npy")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--resume", str(tmp_path / "run"), "--set", "train.steps=3"]) == 0, capsys.readouterr().err
    assert find_checkpoint(tmp_path / "run").name == "step-00000002" and (tmp_path / "run" / "final").is_dir()


def test_metrics_that_cannot_be_written_say_what_is_kept_and_how_to_go_on(write_config, tmp_path, capsys, monkeypatch):
    """output_dir gone read-only mid-run: metrics.jsonl's write fails in one line naming the checkpoint kept and the
    --resume that continues (it said only 'write elsewhere (output_dir)', so a new one restarted from scratch)."""
    import megatrain.loop

    real_write = megatrain.loop.write_jsonl

    def read_only_after_step_3(path, record):
        if record.get("step", 0) > 3:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        real_write(path, record)

    monkeypatch.setattr(megatrain.loop, "write_jsonl", read_only_after_step_3)
    assert main(["train", "--config", str(write_config(train={"steps": 5, "save_every": 2}))]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatrain: SaveError")]
    kept = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert "metrics.jsonl could not be written: [Errno 30] Read-only file system" in line
    assert f"the steps since {kept} (2) are lost" in line and f"--resume {kept}" in line


def test_a_signal_during_the_export_is_said_and_a_second_one_stops_it(write_config, tmp_path, capsys, monkeypatch):
    """Ctrl-C while final/ is written: said at once, and the export finishes (the trained state is in memory alone
    until then; the signal was swallowed without a word); a second Ctrl-C (or SIGTERM) stops the run there, in one
    line saying what is lost and with the signal's exit code (it said "training had not started", and a second
    SIGTERM killed the run without a word)."""
    real_export = Trainer.export
    signals = []

    def interrupted_export(self, *args, **kwargs):
        for sig in signals:
            os.kill(os.getpid(), sig)
            time.sleep(0.1)  # (its handler runs before the next is sent: two pending signals are one)
        return real_export(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "export", interrupted_export)
    signals.append(signal.SIGINT)
    assert main(["train", "--config", str(write_config(train={"steps": 2}))]) == 0
    assert "megatrain: SIGINT: the export finishes first; another stops it now" in capsys.readouterr().err
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    for second, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        shutil.rmtree(tmp_path / "run")
        signals[1:] = [second]
        assert main(["train", "--config", str(write_config(train={"steps": 3, "save_every": 2}))]) == code
        line = capsys.readouterr().err.splitlines()[-1]
        kept = tmp_path / "run" / "checkpoints" / "step-00000002"
        assert line.startswith(f"megatrain: {second.name}: the export to {tmp_path / 'run' / 'final'} stopped; ")
        assert f"the steps since {kept} (1) are lost; continue from it with `megatrain train --resume {kept}`" in line
        assert not (tmp_path / "run" / "final").exists()
    signals.clear()  # (the resumed run trains the lost step again and exports)
    config = write_config(train={"steps": 3, "save_every": 2})
    assert main(["train", "--config", str(config), "--resume", str(kept)]) == 0
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_a_rank_other_than_the_first_says_nothing_of_a_signal_after_its_steps(capsys):
    """Under torchrun every rank gets the signal: one line said (rank 0's), not one a rank; each rank's second
    signal stops it all the same, with the signal's exit code."""
    from megatrain.loop import Stopped, StopRequested

    for says in (True, False):
        with StopRequested(says=says) as stop:
            stop.starting, stop.finishing = False, ("the export finishes first", "the export stopped")
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            assert ("megatrain: SIGTERM: the export finishes first" in capsys.readouterr().err) == says
            with pytest.raises(Stopped, match="SIGTERM: the export stopped") as stopped:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            assert stopped.value.exit_code == 143


def test_signals_while_the_run_closes_are_said_and_a_second_one_stops_it(write_config, tmp_path, capsys, monkeypatch):
    """After final/ is written the run still closes (its pinned memory freed, its trackers closed): a first signal
    there is said, a second stops it with the signal's exit code, saying the model is written."""
    real_close = Trainer.close

    def interrupted_close(self, *args, **kwargs):
        for sig in (signal.SIGTERM, signal.SIGTERM):
            os.kill(os.getpid(), sig)
            time.sleep(0.1)
        return real_close(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "close", interrupted_close)
    assert main(["train", "--config", str(write_config(train={"steps": 2}))]) == 143
    err = capsys.readouterr().err
    assert "megatrain: SIGTERM: the model is written; the run closes first; another stops it now" in err
    final = tmp_path / "run" / "final"
    assert err.splitlines()[-1] == f"megatrain: SIGTERM: stopped closing; the model is in {final}"
    assert (final / "model.safetensors").exists()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # (the run's handler given back, stopped as it was)
