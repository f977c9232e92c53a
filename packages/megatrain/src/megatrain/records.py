"""Record datasets (JSONL, JSON, parquet, `save_to_disk` directories, hub names) through `datasets`,
rendered for pre-training (documents packed with EOS between them) or fine-tuning (one
example per window, loss only on response tokens), tokenized once and cached on disk.

Fine-tuning templates (documented, model-independent):
- alpaca: "### Instruction:\\n{instruction}\\n\\n[### Input:\\n{input}\\n\\n]### Response:\\n" + {output} + EOS
- messages (sharegpt-style lists of {role, content}, under `messages` or `conversations`,
  with from/value accepted for role/content): each turn "<|{role}|>\\n{content}\\n"; the
  content of assistant turns (role assistant/gpt) and the EOS after it carry the loss.
"""

import hashlib
import json
from pathlib import Path

import numpy as np

from .config import ConfigError, DataSection

ALPACA_FIELDS = ("instruction", "output")
ASSISTANT_ROLES = ("assistant", "gpt", "model")


def load_records(source: str):
    """A `datasets.Dataset` of records from a file, a saved directory or a hub name."""
    import datasets

    path = Path(source)
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
            return loaded["train"] if isinstance(loaded, datasets.DatasetDict) else loaded
        if path.suffix in (".jsonl", ".json"):
            return datasets.load_dataset("json", data_files=str(path), split="train")
        if path.suffix == ".parquet":
            return datasets.load_dataset("parquet", data_files=str(path), split="train")
        if path.exists():
            raise ConfigError(
                f"data.dataset {path}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet "
                "or a directory written by Dataset.save_to_disk"
            )
        return datasets.load_dataset(source, split="train")
    except ConfigError:
        raise
    except Exception as error:  # datasets raises many types; one clear message names the source and the fix
        raise ConfigError(
            f"cannot read data.dataset {source!r}: {type(error).__name__}: {str(error)[:300]}; "
            "check the path, the file's format, or (for a hub name) the network"
        ) from error


def _field(record: dict, names: tuple[str, ...], index: int, source: str):
    for name in names:
        if name in record and record[name] is not None:
            return record[name]
    raise ConfigError(
        f"{source}: record {index} has no field {names[0]!r} (fields: {sorted(record)}); "
        f"set data.format / data.text_field to match the records"
    )


def render(record: dict, data: DataSection, index: int, eos: str) -> list[tuple[str, bool]]:
    """The record as (text, carries loss) pieces."""
    if data.format == "text":
        return [(str(_field(record, (data.text_field,), index, data.dataset)) + eos, True)]
    if data.format == "alpaca":
        instruction = _field(record, ("instruction",), index, data.dataset)
        output = _field(record, ("output", "response"), index, data.dataset)
        extra = record.get("input") or ""
        prompt = (
            f"### Instruction:\n{instruction}\n\n" + (f"### Input:\n{extra}\n\n" if extra else "") + "### Response:\n"
        )
        return [(prompt, False), (str(output) + eos, True)]
    turns = _field(record, ("messages", "conversations"), index, data.dataset)
    pieces = []
    for turn in turns:
        role = _field(turn, ("role", "from"), index, data.dataset)
        content = _field(turn, ("content", "value"), index, data.dataset)
        pieces.append((f"<|{role}|>\n", False))
        if role in ASSISTANT_ROLES:
            pieces += [(f"{content}{eos}", True), ("\n", False)]
        else:
            pieces.append((f"{content}\n", False))
    if not any(loss for _, loss in pieces):
        raise ConfigError(f"{data.dataset}: record {index} has no assistant turn, so nothing to learn from")
    return pieces


def tokenize_records(records, data: DataSection, tokenizer, eos: str, batch: int = 1024):
    """Token ids and loss mask per record (parallel encode_batch, with a progress bar)."""
    from tqdm import tqdm

    ids, masks = [], []
    for start in tqdm(range(0, len(records), batch), desc="tokenize", unit="batch", leave=False):
        rows = records[start : start + batch]
        keys = list(rows)
        rendered = [render({k: rows[k][i] for k in keys}, data, start + i, eos) for i in range(len(rows[keys[0]]))]
        flat = [text for pieces in rendered for text, _ in pieces]
        encoded = tokenizer.encode_batch(flat, add_special_tokens=False)
        cursor = 0
        for pieces in rendered:
            record_ids, record_mask = [], []
            for _, loss in pieces:
                piece = encoded[cursor].ids
                cursor += 1
                record_ids.extend(piece)
                record_mask.extend([loss] * len(piece))
            ids.append(record_ids)
            masks.append(record_mask)
    return ids, masks


def records_to_arrays(data: DataSection, tokenizer, tokenizer_path: Path, eos: str, cache_dir: Path):
    """(tokens, loss_mask): pre-training packs documents into one 1-D stream (mask None); fine-tuning
    gives [examples, seq_len] arrays, truncated or padded with EOS (padding carries no loss)."""
    records = load_records(data.dataset)
    if len(records) == 0:
        raise ConfigError(f"data.dataset {data.dataset} holds no records")
    fingerprint = getattr(records, "_fingerprint", "") or data.dataset
    settings = json.dumps([data.format, data.text_field, data.seq_len, eos, fingerprint])
    key = hashlib.sha256(settings.encode() + Path(tokenizer_path).read_bytes()).hexdigest()[:16]
    tokens_path, mask_path = cache_dir / f"records-{key}.npy", cache_dir / f"records-{key}.mask.npy"
    if tokens_path.exists():
        mask = np.load(mask_path, mmap_mode="r") if mask_path.exists() else None
        return np.load(tokens_path, mmap_mode="r"), mask
    ids, masks = tokenize_records(records, data, tokenizer, eos)
    cache_dir.mkdir(parents=True, exist_ok=True)
    if data.format == "text":
        tokens = np.fromiter((t for record in ids for t in record), dtype=np.int32)
        np.save(tokens_path, tokens)
        return tokens, None
    eos_id = tokenizer.token_to_id(eos) or 0
    tokens = np.full((len(ids), data.seq_len), eos_id, dtype=np.int32)
    mask = np.zeros((len(ids), data.seq_len), dtype=bool)
    for row, (record_ids, record_mask) in enumerate(zip(ids, masks)):
        n = min(len(record_ids), data.seq_len)
        tokens[row, :n] = record_ids[:n]
        mask[row, :n] = record_mask[:n]
    np.save(mask_path, mask)
    np.save(tokens_path, tokens)
    return tokens, mask
