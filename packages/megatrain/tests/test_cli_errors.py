"""Every mistake a user can make on the command line ends in one line naming the problem and the fix, a
non-zero exit code, and no traceback; checked by running the command as a subprocess.

The cases share one process (`cli_driver.py`: the console script's `main`, torch imported once); Ctrl-C
during start-up needs processes of its own: one whose `import torch` is interrupted (a stand-in torch, no
real import), and one interrupted while it reads its data (a named pipe it waits on)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain.checkpoint import CHECKPOINTS, FINAL, MANIFEST
from megatrain_store.rundir import LOCK, RunLock
from megatrain_zoo import config_to_hf, preset

TINY = ["--set", "model.preset=tiny-llama", "--set", "device=cpu", "--set", "train.steps=1"]


def read_only_dir(tmp_path: Path) -> str:
    """A directory this process cannot write: without write permission, or for root (who may write there
    anyway) one in sysfs."""
    if os.geteuid() == 0:
        return "/sys/kernel"
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(0o500)
    return str(path)


# Settings refused in one line wherever the command runs: (command line, what its line must say)
SETTING_CASES = [
    (["train", *TINY, "--set", "train.warmup_steps=-10"], "train.warmup_steps must be >= 0"),
    (["train", *TINY, "--set", "train.grpo.beta=-0.1"], "train.grpo.beta must be >= 0, got -0.1"),
    (["train", *TINY, "--set", "train.seed=-1"], "train.seed must be >= 0"),
    (["bench", *TINY, "--steps", "0"], "--steps must be >= 1"),
    (["plan", *TINY, "--gpus", "0"], "--gpus must be >= 1"),
    (["plan", *TINY, "--gpu-memory-gib", "1e308"], "--gpu-memory-gib 1e+308 is more bytes than a machine holds"),
    (["plan", *TINY, "--host-memory-gib", "1e308"], "--host-memory-gib 1e+308 is more bytes than a machine holds"),
    (  # (as the run's ranks would refuse it)
        ["plan", *TINY, "--gpus", "2", "--set", "train.batch_size=3", "--set", "train.micro_batch_size=1"],
        "train.batch_size (3) must be a multiple of the number of ranks (2) times train.micro_batch_size (1)",
    ),
    (  # (a micro-batch set for one GPU: the fix keeps the step's batch, so its result)
        ["plan", *TINY, "--gpus", "2", "--set", "train.batch_size=8", "--set", "train.micro_batch_size=8"],
        "each rank runs whole micro-batches of its share; e.g. train.micro_batch_size: 4",
    ),
    (["train", *TINY, "--set", "train.keep_last=0"], "train.keep_last must be >= 1"),
    (
        ["train", *TINY, "--set", "train.objective=no_such_mod:Loss"],
        "train.objective 'no_such_mod:Loss' cannot be made",
    ),
    (
        ["train", *TINY, "--set", "data.format=prompt", "--set", "data.dataset=p.jsonl"],
        "data.format prompt is GRPO's prompt-only data; set train.objective: grpo",
    ),
    (
        ["train", *TINY, "--set", "train.betas=0.9"],
        "'train.betas' has value 0.9; it takes a list of 2 finite numbers",
    ),
    (["train", *TINY, "--set", "train.lr=fast"], "'train.lr' has value 'fast'; it takes a finite number"),
    (["train", *TINY, "--set", "train.grad_clip=nan"], "'train.grad_clip' has value 'nan'; it takes a finite"),
    (["train", *TINY, "--set", "device=cuda:abc"], "device must be cpu, cuda, cuda:N or auto, got 'cuda:abc'"),
    (["train", *TINY, "--set", "engine.cpu_threads=100000"], "engine.cpu_threads 100000 is more than this"),
    (["train", *TINY, "--set", "model.adapter.r=8"], "model.adapter.r set without model.adapter.type"),
    (["plan", *TINY, "--set", "train.router_z_loss_coef=0.01"], "train.router_z_loss_coef acts on the routers"),
    (["plan", *TINY, "--set", "train.freeze_language_model=true"], "this llama model is all language model"),
    (  # (taken and ignored)
        ["train", *TINY, "--set", "model.image_text=true", "--set", "train.freeze_vision_tower=false"],
        "model.image_text: true, train.freeze_vision_tower: false: for an image-text model's vision tower and "
        "projector; this llama model is all language model (it has neither): leave them out",
    ),
    (["plan", *TINY, "--set", "train.freeze_multi_modal_projector=true"], "projector: true: for an image-text"),
    (  # (the planner would take fewer without a word)
        ["train", *TINY, "--set", "engine.kept_layers=1000"],
        "engine.kept_layers 1000: this run has 2 layers that can keep their matmul products; set at most 2, or auto",
    ),
    (["train", *TINY, "--set", "engine.n_slots=1000"], "engine.n_slots 1000: this run has 4 stages to stream"),
    (["train", *TINY, "--set", "engine.gradient_pool=3"], "no landing pool to size; leave it auto"),
    (  # (before the data is read: the pairs named do not even exist)
        ["train", *TINY, "--set", "train.objective=dpo", "--set", "data.dataset=missing.jsonl"]
        + ["--set", "train.dpo.ref_model=no-such-model"],
        "train.dpo.ref_model no-such-model holds no config.json",
    ),
    (  # (refused before the data is read: the text named does not even exist)
        ["train", *TINY, "--set", "data.seq_len=100000", "--set", "data.text=missing.txt"],
        "data.seq_len 100000 is larger than the model allows",
    ),
    (["train", *TINY, "--set", "train.steps=2.5"], "'train.steps' has value 2.5; it takes a whole number"),
    (["train", *TINY, "--set", "train.save_every=-1"], "train.save_every must be >= 0"),
    (["train", *TINY, "--set", "train.min_lr_ratio=5"], "train.min_lr_ratio must be in [0, 1]"),
    (  # (it trained, then stopped on non-finite steps naming a checkpoint there was not)
        ["train", *TINY, "--set", "train.weight_decay=1e308"],
        "train.lr x train.weight_decay must be < 1, got 0.003 x 1e+308",
    ),
    # (sampling options checked before the checkpoint is looked for: a top-p past 1 or NaN was taken, a seed past int64
    # overflowed in the first step, a repetition penalty of 0 divided by it)
    (["generate", "--checkpoint", "no-run", "--prompts", "p.txt", "--top-p", "nan"], "--top-p must be in (0, 1]"),
    (["generate", "--checkpoint", "no-run", "--prompts", "p.txt", "--seed", str(2**64)], "--seed must be in [0, 2"),
    (
        ["generate", "--checkpoint", "no-run", "--prompts", "p.txt", "--repetition-penalty", "0"],
        "--repetition-penalty must be > 0 and finite, got 0.0",
    ),
]


def cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(command line, what its one line must say)."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-dir" / "notes.txt").write_text("mine\n")
    config = tmp_path / "config.yaml"
    config.write_text(f"model: {{preset: tiny-llama}}\ndevice: cpu\noutput_dir: {tmp_path / 'held'}\n")
    missing_tokenizer = tmp_path / "nowhere" / "tokenizer.json"
    finished = tmp_path / "finished"  # a run's checkpoint and final model (their files need not be whole)
    (finished / CHECKPOINTS / "step-00000003").mkdir(parents=True)
    (finished / CHECKPOINTS / "step-00000003" / MANIFEST).write_text("{}")
    (finished / FINAL).mkdir()
    exported = tmp_path / "exported"  # a run that ended before its first checkpoint (the quick start's)
    (exported / FINAL).mkdir(parents=True)
    for final in (finished / FINAL, exported / FINAL):  # (a model's config.json: a whole model's, read as one)
        (final / "config.json").write_text(json.dumps(config_to_hf(preset("tiny-llama"))))
    return [
        *unreadable_input_cases(tmp_path),
        *model_directory_cases(tmp_path),
        *SETTING_CASES,
        (["train", *TINY, "--set", f"output_dir={tmp_path / 'a-file'}"], "is a file; set output_dir to a directory"),
        (["train", *TINY, "--set", f"output_dir={read_only_dir(tmp_path)}"], "set output_dir to a writable directory"),
        (  # (found at the start, not when a full disk needs it)
            [
                "train",
                *TINY,
                "--set",
                f"output_dir={tmp_path / 'out'}",
                "--set",
                f"fallback_dir={read_only_dir(tmp_path)}/x",
            ],
            "); set fallback_dir to a writable directory on another disk, or leave it out",
        ),
        (["train", *TINY, "--set", "output_dir=null"], "config key 'output_dir' has no value; it takes text"),
        (["train", *TINY, "--set", "data.seq_len="], "config key 'data.seq_len' has no value; it takes a whole number"),
        (["train", "--config", str(tmp_path / "a-dir")], "is a directory; name the YAML file in it"),
        (
            ["train", *TINY, "--set", f"data.tokenizer={missing_tokenizer}"],
            f"data.tokenizer {missing_tokenizer} does not exist",
        ),
        (
            ["train", *TINY, "--set", f"data.tokenizer={tmp_path / 'a-dir'}"],
            f"data.tokenizer {tmp_path / 'a-dir'} is a directory; name the tokenizer.json in it",
        ),
        (["data", *TINY, "--dump", "-1"], "--dump must be >= 1"),
        (["train", "--resume", str(tmp_path / "no-run")], "no checkpoint at"),
        (["eval", "--checkpoint", str(tmp_path / "no-run")], "no weights at"),
        (["train", "--config", str(config)], "is in use by another run"),  # (this test holds its lock)
        (["bench", "--steps", "x"], "invalid int value: 'x'"),
        (["plan", *TINY, "--set", "model.preset=tiny-lama"], "model error: unknown model preset 'tiny-lama'"),
        (
            ["train", *TINY, "--set", f"output_dir={finished}"],
            "already holds a run (checkpoints up to step-00000003, its model in final/); continue it with --resume",
        ),
        (
            ["train", *TINY, "--set", f"output_dir={exported}"],
            f"already holds a run (its model in final/); train on from its model with --set model.hf_dir={exported}",
        ),
        *not_a_model_directory_cases(tmp_path, finished),
    ]


def not_a_model_directory_cases(tmp_path: Path, run: Path) -> list[tuple[list[str], str]]:
    """What megatrain writes that is no model directory, given as model.hf_dir (a run as `eval` and `convert` take
    it): the one line names what to give instead."""
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    hf_dir = ["train", *TINY, "--set", "model.preset=null", "--set"]
    checkpoint = run / CHECKPOINTS / "step-00000003"
    return [
        ([*hf_dir, f"model.hf_dir={run}"], f"is a megatrain run directory, not a model directory: its model is {run}/"),
        (
            [*hf_dir, f"model.hf_dir={checkpoint}"],
            "is a megatrain checkpoint, not a model directory: `megatrain convert",
        ),
        (
            [*hf_dir, f"model.hf_dir={adapters}"],
            "not a model: set model.hf_dir to their base model and model.adapter.path",
        ),
    ]


def model_directory_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """Model directories `model.hf_dir` or `convert` cannot read or write (`tmp_path`'s a-file and a-dir made by
    `cases`): (command line, what its one line says)."""
    weightless, untokenized = tmp_path / "hf-no-weights", tmp_path / "hf-no-tokenizer"
    for model_dir in (weightless, untokenized):
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config_to_hf(preset("tiny-llama"))))
    (untokenized / "model.safetensors").write_text("")  # (its tensors are not read before the data)
    listed, cut_index, bad_manifest = tmp_path / "hf-list", tmp_path / "hf-cut-index", tmp_path / "run-bad" / "step-1"
    for directory in (listed, cut_index, bad_manifest):
        directory.mkdir(parents=True)
    (listed / "config.json").write_text("[1, 2]")
    (cut_index / "config.json").write_text(json.dumps(config_to_hf(preset("tiny-llama"))))
    (cut_index / "model.safetensors.index.json").write_text("")  # (an interrupted download)
    (bad_manifest / MANIFEST).write_text("[]")
    hf_dir = ["train", *TINY, "--set", "model.preset=null", "--set"]
    return [
        ([*hf_dir, f"model.hf_dir={listed}"], "config.json holds a JSON list, not a model's settings"),
        ([*hf_dir, f"model.hf_dir={cut_index}"], "model.safetensors.index.json is damaged"),
        (["train", "--resume", str(bad_manifest)], "holds no manifest (a JSON list); the checkpoint is damaged"),
        (["plan", *TINY, "--host-memory-gib", "inf"], "--host-memory-gib must be >= 1 and finite, got inf"),
        (  # (the model the run starts from, as its output_dir: its config.json was written over)
            [
                "train",
                *TINY,
                "--set",
                "model.preset=null",
                "--set",
                f"model.hf_dir={untokenized}",
                "--set",
                f"output_dir={untokenized}",
            ],
            "holds a model or another program's files (its config.json is no megatrain run's)",
        ),  # fmt: skip
        (
            ["convert", str(tmp_path / "run"), str(tmp_path / "a-file")],
            "is a file; name a directory to write the model",
        ),
        (["convert", str(tmp_path / "run"), str(tmp_path / "a-dir")], "holds files but no model"),
        (["convert", str(untokenized), str(untokenized)], "is the source, which this conversion reads"),
        (
            ["convert", str(untokenized), str(weightless)],
            "holds a model already; name a new directory, or add --overwrite to replace it",
        ),
        (
            ["train", *TINY, "--set", "model.preset=null", "--set", f"model.hf_dir={untokenized}"],
            "has no tokenizer.json: its weights read the ids of the tokenizer they were trained with",
        ),
        (
            ["train", *TINY, "--set", "model.preset=null", "--set", f"model.hf_dir={weightless}"],
            "model error: no *.safetensors weights in",
        ),
        (
            ["train", *TINY, "--set", "model.preset=null", "--set", f"model.hf_dir={tmp_path / 'a-file'}"],
            "a-file/config.json not found: model.hf_dir must be a Hugging Face model directory",
        ),
        (
            ["train", *TINY, "--set", "model.preset=null", "--set", "model.hf_dir=Qwen/Qwen2.5-7B-Instruct"],
            "not the hub: `hf download Qwen/Qwen2.5-7B-Instruct --local-dir DIR` fetches it",
        ),
    ]


def unreadable_input_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """Inputs that are empty, not UTF-8 or not what their key reads: (command line, what its one line says)."""
    not_utf8 = {  # file: its bytes, each with one byte that is not UTF-8 on its last line
        "latin1.jsonl": b'{"text": "fine"}\n{"text": "caf\xe9"}\n',
        "latin1.json": b'[{"text": "caf\xe9"}]',
        "latin1.txt": b"one\ntwo\nthr\xffee\n",
        "latin1.yaml": b"train:\n  lr: 1e-3  # caf\xe9\n",
    }
    where = {}
    for name, raw in not_utf8.items():
        (tmp_path / name).write_bytes(raw)
        offset = next(i for i, byte in enumerate(raw) if byte >= 0x80)
        line = raw[:offset].count(b"\n") + 1
        where[name] = f"{name} line {line}, byte offset {offset} (0x{raw[offset]:02x}) is not UTF-8"
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    (tmp_path / "ids.txt").write_text("1 2 3\n")
    (tmp_path / "short.txt").write_text("a few words\n")
    (tmp_path / "arrays.jsonl").write_text("[1, 2, 3]\n")
    short = ["--set", f"output_dir={tmp_path / 'short-data'}"]
    return [
        # (refused once the data is read: its cache stays in output_dir for the next run)
        (
            ["train", *TINY, *short, "--set", "data.text=short.txt"],
            "windows of seq_len 128, fewer than one batch of 16",
        ),
        (
            ["train", *TINY, *short, "--set", "data.validation=short.txt"],
            "the validation data holds not one window of data.seq_len 128; give data.validation more",
        ),
        (["train", *TINY, "--set", "data.dataset=empty.jsonl"], "empty.jsonl is empty (no records)"),
        (["train", *TINY, "--set", "data.dataset=arrays.jsonl"], "arrays.jsonl line 1 is a JSON list, not an object"),
        (  # (said before the tokenizer chat data needs, which a preset lacks)
            ["train", *TINY, "--set", "data.dataset=nope.jsonl", "--set", "data.format=messages"],
            f"dataset 'nope.jsonl': nope.jsonl ({tmp_path / 'nope.jsonl'}: paths are read from the current directory) "
            "does not exist; check the path",
        ),
        (["train", *TINY, "--set", "data.dataset=latin1.jsonl"], where["latin1.jsonl"]),
        (["train", *TINY, "--set", "data.dataset=latin1.json"], where["latin1.json"]),
        (["train", *TINY, "--set", "data.text=latin1.txt"], where["latin1.txt"]),
        (["train", "--config", "latin1.yaml"], where["latin1.yaml"]),
        # (a byte that is not UTF-8 in argv reaches Python as a lone surrogate, as json.loads makes it here)
        (["train", *TINY, "--set", "data.text=caf\udce9"], "byte offset 13 (0xe9) is not UTF-8"),
        (["train", "--config", "empty.yaml"], "empty.yaml is empty (it sets nothing"),
        (["train", *TINY, "--set", "data.text=a-dir"], "a-dir is a directory; name a text file in it"),
        (["train", *TINY, "--set", "train.micro_batch_size=0"], "train.micro_batch_size must be >= 1, got 0"),
        (["generate", "--checkpoint", "x", "--prompts", "p.txt", "--top-k", "-1"], "--top-k must be >= 0, got -1"),
        (
            ["generate", "--checkpoint", "x", "--prompts", "p.txt", "--top-p", "1.5"],
            "--top-p must be in (0, 1], got 1.5",
        ),
        (["train", *TINY, "--set", "data.tokens=ids.txt"], "ids.txt is not a .npy file (no numpy header)"),
        (["train", "--config", "a.yaml", "--config", "b.yaml"], "--config given twice; give one"),  # (the first lost)
        (  # (where a config's relative paths are read from: the current directory, not the config file's)
            ["train", *TINY, "--set", "data.text=nowhere/corpus.txt"],
            f"nowhere/corpus.txt ({tmp_path / 'nowhere' / 'corpus.txt'}: paths are read from the current directory)",
        ),
    ]


def test_mistakes_are_one_line_a_non_zero_exit_and_no_traceback(tmp_path):
    command_lines = cases(tmp_path)
    (tmp_path / "held").mkdir()
    holder = RunLock(tmp_path / "held")
    holder.acquire()
    process = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cli_driver.py"))],
        input="".join(json.dumps(argv) + "\n" for argv, _ in command_lines),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    holder.release()
    assert process.returncode == 0, process.stderr
    results = [json.loads(line) for line in process.stdout.splitlines()]
    assert len(results) == len(command_lines)
    for (argv, expected), result in zip(command_lines, results):
        lines = result["output"].strip().splitlines()
        assert "Traceback" not in result["output"], (argv, result["output"])
        assert result["code"] not in (0, None) and len(lines) == 1, (argv, result)
        assert expected in lines[0], (argv, lines[0])
    assert not (tmp_path / "held" / "metrics.jsonl").exists()
    assert not (tmp_path / "runs" / "default").exists()  # (the refused runs' output_dir: made, then taken back)


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    """`megatrain data --dump 2000 | head -c 100`: a pipe its reader closed is no mistake of the user's. (2000 rows
    are 2.3 MB, past any pipe's buffer, so the writer is still writing when the reader goes; 50 rows, 58 KB, could
    all fit the pipe before the reader closed it, and the command then rightly ended with 0.)"""
    process = subprocess.Popen(
        [sys.executable, "-m", "megatrain", "data", *TINY, "--dump", "2000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    assert len(process.stdout.read(100)) == 100
    process.stdout.close()
    assert process.stderr.read() == b"" and process.wait(timeout=120) == 141


def test_ctrl_c_while_torch_is_imported_is_one_line(tmp_path):
    """A stand-in `torch` whose import is interrupted, as Ctrl-C in the seconds the real one takes."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise KeyboardInterrupt\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "train"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60
    )
    assert process.returncode == 130
    assert process.stderr.strip().splitlines() == [
        "megatrain: interrupted; train stopped before it finished (training had not started: no checkpoint or "
        "model was written)"
    ]


def as_from_a_shell() -> None:
    """A child's signals as a shell starts a command: SIGINT delivered and handled by default. (What the test
    process has is inherited across exec: in CI's pytest-xdist workers the run never saw the signal.)"""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def as_a_background_job() -> None:
    """A child's signals as a shell without job control (a script's `cmd &`) starts a background job: SIGINT
    ignored."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("started", [as_from_a_shell, as_a_background_job])
def test_ctrl_c_while_the_data_is_read_is_one_line_and_lets_the_directory_go(tmp_path, started, sig, code):
    """SIGINT while the run waits for its data (a named pipe nobody writes): one line, exit 130, the run
    directory it made taken back; also for a background job, which inherits SIGINT ignored (it waited for ever).
    SIGTERM likewise, with 143 (it killed the run without a word until the steps began)."""
    fifo = tmp_path / "corpus.txt"
    os.mkfifo(fifo)
    run = tmp_path / "run"
    args = [*TINY, "--set", f"data.text={fifo}", "--set", f"output_dir={run}"]
    process = subprocess.Popen(
        [sys.executable, "-m", "megatrain", "train", *args],
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=started,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not ((run / LOCK).exists() and (run / LOCK).read_text()):
            time.sleep(0.05)  # the lock is taken just before the data is read
        assert (run / LOCK).read_text(), "the run never started"
        # then until it waits for the pipe's writer (a signal sent before, on a loaded machine, met the run in
        # whatever it did between the lock and the read: CI once saw no line and no exit in 60 s)
        wchan = Path(f"/proc/{process.pid}/wchan")
        while time.time() < deadline and wchan.exists() and wchan.read_text() != "wait_for_partner":
            time.sleep(0.05)
        process.send_signal(sig)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()  # (where it failed: it waits on the pipe for ever)
    assert process.returncode == code and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert f"megatrain: {sig.name}: train stopped before training started: no checkpoint or model was written" in err
    assert not run.exists()  # (the run made it, and wrote nothing in it but its lock)


def test_an_ignored_sigint_is_restored_and_a_handler_kept():
    """`restore_sigint`: SIGINT inherited ignored raises KeyboardInterrupt again; a handler of the caller's stays."""
    from megatrain.cli import restore_sigint

    def own_handler(signum, frame):
        pass

    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        restore_sigint()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, own_handler)
        restore_sigint()
        assert signal.getsignal(signal.SIGINT) is own_handler
    finally:
        signal.signal(signal.SIGINT, previous)


USER_LOSSES = """
from megatrain_templates.objectives import SequenceObjective

MADE = []


class NotAnObjective:
    pass


class NeedsArguments(SequenceObjective):
    def __init__(self, beta):
        self.beta = beta


class Counted(SequenceObjective):
    def __init__(self):
        MADE.append(self)
"""


def test_a_users_objective_is_checked_without_being_made(tmp_path, monkeypatch):
    """The checks before the data is read resolve a `module:Class` objective without making it (its constructor may
    load what it scores with); the trainer makes it, once."""
    import importlib

    from megatrain.config import config_from_dict
    from megatrain.objectives import make_objective, user_objective_class

    (tmp_path / "user_losses_c.py").write_text(USER_LOSSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = config_from_dict({"train": {"objective": "user_losses_c:Counted"}})
    user_objective_class(config.train.objective)
    made = importlib.import_module("user_losses_c").MADE
    assert made == []
    objective = make_objective(config)
    assert made == [objective]


@pytest.mark.parametrize(
    "data, train, said",
    [
        ({"tokens": None, "text": "short.txt"}, {}, "0 windows of seq_len 32, fewer than one batch of 4"),
        ({"validation": "short.npy"}, {}, "the validation data holds not one window of data.seq_len 32"),
        ({}, {"objective": "no_such_mod:Loss"}, "train.objective 'no_such_mod:Loss' cannot be made"),
        ({}, {"objective": "user_losses_a:NotAnObjective"}, "not a megatrain_templates objective"),
        ({}, {"objective": "user_losses_b:NeedsArguments"}, "'user_losses_b:NeedsArguments' cannot be made"),
    ],
)
def test_what_cannot_train_is_refused_before_the_model_is_loaded(
    write_config, tmp_path, capsys, monkeypatch, data, train, said
):
    """Too little data and an objective that does not import, is no objective or needs arguments were found once
    the trainer held the model's weights (4.4 GB for a 270M model): now before it is made."""
    import numpy as np

    import megatrain.loop
    from megatrain.cli import main

    monkeypatch.setattr(megatrain.loop, "Trainer", lambda *a, **k: pytest.fail("the trainer was made"))
    for module in ("user_losses_a", "user_losses_b"):
        (tmp_path / f"{module}.py").write_text(USER_LOSSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "short.txt").write_text("a few words\n")
    np.save(tmp_path / "short.npy", np.arange(10, dtype=np.int32))
    data = {key: str(tmp_path / value) if isinstance(value, str) else value for key, value in data.items()}
    config = write_config(data=data, train=train)
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


@pytest.mark.parametrize("where", ["checkpoint", "metrics"])
def test_disk_full_is_one_line(write_config, tmp_path, capsys, monkeypatch, where):
    """ENOSPC (simulated in this process) while writing a checkpoint, or metrics.jsonl, through the command's
    `main`: one line saying the disk is full, exit 1."""
    import errno

    import megatrain.checkpoint
    import megatrain.loop
    from megatrain.cli import main

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "run" / where))

    if where == "checkpoint":
        monkeypatch.setattr(megatrain.checkpoint, "write_safetensors", full)
    else:
        monkeypatch.setattr(megatrain.loop, "write_jsonl", full)
    assert main(["train", "--config", str(write_config(train={"steps": 2, "save_every": 1}))]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len([line for line in err.splitlines() if "disk is full" in line]) == 1
    assert "disk is full" in err.strip().splitlines()[-1]  # the last line: the run's end


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--set", "train.betas=[0.9, 0.95"], "--set 'train.betas=[0.9, 0.95': the value is not valid YAML; close its"),
        (["--set", "train.lr=["], "--set 'train.lr=[': the value is not valid YAML; close its brackets and quotes"),
        (["--set", "a.b='x"], '--set "a.b=\'x": the value is not valid YAML; close its brackets and quotes'),
        (
            ["--config", "unclosed.yaml"],
            "unclosed.yaml line 2: invalid YAML (expected ',' or ']', but got ':')",
        ),
    ],
)
def test_a_value_that_is_not_yaml_is_one_line(tmp_path, monkeypatch, capsys, argv, line):
    """An unclosed bracket or quote in a --set value, or in a config file (named with the line its list begins on):
    one line, exit 2, no yaml traceback."""
    from megatrain.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "unclosed.yaml").write_text("train:\n  betas: [0.9, 0.95\n  lr: 1e-3\n")
    assert main(["train", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatrain: config error: ") and line in lines[0], lines


@pytest.mark.parametrize("command", ["eval", "convert", "train"])
@pytest.mark.parametrize(
    "change, said",
    [
        ({"hidden_size": "64"}, 'hidden_size is "64"; it must be a whole number'),
        ({"rms_norm_eps": None}, "rms_norm_eps is null"),
    ],
)
def test_a_config_json_number_of_the_wrong_type_is_one_line(tmp_path, monkeypatch, capsys, command, change, said):
    """A model directory whose config.json has a size written as text, or a null epsilon: one line naming the file
    and the field, exit 2, from every command that reads it (not a TypeError from the checks or the norms)."""
    from megatrain.cli import main

    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**config_to_hf(preset("tiny-llama")), **change}))
    argv = {
        "eval": ["eval", "--checkpoint", str(model)],
        "convert": ["convert", str(model), str(tmp_path / "out")],
        "train": ["train", *TINY, "--set", "model.preset=null", "--set", f"model.hf_dir={model}"],
    }[command]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"model error: {model / 'config.json'}: {said}" in lines[0], lines


def test_generation_without_transformers_is_one_line(tmp_path, monkeypatch, capsys):
    """`megatrain generate` and GRPO's sampling run transformers' modules: without transformers, one line naming
    the extra to install, before any weights are read."""
    from megatrain.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # (import transformers raises ImportError)
    code = main(["generate", "--checkpoint", str(tmp_path / "no-run"), "--prompts", str(tmp_path / "p.txt")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1
    assert "megatrain generate decodes with" in lines[0] and "pip install 'transformers>=5.0'" in lines[0]


def test_version_prints_the_package_version_without_torch(tmp_path):
    """`megatrain --version`: the version setuptools gives the package, printed before torch is imported (a
    stand-in torch whose import fails would say so)."""
    import megatrain

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('torch imported')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "--version"], capture_output=True, text=True, env=env, timeout=60
    )
    assert process.returncode == 0 and process.stdout == f"megatrain {megatrain.__version__}\n", process


def garble(path: Path, offset: int, old: bytes = b"", new: bytes = b"XXXXXXXX") -> None:
    """Overwrite `path`'s bytes in place: `new` at `offset`, or (with `old`) over the first `old` from there."""
    raw = bytearray(path.read_bytes())
    at = raw.index(old, offset) if old else offset
    raw[at : at + len(new)] = new
    path.write_bytes(bytes(raw))


def test_damaged_weights_are_refused_in_one_line_and_convert_writes_nothing(
    write_config, tmp_path, capsys, monkeypatch
):
    """What eval refuses, convert refuses too, in one line naming the file, before it writes anything: a checkpoint
    whose model.safetensors has bytes garbled (its CRC32 check), a run whose newest checkpoint's manifest.json was cut
    short (eval and generate too, naming the checkpoint before it), and copies of final/ whose config.json does not
    describe their weights (a layer fewer, another vocab_size, a tensor's name garbled in the header)."""
    import megatrain.generate
    from megatrain.cli import main

    # (generate refuses a machine without transformers first; here its checkpoint is the subject, with or without)
    monkeypatch.setattr(megatrain.generate, "require_transformers", lambda command: None)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(write_config(train={"steps": 2, "save_every": 1}))]) == 0
    for copy in ("garbled", "cut"):
        shutil.copytree("run", copy)
    weights = Path("garbled", CHECKPOINTS, "step-00000002", "model.safetensors")
    garble(weights, weights.stat().st_size // 2)
    shutil.rmtree(Path("cut", FINAL))  # (else the run's newest weights are its final/)
    manifest = Path("cut", CHECKPOINTS, "step-00000002", MANIFEST)
    manifest.write_bytes(manifest.read_bytes()[:300])
    described = {"fewer-layers": ("num_hidden_layers", -1), "more-words": ("vocab_size", 8), "misnamed": None}
    for name, change in described.items():
        shutil.copytree(Path("run", FINAL), name)
        if change is None:
            garble(Path(name, "model.safetensors"), 0, b"model.norm.weight", b"model.nrom.weight")
            continue
        hf_config = json.loads(Path(name, "config.json").read_text())
        hf_config[change[0]] += change[1]
        Path(name, "config.json").write_text(json.dumps(hf_config))
    cut = [f"{manifest} is unreadable", f"name the one before it, {Path('cut', CHECKPOINTS, 'step-00000001')}"]
    refusals = [
        (["convert", str(weights.parent), "out"], [f"{weights} fails its CRC32 check", "step-00000001"]),
        (["convert", "cut", "out"], cut),
        (["eval", "--checkpoint", "cut"], cut),
        (["generate", "--checkpoint", "cut", "--prompts", "p.txt"], cut),
        *((["convert", name, "out"], [f"{name}/model.safetensors: "]) for name in described),
    ]
    capsys.readouterr()
    for argv, says in refusals:  # (damaged or mismatched weights are the user's input: exit 2, as a config error)
        code = main(argv)
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and all(part in lines[0] for part in says), (argv, code, lines)
        assert lines[0].startswith("megatrain: weights error: "), lines
        assert not Path("out").exists() and not list(Path().glob(".out*")), argv


def test_eval_refuses_a_validation_fraction_the_run_trained_on(write_config, tmp_path):
    """`megatrain eval --set data.validation=0.1` on a run that held out nothing would score tokens it trained on:
    one line, exit 2; a file of held-out tokens evaluates."""
    import numpy as np

    np.save(tmp_path / "held-out.npy", np.random.default_rng(1).integers(0, 256, 512).astype(np.int32))
    run = str(tmp_path / "run")
    command_lines = [
        ["train", "--config", str(write_config(train={"steps": 1}))],
        ["eval", "--checkpoint", run, "--set", "data.validation=0.1"],
        ["eval", "--checkpoint", run, "--set", f"data.validation={tmp_path / 'held-out.npy'}"],
    ]
    process = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cli_driver.py"))],
        input="".join(json.dumps(argv) + "\n" for argv in command_lines),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    trained, refused, held_out = [json.loads(line) for line in process.stdout.splitlines()]
    assert trained["code"] == 0 and held_out["code"] == 0, (trained, held_out)
    assert json.loads(held_out["output"].strip().splitlines()[-1])["data"] == "validation"
    assert refused["code"] == 2 and refused["output"].strip().splitlines() == [
        "megatrain: config error: the run held out nothing (with train.seed 0): data.validation 0.1 would evaluate "
        "tokens it trained on; give held-out data as a file (--set data.validation=FILE), or leave data.validation "
        "and train.seed as the run had them"
    ]


def test_non_finite_steps_advise_the_clipping_the_run_lacks(write_config, tmp_path):
    """A learning rate that blows the weights up (`megatrain train` as a subprocess): with train.grad_clip on, the
    advice is a lower clip, not turning it on."""
    config = write_config(train={"steps": 2, "lr": 1e30, "weight_decay": 0.0, "max_bad_steps": 1, "grad_clip": 1.0})
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    last = process.stderr.strip().splitlines()[-1]
    assert process.returncode == 1 and "Traceback" not in process.stderr, process.stderr
    assert last.startswith("megatrain: NonFiniteError: 1 non-finite steps in a row; stopping.")
    assert last.endswith("Lower train.lr, raise train.warmup_steps or lower train.grad_clip (it clips at 1.0 now).")


def test_eval_and_generate_refuse_model_settings_the_weights_decide(write_config, tmp_path, capsys, monkeypatch):
    """`--set model.*` on a checkpoint or a run's final/ was taken and ignored (the weights' own model evaluated):
    one line naming where the model comes from, exit 2, before any model is built; a value the run had is no change."""
    import megatrain.generate
    from megatrain.cli import main

    monkeypatch.setattr(megatrain.generate, "require_transformers", lambda command: None)  # (refused before it)
    assert main(["train", "--config", str(write_config(train={"steps": 1, "save_every": 1}))]) == 0
    run, step = tmp_path / "run", tmp_path / "run" / CHECKPOINTS / "step-00000001"
    (tmp_path / "p.txt").write_text("hello\n")
    capsys.readouterr()
    refusals = [
        (["eval", "--checkpoint", str(step), "--set", "model.preset=tiny-qwen2"], f"manifest ({step})"),
        (["eval", "--checkpoint", str(run / FINAL), "--set", "model.adapter.type=lora"], f"{run / FINAL}/config.json"),
        (
            ["generate", "--checkpoint", str(step), "--prompts", "p.txt", "--set", "model.implementation=transformers"],
            "",
        ),
    ]
    for argv, source in refusals:
        assert main(argv) == 2, argv
        (line,) = capsys.readouterr().err.strip().splitlines()
        key = argv[-1].split("=")[0]
        assert line.startswith(f"megatrain: config error: --set {key}: megatrain {argv[0]} takes the model from "), line
        assert source in line and line.endswith("leave model.* out, or name the weights of that model in --checkpoint")
    assert main(["eval", "--checkpoint", str(step), "--set", "model.preset=tiny-llama", "--batches", "1"]) == 0
