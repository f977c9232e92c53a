import pytest

from megatrain.config import Config, ConfigError, TrainSection, load_config


def test_defaults_are_the_builtin_job():
    config = load_config()
    assert config == Config()
    assert config.model.preset == "small-llama"


def test_yaml_and_overrides(write_config):
    config = load_config(write_config(), ["train.lr=2e-4", "train.betas=[0.8, 0.9]", "data.shuffle=true"])
    assert config.train.lr == 2e-4 and config.train.betas == (0.8, 0.9) and config.data.shuffle is True
    assert config.train.micro_batch_size == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lrr=1"], "unknown config key 'train.lrr'.*lr"),
        (["modle.preset=x"], "unknown config key 'modle'"),
        (["train.batch_size=6", "train.micro_batch_size=4"], "divisible by train.micro_batch_size"),
        (["train.steps=ten"], "train.steps"),
        (["precision.compute_dtype=fp8"], "compute_dtype"),
        (["model.hf_dir=/x"], "exactly one of model.preset"),
        (["data.seq_len=1"], "seq_len must be >= 2"),
        (["device=tpu"], "device must be"),
        (["train"], "key.sub=value"),
        (["engine.kept_layers=-1"], "engine.kept_layers must be auto or an integer >= 0"),
        (["engine.kept_layers=some"], "engine.kept_layers must be auto or an integer >= 0"),
        (["engine.held_layers=1.5"], "engine.held_layers must be auto or an integer >= 0"),
        (["engine.gpu_updated_layers=-1"], "engine.gpu_updated_layers must be auto or an integer >= 0"),
        (["engine.gradient_pool=0.5"], "engine.gradient_pool must be auto or a number >= 1"),
    ],
)
def test_bad_configs_name_the_key_and_fix(write_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(), overrides)


def test_micro_batch_defaults_to_batch():
    assert TrainSection(batch_size=8).micro_batch_size == 8
