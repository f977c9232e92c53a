import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatrain.cli import main


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
    hf = tmp_path / "gpt2"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert main(["train", "--config", str(write_config(model={"preset": None, "hf_dir": str(hf)}))]) != 0
    assert "unsupported architecture: model_type='gpt2'" in capsys.readouterr().err


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
    assert "tokens/s" in capsys.readouterr().out


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
    from megatrain.trainer import Trainer

    real_init = Trainer._init_weights

    def poisoned(self):
        real_init(self)
        self.store.master_views(1)["model.layers.0.input_layernorm.weight"][0] = float("nan")
        self.store.refresh_wire(1)

    monkeypatch.setattr(Trainer, "_init_weights", poisoned)
    settings = {"steps": 10, "max_bad_steps": 3, "grad_clip": grad_clip, "batch_size": batch_size}
    config = write_config(
        train=settings | {"micro_batch_size": min(2, batch_size)}, engine={"gpu_updated_layers": gpu_updated_layers}
    )
    assert main(["train", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "non-finite loss or gradient" in err and "3 non-finite steps in a row; stopping" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["skipped"] for r in rows)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert (checkpoint / "manifest.json").exists()
    weights = load_file(str(checkpoint / "model.safetensors"))
    from megatrain.config import load_config

    initial = Trainer(load_config(config)).named_weights()  # skipped steps changed nothing
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, initial[name], rtol=0, atol=0, equal_nan=True)


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


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_pre_training_a_sigmoid_routed_moe_without_balancing_is_warned_of(write_config, tmp_path, capsys, rate):
    """DeepSeek-V3's routers collapse from a random start unless their correction bias moves by load; the
    run says so (and shows the worst layer's load violation), or does not when the rate is set."""
    config = write_config(model={"preset": "tiny-deepseek-v3"}, train={"router_bias_update_rate": rate})
    assert main(["train", "--config", str(config)]) == 0
    err = capsys.readouterr().err
    assert ("train.router_bias_update_rate: 0.001" in err) == (rate == 0)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["router_max_violation"] >= 0 for row in rows)
    assert (tmp_path / "run" / "loss.png").exists()  # loss beside the load balance


def test_tensorboard_gets_every_metric_of_a_step_the_router_ones_too(write_config, tmp_path, monkeypatch):
    import megatrain.loop

    class Writer:
        tags: set = set()

        def add_scalar(self, tag, value, step):
            assert isinstance(value, float | int)
            self.tags.add(tag)

        def close(self):
            pass

    monkeypatch.setattr(megatrain.loop, "tensorboard_writer", lambda config, out: Writer())
    config = write_config(model={"preset": "tiny-deepseek-v3"}, train={"router_z_loss_coef": 0.001})
    assert main(["train", "--config", str(config)]) == 0
    wanted = {"loss", "grad_norm", "tokens_per_s", "router_aux_loss", "router_max_violation", "router_z_loss"}
    assert {f"train/{key}" for key in wanted} <= Writer.tags
