"""Hugging Face interop: megatrain's export loads in transformers with the same logits, and a
directory written by transformers trains in megatrain from the same weights."""

import json

import pytest
import torch
import transformers  # installed by the integration nox session

from megatrain import Trainer
from megatrain.config import Config, ModelSection, PrecisionSection, TrainSection
from megatrain_data import DataSection
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


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-ernie4_5"])
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


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-ernie4_5"])
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


@pytest.mark.parametrize(
    "name, arch, windows",
    [
        ("tiny-llama", "mistral", {"sliding_window": 5}),  # every layer
        ("tiny-qwen2", "qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
        ("tiny-qwen3", "qwen3", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    ],
)
def test_sliding_windows_apply_where_transformers_applies_them(name, arch, windows, tmp_path):
    """A config.json's sliding window over 16-token rows: on every layer for Mistral, from max_window_layers
    on for Qwen (with use_sliding_window); equal logits, and the export carries the windows back."""
    plain = config_to_hf(preset(name).with_changes(arch=arch))
    hf_config = transformers.AutoConfig.for_model(**{**plain, **windows})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    with torch.no_grad():  # attention that matters: windows change the output
        for param in model.parameters():
            param.normal_(1.0, 0.2) if param.dim() == 1 else param.normal_(0.0, 0.15)
    model.save_pretrained(tmp_path / "hf")
    trainer = make_trainer(tmp_path, hf_dir=str(tmp_path / "hf"))
    assert trainer.model_config.sliding_window == 5 and trainer.model_config.sliding_layers
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, 16))
    unwindowed = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**plain)).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = model(ids).logits.float()
        full = unwindowed(ids).logits.float()
    assert ((full - expected).norm() / expected.norm()).item() > 1e-3  # the window bites
    ours = trainer.logits(ids)
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-5
    exported = trainer.export(tmp_path / "out")
    assert make_trainer(tmp_path, hf_dir=str(exported)).model_config == trainer.model_config


def test_convert_checkpoint_to_transformers(tmp_path):
    from megatrain.checkpoint import save_checkpoint
    from megatrain.cli import main

    trainer = make_trainer(tmp_path, preset="tiny-qwen2")
    randomize(trainer)
    checkpoint = save_checkpoint(trainer.state_dict(), tmp_path / "checkpoints")
    assert main(["convert", str(checkpoint), str(tmp_path / "converted"), "--dtype", "float32"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float32).eval()
    ids = torch.randint(0, trainer.model_config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = model(ids).logits.float()
    assert ((trainer.logits(ids) - expected).norm() / expected.norm()).item() < 1e-5


def test_a_model_trained_from_scratch_on_text_exports_its_end_of_document(tmp_path):
    """A preset trained on text reads it with a tokenizer megatrain trained, whose documents end in <|endoftext|>:
    the export says so, so that transformers' tokenizer knows its EOS and its generate stops there."""

    from megatrain.cli import main

    settings = ["model.preset=tiny-llama", "device=cpu", "train.steps=1", "data.seq_len=32", "train.batch_size=2"]
    settings += ["train.micro_batch_size=2"]
    assert main(["train", "--set", f"output_dir={tmp_path / 'run'}", *(a for s in settings for a in ("--set", s))]) == 0
    final = tmp_path / "run" / "final"
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert json.loads((final / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
