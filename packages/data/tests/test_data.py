import json
import shutil

import numpy as np
import pytest
import torch

from megatrain_data import (
    DataError,
    DataSection,
    TokenWindows,
    builtin_corpus,
    check_tokens,
    load_token_array,
    load_token_data,
    not_utf8_where,
    run_tokenizer,
)

# digits, runs of spaces and newlines, a tab, accents composed and not (NFC), CJK and an emoji: where Qwen's splits
# differ from GPT-2's
SPLIT_PROBE = "in 2024, 12345 cats\n\n  sat\ton 3.14 mats: naïve cafe\u0301 ñ 日本語 🙂 it's\r\n"


def test_consecutive_windows_without_shuffle():
    tokens = np.arange(100)
    windows = TokenWindows(tokens, seq_len=10, batch_size=3, shuffle=False, seed=0)
    batch = windows.batch(1)  # step 1 uses windows 3, 4, 5
    ids, labels = batch.input_ids, batch.labels
    assert torch.equal(ids[0], torch.arange(30, 40))
    assert torch.equal(ids[2], torch.arange(50, 60))
    assert torch.equal(labels[0, :-1], torch.arange(31, 40)) and labels[0, -1] == -100
    ids = windows.batch(3).input_ids  # windows 9, 0, 1: wraps around after the 10th window
    assert ids[0, 0] == 90 and ids[1, 0] == 0 and ids[2, 0] == 10


def test_shuffle_is_a_seeded_permutation_per_pass():
    windows = TokenWindows(np.arange(1000), seq_len=10, batch_size=10, shuffle=True, seed=3)
    first_pass = [i for step in range(10) for i in windows.window_indices(step)]
    assert sorted(first_pass) == list(range(100)) and first_pass != list(range(100))
    second_pass = [i for step in range(10, 20) for i in windows.window_indices(step)]
    assert sorted(second_pass) == list(range(100)) and second_pass != first_pass
    again = TokenWindows(np.arange(1000), seq_len=10, batch_size=10, shuffle=True, seed=3)
    assert again.window_indices(4) == windows.window_indices(4)


@pytest.mark.parametrize(
    "tokens, seq_len, batch_size, message",
    [
        (np.zeros((8, 16), dtype=np.int32), 32, 2, "rows are 16 tokens long, not seq_len 32"),
        (np.arange(100), 0, 1, "seq_len must be >= 2"),
        (np.arange(100), 10, 0, "batch_size must be >= 1"),
        (np.random.default_rng(0).random(100), 10, 1, "token ids must be integers, got float64"),
    ],
)
def test_windows_the_data_cannot_give_are_refused_when_made(tokens, seq_len, batch_size, message):
    # (rows of another width came out silently at their own width; float ids were truncated to 0)
    with pytest.raises(DataError, match=message):
        TokenWindows(tokens, seq_len, batch_size, shuffle=False, seed=0)


def test_bad_token_data():
    with pytest.raises(DataError, match="fewer than one batch"):
        TokenWindows(np.arange(50), seq_len=10, batch_size=8, shuffle=False, seed=0)
    with pytest.raises(DataError, match=r"span \[0, 300\].*vocab_size is 256"):
        check_tokens(np.array([0, 300]), 256, "data.tokens x.npy")
    with pytest.raises(DataError, match="empty"):
        check_tokens(np.array([], dtype=np.int64), 256, "data.tokens x.npy")
    with pytest.raises(DataError, match="1-D integer"):
        check_tokens(np.zeros((2, 2), dtype=np.float32), 256, "data.tokens x.npy")


def test_text_is_tokenized_once_and_cached(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text(builtin_corpus().read_text()[:20000])
    tokens, tokenizer = load_token_array(DataSection(text=str(text)), 512, tmp_path / "cache", None)
    assert tokens.max() < 512 and len(tokens) > 2000 and tokenizer.exists()
    cached = list((tmp_path / "cache").glob("tokens-*.npy"))
    assert len(cached) == 1
    again, _ = load_token_array(DataSection(text=str(text), tokenizer=str(tokenizer)), 512, tmp_path / "cache", None)
    assert np.array_equal(tokens, again)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_a_text_is_encoded_in_pieces_to_the_ids_of_the_whole_text(tmp_path, monkeypatch):
    """A text is encoded in pieces cut at line starts (bounded memory, every core), to the ids a byte-level
    tokenizer gives the whole text: indented lines, blank lines before indented code and the text's end included
    (paragraphs encoded apart, each ending in a blank line, differed at every blank line before an indent)."""
    from tokenizers import Tokenizer

    from megatrain_data import tokens as token_module

    monkeypatch.setattr(token_module, "PIECE_CHARS", 200)
    monkeypatch.setattr(token_module, "BATCH_CHARS", 1000)
    rng = np.random.default_rng(0)
    words = ["alpha", "  indented", "x\ty", "42", "\u00e9tat", "\u65e5\u672c", " ", "", "\n    def f():", "\n\n"]
    text = "\n".join(" ".join(rng.choice(words, 8)) for _ in range(300))
    path = tmp_path / "lines.txt"
    path.write_text(text)
    _, tokenizer_path = load_token_array(DataSection(text=str(path)), 512, tmp_path / "cache", None)
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    pieces = list(token_module._pieces(text, tokenizer))
    assert len(pieces) > 20 and "".join(pieces) == text
    assert max(map(len, pieces)) < 1000 < len(text) / 10  # (a cut waits for a line that starts with no space)
    assert token_module._encoded_text(text, tokenizer, "lines.txt").tolist() == _encode(tokenizer, text)


def test_a_sentencepiece_text_is_encoded_whole(monkeypatch):
    """A SentencePiece-style tokenizer starts each text it encodes with "▁": no cut gives the whole text's ids,
    so its text is one piece."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from megatrain_data import tokens as token_module

    monkeypatch.setattr(token_module, "PIECE_CHARS", 50)
    vocab = {piece: i for i, piece in enumerate(["<unk>", "\u2581", "\n", *"abcdefghij", "\u2581a", "\u2581b"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    text = "\n".join(["abcdefghij"] * 40)
    assert list(token_module._pieces(text, tokenizer)) == [text]
    assert token_module._encoded_text(text, tokenizer, "sp.txt").tolist() == _encode(tokenizer, text)
    monkeypatch.setattr(token_module, "MAX_PIECE_CHARS", 100)  # (memory bounds a piece: cut anyway)
    pieces = list(token_module._pieces(text, tokenizer))
    assert "".join(pieces) == text and len(pieces) == 4 and max(map(len, pieces)) < 200


def test_unreadable_and_empty_sources(tmp_path):
    with pytest.raises(DataError, match="data.tokens .*missing.npy does not exist; check the path"):
        load_token_array(DataSection(tokens=str(tmp_path / "missing.npy")), 256, tmp_path, None)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DataError, match="is empty"):
        load_token_array(DataSection(text=str(empty)), 256, tmp_path, None)


def test_a_tiny_model_gets_a_tokenizer_that_fits_and_reuses_it(tmp_path, monkeypatch):
    """vocab_size 256 (the tiny presets) on the built-in corpus: the trained tokenizer holds the bytes the text
    uses, EOS and merges, at most 256 tokens, and encodes the text losslessly; a second load (a resumed run)
    reuses it without training again."""
    from tokenizers import Tokenizer

    import megatrain_data.tokens as data_module

    text = tmp_path / "a.txt"
    text.write_text(builtin_corpus().read_text()[:50000])
    tokens, path = load_token_array(DataSection(text=str(text)), 256, tmp_path / "cache", None)
    tokenizer = Tokenizer.from_file(str(path))
    assert tokenizer.get_vocab_size() <= 256 and tokens.max() < 256
    assert tokenizer.decode(list(tokens)) == text.read_text()
    monkeypatch.setattr(data_module, "train_tokenizer", lambda *a, **k: pytest.fail("trained again"))
    again, same = load_token_array(DataSection(text=str(text)), 256, tmp_path / "cache", None)
    assert same == path and np.array_equal(tokens, again)


@pytest.mark.parametrize(("model_type", "built"), [("qwen2", "Qwen2Tokenizer"), ("qwen3_5", "Qwen3_5Tokenizer")])
def test_a_tokenizer_trained_for_a_qwen_model_is_encoded_by_transformers_as_trained(tmp_path, model_type, built):
    """transformers builds Qwen2's and Qwen3.5's tokenizers from tokenizer.json's vocabulary and merges alone, split
    by their own regex, whatever tokenizer_config.json names: the tokenizer megatrain trains for those model types
    splits as they do (digits one by one), so that transformers encodes a directory of it as training did."""
    from tokenizers import Tokenizer

    transformers = pytest.importorskip("transformers")
    text = tmp_path / "a.txt"
    text.write_text(builtin_corpus().read_text()[:20000] + SPLIT_PROBE * 20)
    data = load_token_data(DataSection(text=str(text)), 512, tmp_path / "cache", None, model_type=model_type)
    served = tmp_path / "served"
    served.mkdir()
    shutil.copyfile(data.tokenizer, served / "tokenizer.json")
    (served / "config.json").write_text(json.dumps({"model_type": model_type}))
    (served / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    by_transformers = transformers.AutoTokenizer.from_pretrained(served)
    trained = Tokenizer.from_file(str(data.tokenizer))
    assert type(by_transformers).__name__ == built
    expected = trained.encode(SPLIT_PROBE, add_special_tokens=False).ids
    assert by_transformers.encode(SPLIT_PROBE, add_special_tokens=False) == expected
    assert len(trained.encode("12345", add_special_tokens=False).ids) == 5


def test_a_qwen_run_started_before_its_split_keeps_the_tokenizer_it_started_with(tmp_path, monkeypatch):
    """Only a Qwen model's tokenizer (and its cache key) changed: a Llama's is the one trained before. A qwen2 run
    whose cache holds the tokenizer megatrain trained before it split as transformers does (a run started then,
    resumed) goes on with that one, its ids those the model learned, and trains no other; a new run gets Qwen's."""
    import megatrain_data.tokens as data_module

    text = tmp_path / "a.txt"
    text.write_text(builtin_corpus().read_text()[:20000] + SPLIT_PROBE * 20)
    section = DataSection(text=str(text))
    tokens, started_with = load_token_array(section, 256, tmp_path / "cache", None)  # (as megatrain read it before)
    assert load_token_data(section, 256, tmp_path / "cache", None, model_type="llama").tokenizer == started_with
    new_run = load_token_data(section, 256, tmp_path / "new-run", None, model_type="qwen2").tokenizer
    assert new_run.read_bytes() != started_with.read_bytes()
    monkeypatch.setattr(data_module, "train_tokenizer", lambda *a, **k: pytest.fail("trained again"))
    resumed = load_token_data(section, 256, tmp_path / "cache", None, model_type="qwen2")
    assert resumed.tokenizer == started_with and np.array_equal(resumed.train.tokens, tokens)
    assert run_tokenizer(section, 256, tmp_path, None, "qwen2") == started_with  # (its export's, convert's)


def test_a_text_with_more_bytes_than_the_vocabulary_says_what_to_change(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("".join(chr(c) for c in range(32, 127)) * 20)  # 95 distinct bytes
    with pytest.raises(DataError, match="uses 95 distinct bytes.*needs 96 tokens, more than .* vocab_size of 64"):
        load_token_array(DataSection(text=str(text)), 64, tmp_path / "cache", None)


def test_a_missing_tokenizer_is_named(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("some text\n")
    missing = tmp_path / "no" / "tokenizer.json"
    with pytest.raises(DataError, match=f"data.tokenizer {missing} does not exist"):
        load_token_array(DataSection(text=str(text), tokenizer=str(missing)), 256, tmp_path / "cache", None)


def test_not_utf8_where_reads_across_chunks(tmp_path):
    """A character cut by a chunk's end is read whole from the next; the first byte that is not UTF-8 is named by
    its line and offset wherever the chunks fall."""
    raw = "é\n".encode() * 5 + b"ab\xffc"
    path = tmp_path / "text.txt"
    path.write_bytes(raw)
    for chunk_bytes in (1, 2, 3, 7, 1 << 20):
        assert not_utf8_where(path, chunk_bytes) == f"{path} line 6, byte offset 17 (0xff) is not UTF-8"
    path.write_bytes(raw[:-2])
    assert all(not_utf8_where(path, chunk_bytes) is None for chunk_bytes in (1, 2, 3, 1 << 20))
    path.write_bytes(raw[:1])  # (a character cut by the file's end)
    assert not_utf8_where(path, 1) == f"{path} line 1, byte offset 0 (0xc3) is not UTF-8"


def test_token_ids_with_a_tokenizer_that_does_not_exist_are_refused(tmp_path):
    """data.tokenizer beside data.tokens names the tokenizer the export serves; a misspelled one was dropped without a
    word, and the run's export then said its source named none."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, 256, 1024).astype(np.int32))
    section = DataSection(tokens=str(tokens), tokenizer=str(tmp_path / "tokenzier.json"), seq_len=32)
    with pytest.raises(DataError, match=r"data.tokenizer .*tokenzier.json does not exist"):
        load_token_data(section, 256, tmp_path / "cache", None)


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(text_field="body", too_long="drop"), r"data.text_field, data.too_long apply to the records of data"),
        (dict(train_on_prompt=True), r"data.train_on_prompt applies .*: leave it out"),
    ],
)
def test_record_settings_beside_text_or_tokens_are_refused(given, message):
    """data.text_field, train_on_prompt and too_long read records only: with a text file or token ids they were taken
    and ignored. data.chat_template is any run's: `megatrain generate` renders chat prompts with it."""
    for source in (dict(text="corpus.txt"), dict(tokens="tokens.npy")):
        with pytest.raises(DataError, match=message):
            DataSection(**source, **given)
    DataSection(text="corpus.txt", too_long="truncate", text_field="text")  # (their defaults: not set)
    DataSection(dataset="records.jsonl", **given)
    DataSection(text="corpus.txt", chat_template="chat.jinja")
