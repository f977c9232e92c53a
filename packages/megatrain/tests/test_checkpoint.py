"""Checkpoints: atomic, verified, and a resumed run continues exactly like an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import megatrain.checkpoint as checkpoint_module
from megatrain import Trainer
from megatrain.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from megatrain.cli import main
from megatrain.config import ConfigError, load_config
from megatrain.rundir import SaveError
from megatrain_store import StoreError


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
    first_rows = Trainer._first_rows
    monkeypatch.setattr(Trainer, "_first_rows", lambda *a: rows_given.append(first_rows(*a)) or rows_given[-1])
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


def make_trainer(write_config, tmp_path, **train):
    return Trainer(load_config(write_config(train=train, output_dir=str(tmp_path / "t"))))


def test_crash_during_save_leaves_previous_checkpoint(write_config, tmp_path, monkeypatch):
    trainer = make_trainer(write_config, tmp_path)
    first = save_checkpoint(trainer, tmp_path / "ck")
    trainer.step_index = 7
    real_write = checkpoint_module.write_safetensors

    def dies_on_optimizer(path, tensors):
        if "optimizer" in path.name:
            raise OSError("disk full (simulated crash mid-save)")
        return real_write(path, tensors)

    monkeypatch.setattr(checkpoint_module, "write_safetensors", dies_on_optimizer)
    with pytest.raises(SaveError, match="step-00000007 could not be written: disk full"):
        save_checkpoint(trainer, tmp_path / "ck")
    assert find_checkpoint(tmp_path / "ck") == first  # the half-written one is invisible
    assert not (tmp_path / "ck" / "step-00000007").exists()
    assert [p.name for p in (tmp_path / "ck").iterdir()] == [first.name]  # and gone
    load_checkpoint(trainer, tmp_path / "ck")
    assert trainer.step_index == 0


def test_damaged_checkpoints_are_refused(write_config, tmp_path):
    trainer = make_trainer(write_config, tmp_path)
    path = save_checkpoint(trainer, tmp_path / "ck")
    model_file = path / "model.safetensors"
    original = model_file.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="model.safetensors fails its CRC32 check"):
        load_checkpoint(trainer, path)
    model_file.write_bytes(bytes(data[:-100]))
    with pytest.raises(StoreError, match="model.safetensors has .* bytes.*truncated"):
        load_checkpoint(trainer, path)
    model_file.write_bytes(original)
    load_checkpoint(trainer, path)  # intact again: loads
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(StoreError, match="optimizer.safetensors is missing"):
        load_checkpoint(trainer, path)


def test_checkpoint_of_another_model_is_refused(write_config, tmp_path):
    path = save_checkpoint(make_trainer(write_config, tmp_path), tmp_path / "ck")
    other = Trainer(load_config(write_config(model={"preset": "tiny-qwen3"}, output_dir=str(tmp_path / "o"))))
    with pytest.raises(ConfigError, match="different model"):
        load_checkpoint(other, path)
    with pytest.raises(ConfigError, match="no checkpoint at .*nowhere: it does not exist"):
        find_checkpoint(tmp_path / "nowhere")


def test_checkpoint_of_an_older_megatrain_resumes_and_of_a_newer_one_is_refused(write_config, tmp_path):
    """A model field added since a checkpoint was written takes its default (what every model had then);
    a field this version does not know names the fix."""
    trainer = make_trainer(write_config, tmp_path)
    path = save_checkpoint(trainer, tmp_path / "ck")
    manifest_path = path / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for added in ("rope_interleave", "router_scoring", "partial_rotary_factor"):  # fields added in session 15
        del manifest["model"][added]
    manifest_path.write_text(json.dumps(manifest))
    assert load_checkpoint(trainer, path)["step"] == manifest["step"]
    manifest["model"]["a_field_from_the_future"] = 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"newer megatrain .*a_field_from_the_future"):
        load_checkpoint(trainer, path)
    trainer.close()


def test_keep_last(write_config, tmp_path):
    trainer = make_trainer(write_config, tmp_path)
    for step in range(1, 5):
        trainer.step_index = step
        save_checkpoint(trainer, tmp_path / "ck", keep_last=2)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000003", "step-00000004"]
    assert os.path.exists(tmp_path / "ck" / "step-00000004" / "manifest.json")
