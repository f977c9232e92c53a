"""GRPO's data: prompt datasets rendered as TRL renders them, rows of prompt + completion against a plain loop, and
the file of given completions read, with its bad lines refused by number."""

import json
import random
import re

import pytest
import torch
from tokenizers import Tokenizer

from megatrain_data import DataError, DataSection
from megatrain_data.prompts import check_groups, completion_ids, load_prompts, read_completions, rows_of


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_prompts_are_tokenized_with_their_columns(tokenizer_path, tmp_path):
    tokenizer, rng = Tokenizer.from_file(str(tokenizer_path)), random.Random(0)
    rows = [{"prompt": f"What is {rng.randint(0, 99)} plus one?", "answer": str(i)} for i in range(5)]
    data = DataSection(dataset=str(write_jsonl(tmp_path / "prompts.jsonl", rows)), format="prompt")
    prompts = load_prompts(data, 64, tokenizer, tokenizer_path, "")
    assert prompts.given == [r["prompt"] for r in rows] and prompts.columns == {"answer": [r["answer"] for r in rows]}
    assert prompts.ids == [tokenizer.encode(r["prompt"], add_special_tokens=False).ids for r in rows]
    with pytest.raises(DataError, match="longer than train.grpo.max_prompt_length"):
        load_prompts(data, 2, tokenizer, tokenizer_path, "")


def test_a_text_prompt_starts_as_the_tokenizer_starts_a_text(tokenizer_path, tmp_path):
    """TRL tokenizes a text prompt as `tokenizer(text)`: with the <bos> a Llama, Gemma or Mistral tokenizer puts
    first. GRPO's prompts (generated and given completions alike) had none, and trained a distribution the model
    never starts from; a rendered conversation keeps what its template wrote, with no second <bos>."""
    from tokenizers import processors

    from megatrain_data.prompts import render_prompt

    with_bos = Tokenizer.from_file(str(tokenizer_path))
    with_bos.add_special_tokens(["<bos>"])
    bos = with_bos.token_to_id("<bos>")
    with_bos.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    text = "What is 2 plus 3?"
    assert render_prompt(text, None, with_bos, "x") == with_bos.encode(text).ids  # (transformers' tokenizer(text))
    assert render_prompt(text, None, with_bos, "x")[0] == bos

    class Template:  # (a chat template that writes its own <bos>, as Llama 3's does)
        def render(self, messages, add_generation_prompt):
            return ["<bos>" + messages[0]["content"]]

    ids = render_prompt([{"role": "user", "content": text}], Template(), with_bos, "x")
    assert ids == [bos, *with_bos.encode(text, add_special_tokens=False).ids]


def test_an_empty_prompt_is_refused_naming_its_record(tokenizer_path, tmp_path):
    """Generation starts from a prompt's last token: an empty one stopped GRPO mid-run (and `generate`) with an
    IndexError."""
    from megatrain_data.prompts import read_prompts

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "2+2="}, {"prompt": ""}])
    data = DataSection(dataset=str(path), format="prompt")
    with pytest.raises(DataError, match="record 2 has an empty prompt \\(0 tokens\\); give it text or remove it"):
        load_prompts(data, 64, tokenizer, tokenizer_path, "")
    with pytest.raises(DataError, match="prompts.jsonl line 2 has an empty prompt; give it text or remove the line"):
        read_prompts(path)


def test_rows_train_on_the_completion_only():
    rng = random.Random(1)
    prompts = [[rng.randrange(100) for _ in range(rng.randint(1, 5))] for _ in range(4)]
    completions = [[rng.randrange(100) for _ in range(rng.randint(1, 6))] for _ in range(4)]
    batch = rows_of(prompts, completions, 8, pad_id=0)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens = (prompt + completion)[:8]
        assert batch.input_ids[row].tolist() == tokens + [0] * (8 - len(tokens))
        assert batch.valid[row].tolist() == [True] * len(tokens) + [False] * (8 - len(tokens))
        # the label at position t is token t + 1 where that token is the completion's
        expected = [tokens[t + 1] if len(prompt) <= t + 1 < len(tokens) else -100 for t in range(8)]
        assert batch.labels[row].tolist() == expected
    assert batch.labels.dtype == torch.long


def test_given_completions_are_read_and_bad_lines_refused(tokenizer_path, tmp_path):
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    lines = [{"prompt": "1+1=", "completion": " 2", "reward": 1.0}, {"prompt": "1+1=", "completion_ids": [5, 6]}]
    lines[1]["reward"] = 0.0
    records = read_completions(write_jsonl(tmp_path / "given.jsonl", lines))
    assert records == lines and check_groups(records, 2, "given.jsonl") == 1
    assert completion_ids(records[0], tokenizer, "line 1") == tokenizer.encode(" 2", add_special_tokens=False).ids
    assert completion_ids(records[1], tokenizer, "line 2") == [5, 6]
    advantages = [{"prompt": "1+1=", "completion_ids": [5, 6], "advantage": -0.5, "logps": [-1.0, -2.0]}] * 2
    assert read_completions(write_jsonl(tmp_path / "advantages.jsonl", advantages)) == advantages
    mixed = {  # (each step's rows read one way: a step with a line lacking logps dropped them all without a word)
        "line 2 lacks a reward (not an advantage), which line 1 gives": [lines[0], advantages[0]],
        "line 1 lacks logps, which line 2 gives": [lines[0], {**lines[0], "logps": [-1.0]}],
        "line 2: its completion is a list of messages": [
            lines[0],
            {**lines[0], "completion": [{"role": "assistant", "content": " 2"}]},
        ],
    }
    for refusal, records in mixed.items():
        with pytest.raises(DataError, match=re.escape(f"mixed.jsonl {refusal}")):
            read_completions(write_jsonl(tmp_path / "mixed.jsonl", records))
    with pytest.raises(DataError, match="lines 1-2 hold 2 prompts"):
        check_groups([lines[0], {**lines[1], "prompt": "2+2="}], 2, "given.jsonl")
    bad = [{"prompt": "p", "completion": "c", "reward": float("nan")}]
    with pytest.raises(DataError, match="line 1: its reward or advantage nan is not a finite number"):
        read_completions(write_jsonl(tmp_path / "bad.jsonl", bad))
    with pytest.raises(DataError, match="1 logps for 2 completion tokens"):
        completion_ids({**advantages[0], "logps": [-1.0]}, tokenizer, "line 2")


def test_a_prompts_file_that_is_not_utf8_or_is_a_directory_is_refused_naming_it(tmp_path):
    """`megatrain generate --prompts` on a binary file ended in a UnicodeDecodeError traceback, on a directory in
    a line naming no option."""
    from megatrain_data.prompts import read_prompts

    path = tmp_path / "prompts.txt"
    path.write_bytes(b"2+2=\n\xe6 latin-1\n")
    with pytest.raises(DataError, match=r"--prompts .*prompts.txt line 2, byte offset 5 \(0xe6\) is not UTF-8; save"):
        read_prompts(path)
    with pytest.raises(DataError, match=r"--prompts .* is a directory; name a text file in it"):
        read_prompts(tmp_path)
