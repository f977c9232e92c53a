import json
import sys
import types

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatrain.cli import main
from megatrain_zoo import PRESETS


def test_train_writes_metrics_and_a_loadable_model(write_config, tmp_path):
    assert main(["train", "--config", str(write_config())]) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"step", "loss", "lr", "grad_norm", "tokens", "step_time_s"} <= set(rows[0])
    assert rows[0]["tokens"] == 4 * 32
    assert (run / "final" / "config.json").exists() and (run / "loss.png").exists()
    weights = load_file(str(run / "final" / "model.safetensors"))
    assert "model.layers.1.mlp.down_proj.weight" in weights and "lm_head.weight" in weights

    # the exported directory is the initial weights of a new run
    second = write_config(
        model={"preset": None, "hf_dir": str(run / "final")},
        output_dir=str(tmp_path / "run2"),
        train={"steps": 1, "lr": 0.0, "weight_decay": 0.0},
    )
    assert main(["train", "--config", str(second)]) == 0
    again = load_file(str(tmp_path / "run2" / "final" / "model.safetensors"))
    assert all((again[k] == v).all() for k, v in weights.items())  # lr 0: unchanged, so loaded exactly


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.preset=nope"], "unknown model preset 'nope'"),
        (["data.seq_len=512"], "larger than the model allows"),
        (["train.batch_size=3"], "divisible"),
        (["train.foo=1"], "unknown config key 'train.foo'"),
    ],
)
def test_bad_input_is_one_clear_line_and_no_output(write_config, tmp_path, capsys, overrides, message):
    args = ["train", "--config", str(write_config())]
    for item in overrides:
        args += ["--set", item]
    assert main(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "run" / "final").exists()


def test_unsupported_hf_architecture(write_config, tmp_path, capsys):
    """A family neither megatrain's templates nor transformers (where installed) know: one line naming it."""
    hf = tmp_path / "unknown"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "no_such_family", "vocab_size": 256}))
    assert main(["train", "--config", str(write_config(model={"preset": None, "hf_dir": str(hf)}))]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'no_such_family'" in err[0]
    assert "install transformers" in err[0] or "upgrade transformers" in err[0]


def test_token_ids_beyond_vocab(write_config, tmp_path, capsys):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.arange(1000, dtype=np.int32))
    assert main(["train", "--config", str(write_config(data={"tokens": str(bad)}))]) != 0
    assert "vocab_size is 256" in capsys.readouterr().err


def test_builtin_default_job_starts(tmp_path, monkeypatch):
    """`megatrain train` with no config: the shipped corpus, a trained tokenizer, the small model."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", "train.steps=2", "--set", "device=cpu"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "runs/default/metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["tokens"] == 16 * 128
    assert (tmp_path / "runs/default/final/tokenizer.json").exists()


def test_presets_lists_each_preset_with_its_size(capsys):
    assert main(["presets", "qwen3-30b"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()
    assert header.split() == ["preset", "architecture", "params", "active", "layers", "width"]
    assert row.split() == ["qwen3-30b-a3b", "qwen3_moe", "30.5B", "3.4B", "48", "2048"]
    assert main(["presets"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 1 + len(PRESETS)


def test_every_option_says_what_it_does_and_eval_and_generate_name_their_config():
    """`convert --dtype` (and three of generate's options) had no help; eval's and generate's --config said the
    built-in model was its default, where it is the checkpoint's run's own config (`checkpoint.run_config`)."""
    import argparse

    from megatrain.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    undescribed = [
        f"{name} {a.option_strings or a.dest}" for name, c in commands.items() for a in c._actions if not a.help
    ]
    assert undescribed == []
    for name, command in commands.items():
        config = next((a.help for a in command._actions if "--config" in a.option_strings), "")
        assert ("laid over the checkpoint's run config" in config) == (name in ("eval", "generate")), name


def test_bench_command(capsys):
    args = [
        "bench",
        "--steps",
        "1",
        "--set",
        "model.preset=tiny-llama",
        "--set",
        "device=cpu",
        "--set",
        "data.seq_len=32",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.micro_batch_size=1",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and float(out.split(" model TFLOPS")[0].split()[-1]) > 0  # (a CPU's said 0.0)


@pytest.mark.parametrize(
    "grad_clip,batch_size,gpu_updated_layers",
    [
        (1.0, 4, 0),
        (0.0, 4, 0),
        (1.0, 1, 0),  # 1: the embedding's rows go first, and are not updated either
        (0.0, 1, 0),
        (1.0, 4, 1),  # the poisoned layer is updated on the device: not updated either
        (0.0, 4, 1),
    ],
)
def test_non_finite_steps_are_skipped_then_stop_the_run(
    write_config, tmp_path, capsys, monkeypatch, grad_clip, batch_size, gpu_updated_layers
):
    """A weight turned NaN in memory (past the check of loaded weights): every step is skipped and changes
    nothing; the run stops after max_bad_steps, and writes no checkpoint of a state holding NaN."""
    from megatrain.trainer import Trainer

    real_step, states = Trainer.train_step, []

    def poisoned_step(self, *args, **kwargs):
        if self.step_index == 0:
            self.store.master_views(1)["model.layers.0.input_layernorm.weight"][0] = float("nan")
            self.store.refresh_wire(1)
        metrics = real_step(self, *args, **kwargs)
        states.append({name: t.clone() for name, t in self.named_weights().items()})
        return metrics

    monkeypatch.setattr(Trainer, "train_step", poisoned_step)
    settings = {"steps": 10, "max_bad_steps": 3, "grad_clip": grad_clip, "batch_size": batch_size}
    config = write_config(
        train=settings | {"micro_batch_size": min(2, batch_size), "save_every": 0},
        engine={"gpu_updated_layers": gpu_updated_layers},
    )
    assert main(["train", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "non-finite loss or gradient" in err and "3 non-finite steps in a row; stopping" in err
    assert "holds NaN or Inf (" in err and "no checkpoint was written" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["skipped"] for r in rows)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
    for name, tensor in states[-1].items():  # skipped steps changed nothing
        torch.testing.assert_close(tensor, states[0][name], rtol=0, atol=0, equal_nan=True)


def test_a_run_that_diverges_keeps_its_last_good_step(write_config, tmp_path, capsys):
    """A learning rate of 1e30: the first step is finite, the weights it makes overflow every gradient after
    it; the run stops after three skipped steps with the first step's weights saved (finite, so saved)."""
    settings = {"steps": 10, "max_bad_steps": 3, "lr": 1e30, "weight_decay": 0.0, "grad_clip": 1.0}
    assert main(["train", "--config", str(write_config(train=settings))]) == 1
    assert (
        "3 non-finite steps in a row; stopping. The weights are those of the last good step" in capsys.readouterr().err
    )
    one_step = write_config(train=settings | {"steps": 1}, output_dir=str(tmp_path / "one"))
    assert main(["train", "--config", str(one_step)]) == 0
    saved = load_file(str(tmp_path / "run" / "checkpoints" / "step-00000004" / "model.safetensors"))
    after_one = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert all(torch.equal(saved[name], tensor) for name, tensor in after_one.items())


def test_a_run_stopped_by_divergence_keeps_its_older_checkpoints_and_a_resume_gets_its_tries(
    write_config, tmp_path, capsys
):
    """A run resumed with a learning rate of 1e30 diverges: its saves in the streak of non-finite steps keep every
    older checkpoint (train.keep_last rotated out the good ones before), the stop names the newest from before the
    weights diverged, and a resume from the stop's checkpoint gets max_bad_steps tries again (it stopped at its
    first bad step: the count was saved)."""
    settings = {"steps": 6, "max_bad_steps": 3, "save_every": 2, "keep_last": 2}
    assert main(["train", "--config", str(write_config(train=settings))]) == 0
    run = tmp_path / "run"
    diverging = ["--set", "train.lr=1e30", "--set", "train.weight_decay=0"]  # (lr x weight_decay >= 1 is refused)
    assert main(["train", "--resume", str(run), "--set", "train.steps=40", *diverging]) == 1
    err = capsys.readouterr().err
    # step 7 is finite and diverges; 8-10 are skipped; step-8 holds step 7's weights, as the stop's step-10 does
    assert f"saved in {run / 'checkpoints' / 'step-00000010'}; where the loss rose" in err
    assert f"--resume {run / 'checkpoints' / 'step-00000006'}." in err
    names = sorted(p.name for p in (run / "checkpoints").iterdir())  # (step-8 and step-10 rotated none out)
    assert names == ["step-00000004", "step-00000006", "step-00000008", "step-00000010"]
    assert main(["train", "--resume", str(run), "--set", "train.steps=40", "--set", "train.lr=1e-3"]) == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["skipped"]][-3:] == [11, 12, 13]  # three tries, not one
    assert "step-00000006" in {p.name for p in (run / "checkpoints").iterdir()}


def test_weights_holding_nan_are_refused_on_load_naming_the_tensor(write_config, tmp_path, capsys):
    """An hf_dir whose weights hold NaN: refused before any step, the tensor and file named; nothing written."""
    assert main(["train", "--config", str(write_config(train={"steps": 1}, output_dir=str(tmp_path / "src")))]) == 0
    weights = tmp_path / "src" / "final" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("inf")
    save_file(tensors, str(weights))
    capsys.readouterr()
    config = write_config(model={"preset": None, "hf_dir": str(tmp_path / "src" / "final")})
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor model.layers.1.mlp.up_proj.weight in" in err[0] and "NaN or Inf" in err[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_tensorboard_needs_its_package_or_logs(write_config, tmp_path, capsys):
    try:
        import tensorboard  # noqa: F401

        assert main(["train", "--config", str(write_config(train={"tensorboard": True}))]) == 0
        assert any((tmp_path / "run" / "tensorboard").iterdir())
    except ImportError:
        assert main(["train", "--config", str(write_config(train={"tensorboard": True}))]) == 2
        assert "pip install tensorboard" in capsys.readouterr().err


def test_bad_data_stops_the_run_before_host_memory_is_allocated(write_config, tmp_path, capsys, monkeypatch):
    import megatrain.loop

    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([0, 999], dtype=np.int32))  # ids beyond tiny-llama's vocabulary of 256
    monkeypatch.setattr(megatrain.loop, "Trainer", lambda *a, **k: pytest.fail("the trainer was built first"))
    assert main(["train", "--config", str(write_config(data={"tokens": str(bad), "seq_len": 32}))]) == 2
    assert "vocab_size is 256" in capsys.readouterr().err


@pytest.mark.parametrize("rate, adapter", [(0.0, None), (0.01, None), (0.0, "lora")])
def test_pre_training_a_sigmoid_routed_moe_without_balancing_is_warned_of(
    write_config, tmp_path, capsys, rate, adapter
):
    """DeepSeek-V3's routers collapse from a random start unless their correction bias moves by load; the
    run says so (and shows the worst layer's load violation), or does not when the rate is set, nor under LoRA
    (which keeps the routers, biases too, as they are, and refuses the rate)."""
    model = {"preset": "tiny-deepseek-v3", "adapter": {"type": adapter}}
    config = write_config(model=model, train={"router_bias_update_rate": rate})
    assert main(["train", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert ("train.router_bias_update_rate: 0.001" in err) == (rate == 0 and adapter is None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["router_max_violation"] >= 0 for row in rows)
    assert (tmp_path / "run" / "loss.png").exists()  # loss beside the load balance


def fake_module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, value in functions.items():
        setattr(module, key, value)
    return module


def test_tensorboard_gets_every_metric_of_a_step_the_router_ones_too(write_config, tmp_path, monkeypatch):
    """`train.tensorboard: true` (the alias of report_to: [tensorboard]) writes every field of each step."""
    tags: set = set()

    class SummaryWriter:
        def __init__(self, log_dir):
            assert log_dir == str(tmp_path / "run" / "tensorboard")

        def add_text(self, tag, text):
            assert tag == "config" and "router_z_loss_coef" in text

        def add_scalar(self, tag, value, step):
            assert isinstance(value, float | int)
            tags.add(tag)

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake_module("tb", SummaryWriter=SummaryWriter))
    config = write_config(
        model={"preset": "tiny-deepseek-v3"}, train={"router_z_loss_coef": 0.001, "tensorboard": True}
    )
    assert main(["train", "--config", str(config)]) == 0
    wanted = {"loss", "grad_norm", "tokens_per_s", "router_aux_loss", "router_max_violation", "router_z_loss"}
    assert {f"train/{key}" for key in wanted} <= tags


def test_wandb_and_mlflow_get_the_metrics_and_the_config(write_config, tmp_path, monkeypatch):
    """report_to: [wandb, mlflow] (neither is installed in CI: fakes stand in), each gets every metrics.jsonl
    field of every step and validation, and the run's config; W&B and MLflow runs are finished at the end."""
    logged = {"wandb": [], "mlflow": []}
    calls = []

    class Run:
        def log(self, values, step):
            logged["wandb"].append((step, values))

        def finish(self):
            calls.append("wandb.finish")

    def init(project, name, dir, config):
        calls.append(("wandb.init", project, name, dir, config["train"]["lr"]))
        return Run()

    mlflow = fake_module(
        "mlflow",
        set_tracking_uri=lambda uri: calls.append(("mlflow.uri", uri)),
        set_experiment=lambda name: calls.append(("mlflow.experiment", name)),
        start_run=lambda run_name: calls.append(("mlflow.start_run", run_name)),
        log_params=lambda params: calls.append(("mlflow.params", params["train.lr"], params["output_dir"])),
        log_metrics=lambda values, step: logged["mlflow"].append((step, values)),
        end_run=lambda: calls.append("mlflow.end_run"),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake_module("wandb", init=init))
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = tmp_path / "run"
    config = write_config(train={"report_to": ["wandb", "mlflow"], "eval_every": 2}, data={"validation": 0.1})
    assert main(["train", "--config", str(config)]) == 0
    assert calls == [
        ("wandb.init", "megatrain", "run", str(run), 1e-3),
        ("mlflow.uri", f"sqlite:///{run / 'mlflow.db'}"),
        ("mlflow.experiment", "megatrain"),
        ("mlflow.start_run", "run"),
        ("mlflow.params", "0.001", str(run)),
        "wandb.finish",
        "mlflow.end_run",
    ]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for tracker, entries in logged.items():
        assert [step for step, _ in entries] == [r["step"] for r in records], tracker
        assert entries[0][1]["train/loss"] == records[0]["loss"] and entries[0][1]["train/skipped"] == 0.0
        validation = [values for _, values in entries if "val/loss" in values]
        assert [v["val/loss"] for v in validation] == [r["val_loss"] for r in records if "val_loss" in r]
        assert len(validation) == 2  # steps 2 and 3 (the last)


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_is_one_line_before_anything_runs(
    write_config, tmp_path, capsys, monkeypatch, tracker
):
    monkeypatch.setitem(sys.modules, tracker, None)  # (import fails, as when it is not installed)
    assert main(["train", "--config", str(write_config()), "--set", f"train.report_to={tracker}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pip install {tracker}" in err[0]
    assert not (tmp_path / "run").exists()


def test_non_finite_metrics_are_written_as_null(write_config, tmp_path):
    """metrics.jsonl is JSON: a NaN loss is null, and the record says non_finite."""
    from megatrain.loop import finite_record, write_jsonl

    write_jsonl(tmp_path / "m.jsonl", {"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    write_jsonl(tmp_path / "m.jsonl", {"step": 2, "loss": 2.5})
    first, second = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert first == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3, "non_finite": True}
    assert second == {"step": 2, "loss": 2.5} and finite_record(second) is second
