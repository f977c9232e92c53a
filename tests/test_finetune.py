"""Fine-tuning as users do it: the model's own chat template (token ids equal to transformers'
apply_chat_template), packed documents equal to the same documents unpacked, evaluation equal to
plain PyTorch, and the data/eval commands end to end."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import yaml
from chat_templates import CHATML_WITH_GENERATION, END_OF_TURN, SPECIAL_TOKENS, TEMPLATES
from reference_model import ReferenceLM, reference_adamw
from test_exactness import randomize_, rel_err
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatrain import Trainer
from megatrain.cli import main
from megatrain.config import Config, EngineSection, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import (
    ChatTemplate,
    DataError,
    DataSection,
    Tokens,
    TokenWindows,
    builtin_corpus,
    encode_conversation,
    load_token_data,
)
from megatrain_data.records import Examples, to_rows
from megatrain_optim import Schedule, lr_at

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<s>",
    "</s>",
    "<unk>",
    "<bos>",
    "<eos>",
    "<pad>",
    "<start_of_turn>",
    "<end_of_turn>",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": " Blue "},  # the Llama template trims it; the mask follows
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green."},
    ],
    [
        {"role": "user", "content": "Say hi.\n\nTwice."},
        {"role": "assistant", "content": "hi hi"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome!"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer with the chat models' special tokens, saved as tokenizer.json."""
    directory = tmp_path_factory.mktemp("tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([builtin_corpus().read_text()[:60000]], trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def hf_tokenizer(tokenizer_dir, name, template):
    from transformers import PreTrainedTokenizerFast

    special = {k: v for k, v in SPECIAL_TOKENS[name].items() if v is not None}
    return PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_dir / "tokenizer.json"), chat_template=template, **special
    )


def hf_ids(hf, messages, **options):
    """apply_chat_template's token ids (a list in transformers 4, a BatchEncoding in 5), or its dict."""
    out = hf.apply_chat_template(messages, tokenize=True, **options)
    if options.get("return_dict"):
        return dict(out)
    return out if isinstance(out, list) else out["input_ids"]


def our_template(name, template):
    special = {k: v for k, v in SPECIAL_TOKENS[name].items() if v is not None}
    return ChatTemplate(name, template, special)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_template_ids_equal_transformers_and_train_assistant_turns(name, tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hf = hf_tokenizer(tokenizer_dir, name, TEMPLATES[name])
    template = our_template(name, TEMPLATES[name])
    end_of_turn = END_OF_TURN[name]
    conversations = CONVERSATIONS if name != "mistral" else [c for c in CONVERSATIONS if c[0]["role"] != "system"]
    for messages in conversations:
        ids, trained = encode_conversation(template, tokenizer, messages)
        assert ids == hf_ids(hf, messages)
        decoded = tokenizer.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
        expected = "".join(m["content"].strip() + end_of_turn for m in messages if m["role"] == "assistant")
        assert decoded.replace(" ", "") == expected.replace(" ", "")  # byte-level BPE keeps leading spaces in tokens
        everything = encode_conversation(template, tokenizer, messages, train_on_prompt=True)[1]
        assert all(everything)
    if name == "qwen2.5":  # the template's default system turn is rendered (and not trained)
        text = tokenizer.decode(
            encode_conversation(template, tokenizer, CONVERSATIONS[0])[0], skip_special_tokens=False
        )
        assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")


def test_generation_blocks_give_transformers_assistant_mask(tokenizer_dir):
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hf = hf_tokenizer(tokenizer_dir, "qwen2.5", CHATML_WITH_GENERATION)
    template = our_template("qwen2.5", CHATML_WITH_GENERATION)
    for messages in CONVERSATIONS:
        ids, trained = encode_conversation(template, tokenizer, messages)
        expected = hf_ids(hf, messages, return_dict=True, return_assistant_tokens_mask=True)
        assert ids == expected["input_ids"]
        assert [bool(m) for m in expected["assistant_masks"]] == trained


def write_model_tokenizer(directory, tokenizer_dir, name):
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = {k: v for k, v in SPECIAL_TOKENS[name].items()}
    config["chat_template"] = TEMPLATES[name]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_model_template_through_the_data_pipeline(tmp_path, tokenizer_dir):
    model_dir = write_model_tokenizer(tmp_path / "model", tokenizer_dir, "llama-3.1")
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CONVERSATIONS])
    section = DataSection(
        dataset=str(source), format="messages", seq_len=160, tokenizer=str(model_dir / "tokenizer.json")
    )
    data = load_token_data(section, 700, tmp_path / "cache", None)
    assert data.report[0] == f"chat template: {model_dir / 'tokenizer_config.json'}"
    hf = hf_tokenizer(tokenizer_dir, "llama-3.1", TEMPLATES["llama-3.1"])
    for row, messages in enumerate(CONVERSATIONS):
        expected = hf_ids(hf, messages)
        assert data.train.tokens[row, : len(expected)].tolist() == expected
        assert not data.train.loss_mask[row, len(expected) :].any()  # padding is never trained

    mistral_dir = write_model_tokenizer(tmp_path / "mistral", tokenizer_dir, "mistral")
    section = DataSection(
        dataset=str(source), format="messages", seq_len=160, tokenizer=str(mistral_dir / "tokenizer.json")
    )
    with pytest.raises(DataError, match=r"record 2 cannot be rendered.*Conversation roles must alternate"):
        load_token_data(section, 700, tmp_path / "cache2", None)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message.content }")
    with pytest.raises(DataError, match="does not parse"):
        load_token_data(
            DataSection(dataset=str(source), format="messages", chat_template=str(broken), tokenizer=section.tokenizer),
            700,
            tmp_path / "cache3",
            None,
        )


WEATHER_CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOL_CONVERSATION = [  # (every turn with every key, None where a turn has none: as Arrow reads a jsonl file)
    {"role": "user", "content": "Weather in Paris?", "tool_calls": None},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": WEATHER_CALL}]},
    {"role": "tool", "content": "{\"temp\": 20}", "tool_calls": None},
    {"role": "assistant", "content": "It is 20 degrees.", "tool_calls": None},
]  # fmt: skip
TOOL_CALL_RENDERED = {  # the call as each template writes it
    "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "llama-3.1": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
}


SHAREGPT_TOOL_CONVERSATION = [  # LLaMA-Factory's layout of it: the call as JSON in a function_call turn
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": json.dumps(WEATHER_CALL)},
    {"from": "observation", "value": '{"temp": 20}'},
    {"from": "gpt", "value": "It is 20 degrees."},
]


@pytest.mark.parametrize("layout", ["messages", "sharegpt"])
@pytest.mark.parametrize("name", list(TOOL_CALL_RENDERED))
def test_an_assistant_turns_tool_calls_are_rendered_and_trained(name, layout, tmp_path, tokenizer_dir):
    """A messages file's tool calls, and LLaMA-Factory's function_call turns, reach the template, which writes them as
    transformers does, and are trained with the turn's end (the calls were dropped, an empty answer trained; the
    function_call turn's JSON was trained bare, in no form the model calls tools in); keys set to None are no keys."""
    model_dir = write_model_tokenizer(tmp_path / "model", tokenizer_dir, name)
    record = {"messages": TOOL_CONVERSATION} if layout == "messages" else {"conversations": SHAREGPT_TOOL_CONVERSATION}
    source = write_jsonl(tmp_path / "tools.jsonl", [record])
    tokenizer_file = str(model_dir / "tokenizer.json")
    section = DataSection(dataset=str(source), format=layout, seq_len=256, tokenizer=tokenizer_file)
    data = load_token_data(section, 700, tmp_path / "cache", None)
    messages = [{key: value for key, value in turn.items() if value is not None} for turn in TOOL_CONVERSATION]
    expected = hf_ids(hf_tokenizer(tokenizer_dir, name, TEMPLATES[name]), messages)
    assert data.train.tokens[0, : len(expected)].tolist() == expected
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    trained = data.train.tokens[0][data.train.loss_mask[0]].tolist()
    end = END_OF_TURN[name]
    assert (
        tokenizer.decode(trained, skip_special_tokens=False)
        == TOOL_CALL_RENDERED[name] + end + "It is 20 degrees." + end
    )


def fp64_config(tmp_path, dtype="float64", device="cpu", engine=None, **train) -> Config:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    defaults = dict(steps=2, batch_size=4, micro_batch_size=2, lr=1e-3, grad_clip=0.5, warmup_steps=0, seed=seed)
    return Config(
        model=ModelSection(preset="tiny-llama"),
        data=DataSection(seq_len=16),
        train=TrainSection(**{**defaults, **train}),
        precision=PrecisionSection(dtype),
        engine=engine or EngineSection(),
        device=device,
        output_dir=str(tmp_path),
    )


def random_documents(n, vocab, generator, lengths=(3, 13)):
    """Examples of random lengths with random trained spans (each has targets past its first token)."""
    docs = []
    for _ in range(n):
        length = int(torch.randint(*lengths, (), generator=generator))
        ids = torch.randint(0, vocab, (length,), generator=generator).tolist()
        trained = (torch.rand(length, generator=generator) < 0.6).tolist()
        trained[-1] = True
        docs.append((ids, trained))
    return docs


def padded_rows(rows, n: int) -> Tokens:
    """`rows` followed by rows of padding only (no targets) up to n rows."""
    extra, seq_len = n - len(rows.tokens), rows.tokens.shape[1]
    positions = rows.position_ids
    if positions is not None:
        positions = np.concatenate([positions, np.tile(np.arange(seq_len, dtype=np.int32), (extra, 1))])
    return Tokens(
        np.concatenate([rows.tokens, np.zeros((extra, seq_len), np.int32)]),
        np.concatenate([rows.loss_mask, np.zeros((extra, seq_len), bool)]),
        positions,
    )


def reference_loss(reference, docs):
    """Summed next-token loss of each document in a row of its own, and its target count."""
    total, count = 0.0, 0
    device = next(reference.parameters()).device
    for ids, trained in docs:
        ids_t = torch.tensor([ids], device=device)
        labels = torch.full_like(ids_t, -100)
        labels[0, :-1] = torch.where(torch.tensor(trained[1:], device=device), ids_t[0, 1:], -100)
        logits = reference.logits(ids_t)
        total = total + torch.nn.functional.cross_entropy(logits[0], labels[0], ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    return total, count


def check_packed_steps(pack, tmp_path, dtype, device, tolerance, engine=None):
    """Steps on rows that pack several documents (block-diagonal attention, positions restarting) or hold
    one each (padded) equal plain PyTorch + AdamW on every document in a row of its own."""
    config = fp64_config(tmp_path, dtype, device, engine)
    trainer = Trainer(config)
    generator = torch.Generator().manual_seed(config.train.seed)
    randomize_(trainer, generator)
    reference = ReferenceLM(trainer.model_config).to(device=device, dtype=getattr(torch, dtype))
    reference.load_named({k: v.clone() for k, v in trainer.named_weights().items()})
    optimizer = reference_adamw(reference, config.train)
    schedule = Schedule(config.train.lr, config.train.steps, 0, "cosine", config.train.min_lr_ratio)
    vocab = trainer.model_config.vocab_size
    for step in range(config.train.steps):
        # packed: six documents of 3-8 tokens fill at most three rows of 16; unpacked: four, one per row
        docs = random_documents(6, vocab, generator, (3, 9)) if pack else random_documents(4, vocab, generator)
        rows = padded_rows(to_rows(Examples([d[0] for d in docs], [d[1] for d in docs]), 16, pack, pad_id=0), 4)
        batch = TokenWindows(rows, 16, 4, False, 0).batch(0)
        metrics = trainer.train_step(StepBatch(batch.input_ids, batch.labels, batch.position_ids))

        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        optimizer.zero_grad()
        total, count = reference_loss(reference, docs)
        (total / count).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.train.grad_clip)
        optimizer.step()
        assert metrics.loss == pytest.approx((total / count).item(), rel=tolerance)
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=tolerance)
    ours = trainer.named_weights()
    for name, param in reference.named_parameters():
        assert rel_err(ours[name], param.detach().cpu()) < 3 * tolerance, name
    trainer.close()


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("kept_layers", [0, 1], ids=["recomputed", "last-layer-kept"])
def test_packed_steps_equal_the_documents_unpacked_in_plain_pytorch(pack, kept_layers, tmp_path):
    engine = EngineSection(kept_layers=kept_layers)
    check_packed_steps(pack, tmp_path, "float64", "cpu", 1e-10, engine)


@pytest.mark.gpu
def test_gpu_packed_steps_equal_the_documents_unpacked(tmp_path):
    """fp32 on CUDA: packed rows go through FlexAttention's block-sparse kernel."""
    check_packed_steps(True, tmp_path, "float32", "cuda", 1e-5)


@pytest.mark.parametrize("pack", [True, False])
def test_the_setup_warm_up_brings_rows_as_the_fine_tuning_data_will(pack, tmp_path, monkeypatch):
    """A fine-tuning run's warm-up step carries the padding mask, and packed documents' restarting positions,
    so the attention path the data takes (FlexAttention on the GPU) is the one built at setup."""
    config = fp64_config(tmp_path)
    config = replace(config, data=replace(config.data, dataset="count", pack=pack))
    trainer = Trainer(config)
    seen = []
    real_warm_up = trainer.pipeline.warm_up
    monkeypatch.setattr(
        trainer.pipeline, "warm_up", lambda micro, step: (seen.extend(micro), real_warm_up(micro, step))
    )
    trainer.warm_up()
    assert len(seen) == 1 and seen[0].input_ids.shape == (2, 16)  # micro-batches of 2 rows, one shape
    documents = seen[0].documents
    assert documents.valid.all()
    if pack:
        assert documents.position_ids[0].tolist() == list(range(8)) * 2  # two documents a row
    else:
        assert documents.position_ids is None
    trainer.close()


def test_evaluation_equals_plain_pytorch_loss(tmp_path):
    config = fp64_config(tmp_path, micro_batch_size=1)
    trainer = Trainer(config)
    generator = torch.Generator().manual_seed(config.train.seed)
    randomize_(trainer, generator)
    reference = ReferenceLM(trainer.model_config).double()
    reference.load_named({k: v.clone() for k, v in trainer.named_weights().items()})
    docs = random_documents(7, trainer.model_config.vocab_size, generator)
    for pack in (False, True):
        rows = to_rows(Examples([d[0] for d in docs], [d[1] for d in docs]), 16, pack, pad_id=0)
        windows = TokenWindows(Tokens(rows.tokens, rows.loss_mask, rows.position_ids), 16, 1, False, 0)
        batch = windows.rows(list(range(windows.n_windows)))  # 3 rows: micro-batches of 1, the last short
        loss_sum, n_targets = trainer.evaluate(StepBatch(batch.input_ids, batch.labels, batch.position_ids))
        with torch.no_grad():
            total, count = reference_loss(reference, docs)
        assert n_targets == count and loss_sum == pytest.approx(total.item(), rel=1e-12)
    trainer.close()


def write_count_config(directory, tokenizer_dir):
    """Writes a Qwen2.5 tokenizer, 40 sharegpt conversations ('Count to i.' for i in 2..41) and a config
    that trains on them 4 steps with a 20% validation split evaluated every 2 steps; returns the config's path
    and the tokenizer's directory."""
    model_dir = write_model_tokenizer(directory / "model", tokenizer_dir, "qwen2.5")
    records = [
        {
            "conversations": [
                {"from": "human", "value": f"Count to {i}."},
                {"from": "gpt", "value": " ".join(map(str, range(i)))},
            ]
        }
        for i in range(2, 42)
    ]
    write_jsonl(directory / "count.jsonl", records)
    (directory / "dataset_info.json").write_text(
        json.dumps({"count": {"file_name": "count.jsonl", "formatting": "sharegpt"}})
    )
    config = {
        "model": {"preset": "small-llama"},
        "data": {
            "dataset": "count",
            "dataset_dir": str(directory),
            "tokenizer": str(model_dir / "tokenizer.json"),
            "seq_len": 256,
            "pack": True,
            "validation": 0.2,
        },
        "train": {"steps": 4, "batch_size": 2, "lr": 1e-3, "eval_every": 2},
        "device": "cpu",
        "output_dir": str(directory / "run"),
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, model_dir


def check_data_dump_rows(path, model_dir, capsys):
    """`data --dump` prints packed rows whose labels train only the assistants' answers; `--text` shows them."""
    assert main(["data", "--config", str(path), "--dump", "3"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert len(lines) == 3
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for line in lines:
        ids, labels, positions = line["input_ids"], line["labels"], line["position_ids"]
        assert len(ids) == len(labels) == len(positions) == 256
        assert all(label in (-100, token) for label, token in zip(labels, ids))  # HF convention: unshifted
        trained = tokenizer.decode([t for t, label in zip(ids, labels) if label != -100], skip_special_tokens=False)
        assert trained.endswith("<|im_end|>") and "<|im_start|>" not in trained and "Count" not in trained
    assert any(line["position_ids"].count(0) > 2 for line in lines)  # rows hold several conversations
    assert main(["data", "--config", str(path), "--dump", "1", "--text"]) == 0
    shown = capsys.readouterr().out
    assert "<|im_start|>user\nCount to" in shown and "<|im_end|>⟧" in shown
    assert shown.rstrip().endswith("<|im_end|>⟧")  # (the row's padding is counted in its header, not shown)


def test_train_with_validation_then_data_and_eval_commands(tmp_path, tokenizer_dir, capsys):
    path, model_dir = write_count_config(tmp_path, tokenizer_dir)
    assert main(["train", "--config", str(path)]) == 0
    err = capsys.readouterr().err
    assert "dataset count: 40 records -> 40 examples\n" in err and "validation: 8 examples" in err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [2, 4] and evals[-1]["val_perplexity"] == pytest.approx(
        np.exp(evals[-1]["val_loss"]), rel=1e-4
    )

    final = tmp_path / "run" / "final"  # the exported model keeps its chat template
    assert json.loads((final / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATES["qwen2.5"]
    assert main(["eval", "--config", str(path), "--checkpoint", str(final)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["data"] == "validation" and result["val_loss"] == pytest.approx(evals[-1]["val_loss"], rel=1e-5)
    untokenized = yaml.safe_load(path.read_text())  # conversations read with the tokenizer beside the weights
    del untokenized["data"]["tokenizer"]
    (tmp_path / "untokenized.yaml").write_text(yaml.safe_dump(untokenized))
    assert main(["eval", "--config", str(tmp_path / "untokenized.yaml"), "--checkpoint", str(final)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"] == result["val_loss"]

    check_data_dump_rows(path, model_dir, capsys)


# words of each template's own markup before an assistant turn (ChatML's "<|im_start|>assistant", Llama 3's
# "<|start_header_id|>assistant<|end_header_id|>", Mistral's "[/INST]", Gemma's "<start_of_turn>model")
MARKUP_WORDS = ["a", "|", "start", "assistant", "header", "id", "end", "INST", "model", "turn"]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_an_answer_that_is_a_word_of_the_templates_markup_is_trained_in_its_turn(name, tokenizer_dir):
    """An answer such as "a" or "assistant" also occurs in the header the template writes before it; the trained
    tokens are the answer and its end-of-turn token (as transformers' generation masks give), not the header's."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    template = our_template(name, TEMPLATES[name])
    for answer in MARKUP_WORDS:
        messages = [{"role": "user", "content": "One word"}, {"role": "assistant", "content": answer}]
        messages += [{"role": "user", "content": "Another"}, {"role": "assistant", "content": answer}]
        ids, trained = encode_conversation(template, tokenizer, messages)
        decoded = tokenizer.decode([i for i, t in zip(ids, trained) if t], skip_special_tokens=False)
        assert decoded.replace(" ", "") == 2 * (answer + END_OF_TURN[name]), (answer, decoded)


def test_a_short_answer_is_found_in_its_own_turn_not_in_the_system_prompt(tokenizer_dir):
    """Qwen2.5's default system prompt contains 'Qwen'; an assistant answering 'Qwen' is trained on its
    own turn's token, not on the system prompt's."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    template = our_template("qwen2.5", TEMPLATES["qwen2.5"])
    messages = [{"role": "user", "content": "You"}, {"role": "assistant", "content": "Qwen"}]
    ids, trained = encode_conversation(template, tokenizer, messages)
    text = tokenizer.decode(ids[: trained.index(True)], skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("answer", ["def f():\n    return 1\n", "\n\nHello.", "Hi  "])
def test_an_answers_whitespace_is_trained_where_the_template_writes_it_verbatim(answer, tokenizer_dir):
    """ChatML writes an answer as it is, so its leading and trailing newlines and spaces are content: trained, as the
    same template's {% generation %} block marks them in transformers' assistant mask (TRL's assistant_only_loss).
    The answer stripped was found instead, and a code answer's last newline never trained."""
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hf = hf_tokenizer(tokenizer_dir, "qwen2.5", CHATML_WITH_GENERATION)
    unmarked = CHATML_WITH_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    messages = [{"role": "user", "content": "Write"}, {"role": "assistant", "content": answer}]
    ids, trained = encode_conversation(our_template("qwen2.5", unmarked), tokenizer, messages)
    expected = hf_ids(hf, messages, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == expected["input_ids"]
    assert trained == [bool(m) for m in expected["assistant_masks"]]
