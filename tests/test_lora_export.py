"""A LoRA run's adapters leave and enter as PEFT's: its export (and `megatrain convert` of it) loads with
`peft.PeftModel.from_pretrained` and computes megatrain's logits, an adapter PEFT saved starts a run
(model.adapter.path) at PEFT's logits, `megatrain convert --merge` writes a transformers model with the same logits,
and an adapter of another shape is refused in one line before anything loads."""

import json
import shutil
from contextlib import chdir
from pathlib import Path

import numpy as np
import peft
import pytest
import torch
import transformers
from hf_steps import random_batch, rel_err
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from megatrain import Trainer
from megatrain.checkpoint import resolve_resume, save_checkpoint
from megatrain.cli import main
from megatrain.config import AdapterSection, Config, EngineSection, ModelSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import DataSection
from megatrain_data.serving import describe_export
from megatrain_store import read_safetensors_header
from megatrain_zoo import ZooError, config_to_hf, preset

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 (q, k and v biases) written by transformers, with random weights, a word-level tokenizer and a
    chat template."""
    directory = tmp_path_factory.mktemp("base") / "qwen2"
    hf_config = transformers.AutoConfig.for_model(**(config_to_hf(preset("tiny-qwen2")) | {"vocab_size": 96}))
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if name.endswith("norm.weight") else 0.0, 0.2 if name.endswith("norm.weight") else 0.1)
    model.save_pretrained(directory)
    vocab = {"<unk>": 0, "<|end|>": 1, "<|user|>": 2, "<|assistant|>": 3} | {f"w{i}": i + 4 for i in range(90)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"chat_template": TEMPLATE, "eos_token": "<|end|>", "unk_token": "<unk>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def lora_trainer(
    base_dir: Path, tmp_path: Path, adapter: AdapterSection, steps: int = 2, engine: EngineSection = EngineSection()
) -> Trainer:
    train = TrainSection(steps=steps, batch_size=2, micro_batch_size=2, lr=1e-2, warmup_steps=0, grad_clip=0.0)
    model = ModelSection(hf_dir=str(base_dir), adapter=adapter)
    data, out = DataSection(seq_len=12), str(tmp_path)
    return Trainer(Config(model=model, data=data, train=train, engine=engine, device="cpu", output_dir=out))


def peft_model(base_dir: Path, adapter_dir: Path):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_a_trained_adapter_exports_as_peft_and_converts_merged(base_dir, tmp_path, capsys):
    """Two steps at lr 1e-2 move B off zero; the export is a PEFT directory (with the tokenizer and chat template)
    whose PeftModel gives megatrain's logits; convert of a checkpoint writes the same adapter, and --merge of the
    checkpoint and of the export write transformers models with those logits."""
    adapter = AdapterSection(type="lora", r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    trainer = lora_trainer(base_dir, tmp_path / "run", adapter)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    for _ in range(2):
        trainer.train_step(StepBatch(*random_batch(2, 12, 96, generator)))
    ids = torch.randint(0, 96, (2, 12), generator=generator)
    ours = trainer.logits(ids)
    moved = trainer.named_weights()["model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert moved.abs().max() > 0
    exported = trainer.export(tmp_path / "adapter", tokenizer=base_dir / "tokenizer.json")
    checkpoint = save_checkpoint(trainer.state_dict(), tmp_path / "run" / "checkpoints", 1)
    trainer.close()

    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in exported.iterdir()}
    assert "tokenizer, chat template" in describe_export(exported)
    settings = json.loads((exported / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["base_model_name_or_path"]) == (4, 8, str(base_dir))
    assert sorted(settings["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert rel_err(logits_of(peft_model(base_dir, exported), ids), ours) < 1e-5

    assert main(["convert", str(checkpoint), str(tmp_path / "converted")]) == 0
    assert rel_err(logits_of(peft_model(base_dir, tmp_path / "converted"), ids), ours) < 1e-5
    step = {"global_step": 2, "max_steps": 2}  # (the checkpoint's, as a run's final/ says it)
    assert json.loads((tmp_path / "converted" / "trainer_state.json").read_text()) == step
    for source, out in ((checkpoint, "merged"), (exported, "merged-export")):
        assert main(["convert", str(source), str(tmp_path / out), "--merge"]) == 0
        said = f"merged 6 adapted matrices (scale alpha / r = 2) of the base {base_dir} into {tmp_path / out}\n"
        assert said in capsys.readouterr().err  # (3 per layer, 2 layers; the directory written, not the base)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out, dtype=torch.float32)
        assert rel_err(logits_of(merged.eval(), ids), ours) < 1e-5
        assert "tokenizer, chat template" in describe_export(tmp_path / out)


@pytest.mark.parametrize("moe", [False, True], ids=["qwen2", "qwen2-moe"])
def test_an_adapter_peft_saved_starts_a_run_at_peft_logits(moe, base_dir, tmp_path):
    """A PeftModel of all-linear r 4 with random non-zero B, saved by PEFT, read through model.adapter.path: the run's
    logits are PEFT's, and its adapter's settings are the directory's. PEFT 0.22 saves a MoE's adapters of experts
    and router as target_parameters, the gate-up matrix at rank 2r through rank_pattern and alpha_pattern."""
    if moe:
        base_dir = tmp_path / "moe"
        hf_config = transformers.AutoConfig.for_model(**(config_to_hf(preset("tiny-qwen2-moe")) | {"vocab_size": 96}))
        transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, config)
    assert bool(model.peft_config["default"].target_parameters) == moe
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path / "saved")
    ids = torch.randint(0, 96, (2, 12))
    expected = logits_of(model.eval(), ids)
    trainer = lora_trainer(base_dir, tmp_path / "run", AdapterSection(type="lora", path=str(tmp_path / "saved")))
    assert (trainer.spec.adapter.r, trainer.spec.adapter.alpha) == (4, 16.0)
    assert rel_err(trainer.logits(ids), expected) < 1e-5
    trainer.close()


def test_an_adapter_of_another_shape_is_refused_before_anything_loads(base_dir, tmp_path, monkeypatch):
    """An adapter saved with r 8 whose adapter_config.json says r 4, and one for a wider model: each refused in one
    line naming the tensor, both shapes and the fix, before the base model is read."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "r8"
    )
    settings = json.loads((tmp_path / "r8" / "adapter_config.json").read_text())
    (tmp_path / "r8" / "adapter_config.json").write_text(json.dumps(settings | {"r": 4}))
    wide = config_to_hf(preset("tiny-qwen2")) | {"vocab_size": 96}
    wide = transformers.AutoConfig.for_model(**(wide | {"hidden_size": 2 * wide["hidden_size"]}))
    wide_model = transformers.AutoModelForCausalLM.from_config(wide)
    peft.get_peft_model(wide_model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(
        tmp_path / "wide"
    )

    def no_load(*args, **kwargs):
        raise AssertionError("the base model was read before the adapter was checked")

    monkeypatch.setattr("megatrain.trainer.load_hf_weights", no_load)
    rank = r"q_proj\.lora_A\.weight has shape \(8, \d+\), this model needs \(4, \d+\); its rank is 8, .* set r to 8"
    other = r"shape \(\d+, \d+\), this model needs \(\d+, \d+\); the adapter is for another base model"
    for name, message in (("r8", rank), ("wide", other)):
        with pytest.raises(ZooError, match=message) as refused:
            lora_trainer(base_dir, tmp_path / name, AdapterSection(type="lora", path=str(tmp_path / name)))
        assert "\n" not in str(refused.value)


def test_a_lora_runs_final_is_its_adapter_and_convert_merges_it(base_dir, tmp_path, capsys):
    """`megatrain train` with model.adapter writes final/ as a PEFT directory served as its base is (tokenizer, chat
    template); `megatrain convert RUN DIR --merge` finds it and writes the merged model with PeftModel's logits (never
    into the run's base, and into a model only with --overwrite), and `megatrain eval` of the run (its adapters over
    its base) gives the merged model's loss."""
    np.save(tmp_path / "ids.npy", np.random.default_rng().integers(0, 96, 400, dtype=np.int32))
    run = tmp_path / "run"
    pairs = [f"model.hf_dir={base_dir}", "model.adapter.type=lora", "model.adapter.r=4", "data.tokens=ids.npy"]
    pairs += ["data.seq_len=12", "device=cpu", "train.batch_size=2", "train.micro_batch_size=2", "train.lr=1e-2"]
    pairs += ["train.steps=2", f"output_dir={run}"]
    with chdir(tmp_path):
        assert main(["train", *(arg for pair in pairs for arg in ("--set", pair))]) == 0
        assert main(["convert", str(run), "merged", "--merge"]) == 0
        assert "merged 14 adapted matrices" in capsys.readouterr().err  # (all-linear: 7 per layer, 2 layers)
        base_files = {p.name: p.read_bytes() for p in base_dir.iterdir() if p.is_file()}
        refusals = [  # (the run's own base, --overwrite or not: the run, its eval and its resume read it)
            ([str(base_dir), "--overwrite"], "is the LoRA run's base model, which this conversion reads"),
            (["merged"], "merged holds a model already; name a new directory, or add --overwrite to replace it"),
        ]
        for out, refusal in refusals:
            assert main(["convert", str(run), *out, "--merge"]) == 2
            assert refusal in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in base_dir.iterdir() if p.is_file()} == base_files
        assert main(["convert", str(run), "merged", "--merge", "--overwrite"]) == 0
        same = [arg for pair in pairs[3:8] for arg in ("--set", pair)]  # (the run's data, as the merged model's)
        losses = []
        for weights in (run, tmp_path / "merged"):  # (the run's final/: its adapters over its base)
            assert main(["eval", "--checkpoint", str(weights), "--batches", "2", *same]) == 0
            losses.append(json.loads(capsys.readouterr().out.splitlines()[-1])["val_loss"])
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
        Path("alone").mkdir()  # (the adapter's files alone, no run beside them: its tokenizer is its base's)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(run / "final" / name, Path("alone", name))
        Path("prompts.txt").write_text("w1 w2 w3\n")
        assert main(["generate", "--checkpoint", "alone", "--prompts", "prompts.txt", "--max-new-tokens", "2"]) == 0
        assert json.loads(capsys.readouterr().out.splitlines()[-1])["prompt"] == "w1 w2 w3"
    final = run / "final"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in final.iterdir()}
    assert "tokenizer, chat template" in describe_export(final)
    ids = torch.randint(0, 96, (2, 12))
    expected = logits_of(peft_model(base_dir, final), ids)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert rel_err(logits_of(merged, ids), expected) < 1e-5
    assert "tokenizer, chat template" in describe_export(tmp_path / "merged")


def test_an_adapter_over_a_preset_says_how_it_is_served(tmp_path, capsys):
    """LoRA over a preset's seeded weights: no directory holds the base that adapter_config.json would name, so the
    run's last line says that `convert --merge` serves it (and it does)."""
    pairs = ["model.preset=tiny-llama", "model.adapter.type=lora", "data.seq_len=16", "device=cpu", "train.steps=1"]
    pairs += ["train.batch_size=2", "train.micro_batch_size=2", f"output_dir={tmp_path / 'run'}"]
    assert main(["train", *(arg for pair in pairs for arg in ("--set", pair))]) == 0
    assert (
        "an adapter over a base that no directory holds: `megatrain convert RUN OUT --merge`" in capsys.readouterr().err
    )
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "merged"), "--merge"]) == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged") is not None
    (tmp_path / "run" / "final" / "tokenizer.json").unlink()  # (a run on token ids alone: said beside the tokenizer's)
    said = describe_export(tmp_path / "run" / "final")
    assert "no tokenizer" in said and said.endswith("`megatrain convert RUN OUT --merge` serves it"), said


def test_generation_runs_with_the_adapters_on(base_dir, tmp_path):
    """Greedy completions of a trained adapter's run (the GRPO rollouts' engine) equal PeftModel's over its export,
    in both of the engine's ways of holding the layers, and differ from the base's alone."""
    from megatrain_zoo.generate import Generator, Sampling

    adapter = AdapterSection(type="lora", r=4, alpha=32.0, target_modules=("all-linear",))
    trainer = lora_trainer(base_dir, tmp_path / "run", adapter, steps=3)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    for _ in range(3):
        trainer.train_step(StepBatch(*random_batch(2, 12, 96, generator)))
    prompts = [torch.randint(4, 96, (n,), generator=generator).tolist() for n in (5, 9, 3)]
    sampling = Sampling(max_new_tokens=6, temperature=0.0, stop_ids=(1,))
    ours = {
        weights: Generator(trainer, weights).generate(prompts, sampling, pad_id=0)
        for weights in ("resident", "streamed")
    }
    reference = peft_model(base_dir, trainer.export(tmp_path / "adapter"))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    trainer.close()

    def greedy(model, prompt):
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=[1], pad_token_id=0
        )
        return out[0, len(prompt) :].tolist()

    expected = [greedy(reference, prompt) for prompt in prompts]
    assert ours["resident"] == ours["streamed"] == expected
    assert [greedy(base, prompt) for prompt in prompts] != expected


def test_a_resumed_lora_run_trains_as_one_that_was_not_stopped(base_dir, tmp_path):
    """A checkpoint of a LoRA run holds its adapters and their moments alone (not the base); a run resumed from it
    takes the same steps, bit for bit, as the run that went on, and the base stays the directory's."""
    adapter = AdapterSection(type="lora", r=4, alpha=8.0)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    batches = [StepBatch(*random_batch(2, 12, 96, generator)) for _ in range(4)]
    going_on = lora_trainer(base_dir, tmp_path / "run", adapter, steps=4)
    for batch in batches[:2]:
        going_on.train_step(batch)
    saved = save_checkpoint(going_on.state_dict(), tmp_path / "run" / "checkpoints")
    stored = {n for n in read_safetensors_header(saved / "model.safetensors") if n != "__metadata__"}
    assert stored and all(".lora_" in n for n in stored)
    resumed = lora_trainer(base_dir, tmp_path / "resumed", adapter, steps=4)
    resumed.load_state_dict(resolve_resume(saved).state())
    for batch in batches[2:]:
        assert resumed.train_step(batch).loss == going_on.train_step(batch).loss
    ours, theirs = resumed.named_weights(), going_on.named_weights()
    assert all(torch.equal(ours[n], theirs[n]) for n in theirs)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    assert torch.equal(ours["model.layers.1.mlp.up_proj.weight"], base["model.layers.1.mlp.up_proj.weight"])
    for trainer in (resumed, going_on):
        trainer.close()


def test_a_lora_checkpoint_over_a_changed_base_is_refused(base_dir, tmp_path, capsys):
    """A LoRA run's checkpoints know its base by its weight files: `eval` and `--resume` over a base whose weights
    changed since (merged adapters written over it) are refused in one line, naming the fix; over a copy of the same
    base they go ahead."""
    base, copy, run = tmp_path / "base", tmp_path / "copy", tmp_path / "run"
    shutil.copytree(base_dir, base)
    shutil.copytree(base_dir, copy)
    np.save(tmp_path / "ids.npy", np.random.default_rng().integers(0, 96, 400, dtype=np.int32))
    pairs = [f"model.hf_dir={base}", "model.adapter.type=lora", "model.adapter.r=4", "data.tokens=ids.npy"]
    pairs += ["data.seq_len=12", "device=cpu", "train.batch_size=2", "train.micro_batch_size=2", "train.steps=2"]
    pairs += ["train.save_every=1"]
    with chdir(tmp_path):
        assert main(["train", *(arg for pair in [*pairs, f"output_dir={run}"] for arg in ("--set", pair))]) == 0
        checkpoint = sorted((run / "checkpoints").glob("step-*"))[-1]
        evaluate = ["eval", "--checkpoint", str(checkpoint), "--batches", "1"]
        assert main([*evaluate, "--set", f"model.hf_dir={copy}"]) == 0  # (the same base, elsewhere)
        weights = load_file(base / "model.safetensors")
        weights["model.layers.0.self_attn.q_proj.weight"] += 0.01  # (as a merge writes the adapted matrices)
        save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
        capsys.readouterr()
        for command in (evaluate, ["train", "--resume", str(run), "--set", "train.steps=3"]):
            assert main(command) == 2
            err = capsys.readouterr().err.strip().splitlines()[-1]  # (after `--resume`'s "resuming in RUN")
            assert f"model error: the base model {base} is not the one checkpoint {checkpoint} was trained" in err
            assert "restore that base, or start a new run from these adapters (model.adapter.path)" in err


@pytest.mark.parametrize(
    "name, targets, experts_per_stage",
    [
        ("tiny-qwen2-moe", ("all-linear",), "auto"),
        ("tiny-qwen2-moe", ("all-linear",), 3),
        ("tiny-olmoe", ("q_proj", "gate_proj", "up_proj"), "auto"),
        ("tiny-mixtral", ("w2",), "auto"),
    ],
)
def test_a_mixture_of_experts_adapter_exports_as_peft_0_22_saves_one(name, targets, experts_per_stage, tmp_path):
    """The experts' adapters (and the router's, under all-linear) leave in PEFT 0.22's layout and settings
    (target_parameters; the gate-up matrix at rank 2r through rank_pattern and alpha_pattern): PeftModel computes
    megatrain's logits from them, --merge writes a transformers model with those logits, and the export, read back
    through model.adapter.path, starts a run there. A run with its experts in parts of 3 exports the same files."""
    engine = EngineSection(experts_per_stage=experts_per_stage)
    base_dir = tmp_path / "base"
    hf_config = transformers.AutoConfig.for_model(**config_to_hf(preset(name)))
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).save_pretrained(base_dir)
    adapter = AdapterSection(type="lora", r=4, alpha=8.0, target_modules=targets)
    trainer = lora_trainer(base_dir, tmp_path / "run", adapter, engine=engine)
    assert bool(trainer.spec.expert_parts) == (experts_per_stage == 3)
    vocab = trainer.model_config.vocab_size
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    for _ in range(2):
        trainer.train_step(StepBatch(*random_batch(2, 12, vocab, generator)))
    ids = torch.randint(0, vocab, (2, 12), generator=generator)
    ours = trainer.logits(ids)
    experts = {n: v for n, v in trainer.named_weights().items() if ".experts." in n and ".lora_B." in n}
    assert experts and all(v.abs().max() > 0 for v in experts.values())
    exported = trainer.export(tmp_path / "adapter")
    trainer.close()

    settings = json.loads((exported / "adapter_config.json").read_text())
    theirs = peft_model(base_dir, exported)
    assert set(settings["target_parameters"]) == set(theirs.peft_config["default"].target_parameters)
    assert rel_err(logits_of(theirs, ids), ours) < 1e-5
    assert main(["convert", str(exported), str(tmp_path / "merged"), "--merge"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert rel_err(logits_of(merged.eval(), ids), ours) < 1e-5
    adapter = AdapterSection(type="lora", r=4, alpha=8.0, target_modules=targets, path=str(exported))
    resumed = lora_trainer(base_dir, tmp_path / "again", adapter, engine=engine)
    assert rel_err(resumed.logits(ids), ours) < 1e-5
    resumed.close()
