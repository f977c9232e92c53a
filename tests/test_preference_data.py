"""Preference pairs against transformers, by TRL's rules: a conversational pair's sequences are the ids of
`apply_chat_template(prompt + completion)` with the real models' templates, its completion the text past the
prompt rendered with its generation prompt (TRL's `maybe_apply_chat_template`); a text pair's are
`tokenizer(prompt)` then the completion's ids and EOS (TRL's `tokenize_row`)."""

import json

import numpy as np
import pytest
from chat_templates import TEMPLATES
from test_finetune import hf_ids, hf_tokenizer, tokenizer_dir, write_jsonl, write_model_tokenizer  # noqa: F401
from tokenizers import Tokenizer, processors

from megatrain_data import DataSection, load_token_data

USER = {"role": "user", "content": "What is 2 + 2?"}
RECORDS = [
    {
        "prompt": [USER],
        "chosen": [{"role": "assistant", "content": "It is 4."}],
        "rejected": [{"role": "assistant", "content": "Five, I think."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue"},
            {"role": "user", "content": "Another?"},
        ],
        "chosen": [{"role": "assistant", "content": "Green."}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
    {  # TRL's implicit prompt: the leading turns chosen and rejected share
        "chosen": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}],
        "rejected": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "bye"}],
    },
]


def trl_split(hf, prompt, completions):
    """TRL's `maybe_apply_chat_template` for an explicit prompt: (the prompt rendered with its generation prompt,
    cut to the prefix every prompt + completion rendering shares; each completion's text past it)."""
    prompt_text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    wholes = [hf.apply_chat_template(prompt + completion, tokenize=False) for completion in completions]
    for whole in wholes:
        shared = next((i for i, (a, b) in enumerate(zip(prompt_text, whole)) if a != b), len(prompt_text))
        prompt_text = prompt_text[:shared]
    return prompt_text, [whole[len(prompt_text) :] for whole in wholes]


def explicit(record):
    """TRL's `maybe_extract_prompt` for conversations: (prompt, chosen, rejected), the prompt the leading turns
    chosen and rejected share (all but the shorter one's last where they share every turn of it)."""
    if "prompt" in record:
        return record["prompt"], record["chosen"], record["rejected"]
    chosen, rejected = record["chosen"], record["rejected"]
    shorter = min(len(chosen), len(rejected))
    split = next((i for i in range(shorter) if chosen[i] != rejected[i]), shorter - 1)
    return chosen[:split], chosen[split:], rejected[split:]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_conversational_pairs_equal_apply_chat_template(name, tmp_path, tokenizer_dir):  # noqa: F811
    model_dir = write_model_tokenizer(tmp_path / "model", tokenizer_dir, name)
    records = [r for r in RECORDS if name != "mistral" or "system" not in json.dumps(r)]  # (Mistral has none)
    section = DataSection(
        dataset=str(write_jsonl(tmp_path / "pairs.jsonl", records)),
        format="preference",
        tokenizer=str(model_dir / "tokenizer.json"),
        seq_len=256,
    )
    data = load_token_data(section, 700, tmp_path / "cache", None, max_prompt_length=200)
    assert data.pairs and data.report[0] == f"chat template: {model_dir / 'tokenizer_config.json'}"
    hf = hf_tokenizer(tokenizer_dir, name, TEMPLATES[name])
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for pair, record in enumerate(records):
        prompt, chosen, rejected = explicit(record)
        prompt_text, completion_texts = trl_split(hf, prompt, [chosen, rejected])
        for row, completion, completion_text in zip((2 * pair, 2 * pair + 1), (chosen, rejected), completion_texts):
            valid = np.asarray(data.train.valid[row])
            ids = np.asarray(data.train.tokens[row])[valid].tolist()
            trained = np.asarray(data.train.loss_mask[row])[valid]
            assert ids == hf_ids(hf, prompt + completion)  # rendered and tokenized whole
            start = int(np.argmax(trained))
            assert trained[start:].all() and not trained[:start].any()
            assert tokenizer.decode(ids[:start], skip_special_tokens=False) == prompt_text
            assert tokenizer.decode(ids[start:], skip_special_tokens=False) == completion_text
            assert completion_text.startswith(completion[-1]["content"].strip())


def test_tools_reach_the_template(tmp_path, tokenizer_dir):  # noqa: F811
    model_dir = write_model_tokenizer(tmp_path / "model", tokenizer_dir, "qwen2.5")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    record = dict(RECORDS[0], tools=json.dumps(tools))
    section = DataSection(
        dataset=str(write_jsonl(tmp_path / "pairs.jsonl", [record])),
        format="preference",
        tokenizer=str(model_dir / "tokenizer.json"),
        seq_len=512,
    )
    data = load_token_data(section, 700, tmp_path / "cache", None, max_prompt_length=400)
    hf = hf_tokenizer(tokenizer_dir, "qwen2.5", TEMPLATES["qwen2.5"])
    expected = hf_ids(hf, record["prompt"] + record["chosen"], tools=tools)
    assert np.asarray(data.train.tokens[0])[: len(expected)].tolist() == expected


def test_text_pairs_equal_trl_tokenize_row_with_a_bos_tokenizer(tmp_path, tokenizer_dir):  # noqa: F811
    """A Llama-style tokenizer (<s> before a text, </s> the model's EOS): tokenizer(prompt) with its <s>, then
    the completion's ids without special tokens, then eos_token_id."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    path = tmp_path / "llama" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>")
    records = [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        {"prompt": "Q: 2 + 2?\nA:", "chosen": " 4", "rejected": " 5</s>"},  # ends with EOS already: not doubled
    ]
    section = DataSection(
        dataset=str(write_jsonl(tmp_path / "pairs.jsonl", records)), format="preference", tokenizer=str(path)
    )
    data = load_token_data(section, 700, tmp_path / "cache", None, eos_token_id=eos)
    for pair, record in enumerate(records):
        prompt = hf(record["prompt"])["input_ids"]
        assert prompt[0] == bos
        for row, name in ((2 * pair, "chosen"), (2 * pair + 1, "rejected")):
            completion = hf(record[name], add_special_tokens=False)["input_ids"]
            completion += [] if record[name].endswith("</s>") else [hf.eos_token_id]
            valid = np.asarray(data.train.valid[row])
            assert np.asarray(data.train.tokens[row])[valid].tolist() == prompt + completion
            assert np.asarray(data.train.loss_mask[row])[valid].tolist() == [False] * len(prompt) + [True] * len(
                completion
            )


def test_text_pairs_end_with_the_tokenizers_eos_where_the_models_first_differs(tmp_path, tokenizer_dir):  # noqa: F811
    """Llama 3.1 Instruct's case: the model's first EOS is <|end_of_text|>, its tokenizer's eos_token (what TRL
    appends) <|eot_id|>; a completion ends with the tokenizer's, as `AutoTokenizer` reads it."""
    from transformers import AutoTokenizer

    model_dir = tmp_path / "instruct"
    model_dir.mkdir()
    (model_dir / "tokenizer.json").write_text((tokenizer_dir / "tokenizer.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|eot_id|>", "tokenizer_class": "PreTrainedTokenizerFast"})
    )
    hf = AutoTokenizer.from_pretrained(model_dir)
    models_first_eos = hf.convert_tokens_to_ids("<|endoftext|>")
    assert hf.eos_token_id != models_first_eos
    records = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}]
    section = DataSection(
        dataset=str(write_jsonl(tmp_path / "pairs.jsonl", records)),
        format="preference",
        tokenizer=str(model_dir / "tokenizer.json"),
    )
    data = load_token_data(section, 700, tmp_path / "cache", None, eos_token_id=models_first_eos)
    for row, name in ((0, "chosen"), (1, "rejected")):
        expected = hf(records[0]["prompt"])["input_ids"] + hf(records[0][name], add_special_tokens=False)["input_ids"]
        valid = np.asarray(data.train.valid[row])
        assert np.asarray(data.train.tokens[row])[valid].tolist() == expected + [hf.eos_token_id]
