"""GRPO's data: prompt datasets in TRL's prompt-only format (`prompt`, any other columns for the rewards) rendered
to tokens, a step's rows of prompt + completion, and the JSONL of completions sampled elsewhere (`read_completions`,
the format of train.grpo.rollouts: docs/guide.md). What samples, scores and trains on them is the meta-package's
(megatrain/rollouts.py, megatrain/rollout_file.py); the reward functions are `rewards.py`."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .chat import load_chat_template
from .conversations import record_where
from .errors import DataError
from .files import read_text_file
from .records import load_records
from .section import DataSection
from .sources import resolve_sources
from .tokens import document_start_ids
from .windows import Batch


@dataclass
class Prompts:
    """A prompt dataset: each prompt as given (text or messages), its tokens, and every other column."""

    given: list
    ids: list[list[int]]
    columns: dict[str, list]


def render_prompt(prompt, template, tokenizer, where: str) -> list[int]:
    """A prompt's tokens as TRL makes them: a conversation rendered with its generation prompt (the template writes
    any <bos>, as `apply_chat_template`), text as `tokenizer(text)` starts it (Llama's, Gemma's, Mistral's <bos>)."""
    if isinstance(prompt, list):
        if template is None:
            raise DataError(
                f"{where}: a conversational prompt, and the tokenizer has no chat template; set data.chat_template"
            )
        text = template.render(prompt, add_generation_prompt=True)[0]
        return tokenizer.encode(text, add_special_tokens=False).ids
    if not isinstance(prompt, str):
        raise DataError(f"{where}: the prompt is {type(prompt).__name__}; give text or a list of messages")
    return document_start_ids(tokenizer) + tokenizer.encode(prompt, add_special_tokens=False).ids


def load_prompts(data: DataSection, max_prompt_length: int, tokenizer, tokenizer_path: Path, eos: str) -> Prompts:
    """The prompt datasets' records (TRL's prompt-only format: `prompt`, any other columns for the rewards),
    tokenized; refuses, naming the longest, prompts over `max_prompt_length` (train.grpo.max_prompt_length)."""
    template = load_chat_template(tokenizer_path.parent, data.chat_template, eos)
    given, ids, columns = [], [], {}
    for source in resolve_sources(data):
        records = load_records(source)
        if "prompt" not in records.column_names:
            raise DataError(
                f"dataset {source.name!r} has no 'prompt' column (columns: {records.column_names}); GRPO reads "
                "TRL's prompt-only format"
            )
        for index, record in enumerate(records):
            given.append(record["prompt"])
            ids.append(render_prompt(record["prompt"], template, tokenizer, record_where(source, index)))
            if not ids[-1]:  # (generation starts from the prompt's last token)
                raise DataError(
                    f"{record_where(source, index)} has an empty prompt (0 tokens); give it text or remove it"
                )
            for name, value in record.items():
                if name != "prompt":
                    columns.setdefault(name, []).append(value)
    longer = [i for i, prompt in enumerate(ids) if len(prompt) > max_prompt_length]
    if longer:
        longest = max(longer, key=lambda i: len(ids[i]))
        raise DataError(
            f"{len(longer)} prompts are longer than train.grpo.max_prompt_length ({max_prompt_length} tokens), the "
            f"longest (record {longest}) {len(ids[longest])}; raise it or shorten them"
        )
    return Prompts(given, ids, columns)


def rows_of(prompts: list[list[int]], completions: list[list[int]], seq_len: int, pad_id: int) -> Batch:
    """Rows of prompt + completion, right-padded to seq_len, the completion's tokens trained."""
    ids = torch.full((len(prompts), seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens = (prompt + completion)[:seq_len]
        ids[row, : len(tokens)] = torch.tensor(tokens)
        valid[row, : len(tokens)] = True
        labels[row, len(prompt) - 1 : len(tokens) - 1] = ids[row, len(prompt) : len(tokens)]
    return Batch(ids, labels, None, valid)


def read_completions(path: Path) -> list[dict]:
    """The records of a JSONL of given completions (train.grpo.rollouts), one a line: `prompt`, `completion` or
    `completion_ids`, `reward` or `advantage` (finite), optional `logps`; refuses the first bad line."""
    if not path.exists():
        raise DataError(f"train.grpo.rollouts {path} does not exist; give a JSONL of completions (docs/guide.md)")
    records, numbers = [], []
    for number, line in enumerate(read_text_file(path, "train.grpo.rollouts").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path} line {number} is not JSON: {error}") from None
        if "prompt" not in record or not ({"completion", "completion_ids"} & record.keys()):
            raise DataError(
                f"{path} line {number} needs prompt and completion (or completion_ids); it has {sorted(record)}"
            )
        if not ({"reward", "advantage"} & record.keys()):
            raise DataError(f"{path} line {number} has neither reward nor advantage")
        value = record.get("reward", record.get("advantage"))
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DataError(f"{path} line {number}: its reward or advantage {value!r} is not a finite number")
        if isinstance(record.get("completion"), list):
            raise DataError(
                f"{path} line {number}: its completion is a list of messages; give the completion's text (as the "
                "engine wrote it, with its end-of-turn token where it finished) or its completion_ids"
            )
        records.append(record)
        numbers.append(number)
    if not records:
        raise DataError(f"train.grpo.rollouts {path} holds no completions")
    _check_alike(records, numbers, path)
    return records


def _check_alike(records: list[dict], numbers: list[int], path: Path) -> None:
    """Refuse a file whose lines give rewards on some lines and advantages on others, or logps on some only: each
    step's rows would be read two ways (the logps of a step with one line lacking them, dropped without a word)."""
    for what, key in (("a reward (not an advantage)", "reward"), ("logps", "logps")):
        first = key in records[0]
        odd = next((n for record, n in zip(records, numbers) if (key in record) != first), None)
        if odd is not None:
            has, lacks = (numbers[0], odd) if first else (odd, numbers[0])
            raise DataError(
                f"{path} line {lacks} lacks {what}, which line {has} gives; give it on every line or on none"
            )


def completion_ids(record: dict, tokenizer, where: str) -> list[int]:
    """A given completion's tokens: its `completion_ids` exactly, else its `completion` text tokenized as it is."""
    ids = record.get("completion_ids")
    if ids is None:
        ids = tokenizer.encode(str(record["completion"]), add_special_tokens=False).ids
    if not ids:
        raise DataError(f"{where}: an empty completion (nothing to train)")
    if "logps" in record and len(record["logps"]) != len(ids):
        raise DataError(
            f"{where}: {len(record['logps'])} logps for {len(ids)} completion tokens; give completion_ids with them"
        )
    return list(ids)


def given_completions(path: Path, num_generations: int, template, tokenizer) -> tuple[list, list, list]:
    """A rollouts file's records (`read_completions`), in whole groups of `num_generations` (`check_groups`), with
    each prompt rendered (`render_prompt`) and each completion's tokens (`completion_ids`)."""
    records = read_completions(path)
    prompt_ids, completions = [], []
    for index, record in enumerate(records):
        where = f"{path} line {index + 1}"
        prompt_ids.append(render_prompt(record["prompt"], template, tokenizer, where))
        completions.append(completion_ids(record, tokenizer, where))
    check_groups(records, num_generations, path)
    return records, prompt_ids, completions


def check_groups(records: list[dict], size: int, path) -> int:
    """The number of groups: runs of `size` lines with one prompt each, refused where a run breaks."""
    if len(records) % size:
        raise DataError(f"{path} has {len(records)} completions, not whole groups of train.grpo.num_generations {size}")
    for start in range(0, len(records), size):
        prompts = {json.dumps(r["prompt"], sort_keys=True) for r in records[start : start + size]}
        if len(prompts) > 1:
            raise DataError(
                f"{path} lines {start + 1}-{start + size} hold {len(prompts)} prompts; a group is "
                f"num_generations ({size}) consecutive completions of one prompt"
            )
    return len(records) // size


def read_prompts(path) -> list:
    """A prompts file's prompts: JSONL records with `prompt` (text or messages), or one text prompt per line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f'--prompts {path} does not exist; give a JSONL of {{"prompt": ...}} or a text file')
    prompts = []
    for number, line in enumerate(read_text_file(path, "--prompts").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix in (".jsonl", ".json"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path} line {number} is not JSON: {error}") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise DataError(f"{path} line {number} has no 'prompt' field")
            if not record["prompt"]:  # (generation starts from the prompt's last token)
                raise DataError(f"{path} line {number} has an empty prompt; give it text or remove the line")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise DataError(f"--prompts {path} holds no prompts")
    return prompts
