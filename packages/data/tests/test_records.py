"""Record datasets: formats, the dataset_info.json registry, mixing, truncation, packing, validation."""

import json
import re

import numpy as np
import pytest
from tokenizers import Tokenizer

from megatrain_data import (
    EOS_TOKEN,
    DataError,
    DataSection,
    TokenWindows,
    builtin_corpus,
    load_token_data,
)
from megatrain_data.records import _first_bad_json_line, pack_rows


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trained_text(tok, data, row):
    """The decoded trained tokens of a row, EOS shown."""
    tokens, mask = data.train.tokens[row], data.train.loss_mask[row]
    return tok.decode([int(t) for t, m in zip(tokens, mask) if m], skip_special_tokens=False)


def test_pretraining_records_are_one_stream_with_eos(tmp_path, tokenizer_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "first document"}, {"text": "second one"}])
    data = load_token_data(
        DataSection(dataset=str(source), tokenizer=str(tokenizer_path), seq_len=4), 512, tmp_path / "cache", None
    )
    tok = Tokenizer.from_file(str(tokenizer_path))
    eos = tok.token_to_id(EOS_TOKEN)
    tokens = data.train.tokens
    assert data.train.loss_mask is None and tokens.ndim == 1
    assert list(tokens).count(eos) == 2 and tokens[-1] == eos
    assert tok.decode([int(t) for t in tokens if t != eos]) == "first documentsecond one"


def test_documents_end_with_a_tokenizers_own_eos_where_neither_its_config_nor_the_model_names_one(tmp_path):
    """A tokenizer.json whose end-of-text token is Llama 2's `</s>`, brought without its tokenizer_config.json, for a
    preset that names no EOS: documents end with `</s>` (they were joined with nothing between them)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"first": 0, "second": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "first"}, {"text": "second"}])
    data = load_token_data(DataSection(dataset=str(source), tokenizer=str(path), seq_len=2), 8, tmp_path / "c", None)
    assert list(data.train.tokens) == [0, 3, 1, 3]


def test_a_models_eos_id_naming_an_ordinary_token_is_not_taken_for_the_eos(tmp_path, tokenizer_path):
    """A preset's EOS id (2) over a tokenizer megatrain trained names an ordinary token (`"`): documents end with the
    tokenizer's own <|endoftext|>, not with a quote mark (9 of the tiny presets did so, and their exports stopped
    generating at every `"`); an id the tokenizer holds as a special token is the model's EOS."""
    from megatrain_data import eos_token_text
    from megatrain_data.tokens import special_ids_of

    tok = Tokenizer.from_file(str(tokenizer_path))
    ordinary = next(i for i in range(1, 50) if tok.id_to_token(i) is not None)
    eos = tok.token_to_id(EOS_TOKEN)
    assert eos_token_text(tok, ordinary, None) == EOS_TOKEN and eos_token_text(tok, eos, None) == EOS_TOKEN
    assert special_ids_of(tok, [ordinary, eos]) == [eos] and special_ids_of(tok, None) == []
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "first"}, {"text": "second"}])
    data = load_token_data(
        DataSection(dataset=str(source), tokenizer=str(tokenizer_path), seq_len=2), 512, tmp_path / "c", None, ordinary
    )
    first, second = (tok.encode(text, add_special_tokens=False).ids for text in ("first", "second"))
    assert list(data.train.tokens) == [*first, eos, *second, eos]


@pytest.mark.parametrize(
    "entry, said",
    [
        ("alp.jsonl", "entry 'a' is a JSON str; write an object with file_name"),
        ({"file_name": "alp.jsonl", "columns": ["x"]}, "columns is ['x']; write an object of column names"),
        ({"file_name": ["alp.jsonl"]}, "file_name is ['alp.jsonl']; write a file name"),
        ({"file_name": "alp.jsonl", "num_samples": "ten"}, "num_samples is 'ten'; write a whole number"),
        ({"file_name": "alp.jsonl", "num_samples": 0}, "num_samples is 0; write a whole number of records, 1 or more"),
    ],
)
def test_a_registry_entry_of_the_wrong_type_is_one_line_naming_it(tmp_path, tokenizer_path, entry, said):
    """dataset_info.json fields of another type than LLaMA-Factory's raised AttributeError, TypeError or ValueError."""
    write_jsonl(tmp_path / "alp.jsonl", [{"instruction": "hi", "output": "there"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps({"a": entry}))
    section = DataSection(dataset="a", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path))
    with pytest.raises(DataError, match=re.escape(said)):
        load_token_data(section, 512, tmp_path / "cache", None)


def test_a_messages_turn_without_a_role_names_the_key_it_lacks(tmp_path, tokenizer_path):
    """It said "role None under 'from'": sharegpt's key, which a messages file does not use."""
    path = write_jsonl(
        tmp_path / "chat.jsonl", [{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    )
    section = DataSection(dataset=str(path), format="messages", tokenizer=str(tokenizer_path))
    with pytest.raises(DataError, match=re.escape("turn 0 has no 'role' key (its keys: ['content']); give every turn")):
        load_token_data(section, 512, tmp_path / "cache", None)


@pytest.mark.parametrize(
    "data_format, turns, registered, fix",
    [
        ("messages", [("user", "hi"), ("bot", "yo")], False, "rename the file's roles to these, or name the file in"),
        ("sharegpt", [("user", "hi"), ("assistant", "yo")], False, "set data.format: messages, which reads 'user'"),
        ("sharegpt", [("human", "hi"), ("bot", "yo")], True, "set the registry's tags to the dataset's role names"),
    ],
)
def test_an_unknown_role_names_the_fix_for_a_file_and_for_a_registry_entry(
    tmp_path, tokenizer_path, data_format, turns, registered, fix
):
    """A role the tags do not name: a file named in data.dataset has no registry tags to set (the fix said only
    those), so its fix is data.format: messages where that reads the role, else renaming or registering it."""
    role, content = ("role", "content") if data_format == "messages" else ("from", "value")
    field = "messages" if data_format == "messages" else "conversations"
    path = write_jsonl(tmp_path / "chat.jsonl", [{field: [{role: r, content: c} for r, c in turns]}])
    section = DataSection(dataset=str(path), format=data_format, tokenizer=str(tokenizer_path))
    if registered:
        (tmp_path / "dataset_info.json").write_text(
            json.dumps({"chat": {"file_name": "chat.jsonl", "formatting": "sharegpt"}})
        )
        section = DataSection(dataset="chat", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path))
    with pytest.raises(DataError, match=re.escape(fix)):
        load_token_data(section, 512, tmp_path / "cache", None)


def test_documents_start_as_the_tokenizer_starts_a_text(tmp_path, tokenizer_path):
    """A tokenizer that puts <bos> before a text (Gemma's, Llama's): every pre-training document starts with
    it once, records and plain text files alike (not once per paragraph); one that puts nothing adds nothing."""
    from tokenizers import processors

    from megatrain_data import document_start_ids, tokenize_text

    plain = Tokenizer.from_file(str(tokenizer_path))
    assert document_start_ids(plain) == []
    with_bos = Tokenizer.from_file(str(tokenizer_path))
    with_bos.add_special_tokens(["<bos>"])
    bos, eos = with_bos.token_to_id("<bos>"), with_bos.token_to_id(EOS_TOKEN)
    with_bos.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    path = tmp_path / "bos" / "tokenizer.json"
    path.parent.mkdir()
    with_bos.save(str(path))
    assert document_start_ids(with_bos) == [bos]
    source = write_jsonl(tmp_path / "docs.jsonl", [{"text": "first document"}, {"text": "second one"}])
    data = load_token_data(DataSection(dataset=str(source), tokenizer=str(path), seq_len=4), 1024, tmp_path / "c", None)
    first = with_bos.encode("first document", add_special_tokens=False).ids
    second = with_bos.encode("second one", add_special_tokens=False).ids
    assert list(data.train.tokens) == [bos, *first, eos, bos, *second, eos]
    text = tmp_path / "book.txt"
    text.write_text("one paragraph\n\nanother paragraph\n\nand a third")
    tokens, _ = tokenize_text(text, path, 1024, tmp_path / "c2")
    assert tokens[0] == bos and list(tokens).count(bos) == 1


def test_alpaca_with_the_simple_template_trains_the_response_and_eos(tmp_path, tokenizer_path, capsys):
    source = write_jsonl(
        tmp_path / "sft.jsonl",
        [
            {"instruction": "Name a keyword.", "input": "", "output": "lambda"},
            {"instruction": "Add.", "input": "1 and 2", "output": "3", "history": [["Hi", "Hello"]]},
        ],
    )
    section = DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=64)
    data = load_token_data(section, 512, tmp_path / "cache", None)
    assert "no chat template; using the simple template" in capsys.readouterr().err
    tok = Tokenizer.from_file(str(tokenizer_path))
    assert data.train.tokens.shape == (2, 64)
    assert trained_text(tok, data, 0) == f"lambda{EOS_TOKEN}"
    assert trained_text(tok, data, 1) == f"Hello{EOS_TOKEN}3{EOS_TOKEN}"  # every assistant turn, history included
    full = tok.decode([int(t) for t in data.train.tokens[1]], skip_special_tokens=False)
    assert full.startswith(f"<|user|>\nHi\n<|assistant|>\nHello{EOS_TOKEN}\n<|user|>\nAdd.\n1 and 2\n<|assistant|>\n3")
    windows = TokenWindows(data.train, 64, 2, shuffle=False, seed=0)
    batch = windows.batch(0)
    targets = batch.input_ids[0, 1:][batch.labels[0, :-1] != -100]
    assert tok.decode(targets.tolist(), skip_special_tokens=False) == f"lambda{EOS_TOKEN}"


def test_messages_in_every_container_and_layout(tmp_path, tokenizer_path):
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
        assert trained_text(tok, data, 0) == f"hello{EOS_TOKEN}"


def test_registry_formats_tags_and_weighted_mix(tmp_path, tokenizer_path):
    write_jsonl(
        tmp_path / "qa.jsonl", [{"q": f"question {i}", "a": f"answer {i}", "sys": "be brief"} for i in range(4)]
    )
    chats = [
        {"dialog": [{"speaker": "me", "text": f"hi {i}"}, {"speaker": "bot", "text": f"hey {i}"}]} for i in range(2)
    ]
    write_jsonl(tmp_path / "chats.jsonl", chats)
    registry = {
        "qa": {"file_name": "qa.jsonl", "columns": {"prompt": "q", "response": "a", "system": "sys"}},
        "chats": {
            "file_name": "chats.jsonl",
            "formatting": "sharegpt",
            "columns": {"messages": "dialog"},
            "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot"},
        },
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry))
    tok = Tokenizer.from_file(str(tokenizer_path))
    section = DataSection(dataset="qa,chats", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path), seq_len=48)
    data = load_token_data(section, 512, tmp_path / "cache", None)
    texts = [tok.decode([int(t) for t in row], skip_special_tokens=False) for row in data.train.tokens]
    assert len(texts) == 6 and texts[0].startswith("<|system|>\nbe brief\n<|user|>\nquestion 0\n<|assistant|>\n")
    assert sorted(trained_text(tok, data, r) for r in range(4, 6)) == [f"hey 0{EOS_TOKEN}", f"hey 1{EOS_TOKEN}"]

    mixed = load_token_data(
        DataSection(
            dataset="qa,chats",
            dataset_dir=str(tmp_path),
            mix_weights=(1.0, 2.0),
            tokenizer=str(tokenizer_path),
            seq_len=48,
        ),
        512,
        tmp_path / "cache2",
        None,
    )
    texts = [trained_text(tok, mixed, r) for r in range(len(mixed.train.tokens))]
    assert len(texts) == 6 and sum(t.startswith("hey") for t in texts) == 4  # 2/3 of 6: each chat twice
    assert "data.mix_weights [1.0, 2.0]: examples qa 4 -> 2, chats 2 -> 4" in mixed.report

    bad_tags = dict(registry, chats=dict(registry["chats"], tags={"role_tag": "speaker", "content_tag": "text"}))
    (tmp_path / "dataset_info.json").write_text(json.dumps(bad_tags))
    with pytest.raises(DataError, match=r"record 1: turn 0 has role 'me' under 'speaker'"):
        load_token_data(
            DataSection(dataset="chats", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path)),
            512,
            tmp_path / "cache3",
            None,
        )
    with pytest.raises(DataError, match=r"'missing' is not in .*dataset_info.json \(it has \['chats', 'qa'\]\)"):
        load_token_data(
            DataSection(dataset="missing", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path)),
            512,
            tmp_path / "cache4",
            None,
        )


def test_long_examples_are_truncated_or_dropped_and_counted(tmp_path, tokenizer_path, capsys):
    long = " ".join(["word"] * 80)
    records = [{"instruction": "short", "output": "ok"}] * 3 + [{"instruction": long, "output": "ok"}]
    source = write_jsonl(tmp_path / "sft.jsonl", records)
    common = dict(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=32)
    truncated = load_token_data(DataSection(**common), 512, tmp_path / "c1", None)
    assert len(truncated.train.tokens) == 3  # the long one's response lies past seq_len: nothing left to train
    assert "4 records -> 3 examples (1 truncated to seq_len 32; 1 dropped with no trained token" in "\n".join(
        truncated.report
    )
    dropped = load_token_data(DataSection(**common, too_long="drop"), 512, tmp_path / "c2", None)
    assert "1 dropped as longer than seq_len 32" in "\n".join(dropped.report)
    source = write_jsonl(tmp_path / "mostly-long.jsonl", records[2:] + records[3:] * 3)
    with pytest.raises(DataError, match="most records would be skipped; raise data.seq_len, or set data.too_long"):
        load_token_data(DataSection(**dict(common, dataset=str(source)), too_long="drop"), 512, tmp_path / "c3", None)


def test_packing_keeps_examples_whole_with_restarting_positions(tmp_path, tokenizer_path):
    records = [{"instruction": "x " * n, "output": "y " * (n % 3 + 1)} for n in range(1, 13)]
    source = write_jsonl(tmp_path / "sft.jsonl", records)
    common = dict(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=64)
    unpacked = load_token_data(DataSection(**common), 512, tmp_path / "c1", None)
    packed = load_token_data(DataSection(**common, pack=True), 512, tmp_path / "c2", None)
    assert len(packed.train.tokens) < len(unpacked.train.tokens) == 12
    positions = packed.train.position_ids
    assert positions is not None and (positions[:, 0] == 0).all()

    # the same examples: every (ids, mask) document of the packed rows is one of the unpacked rows
    def document(row, mask):  # up to its last trained token (the EOS; padding follows in unpacked rows)
        n = int(np.nonzero(mask)[0].max()) + 1
        return tuple(row[:n].tolist()), tuple(mask[:n].tolist())

    unpacked_docs = sorted(document(r, m) for r, m in zip(unpacked.train.tokens, unpacked.train.loss_mask))
    packed_docs = []
    for row, mask, pos in zip(packed.train.tokens, packed.train.loss_mask, positions):
        starts = list(np.nonzero(pos == 0)[0]) + [len(pos)]
        packed_docs += [document(row[a:b], mask[a:b]) for a, b in zip(starts[:-1], starts[1:]) if mask[a:b].any()]
    assert sorted(packed_docs) == unpacked_docs
    # labels never cross a document boundary
    batch = TokenWindows(packed.train, 64, 1, shuffle=False, seed=0).batch(0)
    boundary = batch.position_ids[0, 1:] == 0
    assert (batch.labels[0, :-1][boundary] == -100).all()


def test_best_fit_packing():
    rows = pack_rows([5, 3, 4, 2, 6, 1], 8)
    assert sorted(i for r in rows for i in r) == list(range(6))
    assert all(sum([5, 3, 4, 2, 6, 1][i] for i in r) <= 8 for r in rows) and len(rows) == 3


def test_validation_fraction_file_and_split(tmp_path, tokenizer_path):
    import datasets

    records = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(20)]
    source = write_jsonl(tmp_path / "sft.jsonl", records)
    common = dict(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=32)
    data = load_token_data(DataSection(**common, validation=0.25), 512, tmp_path / "c1", None)
    assert len(data.train.tokens) == 15 and len(data.validation.tokens) == 5
    train_rows = {tuple(r) for r in data.train.tokens}
    assert not any(tuple(r) in train_rows for r in data.validation.tokens)
    held = write_jsonl(tmp_path / "val.jsonl", records[:3])
    data = load_token_data(DataSection(**common, validation=str(held)), 512, tmp_path / "c2", None)
    assert len(data.train.tokens) == 20 and len(data.validation.tokens) == 3
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records), "test": datasets.Dataset.from_list(records[:2])}
    ).save_to_disk(str(tmp_path / "saved"))
    data = load_token_data(
        DataSection(**dict(common, dataset=str(tmp_path / "saved")), validation="test"), 512, tmp_path / "c3", None
    )
    assert len(data.validation.tokens) == 2
    for dataset, split in ((source, "test"), (tmp_path / "saved", "validation")):  # (a file is one split)
        with pytest.raises(DataError, match=f"has no split '{split}', only \\['train'"):
            load_token_data(DataSection(**dict(common, dataset=str(dataset)), validation=split), 512, tmp_path, None)
    for missing in (tmp_path / "nope.jsonl", "held-out/val", "val.parquet"):  # (a file, by its folder or suffix)
        with pytest.raises(DataError, match=f"data.validation {missing} does not exist; name a file of held-out"):
            load_token_data(DataSection(**common, validation=str(missing)), 512, tmp_path, None)
    text = load_token_data(
        DataSection(text=str(builtin_corpus()), seq_len=64, validation=0.1), 512, tmp_path / "c4", None
    )
    assert len(text.validation.tokens) == round(0.1 * (len(text.train.tokens) + len(text.validation.tokens)) / 64) * 64


@pytest.mark.parametrize(
    "record, data_format, fix",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "text", "set data.format: messages"),
        ({"conversations": [{"from": "human", "value": "hi"}]}, "alpaca", "set data.format: messages"),
        ({"instruction": "a", "input": "", "output": "b"}, "messages", "set data.format: alpaca"),
        ({"prompt": "p", "chosen": "c", "rejected": "r"}, "text", "set data.format: preference"),
        ({"content": "some words"}, "text", r"set data.text_field: content \(its one text field\)"),
        ({"content": "a", "title": "b"}, "text", r"set data.format \(or the registry's columns\)"),
        ({"prompt": "p", "chosen": "c"}, "preference", "give each record its rejected answer beside chosen"),
    ],
)
def test_a_record_of_another_format_names_the_setting_that_reads_it(record, data_format, fix):
    """A record without the field its data.format needs: the format its fields are, or for text its one text field
    (it said only "set data.format" for a chat file read as text)."""
    from megatrain_data.section import fix_for_record

    what = {"text": "text", "alpaca": "instruction", "messages": "messages", "preference": "rejected"}[data_format]
    assert re.search(fix, fix_for_record(record, what))


def test_packing_a_chat_file_read_as_text_names_its_format_first(tmp_path, tokenizer_path):
    """data.pack on a `messages` file left at data.format text: the fix said data.pack: false first, which failed
    next on the records' missing text field; data.format: messages is said instead (plain text still hears of
    data.pack: false)."""
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": turns}])
    section = DataSection(dataset=str(chat), tokenizer=str(tokenizer_path), pack=True)
    said = "holds messages records (fields ['messages']) but data.format is text: set data.format: messages"
    with pytest.raises(DataError, match=re.escape(said)):
        load_token_data(section, 512, tmp_path / "c0", None)
    fixed = DataSection(dataset=str(chat), format="messages", tokenizer=str(tokenizer_path), pack=True)
    assert load_token_data(fixed, 512, tmp_path / "c1", None).train.tokens.shape[0] == 1
    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": "a document"}])
    with pytest.raises(DataError, match=re.escape("set data.pack: false, or data.format")):
        load_token_data(DataSection(dataset=str(docs), tokenizer=str(tokenizer_path), pack=True), 512, tmp_path, None)


def test_bad_records_name_the_record_and_fix(tmp_path, tokenizer_path):
    source = write_jsonl(tmp_path / "bad.jsonl", [{"instruction": "a", "output": "b"}, {"instruction": "c"}])
    section = DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=16)
    with pytest.raises(DataError, match=r"record 2 has no response field 'output'"):
        load_token_data(section, 512, tmp_path / "c1", None)
    chats = {
        "messages": ([{"role": "user", "content": "hi"}], "record 1 has no assistant turn"),
        "sharegpt": (
            [
                {"from": "human", "value": "hi"},
                {"from": "function_call", "value": "f(x)"},
                {"from": "gpt", "value": "x"},
            ],
            'record 1: turn 1 is a function call whose value is not JSON of {"name"',
        ),
    }
    for data_format, (turns, said) in chats.items():
        chat = write_jsonl(
            tmp_path / f"{data_format}.jsonl",
            [{"messages": turns} if data_format == "messages" else {"conversations": turns}],
        )
        with pytest.raises(DataError, match=re.escape(said)):
            load_token_data(
                DataSection(dataset=str(chat), format=data_format, tokenizer=str(tokenizer_path)),
                512,
                tmp_path / data_format,
                None,
            )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl is empty \\(no records\\)"):
        load_token_data(DataSection(dataset=str(empty), tokenizer=str(tokenizer_path)), 512, tmp_path / "c2", None)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"}\n\n{not json\n')
    with pytest.raises(DataError, match=r"broken.jsonl line 3 is not JSON \(Expecting property name"):
        load_token_data(DataSection(dataset=str(broken), tokenizer=str(tokenizer_path)), 512, tmp_path / "c5", None)
    # (datasets reads a large file's columns from its first records and fails on a field seen later, deep in it)
    later = write_jsonl(tmp_path / "later.jsonl", [{"text": "a"}, {"text": "b", "source": "web"}])
    assert _first_bad_json_line(later).endswith(
        "later.jsonl line 2 has fields ['source'] that the records before it lack (line 1's: ['text']), and a file's "
        "records are read as the columns of its first ones; give every record the same fields (null where one has no "
        "value) or drop the others"
    )
    number = write_jsonl(tmp_path / "number.jsonl", [{"text": "a b"}, {"text": 12345}])
    with pytest.raises(DataError, match=r"record 2 field 'text' is a int, not text"):
        load_token_data(DataSection(dataset=str(number), tokenizer=str(tokenizer_path)), 512, tmp_path / "c6", None)
    odd = tmp_path / "data.csv"
    odd.write_text("a,b\n")
    with pytest.raises(DataError, match="unknown file type '.csv'"):
        load_token_data(DataSection(dataset=str(odd), tokenizer=str(tokenizer_path)), 512, tmp_path / "c3", None)
    with pytest.raises(DataError, match="needs the model's tokenizer"):
        load_token_data(DataSection(dataset=str(source), format="alpaca"), 512, tmp_path / "c4", None)
    with pytest.raises(DataError, match="vocab_size is 100"):
        load_token_data(
            DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path)), 100, tmp_path / "c5", None
        )


ROLE_ORDERS = [  # (LLaMA-Factory's converters skip such records; each was trained silently)
    (["gpt", "human", "gpt"], "turn 0 is an assistant turn at the start"),
    (["human", "gpt", "gpt"], "turn 2 is an assistant turn after an assistant turn"),
    (["human", "gpt", "system", "human", "gpt"], "turn 2 is a system turn after an assistant turn"),
    (["human", "observation", "gpt"], "turn 1 is a tool turn after a user turn"),
    (["human", ""], "turn 1 is an assistant turn with no content, nothing to learn"),
]


@pytest.mark.parametrize("roles,said", ROLE_ORDERS)
def test_a_conversation_whose_roles_are_out_of_order_is_refused_naming_the_turn(tmp_path, tokenizer_path, roles, said):
    turns = [{"from": role or "gpt", "value": f"turn {i}" if role else ""} for i, role in enumerate(roles)]
    source = write_jsonl(tmp_path / "chat.jsonl", [{"conversations": turns}])
    section = DataSection(dataset=str(source), format="sharegpt", tokenizer=str(tokenizer_path), seq_len=64)
    with pytest.raises(DataError, match=f"record 1: {re.escape(said)}; fix"):
        load_token_data(section, 512, tmp_path / "cache", None)


HISTORY_PAIRS = "history must be a list of [prompt, response] pairs of text"
ALPACA_RECORDS = [  # (each trained something else: "None", an empty answer, the history's characters as turns)
    ({"instruction": "q", "output": "a", "history": [["h", None]]}, f"{HISTORY_PAIRS}, got ['h', None]"),
    ({"instruction": "q", "output": "a", "history": "h r"}, f"{HISTORY_PAIRS}, got 'h r'"),
    ({"instruction": "q", "output": ""}, "turn 1 is an assistant turn with no content, nothing to learn"),
]  # fmt: skip


@pytest.mark.parametrize("record,said", ALPACA_RECORDS)
def test_an_alpaca_record_of_an_empty_answer_or_a_bad_history_is_refused(tmp_path, tokenizer_path, record, said):
    source = write_jsonl(tmp_path / "sft.jsonl", [record])
    section = DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), seq_len=64)
    with pytest.raises(DataError, match=f"record 1: {re.escape(said)}"):
        load_token_data(section, 512, tmp_path / "cache", None)


def test_an_alpaca_prompt_joins_instruction_and_input_leaving_an_empty_one_out():
    """As LLaMA-Factory joins them: an empty instruction gave the user's turn "\\nonly input"."""
    from megatrain_data.conversations import to_conversation
    from megatrain_data.sources import Source

    source = Source("sft", "sft.jsonl", "alpaca")
    for instruction, query, said in [("", "only input", "only input"), ("do", "", "do"), ("do", "this", "do\nthis")]:
        record = {"instruction": instruction, "input": query, "output": "x"}
        assert to_conversation(record, source, 0)[0][0] == {"role": "user", "content": said}


@pytest.mark.parametrize("samples", [3, 25])
def test_num_samples_draws_records_at_random_and_upsamples_past_the_dataset(tmp_path, tokenizer_path, samples):
    """As LLaMA-Factory reads num_samples: it took the first N (a sorted file's slice) and never more than all."""
    write_jsonl(tmp_path / "ten.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(10)])
    entry = {"file_name": "ten.jsonl", "formatting": "alpaca", "num_samples": samples}
    (tmp_path / "dataset_info.json").write_text(json.dumps({"ten": entry}))
    section = DataSection(
        dataset="ten", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path), seq_len=32, pack=False
    )
    data = load_token_data(section, 512, tmp_path / "cache", None)
    assert data.train.tokens.shape[0] == samples
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    questions = [re.search(r"q\d", tokenizer.decode(row.tolist())).group() for row in data.train.tokens]
    if samples < 10:
        assert len(set(questions)) == samples and set(questions) != {"q0", "q1", "q2"}
    else:
        assert set(questions) == {f"q{i}" for i in range(10)}


def test_a_system_turn_overrides_the_system_column_and_messages_in_a_row_are_read(tmp_path, tokenizer_path):
    """As LLaMA-Factory reads them: a first system turn replaces the system column (two system turns were rendered);
    two user turns in a row, and tool results in a row after parallel calls, are conversations."""
    turns = [{"from": "system", "value": "TURN"}, {"from": "human", "value": "a"}, {"from": "human", "value": "b"}]
    turns += [
        {"from": "gpt", "value": "c"},
        {"from": "observation", "value": "d"},
        {"from": "observation", "value": "e"},
    ]
    turns += [{"from": "gpt", "value": "f"}]
    source = write_jsonl(
        tmp_path / "chat.jsonl",
        [{"conversations": turns[1:], "system": "COLUMN"}, {"conversations": turns, "system": "COLUMN"}],
    )
    section = DataSection(
        dataset=str(source),
        format="sharegpt",
        tokenizer=str(tokenizer_path),
        seq_len=128,
        chat_template="simple",
        shuffle=False,
    )
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    texts = [
        tokenizer.decode(row.tolist()) for row in load_token_data(section, 512, tmp_path / "cache", None).train.tokens
    ]
    assert "COLUMN" in texts[0] and "TURN" not in texts[0]
    assert "TURN" in texts[1] and "COLUMN" not in texts[1]


def test_tokenized_once_then_cached(tmp_path, tokenizer_path, monkeypatch):
    source = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "x y", "output": "z"}] * 50)
    section = DataSection(dataset=str(source), format="alpaca", tokenizer=str(tokenizer_path), validation=0.1)
    first = load_token_data(section, 512, tmp_path / "cache", None)
    import megatrain_data.records as records

    monkeypatch.setattr(records, "tokenize_source", lambda *a, **k: pytest.fail("tokenized twice"))
    again = load_token_data(section, 512, tmp_path / "cache", None)
    assert np.array_equal(first.train.tokens, again.train.tokens)
    assert np.array_equal(first.validation.loss_mask, again.validation.loss_mask) and again.report == first.report


def test_a_hub_name_the_hub_cannot_be_reached_for_is_refused_at_once(monkeypatch, tmp_path):
    """A name that is no local path, on a machine that cannot reach the Hub (here: an endpoint that refuses
    connections) and with no copy in datasets' cache: one line naming the name, the Hub and the fix, read in
    offline mode (no half a minute of retries first); offline mode is off again afterwards."""
    import datasets
    import huggingface_hub.constants as hub

    from megatrain_data.records import PROXY_VARIABLES, load_records
    from megatrain_data.sources import Source

    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:9")  # (the discard port: nothing listens)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    offline = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(DataError, match=r"'someone/no-such-set'.*cannot be reached \(127\.0\.0\.1:9: .*local file"):
        load_records(Source("someone/no-such-set", "someone/no-such-set", "text"))
    assert datasets.config.HF_HUB_OFFLINE == offline


def test_a_registry_entrys_folder_and_subset_are_what_datasets_reads_of_the_hub(monkeypatch, tmp_path):
    """LLaMA-Factory's `folder` (a hub repository's folder, datasets' data_dir) was accepted and not read: the whole
    repository was loaded."""
    import datasets

    import megatrain_data.records as records
    from megatrain_data.sources import resolve_sources

    entry = {
        "hf_hub_url": "someone/chats",
        "folder": "en",
        "subset": "clean",
        "split": "test",
        "formatting": "sharegpt",
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps({"chats": entry}))
    asked = {}
    monkeypatch.setattr(records, "_hub_unreachable", lambda: None)
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: asked.update(args=args, **kwargs) or [{}])
    records.load_records(resolve_sources(DataSection(dataset="chats", dataset_dir=str(tmp_path)))[0])
    assert asked == {"args": ("someone/chats", "clean"), "data_dir": "en", "split": "test"}


def test_trls_conversational_prompt_completion_records_train_the_completion(tmp_path, tokenizer_path):
    """As TRL's SFTTrainer reads them (completion_only_loss): the same rows as the messages they make; text ones, and
    prompts holding an answer (which megatrain would train too), are refused naming the fix."""
    user, answer = {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}
    both = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": [user], "completion": [answer]}])
    messages = write_jsonl(tmp_path / "m.jsonl", [{"messages": [user, answer]}])
    sections = [
        DataSection(dataset=str(path), format="messages", tokenizer=str(tokenizer_path)) for path in (both, messages)
    ]
    rows = [load_token_data(section, 512, tmp_path / f"cache{i}", None).train for i, section in enumerate(sections)]
    assert np.array_equal(rows[0].tokens, rows[1].tokens) and np.array_equal(rows[0].loss_mask, rows[1].loss_mask)
    for record, said in [
        ({"prompt": "Q", "completion": "A"}, "holds prompt and completion text (TRL's prompt-completion format)"),
        ({"prompt": [user, answer, user], "completion": [answer]}, "its prompt holds an assistant turn"),
    ]:
        path = write_jsonl(tmp_path / "bad.jsonl", [record])
        with pytest.raises(DataError, match=re.escape(said)):
            load_token_data(
                DataSection(dataset=str(path), format="messages", tokenizer=str(tokenizer_path)),
                512,
                tmp_path / "c",
                None,
            )


def test_a_folder_of_record_files_is_one_dataset(tmp_path, tokenizer_path):
    """As LLaMA-Factory reads a file_name naming a folder (it said "neither a Dataset directory nor a DatasetDict
    directory"); a folder of JSON and Parquet files is refused naming both."""
    folder = tmp_path / "shards"
    folder.mkdir()
    for shard in range(2):
        write_jsonl(folder / f"part-{shard}.jsonl", [{"instruction": f"q{shard}", "output": f"a{shard}"}])
    section = DataSection(
        dataset=str(folder), format="alpaca", tokenizer=str(tokenizer_path), seq_len=32, shuffle=False
    )
    rows = load_token_data(section, 512, tmp_path / "cache", None).train.tokens
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    assert [re.search(r"q\d", tokenizer.decode(row.tolist())).group() for row in rows] == ["q0", "q1"]
    (folder / "part-2.parquet").write_bytes(b"")
    with pytest.raises(DataError, match=r"holds files of both JSON and Parquet; give a folder of records of one type"):
        load_token_data(section, 512, tmp_path / "cache2", None)


def test_a_chat_template_that_is_not_utf8_or_is_a_directory_is_refused_naming_it(tmp_path):
    """data.chat_template on a binary file ended in a UnicodeDecodeError traceback, on a directory in an
    IsADirectoryError one."""
    from megatrain_data.chat import load_chat_template

    path = tmp_path / "template.jinja"
    path.write_bytes(b"{{ messages }}\xe6")
    with pytest.raises(DataError, match=r"data.chat_template .*template.jinja line 1, byte offset 14 \(0xe6\) is not"):
        load_chat_template(None, str(path), "</s>")
    with pytest.raises(DataError, match=r"data.chat_template .* is a directory; name a text file in it"):
        load_chat_template(None, str(tmp_path), "</s>")
