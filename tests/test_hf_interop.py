"""Hugging Face interop: megatrain's export loads in transformers with the same logits, and a
directory written by transformers trains in megatrain from the same weights."""

import pytest
import torch
import transformers  # installed by the integration nox session

from megatrain import Trainer
from megatrain.config import Config, DataSection, ModelSection, PrecisionSection, TrainSection
from megatrain_zoo import config_to_hf, preset


def make_trainer(tmp_path, **model):
    config = Config(
        model=ModelSection(**model),
        data=DataSection(seq_len=16),
        train=TrainSection(steps=1, batch_size=2),
        precision=PrecisionSection("float32"),
        device="cpu",
        output_dir=str(tmp_path / "run"),
    )
    return Trainer(config)


def randomize(trainer):
    for name, view in trainer.named_weights().items():
        view.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2 if name.endswith("norm.weight") else 0.05)
    trainer.store.refresh_wire()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_export_loads_in_transformers_with_equal_logits(name, tmp_path):
    trainer = make_trainer(tmp_path, preset=name)
    randomize(trainer)
    out = trainer.export(tmp_path / "hf", shard_bytes=50_000)  # small shards: exercise the index too
    assert (out / "model.safetensors.index.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits.float()
    ours = trainer.logits(ids)
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-5


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_transformers_directory_imports(name, tmp_path):
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(preset(name)))
    model = transformers.AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.float32).eval()
    model.save_pretrained(tmp_path / "hf")
    trainer = make_trainer(tmp_path, hf_dir=str(tmp_path / "hf"))
    assert trainer.model_config == preset(name).with_changes(initializer_range=hf_config.initializer_range)
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits.float()
    ours = trainer.logits(ids)
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-5


def test_convert_checkpoint_to_transformers(tmp_path):
    from megatrain.checkpoint import save_checkpoint
    from megatrain.cli import main

    trainer = make_trainer(tmp_path, preset="tiny-qwen2")
    randomize(trainer)
    checkpoint = save_checkpoint(trainer, tmp_path / "checkpoints")
    assert main(["convert", str(checkpoint), str(tmp_path / "converted"), "--dtype", "float32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32).eval()
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits.float()
    assert ((trainer.logits(ids) - expected).norm() / expected.norm()).item() < 1e-5
