"""`megatrain train` with train.objective dpo on preference records: TRL's metrics in metrics.jsonl and on held-out
pairs, the reference pass cached beside the data and equal to a fresh forward of the initial weights, exact resume
without a second pass, `megatrain eval` of a run, a reference model of another architecture refused."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.step import StepBatch
from megatrain.trainer import Trainer
from megatrain_data import PairWindows, builtin_corpus, load_token_data, train_tokenizer

SUBJECTS = ["The sky", "Water", "The sun", "Snow", "Grass", "The sea", "Fire", "Ice", "A lemon", "Coal"]
GOOD = ["is blue.", "is wet.", "is hot.", "is cold.", "is green.", "is salty.", "is bright.", "is hard.", "is sour."]


def pairs(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        chosen, rejected = rng.choice(GOOD, 2, replace=False)
        out.append(
            {"prompt": f"{SUBJECTS[i % len(SUBJECTS)]} ({i})", "chosen": f" {chosen}", "rejected": f" {rejected}"}
        )
    return out


@pytest.fixture
def dpo_config(tmp_path):
    """A DPO run's config file: tiny-llama, 24 pairs (a quarter held out), a byte-level tokenizer of its vocab."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs(24)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(builtin_corpus().read_text()[:20000] + data.read_text())
    train_tokenizer(corpus, 256, tmp_path / "tokenizer.json")

    def write(**train):
        config = {
            "model": {"preset": "tiny-llama"},
            "data": {
                "dataset": str(data),
                "format": "preference",
                "tokenizer": str(tmp_path / "tokenizer.json"),
                "seq_len": 24,
                "validation": 0.25,
            },
            "train": {
                "objective": "dpo",
                "dpo": {"beta": 0.2},
                "steps": 4,
                "batch_size": 3,
                "micro_batch_size": 2 if train.get("batch_size", 3) % 2 == 0 else 1,
                "lr": 1e-3,
                "save_every": 2,
                "eval_every": 2,
            }
            | train,
            "precision": {"compute_dtype": "float64"},
            "device": "cpu",
            "output_dir": str(tmp_path / "run"),
        }
        path = tmp_path / "dpo.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


def records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_dpo_run_logs_trls_metrics_caches_its_reference_and_resumes_exactly(dpo_config, tmp_path, capsys):
    path = dpo_config()
    assert main(["train", "--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "reference log-probabilities of 36 training sequences" in err  # 18 training pairs
    run = tmp_path / "run"
    rows = records(run)
    steps = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen"):
        assert key in steps[0] and f"val_{key}" in evals[0]
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy = reference at the first step

    # the cache equals a fresh forward of the initial weights
    (cached,) = [np.load(p) for p in (run / "cache").glob("reference-*.npy") if len(np.load(p)) == 36]
    config = load_config(path)
    fresh = Trainer(config, training=False)
    data = load_token_data(config.data, 256, run / "cache", None, max_prompt_length=config.train.dpo.max_prompt_length)
    batch = PairWindows(data.train, 1, shuffle=False, seed=0).pair_rows(list(range(18)))
    assert np.allclose(fresh.sequence_logps(StepBatch(batch.input_ids, batch.labels)).logps.numpy(), cached, rtol=1e-12)
    fresh.close()

    # resumed from step 2: the same steps, bit for bit, and no second reference pass
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000004")
    assert main(["train", "--resume", str(resumed / "checkpoints" / "step-00000002")]) == 0
    assert "reference log-probabilities" not in capsys.readouterr().err
    again = {r["step"]: r["loss"] for r in records(resumed) if "loss" in r}
    assert again == {r["step"]: r["loss"] for r in steps}

    assert main(["eval", "--checkpoint", str(run)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["data"] == "validation" and result["val_pairs"] == 6
    assert result["val_loss"] == pytest.approx(evals[-1]["val_loss"], abs=1e-6)


def test_the_reference_cache_is_keyed_by_what_the_reference_computes_with(dpo_config):
    """DPO's and GRPO's cached reference scores are found again only for the same rows, weights and model section: a
    run restarted with its LoRA base held otherwise (nf4 after bf16 ran out of memory) scores again (it read the
    other base's scores back: step 1's loss not ln 2)."""
    from types import SimpleNamespace

    from megatrain.reference import reference_key

    rows = (np.arange(12).reshape(3, 4), np.ones((3, 4), dtype=bool))

    def key(*overrides, rows=rows):
        config = load_config(dpo_config(), list(overrides))
        trainer = SimpleNamespace(config=config, model_config=config.model, compute_dtype=torch.float64)
        return reference_key(trainer, rows, None)

    lora = "model.adapter.type=lora"
    assert key(lora) == key(lora) != key()
    assert key(lora) != key(lora, "model.adapter.base_dtype=nf4") != key(lora, "model.adapter.base_dtype=int8")
    assert key(lora) != key(lora, rows=(rows[0] + 1, rows[1])) != key(lora, "train.seed=7")


def test_a_lora_dpo_runs_final_adapters_evaluate_as_its_last_step(dpo_config, tmp_path, capsys):
    """A LoRA DPO run that saved no checkpoint: `eval` of the run (its final/, PEFT's adapter files) loads the adapters
    over the base and scores the held-out pairs as the run's last evaluation did (it refused: a full model expected)."""
    assert main(["train", "--config", str(dpo_config(save_every=0)), "--set", "model.adapter.type=lora"]) == 0
    last = [r for r in records(tmp_path / "run") if "val_loss" in r][-1]
    capsys.readouterr()
    for named in (tmp_path / "run", tmp_path / "run" / "final"):
        assert main(["eval", "--checkpoint", str(named)]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["val_pairs"] == 6 and result["val_loss"] == pytest.approx(last["val_loss"], abs=1e-6), result
        assert result["val_rewards/margins"] == pytest.approx(last["val_rewards/margins"], abs=1e-6)


def test_dpo_needs_pairs_and_pairs_need_dpo(dpo_config, write_config, capsys):
    path = dpo_config()
    assert main(["train", "--config", str(path), "--set", "train.objective=sft"]) == 2  # (its train.dpo first)
    assert "train.dpo.beta is set, but train.objective is sft, which reads no train.dpo" in capsys.readouterr().err
    config = yaml.safe_load(path.read_text())
    del config["train"]["dpo"]
    path.write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(path), "--set", "train.objective=sft"]) == 2
    assert "the data are preference pairs (chosen/rejected): set train.objective: dpo" in capsys.readouterr().err
    assert main(["train", "--config", str(write_config()), "--set", "train.objective=dpo"]) == 2
    assert "train.objective dpo trains on preference pairs: set data.format: preference" in capsys.readouterr().err


def test_a_reference_model_of_another_architecture_is_refused(dpo_config, tmp_path, capsys):
    other = tmp_path / "other"
    qwen = Trainer(load_config(None, ["model.preset=tiny-qwen2", "device=cpu", f"output_dir={tmp_path / 'q'}"]))
    qwen.export(other)
    qwen.close()
    assert main(["train", "--config", str(dpo_config()), "--set", f"train.dpo.ref_model={other}"]) == 2
    err = capsys.readouterr().err
    assert f"train.dpo.ref_model {other} has arch 'qwen2' where the policy has 'llama'" in err
    assert torch.cuda.is_available() or "Traceback" not in err


def test_trl_pairs_train_without_data_format_and_a_first_step_tie_is_not_right(dpo_config, tmp_path):
    """`megatrain train` (a subprocess) of train.objective dpo on TRL's prompt/chosen/rejected records with no
    data.format: the objective says they are pairs. Its first step, policy = reference, scores each pair a tie (a
    margin of float32 noise), so none is right: rewards/accuracies 0, not the noise's coin flips."""
    path = dpo_config(steps=1, batch_size=8, eval_every=0, save_every=0)
    config = yaml.safe_load(path.read_text())
    del config["data"]["format"], config["data"]["validation"]
    config["precision"]["compute_dtype"] = "float32"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "train", "--config", str(path)], capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, process.stderr
    (first,) = records(tmp_path / "run")
    assert first["rewards/accuracies"] == 0.0 and abs(first["rewards/margins"]) < 1e-4, first


def test_a_reference_model_changed_since_the_run_is_refused(dpo_config, tmp_path, capsys):
    """A run's reference weights written over after it trained (a resumed SFT run exporting into the folder the DPO
    run starts from): `eval` and a resumed run refuse, where they recomputed the reference and scored against
    another model without a word."""

    def export_llama(seed: int):
        config = ["model.preset=tiny-llama", "device=cpu", f"output_dir={tmp_path / 'r'}", f"train.seed={seed}"]
        trainer = Trainer(load_config(None, config))
        trainer.export(tmp_path / "ref")
        trainer.close()

    export_llama(1)
    assert main(["train", "--config", str(dpo_config()), "--set", f"train.dpo.ref_model={tmp_path / 'ref'}"]) == 0
    capsys.readouterr()
    shutil.rmtree(tmp_path / "ref")
    export_llama(2)
    assert main(["eval", "--checkpoint", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"the DPO reference {tmp_path / 'ref'} changed since this run used it" in err[0]
