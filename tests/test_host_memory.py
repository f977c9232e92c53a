"""The host-memory plan is a promise: `megatrain train` runs of a ~36M-parameter model on the CPU, each a process
of its own, under the placements that cost host memory (sweeps, gradients held for clipping, offloaded
checkpoints, the disk tier, DPO's cached reference pass, GRPO's KL reference copy), peak at no more resident memory
than the plan's items, what the process held when it was planned, and a slack far under the stated margin."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from megatrain_data import train_tokenizer
from megatrain_plan import HOST_MARGIN_MIN

# What a run may take beyond its plan and its footprint at planning, in these tests: the allocator's arenas and
# freed-late temporaries of a CPU step. Far under the stated margin (host_memory.HOST_MARGIN_MIN, 1 GiB), so that
# an item the plan left out (a copy of the gradients is 139 MiB here) fails the test.
SLACK = 96 * 2**20
VOCAB, D_MODEL, LAYERS, FFN = 24000, 512, 4, 1408


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A Llama-shaped Hugging Face directory of ~36M parameters: random fp32 weights, big enough that each host
    item a placement adds (0.14-0.3 GiB) is larger than the slack."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("model")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=D_MODEL,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=FFN,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    config.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "model.safetensors")
    return directory


# Runs `megatrain` and, at its exit, writes its address space's peak resident memory (VmHWM, kB) to the file named
# last on its command line. Not the child's ru_maxrss from wait4: exec folds the forking process's peak into it, so a
# test process past a GiB (the whole suite in one pytest process) would read as the run's own peak.
MEASURED_LAUNCH = """
import atexit, re, runpy, sys
peak_file = sys.argv.pop()
status = lambda: open("/proc/self/status").read()
atexit.register(lambda: open(peak_file, "w").write(re.search(r"VmHWM:\\s+(\\d+) kB", status())[1]))
sys.argv[0] = "megatrain"
runpy.run_module("megatrain", run_name="__main__", alter_sys=True)
"""


def run_measured(config: dict, tmp_path: Path) -> tuple[int, dict]:
    """Run `megatrain train` on `config` in a process of its own: (its peak RSS in bytes, placement.json's plan)."""
    path, peak_file = tmp_path / "config.yaml", tmp_path / "peak_kb"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-c", MEASURED_LAUNCH, "train", "--config", str(path), str(peak_file)]
    process = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert process.returncode == 0, process.stderr
    predicted = json.loads((Path(config["output_dir"]) / "placement.json").read_text())["predicted"]
    return int(peak_file.read_text()) * 1024, predicted


def base_config(model_dir: Path, tmp_path: Path, **train) -> dict:
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, VOCAB, 1 << 15).astype(np.int32))
    return {
        "model": {"hf_dir": str(model_dir)},
        "data": {"tokens": str(tokens), "seq_len": 64, "shuffle": False},
        "train": {"steps": 1, "batch_size": 8, "micro_batch_size": 2, "lr": 1e-4, "grad_clip": 0.0, **train},
        "precision": {"compute_dtype": "float32"},
        "device": "cpu",
        "output_dir": str(tmp_path / "run"),
    }


def preference_data(tmp_path: Path, config: dict) -> dict:
    rows = [
        {"prompt": f"Is {i} even?", "chosen": " yes" if i % 2 == 0 else " no", "rejected": " maybe"} for i in range(16)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    train_tokenizer(data, 256, tmp_path / "tokenizer.json")
    config["data"] = {"dataset": str(data), "format": "preference", "tokenizer": str(tmp_path / "tokenizer.json")}
    config["data"]["seq_len"] = 32
    return config


def prompt_data(tmp_path: Path, config: dict) -> dict:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(4) for b in range(4)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "corpus.txt").write_text(" ".join(f"{a}+{b}={a + b}" for a in range(10) for b in range(10)) * 5)
    train_tokenizer(tmp_path / "corpus.txt", 64, tmp_path / "tokenizer.json")
    config["data"] = {"dataset": str(data), "format": "prompt", "tokenizer": str(tmp_path / "tokenizer.json")}
    config["data"]["seq_len"] = 16
    return config


PLACEMENTS = {
    "sweeps": ({"engine": {"sweeps": 2}}, "gradients held across 2 sweeps"),
    "clipping": ({"train": {"grad_clip": 1.0}}, "gradients held for clipping"),
    "offloaded checkpoints": ({"engine": {"offload_checkpoints": True}}, "offloaded checkpoints"),
    "disk tier": ({"engine": {"disk_state_fraction": 0.5}}, "disk tier's page cache"),
    "dpo": ({"train": {"objective": "dpo", "batch_size": 4}}, "gradient pool"),
    "grpo": (
        {
            "train": {
                "objective": "grpo",
                "batch_size": 8,
                "micro_batch_size": 8,
                "grpo": {
                    "num_generations": 4,
                    "max_prompt_length": 8,
                    "max_completion_length": 4,
                    "beta": 0.04,
                    "reward_funcs": ["exact_match"],
                },
            }
        },
        "KL reference copy",
    ),
}


@pytest.mark.parametrize("case", PLACEMENTS)
def test_peak_rss_stays_within_the_plan(model_dir, tmp_path, case):
    settings, item = PLACEMENTS[case]
    config = base_config(model_dir, tmp_path)
    if case == "dpo":
        config = preference_data(tmp_path, config)
    elif case == "grpo":
        config = prompt_data(tmp_path, config)
    if case == "disk tier":
        settings["engine"]["optimizer_state_dir"] = str(tmp_path / "state")
    for section, values in settings.items():
        config.setdefault(section, {}).update(values)
    peak, predicted = run_measured(config, tmp_path)
    assert predicted["host_items"].get(item, 0) > 0, predicted["host_items"]  # the placement costs what it should
    planned = sum(predicted["host_items"].values()) + predicted["process_bytes"]
    assert peak <= planned + SLACK, (peak / 2**20, planned / 2**20, predicted["host_items"])
    assert SLACK < HOST_MARGIN_MIN
