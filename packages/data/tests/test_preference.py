"""Preference pairs: TRL's tokenization of text pairs, implicit prompts, the simple template's conversations,
ranking registry entries, truncation and its counts, bad records, the cache, PairWindows and the data dump."""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, processors

from megatrain_data import (
    EOS_TOKEN,
    DataError,
    DataSection,
    PairWindows,
    Tokens,
    load_token_data,
)

PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "Two and two make", "chosen": " four.", "rejected": " five."},
    {"prompt": "Water is", "chosen": " wet.", "rejected": " dry."},
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Rome."},
]


@pytest.fixture(scope="module")
def bos_tokenizer_path(tokenizer_path, tmp_path_factory):
    """The same tokenizer putting <bos> before a text, as Llama's and Gemma's do."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    tokenizer.add_special_tokens(["<bos>"])
    bos = tokenizer.token_to_id("<bos>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    path = tmp_path_factory.mktemp("bos") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def load_pairs(path, tokenizer_path, cache, max_prompt_length=None, **data):
    section = DataSection(**{"dataset": str(path), "format": "preference", "tokenizer": str(tokenizer_path), **data})
    return load_token_data(section, 1024, cache, None, max_prompt_length=max_prompt_length)


def sequence(rows: Tokens, row: int) -> tuple[list[int], list[bool]]:
    """A row's real tokens and their trained flags (padding left out)."""
    valid = np.asarray(rows.valid[row])
    return np.asarray(rows.tokens[row])[valid].tolist(), np.asarray(rows.loss_mask[row])[valid].tolist()


def trl_text_pair(tokenizer, prompt, completion):
    """TRL's rule for a text pair member: tokenizer(prompt) with its special tokens, then the completion's
    ids without them, then EOS; the completion is trained."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True).ids
    completion_ids = tokenizer.encode(completion, add_special_tokens=False).ids + [eos]
    return prompt_ids + completion_ids, [False] * len(prompt_ids) + [True] * len(completion_ids)


def trl_implicit_prompt(chosen, rejected):
    """TRL's `extract_prompt` as its documentation states it: the longest common prefix (a space just before the
    first difference goes to the completions); without a difference, all but the shorter one's last element."""
    for index in range(min(len(chosen), len(rejected))):
        if chosen[index] != rejected[index]:
            if index > 0 and chosen[index - 1] == " ":
                index -= 1
            break
    return chosen[:index], chosen[index:], rejected[index:]


@pytest.mark.parametrize("bos", [False, True], ids=["no-bos", "bos"])
def test_text_pairs_are_tokenized_as_trl_tokenizes_them(tmp_path, tokenizer_path, bos_tokenizer_path, bos):
    path = bos_tokenizer_path if bos else tokenizer_path
    tokenizer = Tokenizer.from_file(str(path))
    data = load_pairs(write_jsonl(tmp_path / "p.jsonl", PAIRS), path, tmp_path / "cache", seq_len=48)
    assert data.pairs and data.train.tokens.shape == (8, 48) and data.train.position_ids is None
    for i, record in enumerate(PAIRS):
        for row, completion in ((2 * i, record["chosen"]), (2 * i + 1, record["rejected"])):
            assert sequence(data.train, row) == trl_text_pair(tokenizer, record["prompt"], completion)
    padding = ~np.asarray(data.train.valid)
    assert padding.any() and not np.asarray(data.train.loss_mask)[padding].any()


def test_implicit_prompts_of_text_and_conversations(tmp_path, tokenizer_path):
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    texts = [
        {"chosen": "Say it: yes", "rejected": "Say it: no"},
        {"chosen": "abc", "rejected": "abcdef"},  # no difference within the shorter: all but its last character
    ]
    data = load_pairs(write_jsonl(tmp_path / "t.jsonl", texts), tokenizer_path, tmp_path / "c1", seq_len=32)
    for i, record in enumerate(texts):
        prompt, chosen, rejected = trl_implicit_prompt(record["chosen"], record["rejected"])
        assert sequence(data.train, 2 * i) == trl_text_pair(tokenizer, prompt, chosen)
        assert sequence(data.train, 2 * i + 1) == trl_text_pair(tokenizer, prompt, rejected)

    user = {"role": "user", "content": "Name a colour."}
    chats = [
        {
            "chosen": [user, {"role": "assistant", "content": "Blue"}],
            "rejected": [user, {"role": "assistant", "content": "Seven"}],
        }
    ]
    implicit = load_pairs(write_jsonl(tmp_path / "c.jsonl", chats), tokenizer_path, tmp_path / "c2", seq_len=32)
    explicit = [{"prompt": [user], "chosen": chats[0]["chosen"][1:], "rejected": chats[0]["rejected"][1:]}]
    direct = load_pairs(write_jsonl(tmp_path / "e.jsonl", explicit), tokenizer_path, tmp_path / "c3", seq_len=32)
    assert np.array_equal(implicit.train.tokens, direct.train.tokens)
    assert np.array_equal(implicit.train.loss_mask, direct.train.loss_mask)


def test_conversations_with_the_simple_template_train_the_rendered_completion(tmp_path, tokenizer_path, capsys):
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    records = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "assistant", "content": "go away"}],
        }
    ]
    data = load_pairs(write_jsonl(tmp_path / "c.jsonl", records), tokenizer_path, tmp_path / "cache", seq_len=128)
    assert "no chat template; using the simple template" in capsys.readouterr().err
    assert data.report[0] == "chat template: the simple template"
    prompt = "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"  # rendered with its generation prompt
    for row, answer in ((0, "hello"), (1, "go away")):
        ids, trained = sequence(data.train, row)
        completion = f"{answer}{EOS_TOKEN}\n"  # everything the template renders past the prompt
        assert ids == tokenizer.encode(prompt + completion, add_special_tokens=False).ids  # rendered whole
        assert tokenizer.decode([i for i, t in zip(ids, trained) if not t], skip_special_tokens=False) == prompt
        assert tokenizer.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False) == completion


def common_prefix_length(ids, other_ids):
    return next((i for i, (a, b) in enumerate(zip(ids, other_ids)) if a != b), min(len(ids), len(other_ids)))


def test_a_pairs_completions_start_where_trl_splits_them_when_one_merges_into_the_prompt(tmp_path, tokenizer_path):
    """TRL's DPOTrainer splits a conversational pair at one prompt length for both completions: the shorter of the
    prompt's ids' common prefixes with chosen's and rejected's. Where only chosen's first characters merge with the
    prompt's last ("assistant: " + "away": one token " a"), rejected trains that prompt token too."""
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    template = tmp_path / "colon.jinja"  # a generation prompt ending in a space
    template.write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    record = {
        "prompt": [{"role": "user", "content": "hi"}],
        "chosen": [{"role": "assistant", "content": "away"}],
        "rejected": [{"role": "assistant", "content": "\nno"}],
    }
    source = write_jsonl(tmp_path / "c.jsonl", [record])
    data = load_pairs(source, tokenizer_path, tmp_path / "cache", seq_len=64, chat_template=str(template))
    prompt_ids = tokenizer.encode("user: hi\nassistant: ", add_special_tokens=False).ids
    texts = ("user: hi\nassistant: away\n", "user: hi\nassistant: \nno\n")
    full = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
    prompt_length = min(common_prefix_length(prompt_ids, ids) for ids in full)  # (TRL's `tokenize_fn`)
    assert prompt_length < len(prompt_ids)  # the merge this test is about
    for row, ids in enumerate(full):
        assert sequence(data.train, row) == (ids, [i >= prompt_length for i in range(len(ids))])


def test_truncation_keeps_the_prompts_end_and_the_completions_start(tmp_path, tokenizer_path):
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    long_prompt = " ".join(f"word{i}" for i in range(30))
    long_answer = " ".join(f"answer{i}" for i in range(30))
    records = PAIRS[:2] + [
        {"prompt": long_prompt, "chosen": " yes", "rejected": " no"},
        {"prompt": "Tell me", "chosen": " " + long_answer, "rejected": " nothing"},
    ]
    source = write_jsonl(tmp_path / "p.jsonl", records)
    data = load_pairs(source, tokenizer_path, tmp_path / "c1", 10, seq_len=24)
    assert (
        "4 records -> 4 pairs (1 with the prompt cut to its last 10 tokens by train.dpo.max_prompt_length; "
        "1 with a completion cut to fit seq_len 24)" in data.report[0]
    )
    for row, (prompt, completion) in {4: (long_prompt, " yes"), 6: ("Tell me", " " + long_answer)}.items():
        full_ids, full_trained = trl_text_pair(tokenizer, prompt, completion)
        start = full_trained.index(True)
        kept_prompt = full_ids[:start][-10:]
        expected = kept_prompt + full_ids[start:][: 24 - len(kept_prompt)]
        ids, trained = sequence(data.train, row)
        assert ids == expected and trained == [False] * len(kept_prompt) + [True] * (len(ids) - len(kept_prompt))
    default = load_pairs(source, tokenizer_path, tmp_path / "c2", seq_len=24)  # max_prompt_length: seq_len // 2
    assert "cut to its last 12 tokens" in default.report[0]
    dropped = load_pairs(source, tokenizer_path, tmp_path / "c3", 10, seq_len=24, too_long="drop")
    assert "4 records -> 2 pairs (2 dropped as longer than seq_len 24)" in dropped.report[0]


def write_ranking_registry(directory):
    """Writes an alpaca ranking file, a sharegpt ranking file and a dataset_info.json naming them (entries
    'rank' and 'chat'), plus an 'sft' entry over the ranking file; returns the registry as written."""
    write_jsonl(
        directory / "rank.jsonl",
        [{"q": "Add.", "extra": "1 and 2", "good": "3", "bad": "4", "history": [["Hi", "Hello"]]}],
    )
    conversation = [
        {"speaker": "me", "text": "hi"},
        {"speaker": "bot", "text": "hey"},
        {"speaker": "me", "text": "bye"},
    ]
    write_jsonl(
        directory / "chat.jsonl",
        [
            {
                "dialog": conversation,
                "chosen": {"speaker": "bot", "text": "see you"},
                "rejected": {"speaker": "bot", "text": "no"},
            }
        ],
    )
    registry = {
        "rank": {
            "file_name": "rank.jsonl",
            "ranking": True,
            "columns": {"prompt": "q", "query": "extra", "chosen": "good", "rejected": "bad"},
        },
        "chat": {
            "file_name": "chat.jsonl",
            "formatting": "sharegpt",
            "ranking": True,
            "columns": {"messages": "dialog"},
            "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me", "assistant_tag": "bot"},
        },
        "sft": {"file_name": "rank.jsonl", "columns": {"prompt": "q", "chosen": "good"}},
    }
    (directory / "dataset_info.json").write_text(json.dumps(registry))
    return registry


def check_ranking_pairs_render_both_formats(data, tokenizer):
    """The alpaca pair (with its history) fills rows 0-1 as chosen then rejected; the sharegpt pair rows 2-3."""
    assert data.pairs and data.train.tokens.shape == (4, 128)
    texts = [tokenizer.decode(sequence(data.train, row)[0], skip_special_tokens=False) for row in range(4)]
    history = f"<|user|>\nHi\n<|assistant|>\nHello{EOS_TOKEN}\n<|user|>\nAdd.\n1 and 2\n<|assistant|>\n"
    assert texts[:2] == [f"{history}3{EOS_TOKEN}\n", f"{history}4{EOS_TOKEN}\n"]
    turns = f"<|user|>\nhi\n<|assistant|>\nhey{EOS_TOKEN}\n<|user|>\nbye\n<|assistant|>\n"
    assert texts[2:] == [f"{turns}see you{EOS_TOKEN}\n", f"{turns}no{EOS_TOKEN}\n"]


def check_sft_entry_and_mixed_datasets_are_refused(directory, registry, tokenizer):
    """A non-ranking entry with a 'chosen' column is refused, and so is mixing pairs with plain datasets."""
    with pytest.raises(DataError, match=r"entry 'sft' uses \['chosen'\], which megatrain does not support"):
        load_token_data(
            DataSection(dataset="sft", dataset_dir=str(directory), tokenizer=tokenizer),
            1024,
            directory / "c2",
            None,
        )
    with pytest.raises(DataError, match=r"mixes preference pairs \(rank\) with other datasets \(plain\)"):
        write_jsonl(directory / "plain.jsonl", [{"instruction": "a", "output": "b"}])
        registry["plain"] = {"file_name": "plain.jsonl"}
        (directory / "dataset_info.json").write_text(json.dumps(registry))
        load_token_data(
            DataSection(dataset="rank,plain", dataset_dir=str(directory), tokenizer=tokenizer),
            1024,
            directory / "c3",
            None,
        )


def test_ranking_registry_entries_alpaca_and_sharegpt(tmp_path, tokenizer_path):
    registry = write_ranking_registry(tmp_path)
    section = DataSection(dataset="rank,chat", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path), seq_len=128)
    data = load_token_data(section, 1024, tmp_path / "cache", None)
    check_ranking_pairs_render_both_formats(data, Tokenizer.from_file(str(tokenizer_path)))
    check_sft_entry_and_mixed_datasets_are_refused(tmp_path, registry, section.tokenizer)


USER, SYSTEM, ANSWER = ({"role": role, "content": "x"} for role in ("user", "system", "assistant"))


def turns_after(last: dict, chosen: dict) -> dict:
    """A conversational pair whose prompt ends in `last` and whose chosen completion starts with `chosen`."""
    return {"prompt": [USER, last], "chosen": [chosen], "rejected": [{"role": "assistant", "content": "c"}]}


BAD_RECORDS = [
    (
        {"prompt": "a", "chosen": "b"},
        r"record 2 has no rejected field 'rejected' \(its fields: \['chosen', 'prompt'\]\); other records have it",
    ),
    ({"prompt": "a", "chosen": "", "rejected": "c"}, r"record 2: its chosen completion is empty"),
    (
        {"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": "c"},
        r"record 2: prompt is conversation, chosen is text",
    ),
    (
        {
            "prompt": [{"role": "human", "content": "a"}],
            "chosen": [{"role": "assistant", "content": "b"}],
            "rejected": [],
        },
        r"record 2: prompt turn 0 has role 'human', not one of user, assistant, system, tool",
    ),
    (
        {
            "prompt": [{"role": "user", "content": "a"}],
            "chosen": [{"role": "assistant", "content": "b"}],
            "rejected": [],
        },
        r"record 2: its rejected completion is empty",
    ),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, r"record 2: chosen must be text or a conversation"),
    # (TRL refuses the first, continues the prompt's last assistant turn in the second; the third trained its headers)
    (turns_after(SYSTEM, ANSWER), r"record 2 \(chosen\): turn 1 is a system turn after a user turn"),
    (turns_after(ANSWER, ANSWER), r"record 2 \(chosen\): turn 2 is an assistant turn after an assistant turn"),
    (turns_after(USER, USER), r"record 2: its chosen completion starts with a user turn; it must be"),
    ({"prompt": " ".join(["word"] * 40), "chosen": "b", "rejected": "c"}, r"record 2: its prompt keeps \d+ tokens"),
]


@pytest.mark.parametrize("record, message", BAD_RECORDS)
def test_a_bad_record_is_one_line_naming_it_and_the_fix(tmp_path, tokenizer_path, record, message):
    source = write_jsonl(tmp_path / "bad.jsonl", [PAIRS[0], record])
    with pytest.raises(DataError, match=message) as error:
        load_pairs(source, tokenizer_path, tmp_path / "cache", 40, seq_len=16)
    assert "\n" not in str(error.value) and ";" in str(error.value)  # one line, then what to do


HUMAN, GPT = {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}
BAD_RANKING_RECORDS = [
    (
        {"conversations": [HUMAN, GPT], "chosen": GPT, "rejected": GPT},
        r"record 1: its 'conversations' end with assistant",
    ),
    ({"conversations": [HUMAN], "chosen": "hey", "rejected": GPT}, r"record 1: chosen must be one turn such as"),
    ({"conversations": [HUMAN], "chosen": GPT, "rejected": HUMAN}, r"record 1: rejected is a user turn"),
    ({"conversations": [HUMAN], "chosen": GPT}, r"record 1 has no rejected field 'rejected'"),
    (
        {"conversations": [HUMAN], "chosen": {"from": "bot", "value": "x"}, "rejected": GPT},
        r"record 1: chosen has role 'bot'",
    ),
]


@pytest.mark.parametrize("record, message", BAD_RANKING_RECORDS)
def test_a_bad_ranking_record_is_one_line_naming_it(tmp_path, tokenizer_path, record, message):
    write_jsonl(tmp_path / "rank.jsonl", [record])
    registry = {"rank": {"file_name": "rank.jsonl", "formatting": "sharegpt", "ranking": True}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry))
    section = DataSection(dataset="rank", dataset_dir=str(tmp_path), tokenizer=str(tokenizer_path))
    with pytest.raises(DataError, match=message) as error:
        load_token_data(section, 1024, tmp_path / "cache", None)
    assert "\n" not in str(error.value) and ";" in str(error.value)


def test_pairs_whose_chosen_equals_rejected_are_dropped_and_counted(tmp_path, tokenizer_path):
    same = {"prompt": "a", "chosen": " same", "rejected": " same"}
    data = load_pairs(write_jsonl(tmp_path / "p.jsonl", PAIRS + [same]), tokenizer_path, tmp_path / "c1", seq_len=32)
    assert "5 records -> 4 pairs (1 dropped with chosen equal to rejected)" in data.report[0]
    assert len(data.train.tokens) == 8
    with pytest.raises(DataError, match="most pairs would be dropped; fix the dataset"):
        load_pairs(write_jsonl(tmp_path / "q.jsonl", PAIRS[:1] + [same] * 2), tokenizer_path, tmp_path / "c2")


def test_settings_pairs_cannot_take_are_refused():
    with pytest.raises(DataError, match="set data.train_on_prompt: false"):
        DataSection(dataset="p.jsonl", format="preference", train_on_prompt=True)


def test_validation_mixing_and_the_cache(tmp_path, tokenizer_path, monkeypatch):
    records = [{"prompt": f"q{i}", "chosen": f" good {i}", "rejected": f" bad {i}"} for i in range(20)]
    source = write_jsonl(tmp_path / "p.jsonl", records)
    data = load_pairs(source, tokenizer_path, tmp_path / "cache", seq_len=16, validation=0.25)
    assert data.train.tokens.shape == (30, 16) and data.validation.tokens.shape == (10, 16)
    train_rows = {tuple(r) for r in data.train.tokens}
    assert not any(tuple(r) in train_rows for r in data.validation.tokens) and data.report[-1] == "validation: 5 pairs"
    mixed = load_pairs(
        f"{source},{write_jsonl(tmp_path / 'q.jsonl', PAIRS)}",
        tokenizer_path,
        tmp_path / "mix",
        seq_len=16,
        mix_weights=(1.0, 3.0),
    )
    assert len(mixed.train.tokens) == 2 * 24 and sum(r.startswith("q") for r in _prompts(tokenizer_path, mixed)) == 6

    import megatrain_data.preference as preference

    real = preference.tokenize_pairs
    monkeypatch.setattr(preference, "tokenize_pairs", lambda *a, **k: pytest.fail("tokenized twice"))
    again = load_pairs(source, tokenizer_path, tmp_path / "cache", seq_len=16, validation=0.25)
    assert np.array_equal(again.train.tokens, data.train.tokens) and again.report == data.report
    calls = []
    monkeypatch.setattr(preference, "tokenize_pairs", lambda *a, **k: calls.append(1) or real(*a, **k))
    load_pairs(source, tokenizer_path, tmp_path / "cache", 3, seq_len=16, validation=0.25)
    assert calls  # a truncation setting is part of the key


def _prompts(tokenizer_path, data):
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    return [tokenizer.decode(sequence(data.train, row)[0][:2]) for row in range(0, len(data.train.tokens), 2)]


def test_pair_windows_draw_whole_pairs_once_per_epoch():
    n_pairs, seq_len = 10, 6
    tokens = np.repeat(np.arange(2 * n_pairs, dtype=np.int32)[:, None], seq_len, axis=1)  # row r holds r
    rows = Tokens(tokens, np.ones_like(tokens, dtype=bool), None, np.ones_like(tokens, dtype=bool))
    for shuffle in (False, True):
        windows = PairWindows(rows, batch_size=4, shuffle=shuffle, seed=3)
        drawn = []
        for step in range(5):  # two epochs of 10 pairs
            batch = windows.batch(step)
            assert batch.input_ids.shape == (8, seq_len) and batch.position_ids is None
            first = batch.input_ids[:, 0]
            assert torch.equal(first[1::2], first[0::2] + 1) and (first[0::2] % 2 == 0).all()  # chosen, its rejected
            drawn += (first[0::2] // 2).tolist()
        assert sorted(drawn[:10]) == list(range(10)) and sorted(drawn[10:]) == list(range(10))
        assert (drawn[:10] != list(range(10))) == shuffle
    assert [b.input_ids.shape[0] for b in windows.in_order(4)] == [8, 8, 4]
    with pytest.raises(DataError, match="10 preference pairs, fewer than one batch of train.batch_size 11"):
        PairWindows(rows, batch_size=11, shuffle=False, seed=0)
