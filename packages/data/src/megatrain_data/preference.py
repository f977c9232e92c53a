"""Preference datasets -> DPO rows: each record a prompt with a chosen and a rejected completion.

records.py resolves and reads the sources (TRL's preference format, LLaMA-Factory ranking entries); this file
turns each record into a pair tokenized as TRL's DPOTrainer tokenizes it, truncated (the prompt from the left,
then each completion to fit seq_len) and counted, and caches the rows: row 2i is pair i's chosen sequence,
row 2i + 1 its rejected one, trained on the completions. windows.PairWindows batches them whole.
"""

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatrain_store import atomic_write_text
from megatrain_store.progress import progress

from .chat import ChatTemplate, _content_text, load_chat_template
from .conversations import (
    alpaca_prompt,
    check_role_order,
    record_field,
    record_tools,
    record_where,
    sharegpt_turn,
    to_conversation,
)
from .errors import DataError
from .records import RecordData, hold_out, load_records, mix_indices, render_error, validation_source
from .section import DataSection
from .sources import Source, resolve_sources
from .tokens import Tokens, document_start_ids, pad_token_id

# Bumped whenever what the cache holds changes, so that an older cache is never read as a newer one
CACHE_FORMAT = 2  # 2: a conversational pair's completions start at one prompt length, as TRL splits them
ROLES = ("user", "assistant", "system", "tool")


@dataclass
class PreferenceExample:
    """One record as TRL's explicit-prompt preference example: each part text, or each a conversation
    (role/content turns: the prompt the conversation so far, a completion the turns that answer it)."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]
    tools: object = None

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


# ----------------------------------------------------------------- records
def uses_pairs(data: DataSection) -> bool:
    """Whether `data` names preference pairs (data.format preference, or ranking registry entries);
    a DataError where it mixes them with other datasets."""
    return pair_sources(resolve_sources(data))


def pair_sources(sources: list[Source]) -> bool:
    """Whether the sources are preference pairs, all of them; a DataError where only some are."""
    kinds = {source.is_preference for source in sources}
    if len(kinds) > 1:
        pairs = [s.name for s in sources if s.is_preference]
        others = [s.name for s in sources if not s.is_preference]
        raise DataError(
            f"data.dataset mixes preference pairs ({', '.join(pairs)}) with other datasets ({', '.join(others)}); "
            "train them in separate runs (supervised fine-tuning, then DPO)"
        )
    return kinds == {True}


def extract_prompt(chosen, rejected) -> tuple:
    """TRL's implicit prompt (`extract_prompt`): (prompt, chosen, rejected) where the prompt is the longest
    common prefix of chosen and rejected (characters of a text, turns of a conversation), at most all but the
    last element of the shorter; a space just before the first difference goes to the completions."""
    shorter = min(len(chosen), len(rejected))
    split = next((i for i in range(shorter) if chosen[i] != rejected[i]), None)
    if split is None:
        split = shorter - 1
    elif isinstance(chosen, str) and split > 0 and chosen[split - 1] == " ":
        split -= 1
    return chosen[:split], chosen[split:], rejected[split:]


def _kind(value, name: str, where: str) -> str:
    """`text` or `conversation` (its roles checked), else a DataError naming the field."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and all(isinstance(turn, dict) for turn in value):
        for turn_index, turn in enumerate(value):
            if turn.get("role") not in ROLES:
                raise DataError(
                    f"{where}: {name} turn {turn_index} has role {turn.get('role')!r}, not one of {', '.join(ROLES)}; "
                    "rename the roles (a registry entry's tags map sharegpt names)"
                )
        return "conversation"
    raise DataError(
        f"{where}: {name} must be text or a conversation (a list of role/content turns), got "
        f"{type(value).__name__}; fix the record"
    )


def _trl_parts(record: dict, source: Source, index: int, where: str) -> tuple:
    """(prompt or None where implicit, chosen, rejected, tools) of a record in TRL's preference format."""
    chosen = record_field(record, source.column("chosen"), index, source, "chosen")
    rejected = record_field(record, source.column("rejected"), index, source, "rejected")
    prompt = record.get(source.column("prompt"))
    parts = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    kinds = {name: _kind(value, name, where) for name, value in parts.items() if value is not None}
    if len(set(kinds.values())) > 1:
        described = ", ".join(f"{name} is {kind}" for name, kind in kinds.items())
        raise DataError(f"{where}: {described}; prompt, chosen and rejected must be all text or all conversations")
    return prompt, chosen, rejected, record_tools(record, source, where)


def _ranking_answer(record: dict, name: str, source: Source, index: int, where: str) -> list[dict]:
    """A ranking record's chosen or rejected answer as one assistant turn."""
    value = record_field(record, source.column(name), index, source, name)
    if source.formatting == "alpaca":
        if not isinstance(value, str):
            raise DataError(
                f"{where}: {name} must be text in a ranking alpaca record, got {type(value).__name__}; fix the "
                "record, or the registry's columns"
            )
        return [{"role": "assistant", "content": value}]
    if not isinstance(value, dict):
        raise DataError(
            f"{where}: {name} must be one turn such as {{'from': 'gpt', 'value': ...}} in a ranking sharegpt "
            f"record, got {type(value).__name__}; fix the record, or the registry's columns"
        )
    turn = sharegpt_turn(value, name, source, where)
    if turn["role"] != "assistant":
        raise DataError(f"{where}: {name} is a {turn['role']} turn; it must be the assistant's answer")
    return [turn]


def _ranking_parts(record: dict, source: Source, index: int, where: str) -> tuple:
    """(prompt, chosen, rejected, tools) of a LLaMA-Factory ranking record (alpaca or sharegpt)."""
    if source.formatting == "alpaca":
        prompt, tools = alpaca_prompt(record, source, index), None
    else:
        prompt, tools = to_conversation(record, source, index)
        if not prompt or prompt[-1]["role"] not in ("user", "tool"):
            last = prompt[-1]["role"] if prompt else "nothing"
            raise DataError(
                f"{where}: its {source.column('messages')!r} end with {last}; a ranking record's conversation "
                "ends with the user's turn that chosen and rejected answer"
            )
    chosen = _ranking_answer(record, "chosen", source, index, where)
    return prompt, chosen, _ranking_answer(record, "rejected", source, index, where), tools


def _refuse_empty(completion, name: str, where: str) -> None:
    if isinstance(completion, str):
        empty = not completion.strip()
    else:
        empty = not any(_content_text(turn.get("content")).strip() or turn.get("tool_calls") for turn in completion)
    if empty:
        raise DataError(f"{where}: its {name} completion is empty; give it text, or remove the record")


def read_pair(record: dict, source: Source, index: int) -> PreferenceExample | None:
    """The record as a preference example, or None where chosen equals rejected (the caller drops and counts
    it). A DataError names the record and the field for what cannot be read as one."""
    where = record_where(source, index)
    reader = _trl_parts if source.formatting == "preference" else _ranking_parts
    prompt, chosen, rejected, tools = reader(record, source, index, where)
    _refuse_empty(chosen, "chosen", where)
    _refuse_empty(rejected, "rejected", where)
    if chosen == rejected:
        return None
    if prompt is None:
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        _refuse_empty(chosen, "chosen", where)
        _refuse_empty(rejected, "rejected", where)
    if isinstance(chosen, list) and not prompt:
        raise DataError(f"{where} has no prompt (chosen and rejected share no leading turn); give it a prompt field")
    if isinstance(chosen, list):
        _check_conversations(prompt, {"chosen": chosen, "rejected": rejected}, where)
    return PreferenceExample(prompt, chosen, rejected, tools)


def _check_conversations(prompt: list[dict], completions: dict[str, list[dict]], where: str) -> None:
    """Refuse a completion that is not the assistant's answer (its role headers were trained) and roles out of order
    (`check_role_order`: a prompt ending in a system turn, or in the assistant's, which TRL continues instead)."""
    for name, completion in completions.items():
        first = completion[0].get("role") if completion and isinstance(completion[0], dict) else None
        if first != "assistant":
            raise DataError(
                f"{where}: its {name} completion starts with a {first} turn; it must be the assistant's answer"
            )
        check_role_order(prompt + completion, f"{where} ({name})")


# ------------------------------------------------------------- tokenizing
@dataclass
class Pairs:
    """Tokenized pairs of one source and what happened to its records on the way: sequences[2i] and
    sequences[2i + 1] are pair i's chosen and rejected token ids (prompt, then completion), starts[...] the
    index in each where its completion (the trained tokens) starts."""

    sequences: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    records: int = 0
    prompt_truncated: int = 0  # pairs whose prompt lost its first tokens to train.dpo.max_prompt_length
    completion_truncated: int = 0  # pairs with a completion cut to fit data.seq_len
    dropped_identical: int = 0  # chosen equal to rejected: nothing to prefer
    dropped_long: int = 0  # data.too_long: drop, instead of the two truncations

    def __len__(self) -> int:
        return len(self.sequences) // 2

    def select(self, indices) -> "Pairs":
        rows = [row for i in indices for row in (2 * i, 2 * i + 1)]
        return Pairs([self.sequences[r] for r in rows], [self.starts[r] for r in rows], len(indices))

    @staticmethod
    def concat(parts: list["Pairs"]) -> "Pairs":
        return Pairs([s for p in parts for s in p.sequences], [s for p in parts for s in p.starts])


def _common_prefix(*texts: str) -> int:
    """The length of the longest prefix the texts share, in characters."""
    length = min(len(text) for text in texts)
    for i in range(length):
        if any(text[i] != texts[0][i] for text in texts):
            return i
    return length


def _render(example: PreferenceExample, template: ChatTemplate) -> tuple[list[str], int]:
    """TRL's `maybe_apply_chat_template` for a pair: ([prompt + chosen, prompt + rejected] rendered whole,
    the length of their prompt: the prefix they share with the prompt rendered with its generation prompt)."""
    prompt = template.render(example.prompt, example.tools, add_generation_prompt=True)[0]
    texts = [template.render(example.prompt + c, example.tools)[0] for c in (example.chosen, example.rejected)]
    return texts, _common_prefix(prompt, *texts)


def _conversation_members(example, template, tokenizer, where: str) -> list[tuple[list[int], int]]:
    """[(ids, completion start)] of chosen and rejected: each conversation tokenized whole, as
    apply_chat_template(prompt + completion) makes it; both completions start at the first token that reaches past
    the prompt's text in either (TRL splits a pair at one prompt length: where a completion's first characters merge
    with the prompt's last into one token, the other completion trains that prompt token too)."""
    texts, boundary = _render(example, template)
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    starts = []
    for name, encoding in zip(("chosen", "rejected"), encodings):
        start = next((t for t, (_, end) in enumerate(encoding.offsets) if end > boundary), len(encoding.ids))
        if start == len(encoding.ids):
            raise DataError(
                f"{where}: the chat template renders nothing of its {name} completion after the prompt; fix the "
                "record's roles, or set data.chat_template"
            )
        starts.append(start)
    return [(encoding.ids, min(starts)) for encoding in encodings]


def _text_members(examples: list[PreferenceExample], tokenizer, eos: str) -> list[list[tuple[list[int], int]]]:
    """Per example [(ids, completion start)] of chosen and rejected, as TRL's `tokenize_row`: the prompt's ids
    (after the special tokens the tokenizer starts a text with), then the completion's, then EOS."""
    eos_id = tokenizer.token_to_id(eos) if eos else None
    if eos_id is None:
        raise DataError(
            "text preference pairs end each completion with EOS, and the tokenizer has none; set the model's "
            "eos_token_id, or use a tokenizer with <|endoftext|>"
        )
    start_ids = document_start_ids(tokenizer)
    texts = [text for e in examples for text in (e.prompt, e.chosen, e.rejected)]
    encoded = [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]
    members = []
    for i, example in enumerate(examples):
        prompt = start_ids + encoded[3 * i]
        completions = zip((example.chosen, example.rejected), encoded[3 * i + 1 : 3 * i + 3])
        # (TRL appends EOS where the text does not already end with it)
        members.append(
            [(prompt + ids + ([] if text.endswith(eos) else [eos_id]), len(prompt)) for text, ids in completions]
        )
    return members


def fit(ids: list[int], start: int, max_prompt: int, seq_len: int) -> tuple[list[int], int, bool, bool]:
    """(ids, completion start, prompt cut, completion cut) of one sequence made to fit: the prompt keeps its
    last `max_prompt` tokens, then the completion its first ones that fit `seq_len` (TRL's truncation)."""
    prompt, completion = ids[:start][-max_prompt:], ids[start:]
    room = seq_len - len(prompt)
    return prompt + completion[: max(room, 0)], len(prompt), len(prompt) < start, len(completion) > room


def _keep(pairs: Pairs, index: int, members, data: DataSection, max_prompt: int, where: str) -> None:
    """Truncate the pair's two sequences (or drop the pair, data.too_long: drop) and add it to `pairs`, counted."""
    fitted = [fit(ids, start, max_prompt, data.seq_len) for ids, start in members]
    prompt_cut, completion_cut = any(f[2] for f in fitted), any(f[3] for f in fitted)
    if (prompt_cut or completion_cut) and data.too_long == "drop":
        pairs.dropped_long += 1
        return
    kept_prompt = max(f[1] for f in fitted)
    if kept_prompt >= data.seq_len:
        raise DataError(
            f"{where}: its prompt keeps {kept_prompt} tokens (train.dpo.max_prompt_length {max_prompt}), leaving no "
            f"room for a completion in data.seq_len {data.seq_len}; set train.dpo.max_prompt_length below data.seq_len"
        )
    pairs.prompt_truncated += prompt_cut
    pairs.completion_truncated += completion_cut
    for ids, start, _, _ in fitted:
        pairs.sequences.append(ids)
        pairs.starts.append(start)


def _members(examples: list[tuple[int, PreferenceExample]], source: Source, template, tokenizer, eos: str) -> list:
    """[(ids, completion start)] of chosen and rejected per example: conversations rendered with the template."""
    import jinja2

    texts = [example for _, example in examples if not example.conversational]
    text_members = iter(_text_members(texts, tokenizer, eos) if texts else [])
    members = []
    for index, example in examples:
        if not example.conversational:
            members.append(next(text_members))
            continue
        where = record_where(source, index)
        try:
            members.append(_conversation_members(example, template, tokenizer, where))
        except (jinja2.TemplateError, ValueError, TypeError) as error:
            raise render_error(source, index, error) from error
    return members


def tokenize_pairs(
    records, source: Source, data: DataSection, max_prompt: int, template, tokenizer, eos: str, batch: int = 512
) -> Pairs:
    """The source's records as tokenized pairs, truncated (or dropped) to fit data.seq_len, counted."""
    pairs = Pairs(records=len(records))
    for first in progress(range(0, len(records), batch), desc=f"tokenize {source.name}", unit="batch", leave=False):
        rows = records[first : first + batch]
        keys = list(rows)
        examples = []
        for offset in range(len(rows[keys[0]])):
            example = read_pair({k: rows[k][offset] for k in keys}, source, first + offset)
            if example is None:
                pairs.dropped_identical += 1
            else:
                examples.append((first + offset, example))
        for (index, _), members in zip(examples, _members(examples, source, template, tokenizer, eos)):
            _keep(pairs, index, members, data, max_prompt, record_where(source, index))
    return pairs


def report_line(source: Source, pairs: Pairs, data: DataSection, max_prompt: int) -> str:
    notes = []
    if pairs.prompt_truncated:
        cut = f"the prompt cut to its last {max_prompt} tokens by train.dpo.max_prompt_length"
        notes.append(f"{pairs.prompt_truncated} with {cut}")
    if pairs.completion_truncated:
        notes.append(f"{pairs.completion_truncated} with a completion cut to fit seq_len {data.seq_len}")
    if pairs.dropped_long:
        notes.append(f"{pairs.dropped_long} dropped as longer than seq_len {data.seq_len}")
    if pairs.dropped_identical:
        notes.append(f"{pairs.dropped_identical} dropped with chosen equal to rejected")
    detail = f" ({'; '.join(notes)})" if notes else ""
    return f"dataset {source.name}: {pairs.records} records -> {len(pairs)} pairs{detail}"


def check_kept(source: Source, pairs: Pairs, data: DataSection, max_prompt: int) -> None:
    """Refuse a dataset most of whose pairs would be dropped: that is a wrong setting or a broken dataset."""
    if (pairs.dropped_long + pairs.dropped_identical) * 2 > pairs.records:
        fix = "raise data.seq_len, or set data.too_long: truncate" if pairs.dropped_long else "fix the dataset"
        raise DataError(f"{report_line(source, pairs, data, max_prompt)}: most pairs would be dropped; {fix}")


# ----------------------------------------------------------------- rows
def pair_rows(pairs: Pairs, seq_len: int, pad_id: int) -> Tokens:
    """Tokens of [2 * pairs, seq_len]: row 2i pair i's chosen sequence, row 2i + 1 its rejected one, each padded
    with `pad_id` (valid False there), loss_mask True on its completion; no position ids (one sequence a row)."""
    tokens = np.full((len(pairs.sequences), seq_len), pad_id, dtype=np.int32)
    mask = np.zeros((len(pairs.sequences), seq_len), dtype=bool)
    valid = np.zeros((len(pairs.sequences), seq_len), dtype=bool)
    for row, (ids, start) in enumerate(zip(pairs.sequences, pairs.starts)):
        tokens[row, : len(ids)] = ids
        mask[row, start : len(ids)] = True
        valid[row, : len(ids)] = True
    return Tokens(tokens, mask, None, valid)


def max_prompt_length(data: DataSection, configured: int | None) -> int:
    """Prompt tokens kept (its last ones): train.dpo.max_prompt_length (`configured`), by default data.seq_len // 2."""
    return configured if configured is not None else data.seq_len // 2


def _template(tokenizer_path: Path, data: DataSection, eos: str) -> tuple[ChatTemplate, bool]:
    """(the chat template conversations are rendered with, whether it is the simple fallback)."""
    template = load_chat_template(Path(tokenizer_path).parent, data.chat_template, eos)
    if template is None:
        return load_chat_template(None, "simple", eos), True
    return template, False


def _is_conversation(records, source: Source) -> bool:
    """TRL's `is_conversational`, on the source's first record (a ranking entry always is)."""
    return source.ranking or isinstance(records[0].get(source.column("chosen")), list)


def _cache_prefix(data, max_prompt, eos, seed, fingerprints, template, tokenizer_path, cache_dir) -> Path:
    settings = json.dumps(
        [CACHE_FORMAT, data.as_key(), max_prompt, eos, seed, fingerprints, template.template], default=str
    )
    key = hashlib.sha256(settings.encode() + Path(tokenizer_path).read_bytes()).hexdigest()[:16]
    return cache_dir / f"pairs-{key}"


def _load_cached(prefix: Path) -> RecordData | None:
    report_path = Path(f"{prefix}.report.json")
    if not report_path.exists():
        return None
    report = json.loads(report_path.read_text())
    validation = Tokens.load(f"{prefix}.val") if report["validation"] else None
    return RecordData(Tokens.load(str(prefix)), validation, report["lines"], report["template"])


def _save(prefix: Path, rows: RecordData) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    rows.train.save(str(prefix))
    if rows.validation is not None:
        rows.validation.save(f"{prefix}.val")
    report = {"lines": rows.report, "validation": rows.validation is not None, "template": rows.template_source}
    atomic_write_text(Path(f"{prefix}.report.json"), json.dumps(report))  # written last: the cache is whole


def _tokenized(data, sources, all_records, validation_records, tokenize, max_prompt, seed) -> tuple:
    """(training pairs mixed as data.mix_weights says, validation pairs or None, report lines)."""
    lines, parts, held_out = [], [], []
    for source, records in zip(sources, all_records):
        pairs = tokenize(records, source)
        check_kept(source, pairs, data, max_prompt)
        lines.append(report_line(source, pairs, data, max_prompt))
        if isinstance(data.validation, float):
            pairs, validation_part = hold_out(pairs, data.validation, seed)
            held_out.append(validation_part)
        parts.append(pairs)
    validation = Pairs.concat(held_out) if held_out else None
    if validation_records is not None:
        source = validation_source(data, sources[0])
        validation = tokenize(validation_records, source)
        lines.append(report_line(source, validation, data, max_prompt))
    if validation is not None:
        lines.append(f"validation: {len(validation)} pairs")
    chosen = mix_indices([len(p) for p in parts], data.mix_weights, seed)
    train = Pairs.concat([part.select(indices) for part, indices in zip(parts, chosen)])
    return train, validation, lines


def preference_rows(
    data: DataSection,
    configured_max_prompt: int | None,
    tokenizer,
    tokenizer_path: Path,
    eos: str,
    cache_dir: Path,
    seed: int,
) -> RecordData:
    """Read, tokenize, truncate and mix the configured preference datasets (cached under `cache_dir`): `train`
    (and `validation`) Tokens of [2 * pairs, data.seq_len], row 2i pair i's chosen and row 2i + 1 its rejected
    sequence, loss_mask True on the completions, valid False on padding; each prompt cut to its last
    `configured_max_prompt` tokens (train.dpo.max_prompt_length; None: data.seq_len // 2). `tokenizer`: a tokenizers.Tokenizer
    (the file `tokenizer_path`, whose directory holds its chat template); `eos`: the EOS token's text."""
    data.check_pair_settings()
    sources = resolve_sources(data)
    if not pair_sources(sources):
        raise DataError(
            "data.dataset names no preference pairs; set data.format: preference, or name ranking registry entries"
        )
    max_prompt = max_prompt_length(data, configured_max_prompt)
    template, fallback = _template(tokenizer_path, data, eos)
    all_records = [load_records(s) for s in sources]
    validation_records = load_records(validation_source(data, sources[0])) if isinstance(data.validation, str) else None
    fingerprints = [getattr(r, "_fingerprint", "") or s.location for r, s in zip(all_records, sources)]
    if validation_records is not None:
        fingerprints.append(getattr(validation_records, "_fingerprint", "") or data.validation)
    conversational = any(_is_conversation(r, s) for r, s in zip(all_records, sources))
    if conversational and fallback:
        print(
            f"megatrain: the tokenizer at {Path(tokenizer_path).parent} has no chat template; using the simple "
            "template (docs/guide.md). Set data.chat_template to a .jinja file to use another.",
            file=sys.stderr,
        )
    prefix = _cache_prefix(data, max_prompt, eos, seed, fingerprints, template, tokenizer_path, cache_dir)
    cached = _load_cached(prefix)
    if cached is not None:
        return cached

    def tokenize(records, source):
        return tokenize_pairs(records, source, data, max_prompt, template, tokenizer, eos)

    train, validation, lines = _tokenized(data, sources, all_records, validation_records, tokenize, max_prompt, seed)
    pad = pad_token_id(tokenizer, eos)
    rows = RecordData(
        pair_rows(train, data.seq_len, pad),
        pair_rows(validation, data.seq_len, pad) if validation is not None else None,
        lines,
        template.source if conversational else None,
    )
    _save(prefix, rows)
    return rows
