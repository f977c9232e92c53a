"""Record datasets through `datasets`: pre-training packing and fine-tuning with response-only loss."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from megatrain.config import ConfigError, DataSection
from megatrain.data import EOS_TOKEN, TokenWindows, builtin_corpus, load_token_data, train_tokenizer


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


def test_pretraining_records_are_packed_with_eos(tmp_path, tokenizer_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "first document"}, {"text": "second one"}])
    data = load_token_data(
        DataSection(dataset=str(source), tokenizer=str(tokenizer_path), seq_len=4), 512, tmp_path / "cache", None
    )
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id(EOS_TOKEN)
    assert data.loss_mask is None and data.tokens.ndim == 1
    assert list(data.tokens).count(eos) == 2 and data.tokens[-1] == eos
    assert tok.decode([int(t) for t in data.tokens if t != eos]) == "first documentsecond one"


def test_alpaca_loss_only_on_the_response(tmp_path, tokenizer_path):
    source = write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"instruction": "Name a keyword.", "input": "", "output": "lambda"},
            {"instruction": "Add.", "input": "1 and 2", "output": "3"},
        ],
    )
    section = DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=48)
    data = load_token_data(section, 512, tmp_path / "cache", None)
    tok = Tokenizer.from_file(str(tokenizer_path))
    assert data.tokens.shape == (2, 48) and data.loss_mask.shape == (2, 48)
    response = tok.decode([int(t) for t, m in zip(data.tokens[0], data.loss_mask[0]) if m])
    assert response == "lambda"  # the EOS after it is a target too, decoded as a special token (skipped)
    prompt = tok.decode([int(t) for t, m in zip(data.tokens[1], data.loss_mask[1]) if not m])
    assert prompt.startswith("### Instruction:\nAdd.\n\n### Input:\n1 and 2")
    windows = TokenWindows(data.tokens, 48, 2, shuffle=False, seed=0, loss_mask=data.loss_mask)
    ids, labels = windows.batch(0)
    targets = ids[0, 1:][labels[0, :-1] != -100]
    assert tok.decode(targets.tolist()) == "lambda"
    assert int((labels != -100).sum()) == int(data.loss_mask[:, 1:].sum())


def test_messages_and_other_containers(tmp_path, tokenizer_path):
    import datasets

    records = [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}]
    tok = Tokenizer.from_file(str(tokenizer_path))
    for source in (write_jsonl(tmp_path / "chat.jsonl", records), tmp_path / "chat.parquet", tmp_path / "saved"):
        if source.suffix == ".parquet":
            datasets.Dataset.from_list(records).to_parquet(str(source))
        elif source.name == "saved":
            datasets.Dataset.from_list(records).save_to_disk(str(source))
        section = DataSection(dataset=str(source), format="messages", tokenizer=str(tokenizer_path), seq_len=32)
        data = load_token_data(section, 512, tmp_path / f"cache-{source.name}", None)
        assert tok.decode([int(t) for t, m in zip(data.tokens[0], data.loss_mask[0]) if m]) == "hello"


def test_bad_records_name_the_record_and_fix(tmp_path, tokenizer_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    section = DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=16)
    with pytest.raises(ConfigError, match=r"record 1 has no field 'output'"):
        load_token_data(section, 512, tmp_path / "c1", None)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="cannot read data.dataset|holds no records"):
        load_token_data(DataSection(dataset=str(empty), tokenizer=str(tokenizer_path)), 512, tmp_path / "c2", None)
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(ConfigError, match="unknown file type '.csv'"):
        load_token_data(DataSection(dataset=str(odd), tokenizer=str(tokenizer_path)), 512, tmp_path / "c3", None)
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        load_token_data(DataSection(dataset=str(source), format="alpaca"), 512, tmp_path / "c4", None)
    with pytest.raises(ConfigError, match="vocab_size is 100"):
        load_token_data(
            DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path)), 100, tmp_path / "c5", None
        )


def test_tokenized_once_then_cached(tmp_path, tokenizer_path, monkeypatch):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "x y z"}] * 50)
    section = DataSection(dataset=str(source), tokenizer=str(tokenizer_path))
    first = load_token_data(section, 512, tmp_path / "cache", None)
    import megatrain.records as records

    monkeypatch.setattr(records, "tokenize_records", lambda *a, **k: pytest.fail("tokenized twice"))
    again = load_token_data(section, 512, tmp_path / "cache", None)
    assert np.array_equal(first.tokens, again.tokens)
