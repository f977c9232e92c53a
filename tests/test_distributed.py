"""Data parallel over torch.distributed: `megatrain train` in 2 and 4 ranks (gloo, on the CPU) equals one process
on the same config, step by step: the loss, the gradient norm and the exported weights. Also two simulated hosts of
two ranks each (a replica of the state per host, or the state split over them). The ranks are torchrun's, or
forked with its environment from one process that imported torch once (`forked_ranks.py`); torchrun's own
behaviour (a config error said once, signals, a rank that stops) is tested under torchrun."""

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from forked_ranks import free_port
from safetensors.torch import load_file

from megatrain_data import train_tokenizer
from megatrain_plan import host_memory

CONFIG = {
    "model": {"preset": "tiny-qwen2"},
    "data": {"seq_len": 16, "shuffle": True},
    "train": {
        "steps": 4,
        "batch_size": 8,
        "micro_batch_size": 2,
        "lr": 1e-3,
        "warmup_steps": 1,
        "weight_decay": 0.1,
        "grad_clip": 0.05,
        "seed": 3,
        "loss_plot": False,  # (1.3 s of each run's 4.6 on two cores: drawing it is not what these tests check)
    },
    "precision": {"compute_dtype": "float32"},
    "device": "cpu",
}


def simulate_host(monkeypatch, gib: float) -> None:
    """Plan as on a host whose operating system gives the run `gib` GiB (less the stated margin)."""
    monkeypatch.setattr(host_memory, "os_room", lambda: (int(gib * 2**30), "a simulated host"))


def run(tmp_path, name, launcher, device="cpu", **changes):
    """Train with `launcher` (a list of argv before `-m megatrain`); returns (metrics rows, exported weights)."""
    config = json.loads(json.dumps(CONFIG))
    for section, values in changes.items():
        config.setdefault(section, {}).update(values)
    config["device"] = device
    if "dataset" not in config["data"]:
        config["data"]["tokens"] = str(tmp_path / "tokens.npy")
    config["output_dir"] = str(tmp_path / name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(config))
    return launch(tmp_path, name, launcher, ["--config", str(path)])


# A launcher: `megatrain train` in the test's own process, as one process (its imports already paid: 2.6 of a tiny
# run's 4.6 s on two cores); the references the ranks are compared with run so
HERE = ["this process"]


def launch(tmp_path, name, launcher, args):
    """Run `megatrain train ARGS` under `launcher`; (metrics rows, exported weights) of output_dir `name`."""
    if launcher is HERE:
        (tmp_path / name / "stderr-0.txt").write_text(train_here(args))
    else:
        launch_processes(tmp_path, name, launcher, args)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert not (tmp_path / name / "loss.png").exists()  # (train.loss_plot: false)
    final = tmp_path / name / "final"
    weights = (
        final / "model.safetensors" if (final / "model.safetensors").exists() else final / "adapter_model.safetensors"
    )
    return rows, load_file(str(weights))  # (a LoRA run's final/ is its adapters, PEFT's directory)


def launch_processes(tmp_path, name, launcher, args) -> None:
    """`megatrain train ARGS` under `launcher` (a command, or one per host), each one's stderr kept."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGATRAIN_SHARED_DIR": str(tmp_path / "shm")}
    commands = launcher if isinstance(launcher[0], list) else [launcher]
    processes = [  # (each launcher and its ranks a process group of their own, for the kill below)
        subprocess.Popen(
            [*command, "-m", "megatrain", "train", *args], env=env, stderr=subprocess.PIPE, start_new_session=True
        )
        for command in commands
    ]
    for index, process in enumerate(processes):
        try:
            _, err = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:  # (a hung launch leaves no rank running on into the other tests)
            for launcher in processes:
                os.killpg(launcher.pid, signal.SIGKILL)
            raise
        assert process.returncode == 0, err.decode()
        (tmp_path / name / f"stderr-{index}.txt").write_bytes(err)  # per launcher (host)


def train_here(args) -> str:
    """`megatrain train ARGS` in this process, on one thread as the launched processes run; its stderr."""
    from megatrain.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            code = main(["train", *args])
    finally:
        torch.set_num_threads(threads)
    assert code == 0, err.getvalue()
    return err.getvalue()


def resume(tmp_path, name, launcher, steps, **changes):
    """Continue run `name` from its newest checkpoint up to `steps`, under `launcher`, with `changes`."""
    config = json.loads((tmp_path / f"{name}.yaml").read_text())
    config["train"]["steps"] = steps
    for section, values in changes.items():
        config.setdefault(section, {}).update(values)
    path = tmp_path / f"{name}-resumed.yaml"
    path.write_text(json.dumps(config))
    return launch(tmp_path, name, launcher, ["--config", str(path), "--resume", str(tmp_path / name)])


def torchrun(n, *extra):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", *extra]


def forked_ranks(n, *extra):
    """torchrun's `n` ranks forked from one launcher that imported torch once (`forked_ranks.py`, which takes
    torchrun's options): the launcher of the tests that compare the ranks' training with one process's. What
    torchrun itself does is tested under torchrun, as is one of these comparisons."""
    return [sys.executable, str(Path(__file__).with_name("forked_ranks.py")), f"--nproc-per-node={n}", *extra]


def assert_same_weights(weights_1, weights_n):
    """Within 1e-5 of each tensor's norm; k_proj.bias starts at zero and its gradient is rounding
    noise only (a per-query constant that softmax cancels), so it gets an absolute floor instead."""
    for name, tensor in weights_1.items():
        diff = (weights_n[name].double() - tensor.double()).norm().item()
        assert diff <= 1e-5 * tensor.double().norm().item() + 1e-6 * tensor.numel() ** 0.5, name


def assert_same_training(one, many):
    (rows_1, weights_1), (rows_n, weights_n) = one, many
    assert len(rows_1) == len(rows_n) == CONFIG["train"]["steps"]
    for a, b in zip(rows_1, rows_n):
        # (abs: GRPO's loss is about 1e-8 where its advantages sum to zero; metrics keep 8 significant digits)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b.get("router_max_violation") == pytest.approx(a.get("router_max_violation"))  # global loads
        assert b.get("router_seq_aux_loss") == pytest.approx(a.get("router_seq_aux_loss"))
        assert b.get("router_z_loss") == pytest.approx(a.get("router_z_loss"))
    assert rows_1[0]["grad_norm"] > CONFIG["train"]["grad_clip"]  # clipping really acts (when on)
    assert_same_weights(weights_1, weights_n)


@pytest.fixture
def tokens(tmp_path):
    np.save(tmp_path / "tokens.npy", np.random.default_rng().integers(0, 256, 40 * 16).astype(np.int32))


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_two_and_four_ranks_equal_one_process(tmp_path, tokens, grad_clip):
    train = {"grad_clip": grad_clip}
    one = run(tmp_path, "one", HERE, train=train)
    assert_same_training(one, run(tmp_path, "two", torchrun(2, "--standalone"), train=train))  # (as users launch)
    if grad_clip:  # (without clipping, updates apply as gradients land: each rank's shards of a small pool)
        assert_same_training(one, run(tmp_path, "four", forked_ranks(4, "--standalone"), train=train))


@pytest.mark.parametrize("grad_clip, split", [(0.05, False), (0.0, False), (0.05, True)])
def test_ranks_in_sweeps_equal_one_process_in_one(tmp_path, tokens, grad_clip, split):
    """Each rank runs its micro-batches in two sweeps: every sweep's gradients are reduced over the ranks (and the
    hosts, each holding half the state where they split it), and the earlier sweeps' sum of a rank's shard comes
    back to be added to the next: the same training as one process in one sweep."""
    train = {"grad_clip": grad_clip, "micro_batch_size": 1}  # (two micro-batches a rank, of four ranks too)
    one = run(tmp_path, "one", HERE, train=train, engine={"sweeps": 1})
    launcher = two_hosts(2) if split else forked_ranks(2, "--standalone")
    many = run(tmp_path, "many", launcher, train=train, engine={"sweeps": 2, "shard_across_hosts": split})
    assert json.loads((tmp_path / "many" / "placement.json").read_text())["placement"]["sweeps"] == 2
    assert_same_training(one, many)


def two_hosts(ranks_per_host: int, launcher=forked_ranks) -> list[list[str]]:
    """Two launchers (`forked_ranks`, or `torchrun`'s agents) on this machine, standing for two hosts (each with its own
    shared memory)."""
    port = free_port()
    return [
        launcher(
            ranks_per_host, "--nnodes=2", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}"
        )
        for node in range(2)
    ]


@pytest.mark.parametrize("pack, loss_type", [(False, "sigmoid"), (True, "sigmoid"), (False, "orpo"), (True, "orpo")])
def test_dpo_over_two_ranks_equals_one_process(tmp_path, pack, loss_type):
    """Preference pairs stay whole on a rank; the loss averages over every rank's pairs; the reference pass runs on
    every rank's share of the pairs and is gathered. Packed, each rank's share of a step's pairs shares rows. ORPO's
    NLL term is one token mean over every rank's chosen completions (ranks of unequal chosen tokens: each rank's own
    mean, summed, counted it once a rank)."""
    pairs = [{"prompt": f"Item {i} is", "chosen": f" good {i % 3}.", "rejected": f" bad {i % 5}!"} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((tmp_path / "pairs.jsonl").read_text() * 20)
    train_tokenizer(corpus, 256, tmp_path / "tokenizer.json")
    data = {
        "dataset": str(tmp_path / "pairs.jsonl"),
        "format": "preference",
        "tokenizer": str(tmp_path / "tokenizer.json"),
        "pack": pack,
        "seq_len": 48 if pack else 16,
    }
    train = {"objective": "dpo", "batch_size": 4, "micro_batch_size": 1, "dpo": {"beta": 0.3, "loss_type": loss_type}}
    one = run(tmp_path, "one", HERE, data=data, train=train)
    assert_same_training(one, run(tmp_path, "two", forked_ranks(2, "--standalone"), data=data, train=train))
    if pack and loss_type == "sigmoid":
        assert (
            "the first step's 4 pairs share 2 rows of 48 tokens, not 8"
            in (tmp_path / "one" / "stderr-0.txt").read_text()
        )


REWARD = """
def starts_with_answer(prompts, completions, answer, **_):
    return [float(c.strip().startswith(a)) + 0.1 * len(c) for c, a in zip(completions, answer)]
"""


def test_grpo_generating_over_two_ranks_equals_one_process(tmp_path, monkeypatch):
    """Each rank generates and scores its share of a step's groups, which every rank then gathers: the rewards,
    advantages, the reference's (KL) and old policy's log-probabilities and the updates equal one process's (a
    row's sample is its own, whichever rank draws it)."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "corpus.txt").write_text(" ".join(f"{a}+{b}={a + b}" for a in range(10) for b in range(10)) * 5)
    train_tokenizer(tmp_path / "corpus.txt", 64, tmp_path / "tokenizer.json")
    (tmp_path / "grpo_rewards.py").write_text(REWARD)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    data = {
        "dataset": str(tmp_path / "prompts.jsonl"),
        "format": "prompt",
        "tokenizer": str(tmp_path / "tokenizer.json"),
    }
    grpo = {
        "num_generations": 4,
        "max_prompt_length": 8,
        "max_completion_length": 6,
        "reward_funcs": ["grpo_rewards:starts_with_answer"],
        "beta": 0.05,
        "num_iterations": 2,
    }
    train = {"objective": "grpo", "batch_size": 8, "micro_batch_size": 2, "grpo": grpo}
    one = run(tmp_path, "one", [sys.executable], data=data, train=train)
    two = run(tmp_path, "two", forked_ranks(2, "--standalone"), data=data, train=train)
    assert_same_training(one, two)
    for a, b in zip(one[0], two[0]):  # (a rollout's second update logs no reward)
        assert (a.get("reward"), a.get("completions/mean_length")) == (
            b.get("reward"),
            b.get("completions/mean_length"),
        )
        assert b["kl"] == pytest.approx(a["kl"], rel=1e-5, abs=1e-9)
    assert one[0][-1]["kl"] > 0 and "reward" in one[0][0]


def test_two_hosts_of_two_ranks_equal_one_process(tmp_path, tokens):
    """Each host keeps its own replica of the state; gradients are reduced within and then across hosts."""
    assert_same_training(run(tmp_path, "one", HERE), run(tmp_path, "hosts", two_hosts(2)))


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_hosts_that_split_the_state_equal_one_process(tmp_path, tokens, grad_clip):
    """engine.shard_across_hosts: each host holds the masters and moments of half of every layer and
    receives the other half's updated weights; training, checkpoints and the export equal one process,
    and a checkpoint written by the split hosts resumes on one process (and one process's on them)."""
    train = {"grad_clip": grad_clip, "save_every": 2}
    one = run(tmp_path, "one", HERE, train=train)
    split = run(tmp_path, "split", two_hosts(2), train=train, engine={"shard_across_hosts": True})
    assert_same_training(one, split)
    assert "the state split over 2 hosts" in (tmp_path / "split" / "stderr-0.txt").read_text()
    for name in ("one", "split"):  # the same checkpoint files, whoever wrote them
        checkpoint = tmp_path / name / "checkpoints" / "step-00000004"
        for kind in ("model", "optimizer"):
            assert_same_weights(
                load_file(str(tmp_path / "one" / "checkpoints" / "step-00000004" / f"{kind}.safetensors")),
                load_file(str(checkpoint / f"{kind}.safetensors")),
            )
    if grad_clip:
        resumed = resume(tmp_path, "split", HERE, steps=6)  # split hosts' checkpoint on one process
        again = resume(tmp_path, "one", two_hosts(1), steps=6, engine={"shard_across_hosts": True})
        assert [r["step"] for r in resumed[0]] == [r["step"] for r in again[0]] == [1, 2, 3, 4, 5, 6]
        for a, b in zip(resumed[0], again[0]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
        assert_same_weights(resumed[1], again[1])


def test_experts_in_parts_on_hosts_that_split_the_state_equal_one_process(tmp_path, tokens):
    """gpt-oss with its experts in parts of 3 (row slices of its fused expert tensors, one group per
    part) on two hosts that split the state, against one process with whole layers: the same
    training, and checkpoints gathered from the hosts hold transformers' whole tensors."""
    model, train = {"preset": "tiny-gpt-oss"}, {"save_every": 4}
    one = run(tmp_path, "one", HERE, model=model, train=train)
    engine = {"shard_across_hosts": True, "experts_per_stage": 3}
    split = run(tmp_path, "split", two_hosts(2), model=model, train=train, engine=engine)
    assert_same_training(one, split)
    assert "model.layers.0.mlp.experts.gate_up_proj" in split[1]
    for kind in ("model", "optimizer"):
        assert_same_weights(
            *(
                load_file(str(tmp_path / name / "checkpoints" / "step-00000004" / f"{kind}.safetensors"))
                for name in ("one", "split")
            )
        )


def test_two_ranks_with_the_disk_tier_equal_one_process(tmp_path, tokens):
    """The host's ranks share one set of disk-tier state files (half the moments on disk), each
    updating its slice; the files are named for the run and gone when it ends."""
    state_dir = tmp_path / "state"
    engine = {"optimizer_state_dir": str(state_dir), "disk_state_fraction": 0.5}
    one = run(tmp_path, "one", HERE)
    assert_same_training(one, run(tmp_path, "two", forked_ranks(2, "--standalone"), engine=engine))
    assert not list(state_dir.iterdir())


def test_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path, tokens):
    with pytest.raises(AssertionError) as failure:
        run(tmp_path, "bad", torchrun(4, "--standalone"), train={"batch_size": 12})
    assert "train.batch_size (12) must be a multiple of the number of ranks (4)" in str(failure.value)


def test_resume_on_a_different_number_of_ranks(tmp_path, tokens):
    """A checkpoint written by two ranks resumes on one process and continues as if never stopped."""
    full = run(tmp_path, "full", HERE)
    run(tmp_path, "part", forked_ranks(2, "--standalone"), train={"steps": 2, "save_every": 2})
    rows, weights = resume(tmp_path, "part", HERE, steps=4)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(full[0], rows):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
    assert_same_weights(full[1], weights)


def test_moe_load_balancing_loss_over_two_ranks_equals_one_process(tmp_path, tokens):
    """The aux loss is a property of the global batch: the ranks sum their routing statistics."""
    model = {"preset": "tiny-mixtral"}
    one = run(tmp_path, "one", HERE, model=model)
    assert all(row["router_aux_loss"] > 0 for row in one[0])
    two = run(tmp_path, "two", forked_ranks(2, "--standalone"), model=model)
    assert_same_training(one, two)
    for a, b in zip(one[0], two[0]):
        assert b["router_aux_loss"] == pytest.approx(a["router_aux_loss"], rel=1e-6)


def test_correction_biases_balanced_by_load_over_ranks_and_split_hosts_equal_one_process(tmp_path, tokens):
    """DeepSeek-V3's biases move by the sign of their layer's excess load over the global batch: the ranks
    average their loads as they do gradients; two hosts that split the state, experts in parts, hold
    shards whose edges may fall between a bias's hi and lo halves. Its sequence-wise balance loss is a
    mean over the global batch's sequences, the router z-loss over its tokens. Two hosts of two ranks that
    split the state equal one process."""
    model = {"preset": "tiny-deepseek-v3"}
    train = {"router_bias_update_rate": 0.01, "router_seq_aux_loss_coef": 0.05, "router_z_loss_coef": 0.01}
    one = run(tmp_path, "one", HERE, model=model, train=train)
    biases = [name for name in one[1] if name.endswith("e_score_correction_bias")]
    # from zero, in steps of 0.01 (a tiny model's biases may swing back and forth to zero: some moved)
    assert biases and any(one[1][name].abs().max() > 0.005 for name in biases)
    engine = {"shard_across_hosts": True, "experts_per_stage": 3}
    split = run(tmp_path, "split", two_hosts(2), model=model, train=train, engine=engine)
    assert_same_training(one, split)
    for name in biases:
        assert split[1][name].sub(one[1][name]).abs().max() < 1e-6, name


LORA = {"type": "lora", "r": 4, "alpha": 8.0}


@pytest.mark.gpu
@pytest.mark.two_gpus
@pytest.mark.parametrize(
    "model, dtype, rel",
    [
        ({"preset": "tiny-mixtral"}, "float64", 1e-10),
        ({"preset": "tiny-mixtral", "adapter": LORA}, "float64", 1e-10),  # (adapters on a MoE's attention)
        ({"preset": "tiny-qwen2", "adapter": LORA | {"base_dtype": "nf4"}}, "float32", 1e-5),  # (nf4 unpacks to fp32)
    ],
    ids=["full", "lora", "qlora-nf4"],
)
def test_gpu_two_ranks_equal_one_process(tmp_path, tokens, model, dtype, rel):
    """NCCL, one GPU per rank, pinned shared arenas, collectives on the copy-out stream: float64 where the base can
    be, so a missing stream dependency would show far above rounding; LoRA's adapter gradients all-reduced over
    the ranks, its base held once per host (over a packed nf4 base too, dequantized on each GPU)."""
    changes = {"precision": {"compute_dtype": dtype}, "model": model}
    one = run(tmp_path, "one", [sys.executable], "cuda", **changes)
    two = run(tmp_path, "two", torchrun(2, "--standalone"), "cuda", **changes)
    for a, b in zip(one[0], two[0]):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel)
    if "adapter" in model:  # (what final/ holds: the adapters alone, trained alike)
        assert one[1].keys() == two[1].keys() and all("lora_" in name for name in one[1])
        assert_same_weights(one[1], two[1])


@pytest.mark.parametrize("split", [False, True])
def test_a_rank_that_stops_updating_stops_the_others_with_a_message(tmp_path, tokens, split):
    """Rank 1 is made to hang in its optimizer; rank 0, waiting for its shard, names it and stops
    (or, where two hosts split the state, waiting for its updated weights, names the other hosts)."""
    script = tmp_path / "hang.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, time
            import megatrain_optim
            update = megatrain_optim.HostAdamW.update_group
            hung = []
            def hang(self, *args, **kwargs):
                if os.environ["RANK"] == "1" and not hung:  # once: then it goes on and meets rank 0 gone
                    hung.append(True)
                    time.sleep(8)
                update(self, *args, **kwargs)
            megatrain_optim.HostAdamW.update_group = hang
            from megatrain.cli import main
            sys.exit(main(sys.argv[1:]))
            """
        )
    )
    config = json.loads(json.dumps(CONFIG)) | {"output_dir": str(tmp_path / "run")}
    config["data"]["tokens"] = str(tmp_path / "tokens.npy")
    config["engine"] = {"shard_across_hosts": split}
    (tmp_path / "c.yaml").write_text(json.dumps(config))
    env = {**os.environ, "MEGATRAIN_RANK_WAIT_S": "5", "MEGATRAIN_SHARED_DIR": str(tmp_path / "shm")}
    launchers = (
        [[*host, str(script)] for host in two_hosts(1, torchrun)]
        if split
        else [[*torchrun(2, "--standalone"), str(script)]]
    )
    processes = [
        subprocess.Popen([*launcher, "train", "--config", str(tmp_path / "c.yaml")], env=env, stderr=subprocess.PIPE)
        for launcher in launchers
    ]
    err = processes[0].communicate(timeout=300)[1].decode()
    for process in processes[1:]:
        process.kill()
    assert processes[0].returncode != 0
    expected = "did not receive the other hosts' updated weights" if split else "rank(s) [1] of host 0 have not updated"
    assert expected in err, err[-4000:]


@pytest.fixture
def torch_threads():
    """torch's CPU threads as they were before the test (a test that sets them gives them back)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def pretend_launched(monkeypatch, local_world: int) -> None:
    """Rank 0 of `local_world` processes on one host, as torchrun describes it, with the process group's calls
    answered here: `init_ranks` and `shared_arenas` run in this one process."""
    monkeypatch.setenv("WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "new_group", lambda *args, **kwargs: object())
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", lambda objects, src: None)


def test_a_rank_takes_its_threads_wait_and_shared_directory_from_the_engine_keys(tmp_path, monkeypatch, torch_threads):
    from megatrain.config import EngineSection
    from megatrain.distributed import init_ranks, shared_arenas

    pretend_launched(monkeypatch, local_world=2)
    engine = EngineSection(cpu_threads=2, rank_wait_s=5, shared_dir=str(tmp_path / "shm"))
    ranks = init_ranks("cpu", engine)
    assert torch.get_num_threads() == 2 and ranks.wait_s == 5
    assert shared_arenas(ranks, engine.shared_dir).directory.parent == tmp_path / "shm"
    ranks = init_ranks("cpu", EngineSection())  # auto: the host's cores split among its ranks
    assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2) and ranks.wait_s == 600


def test_the_environment_variables_override_the_wait_and_shared_directory(tmp_path, monkeypatch, torch_threads):
    from megatrain.config import EngineSection
    from megatrain.distributed import init_ranks, shared_arenas

    pretend_launched(monkeypatch, local_world=2)
    monkeypatch.setenv("MEGATRAIN_RANK_WAIT_S", "7")
    monkeypatch.setenv("MEGATRAIN_SHARED_DIR", str(tmp_path / "from-env"))
    engine = EngineSection(rank_wait_s=5, shared_dir=str(tmp_path / "shm"))
    ranks = init_ranks("cpu", engine)
    assert ranks.wait_s == 7
    assert shared_arenas(ranks, engine.shared_dir).directory.parent == tmp_path / "from-env"


def test_a_process_alone_takes_engine_cpu_threads_in_a_run(tmp_path, torch_threads):
    """engine.cpu_threads sets the threads of a run of one process too ("auto" leaves torch's own)."""
    from test_exactness import tiny_llama_config

    from megatrain.config import EngineSection
    from megatrain.trainer import Trainer

    torch.set_num_threads(2)
    Trainer(tiny_llama_config(tmp_path / "auto", "cpu", "float32", 8, batch_size=2, steps=1)).close()
    assert torch.get_num_threads() == 2
    engine = EngineSection(cpu_threads=1)
    Trainer(tiny_llama_config(tmp_path / "one", "cpu", "float32", 8, engine, batch_size=2, steps=1)).close()
    assert torch.get_num_threads() == 1


def test_a_rank_waits_engine_rank_wait_s_for_another_then_names_it():
    from megatrain_optim import RankError, Ranks, RankSync

    store = SimpleNamespace(
        n_groups=1, shared=SimpleNamespace(tensor=lambda name, dtype, numel: torch.zeros(numel, dtype=dtype))
    )
    sync = RankSync(Ranks(0, 2, 0, 2, wait_s=0.2), store, torch.device("cpu"))
    sync.mark_applied(0, 1)  # rank 1 never does
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] of host 0 have not updated group 0 for step 1"):
        sync.wait_applied([0], 1)
    assert 0.2 <= time.monotonic() - start < 5


def test_each_rank_plans_for_its_share_of_the_global_batch(monkeypatch):
    """Under torchrun the memory check counts one GPU's share of the batch, and the host's ranks."""
    from megatrain.config import load_config
    from megatrain.planning import make_plan
    from megatrain_optim.launch import launch_shape

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert launch_shape() == (4, 2)
    config = load_config(None, ["model.preset=qwen2.5-7b", "train.batch_size=64", "data.seq_len=2048", "device=cpu"])
    alone, shared = make_plan(config), make_plan(config, gpus=4, hosts=2)
    assert shared.tokens_per_step == alone.tokens_per_step
    assert shared.compute_s == pytest.approx(alone.compute_s / 8, rel=0.05)


def test_hosts_that_split_the_state_plan_a_part_each(monkeypatch):
    """Split over 4 hosts, a host holds a quarter of the masters, moments and gradients and a whole
    bf16 copy (2 + 16 / 4 B/param with clipping), updates a quarter, and sends its quarter of the
    weights plus the others' part of its gradient sum."""
    from megatrain.config import ConfigError, load_config
    from megatrain.planning import check_plan, make_plan, make_planner

    simulate_host(monkeypatch, 64)  # a replica (16 B/param) does not fit, a quarter does
    overrides = ["model.preset=qwen2.5-7b", "train.batch_size=64", "data.seq_len=2048", "device=cpu"]
    config = load_config(None, [*overrides, "precision.compute_dtype=bfloat16"])
    split = load_config(None, [*overrides, "precision.compute_dtype=bfloat16", "engine.shard_across_hosts=true"])
    h200 = 140 * 2**30  # (GPUs of that size: the runtime's host memory a GPU run's, not this CPU's compute's)
    replicated_planner = make_planner(config, gpus=8, hosts=4, gpu_memory=h200)
    parts_planner = make_planner(split, gpus=8, hosts=4, gpu_memory=h200)
    replicated = replicated_planner.plan(replicated_planner.place(replicated_planner.step_tokens))
    parts = parts_planner.plan(parts_planner.place(parts_planner.step_tokens))

    def state_per_param(plan):  # (beside the runtime's)
        return (plan.host_bytes - plan.host_items["runtime"]) / plan.n_params

    assert state_per_param(replicated) == pytest.approx(16, abs=0.1)
    assert parts.split_state and state_per_param(parts) == pytest.approx(2 + 16 / 4, abs=0.1)
    assert parts.optimizer_s == pytest.approx(replicated.optimizer_s / 4)
    assert parts.network_bytes == pytest.approx(3 / 4 * (4 + 2) * parts.n_params, rel=1e-6)
    # one host: nothing to split
    assert make_plan(split, gpu_memory=h200).host_bytes == make_plan(config, gpu_memory=h200).host_bytes
    with pytest.raises(ConfigError, match="engine.shard_across_hosts: true splits the state over the 4 hosts"):
        check_plan(replicated, replicated_planner)
    check_plan(parts, parts_planner)


def test_a_model_through_transformers_modules_on_split_hosts_with_the_disk_tier_equals_one_process(tmp_path, tokens):
    """The generic template (model.implementation: transformers) on two hosts of two ranks that split the state,
    half the moments on disk, trains as one process does; its weights keep transformers' names."""
    model = {"preset": "tiny-qwen2", "implementation": "transformers"}
    one = run(tmp_path, "one", HERE, model=model)
    engine = {"shard_across_hosts": True, "optimizer_state_dir": str(tmp_path / "state"), "disk_state_fraction": 0.5}
    assert_same_training(one, run(tmp_path, "split", two_hosts(2), model=model, engine=engine))
    assert "model.layers.0.self_attn.q_proj.weight" in one[1]


def test_a_config_error_under_torchrun_is_said_once_and_every_rank_exits_2(tmp_path, tokens):
    """`torchrun -m megatrain train` with a bad --set: the one line on rank 0 only; torchrun's summary lists both
    ranks with exit code 2 (none stopped by its SIGTERM while the other was still failing)."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(CONFIG | {"output_dir": str(tmp_path / "run")}))
    process = subprocess.run(
        [*torchrun(2, "--standalone"), "-m", "megatrain", "train", "--config", str(config), "--set", "train.lr=-1"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    said = [line for line in process.stderr.splitlines() if line.startswith("megatrain: ")]
    assert said == ["megatrain: config error: train.lr must be >= 0 (the peak learning rate), got -1.0"], said
    exit_codes = [line.split()[2] for line in process.stderr.splitlines() if line.strip().startswith("exitcode")]
    assert process.returncode == 1 and exit_codes == ["2", "2"], process.stderr


def test_a_refusal_rank_0_alone_makes_is_said_and_the_other_rank_says_one_line(tmp_path, tokens):
    """A data file that is missing: rank 0 reads the data first and refuses, the other rank's collective fails as
    rank 0 leaves: rank 0's line is said (torchrun ended it before it did), the other rank's is one line too."""
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(CONFIG | {"output_dir": str(tmp_path / "run")}))
    missing = ["--set", f"data.tokens={tmp_path / 'nope.npy'}"]
    process = subprocess.run(
        [*torchrun(2, "--standalone"), "-m", "megatrain", "train", "--config", str(config), *missing],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    said = [line for line in process.stderr.splitlines() if line.startswith("megatrain: ")]
    refused = f"megatrain: data error: data.tokens {tmp_path / 'nope.npy'} does not exist"
    assert any(line.startswith(refused) for line in said), process.stderr
    assert any(line.startswith("megatrain: another process of this run ended") for line in said)  # (rank 1)
    assert not any(line.startswith("[rank") and "Traceback" in line for line in process.stderr.splitlines())


RECORD_EXIT = """
import os, signal, subprocess, sys, time
late = os.environ["RANK"] == "1" and os.environ.get("LATE_RANK_1")  # (its megatrain out of torchrun's reach)
child = subprocess.Popen([sys.executable, "-m", "megatrain", *sys.argv[1:]], start_new_session=bool(late))
def forward(sig, _):  # (torchrun signals the rank's process group: megatrain gets it, but for the late rank)
    while late and not os.listdir(late) and child.poll() is None:
        time.sleep(0.01)
    if late:  # (the copy once the checkpoint rank 0's signal stopped both ranks for is written)
        child.send_signal(sig)
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, forward)
open(os.path.join(os.environ["EXIT_CODES"], os.environ["RANK"]), "w").write(str(child.wait()))
"""


@pytest.mark.parametrize("late", [False, True], ids=["together", "rank-1-late"])
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_to_torchrun_checkpoints_then_every_rank_exits_128_plus_it(tmp_path, tokens, sig, code, late):
    """SIGINT or SIGTERM to torchrun mid-run: torchrun passes it to the ranks, which write the checkpoint, say so
    once, and each exit 128 + the signal (recorded by a wrapper around each rank's megatrain); torchrun itself
    exits 1 (its SignalException). Where rank 1's copy comes only after rank 0's stop made both write the
    checkpoint (a loaded machine), rank 1 exits as rank 0's signal says, and its own copy, late, changes nothing."""
    (tmp_path / "record_exit.py").write_text(RECORD_EXIT)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "codes").mkdir()
    config = tmp_path / "config.yaml"
    long_run = {
        "train": CONFIG["train"] | {"steps": 100_000},
        "data": CONFIG["data"] | {"tokens": str(tmp_path / "tokens.npy")},
    }
    config.write_text(json.dumps(CONFIG | long_run | {"output_dir": str(tmp_path / "run")}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EXIT_CODES": str(tmp_path / "codes")}
    env |= {"LATE_RANK_1": str(tmp_path / "run" / "checkpoints")} if late else {}
    command = [*torchrun(2, "--standalone"), str(tmp_path / "record_exit.py"), "train", "--config", str(config)]
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = tmp_path / "run" / "metrics.jsonl", time.time() + 240
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.2)  # (until the first step is recorded: training has begun)
        process.send_signal(sig)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    codes = {path.name: int(path.read_text()) for path in (tmp_path / "codes").iterdir()}
    assert codes == {"0": code, "1": code} and process.returncode == 1, err
    said = [line for line in err.splitlines() if "received; checkpoint" in line]
    assert len(said) == 1 and said[0].startswith(f"megatrain: {sig.name} received; checkpoint {tmp_path / 'run'}")
    assert list((tmp_path / "run" / "checkpoints").glob("step-*/manifest.json"))
