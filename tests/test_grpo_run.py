"""`megatrain train` with GRPO end to end on the CPU: a toy task a small model learns (answer a+b, rewarded for
starting with a digit and more for the right one) raises its mean reward; a run resumed in the middle of a
rollout's updates continues exactly; given completions train with a reference pass; `megatrain generate` answers;
bad input gets one line."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from megatrain.cli import main
from megatrain_data import train_tokenizer

REWARD = """
def digit_then_sum(prompts, completions, answer, **_):
    return [(0.2 if c.strip()[:1].isdigit() else 0.0) + (1.0 if c.strip().startswith(a) else 0.0)
            for c, a in zip(completions, answer)]

def broken(prompts, completions, **_):
    raise KeyError("score")

def infinite(prompts, completions, **_):
    return [float("inf")] * len(completions)

calls = 0

def flaky(prompts, completions, **_):
    global calls
    calls += 1
    if calls == 3:
        raise ConnectionError("the grader is down")
    return [0.0] * len(completions)
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy task's prompts, tokenizer and reward module; returns write(name, **train overrides) -> config."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "corpus.txt").write_text(" ".join(f"{a}+{b}={a + b}" for a in range(10) for b in range(10)) * 5)
    train_tokenizer(tmp_path / "corpus.txt", 64, tmp_path / "tokenizer.json")
    (tmp_path / "toy_rewards.py").write_text(REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(name: str, grpo: dict | None = None, **train) -> str:
        config = {
            "model": {"preset": "tiny-llama"},
            "data": {"dataset": str(tmp_path / "prompts.jsonl"), "format": "prompt", "seq_len": 16},
            "train": {
                "objective": "grpo",
                "steps": 40,
                "batch_size": 32,
                "micro_batch_size": 16,
                "lr": 1e-3,
                "warmup_steps": 2,
                "grpo": {
                    "num_generations": 8,
                    "max_prompt_length": 8,
                    "max_completion_length": 4,
                    "reward_funcs": ["toy_rewards:digit_then_sum"],
                    **(grpo or {}),
                },
                **train,
            },
            "precision": {"compute_dtype": "float32"},
            "device": "cpu",
            "output_dir": str(tmp_path / name),
        }
        config["data"]["tokenizer"] = str(tmp_path / "tokenizer.json")
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        return str(path)

    return write


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_mean_reward_rises_on_a_toy_task(toy, tmp_path):
    assert main(["train", "--config", toy("run", steps=120)]) == 0
    rewards = [row["reward"] for row in metrics(tmp_path / "run")]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last > first + 0.1, (first, last)
    row = metrics(tmp_path / "run")[-1]
    assert {"reward_std", "frac_reward_zero_std", "completions/mean_length", "clip_ratio/region_mean"} <= set(row)
    assert "rewards/digit_then_sum/mean" in row  # (TRL's name: the function's own)
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert {"prompt", "completion", "reward", "advantage"} <= set(samples[0]) and samples[0]["step"] == 1


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_a_run_resumed_inside_a_rollouts_updates_continues_exactly(toy, tmp_path, beta):
    """Two updates per rollout, a checkpoint after step 3 (the second rollout's first update): the resumed run
    takes the rollout from the checkpoint and samples the next ones with the same seeds; with the KL term, its
    reference is still the initial weights (not the checkpoint's)."""
    settings = {"steps": 6, "save_every": 3, "grpo": {"num_iterations": 2, "temperature": 0.9, "beta": beta}}
    assert main(["train", "--config", toy("full", **settings)]) == 0
    step3 = tmp_path / "full" / "checkpoints" / "step-00000003"
    assert (step3 / "rollout.safetensors").exists()
    assert main(["train", "--config", toy("resumed", **settings), "--resume", str(step3)]) == 0
    full, resumed = metrics(tmp_path / "full"), metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(full[3:], resumed):
        assert (a["loss"], a["grad_norm"], a.get("reward"), a.get("kl")) == (
            b["loss"], b["grad_norm"], b.get("reward"), b.get("kl")
        )  # fmt: skip
    assert (full[0].get("kl"), full[-1].get("kl", 0) > 0) == ((0.0, True) if beta else (None, False))
    a, b = (load_file(str(tmp_path / run / "final" / "model.safetensors")) for run in ("full", "resumed"))
    assert all((a[k] == b[k]).all() for k in a)


def test_given_completions_train_with_a_reference_pass(toy, tmp_path, capsys):
    """A rollouts file trains (its reference pass cached), and `megatrain data` shows its rows as trained: the
    prompt, then the completion's tokens, the trained span."""
    rollouts = tmp_path / "rollouts.jsonl"
    lines = []
    for group in range(4):
        for k in range(4):
            lines.append({"prompt": f"{group}+{k}=", "completion": str(group + k), "reward": float(k % 2)})
            lines[-1]["prompt"] = f"{group}+1="  # (a group: one prompt)
    rollouts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    grpo = {"rollouts": str(rollouts), "num_generations": 4, "beta": 0.04, "reward_funcs": []}
    config = toy("file", grpo, steps=3, batch_size=8, micro_batch_size=8)
    assert main(["data", "--config", config, "--dump", "2", "--text"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("--- sequence") == 2 and "0+1=⟦0⟧" in shown and "0+1=⟦1⟧" in shown, shown
    assert main(["train", "--config", config]) == 0
    rows = metrics(tmp_path / "file")
    assert len(rows) == 3 and all("kl" in row for row in rows) and rows[0]["kl"] == pytest.approx(0.0, abs=1e-9)
    assert list((tmp_path / "file" / "cache").glob("reference-tokens-*.npy"))


def test_a_reference_model_changed_since_the_run_is_refused_on_resume(toy, tmp_path, capsys):
    """The KL's reference written over between a run's start and its resume (another model exported into its
    folder): refused, where the resumed steps took their KL against another model without a word."""
    from megatrain import Trainer, load_config

    def export_reference(seed: int):
        trainer = Trainer(load_config(toy("ref", seed=seed)))
        trainer.export(tmp_path / "reference")
        trainer.close()

    rollouts = tmp_path / "rollouts.jsonl"
    lines = [{"prompt": f"{g}+1=", "completion": str(k), "reward": float(k % 2)} for g in range(2) for k in range(4)]
    rollouts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    grpo = {"rollouts": str(rollouts), "num_generations": 4, "beta": 0.04, "reward_funcs": []}
    grpo["ref_model"] = str(tmp_path / "reference")
    export_reference(1)
    assert main(["train", "--config", toy("run", grpo, steps=2, save_every=1, batch_size=8, micro_batch_size=8)]) == 0
    export_reference(2)
    capsys.readouterr()
    assert main(["train", "--resume", str(tmp_path / "run" / "checkpoints" / "step-00000001")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"the GRPO reference {tmp_path / 'reference'} changed since this run used it" in err[-1], err


def test_generate_answers_prompts_from_a_run(toy, tmp_path, capsys):
    assert main(["train", "--config", toy("run", steps=2)]) == 0
    (tmp_path / "ask.txt").write_text("1+2=\n3+1=\n")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--prompts", str(tmp_path / "ask.txt"),
                 "--max-new-tokens", "3"]) == 0  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["1+2=", "3+1="] and all("completion" in line for line in lines)


@pytest.mark.parametrize(
    "grpo, train, message",
    [
        ({"reward_funcs": ["toy_rewards:missing"]}, {}, "cannot be loaded"),
        ({"reward_funcs": ["no_such_module:f"]}, {}, "cannot be loaded (ModuleNotFoundError"),
        ({"reward_funcs": ["toy_rewards:broken"]}, {}, "reward function 'toy_rewards:broken' raised KeyError"),
        ({"reward_funcs": ["toy_rewards:infinite"]}, {}, "rewards must be finite"),
        ({"max_prompt_length": 2, "max_completion_length": 4}, {}, "prompts are longer than"),
        ({"num_generations": 5}, {}, "must be a multiple of train.grpo.num_generations 5"),
        ({"beta": 0.1, "ref_model": "no_such_dir"}, {}, "train.grpo.ref_model no_such_dir"),
        ({"max_completion_length": 20}, {}, "data.seq_len 16 cannot hold"),
        ({"rollouts": "missing.jsonl"}, {}, "does not exist"),
    ],
)
def test_bad_grpo_input_is_one_line(toy, capsys, grpo, train, message):
    assert main(["train", "--config", toy("bad", grpo, **train)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and not any("Traceback" in line for line in err)


def test_a_reward_function_that_does_not_load_is_refused_before_the_model_is(toy, tmp_path, capsys, monkeypatch):
    """A misspelled reward function was found once the model's weights were loaded (4.5 GB of host memory for a
    270M model): now before the trainer is made."""
    import megatrain.loop

    monkeypatch.setattr(megatrain.loop, "Trainer", lambda *a, **k: pytest.fail("the trainer was made"))
    assert main(["train", "--config", toy("bad", {"reward_funcs": ["toy_rewards:missing"]})]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'toy_rewards:missing' cannot be loaded" in err[0], err


def test_data_shows_the_prompts_and_eval_points_to_generate(toy, capsys):
    config = toy("run")
    assert main(["data", "--config", config, "--dump", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["answer"] for line in lines] == ["0", "1"] and all(line["input_ids"] for line in lines)
    assert main(["train", "--config", toy("run", steps=1)]) == 0
    capsys.readouterr()
    assert main(["eval", "--config", config, "--checkpoint", str(Path(config).parent / "run")]) != 0
    assert "megatrain generate" in capsys.readouterr().err


def test_a_reward_function_failing_mid_run_keeps_the_trained_steps(toy, tmp_path):
    """The reward function raises at step 3 (`megatrain train` as a subprocess): steps 1-2 are saved in a checkpoint
    first, then one line says "reward error", names the function and how to continue, exit 1."""
    config = toy("flaky", {"reward_funcs": ["toy_rewards:flaky"]}, steps=5, batch_size=8, micro_batch_size=8)
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "train", "--config", config],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    last = process.stderr.strip().splitlines()[-1]
    assert process.returncode == 1 and "Traceback" not in process.stderr, process.stderr
    assert last.startswith(
        "megatrain: reward error: reward function 'toy_rewards:flaky' raised ConnectionError: the grader is down"
    )
    checkpoint = tmp_path / "flaky" / "checkpoints" / "step-00000002"
    assert f"Steps 1-2 are saved in {checkpoint}; continue with `megatrain train --resume" in last
    assert json.loads((checkpoint / "manifest.json").read_text())["step"] == 2
    assert [row["step"] for row in metrics(tmp_path / "flaky")] == [1, 2]


def test_reward_names_are_taken_as_written(toy, tmp_path):
    """A format regex keeps its trailing space (`^ `: completions that start with a space, not every one) and
    its comma (`{1,2}`); each completion's reward is what the two regexes say of its text."""
    names = ["format:^ ", "format:^[0-9]{1,2}$"]
    assert main(["train", "--config", toy("names", {"reward_funcs": names}, steps=1, batch_size=16)]) == 0
    assert {f"rewards/{name}/mean" for name in names} <= set(metrics(tmp_path / "names")[0])
    samples = [json.loads(line) for line in (tmp_path / "names" / "completions.jsonl").read_text().splitlines()]
    for sample in samples:
        expected = sum(
            re.match(name.removeprefix("format:"), sample["completion"], re.DOTALL) is not None for name in names
        )
        assert sample["reward"] == expected, sample
