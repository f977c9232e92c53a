"""`megatrain data`: the report's warning of an end of turn that is no token, and the dump of preference pairs."""

import json
import subprocess
import sys

import pytest
import yaml
from tokenizers import Tokenizer

from megatrain.cli import main
from megatrain_data import EOS_TOKEN, builtin_corpus, train_tokenizer

PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Two and two make", "chosen": " four.", "rejected": " five."},
    {"prompt": "Water is", "chosen": " wet.", "rejected": " dry."},
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Rome."},
]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    text = tmp_path_factory.mktemp("tok") / "corpus.txt"
    text.write_text(builtin_corpus().read_text()[:50000])
    path = text.parent / "tokenizer.json"
    train_tokenizer(text, 512, path)
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trl_text_pair(tokenizer, prompt, completion):
    """TRL's rule for a text pair member: tokenizer(prompt) with its special tokens, then the completion's
    ids without them, then EOS; the completion is trained."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    completion_ids = tokenizer.encode(completion, add_special_tokens=False).ids + [eos]
    return prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids)


@pytest.mark.parametrize("marker, warned", [("<|end|>", True), ("{{ eos_token }}", False)])
def test_an_end_of_turn_marker_that_is_no_token_is_warned_of(tmp_path, tokenizer_path, marker, warned):
    """`megatrain data` (a subprocess) with a chat template ending turns with <|end|>, which the tokenizer splits
    into pieces: one warning line naming the marker and the turns left without a trained end; none where the
    template ends them with the EOS token."""
    chats = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
        for i in range(3)
    ]
    write_jsonl(tmp_path / "chat.jsonl", chats)
    (tmp_path / "turns.jinja").write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}" + marker + "\n{% endfor %}"
    )
    settings = {
        "model.preset": "small-llama",  # (its vocabulary holds the tokenizer's 512; `data` builds no model)
        "device": "cpu",
        "data.dataset": tmp_path / "chat.jsonl",
        "data.format": "messages",
        "data.tokenizer": tokenizer_path,
        "data.chat_template": tmp_path / "turns.jinja",
        "data.seq_len": 32,
        "train.batch_size": 2,
        "train.micro_batch_size": 1,
        "output_dir": tmp_path / "run",
    }
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    process = subprocess.run(
        [sys.executable, "-m", "megatrain", "data", *overrides, "--dump", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    warnings = [line for line in process.stderr.splitlines() if "warning" in line]
    expected = (
        "megatrain: warning: dataset {}: the chat template ends assistant turns with '<|end|>', which is no special "
        "token of the tokenizer: 3 of 3 trained turns end with no trained end-of-turn token, so the model does not "
        "learn to stop"
    ).format(tmp_path / "chat.jsonl")
    assert len(warnings) == warned and all(line.startswith(expected) for line in warnings), warnings


def test_data_command_dumps_pairs_as_json_lines_and_text(tmp_path, tokenizer_path, capsys):
    write_jsonl(tmp_path / "p.jsonl", PAIRS)
    config = {
        "model": {"preset": "small-llama"},
        "data": {
            "dataset": str(tmp_path / "p.jsonl"),
            "format": "preference",
            "tokenizer": str(tokenizer_path),
            "seq_len": 32,
            "shuffle": False,
        },
        "train": {"batch_size": 2, "objective": "dpo"},
        "device": "cpu",
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["data", "--config", str(path), "--dump", "3"]) == 0
    captured = capsys.readouterr()
    assert "dataset " in captured.err and "4 records -> 4 pairs" in captured.err
    lines = [json.loads(line) for line in captured.out.strip().splitlines()]
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    assert len(lines) == 3
    for line, record in zip(lines, PAIRS):
        assert set(line) == {"prompt", "chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"}
        for name in ("chosen", "rejected"):
            ids, labels = trl_text_pair(tokenizer, record["prompt"], record[name])
            assert line[f"{name}_input_ids"] == ids
            assert line[f"{name}_labels"] == [i if t else -100 for i, t in zip(ids, labels)]  # unshifted
        assert line["prompt"] == tokenizer.encode(record["prompt"]).ids
    assert main(["data", "--config", str(path), "--dump", "1", "--text"]) == 0
    shown = capsys.readouterr().out
    assert f"chosen:\nThe sky is⟦ blue.{EOS_TOKEN}⟧\nrejected:\nThe sky is⟦ green.{EOS_TOKEN}⟧" in shown


def test_data_command_caches_a_relative_dataset_path_as_train_does(tmp_path, tokenizer_path, monkeypatch):
    """`megatrain data` with data.dataset relative to the current directory, then with it absolute (as `train`
    makes every path): one tokenization cache, not one per spelling of the path (`data` kept it relative)."""
    chats = [
        {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]}
        for i in range(3)
    ]
    write_jsonl(tmp_path / "chat.jsonl", chats)
    monkeypatch.chdir(tmp_path)
    settings = {
        "model.preset": "small-llama",
        "device": "cpu",
        "data.format": "messages",
        "data.tokenizer": tokenizer_path,
        "data.seq_len": 32,
        "train.batch_size": 2,
        "train.micro_batch_size": 1,
        "output_dir": "run",
    }
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    for dataset in ("chat.jsonl", tmp_path / "chat.jsonl"):
        assert main(["data", *overrides, "--set", f"data.dataset={dataset}", "--dump", "1"]) == 0
    assert len(list((tmp_path / "run" / "cache").glob("records-*.report.json"))) == 1
