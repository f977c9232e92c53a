"""Record datasets -> training rows: sources, formats, the chat template, truncation, mixing, packing.

Sources (sources.py) are .jsonl/.json/.parquet files, `Dataset.save_to_disk` directories or hub
names (through `datasets`), or names in a LLaMA-Factory `dataset_info.json` registry; several
are mixed with weights. `text` records are pre-training documents (one stream, EOS between
documents); alpaca, sharegpt and messages records become conversations rendered with the
model's chat template (chat.py), loss on assistant turns. An example longer than seq_len
is truncated or dropped as configured; every such example is counted and reported.
Fine-tuning rows hold one example each (padded) or, packed, several whole examples with
positions restarting at each, which the engine keeps apart (block-diagonal attention).
Everything is tokenized once and cached on disk. Preference pairs (data.format preference,
ranking registry entries) are resolved and read here and tokenized by preference.py.
"""

import bisect
import hashlib
import json
import os
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from megatrain_store import atomic_write_text
from megatrain_store.progress import progress

from .chat import ChatTemplate, load_chat_template, render_conversation, special_token_ids, trained_tokens
from .conversations import record_field, record_where, to_conversation
from .errors import DataError
from .files import not_utf8_where
from .section import FORMAT_BY_FIELDS, DataSection
from .sources import RECORD_SUFFIXES, Source, resolve_sources
from .tokens import Tokens, document_start_ids, pad_token_id

# Bumped whenever what the cache holds changes, so that an older cache is never read as a newer one
CACHE_FORMAT = 5  # 5: an answer's own leading and trailing whitespace trained


# A file of records smaller than this is read without `datasets`' progress bars (a second or less: a bar, even for
# a file it then refuses, is only lines before the one that says what is wrong).
PROGRESS_FILE_BYTES = 64 * 2**20


def load_records(source: Source):
    """A `datasets.Dataset` of the source's records (a file, a saved directory or a hub name)."""
    path = Path(source.location)
    try:
        with _datasets_quiet(progress_bars=not path.is_file() or path.stat().st_size >= PROGRESS_FILE_BYTES):
            records = _load_split(source, path)
    except DataError:
        raise
    except Exception as error:  # datasets raises many types; one clear message names the source and the fix
        if path.is_file() and not path.read_bytes().strip():
            raise DataError(
                f"dataset {source.name!r}: {path} is empty (no records); write records into it or name another file"
            ) from None
        bad_line = _first_bad_json_line(path) if path.suffix == ".jsonl" and path.is_file() else None
        if bad_line is not None:
            raise DataError(f"dataset {source.name!r}: {bad_line}; fix or remove that line") from error
        raise DataError(
            f"cannot read dataset {source.name!r} ({source.location}, split {source.split!r}): "
            f"{type(error).__name__}: {str(error)[:300]}; check the path, the file's format, the split, "
            "or (for a hub name) the network"
        ) from error
    if len(records) == 0:
        raise DataError(f"dataset {source.name!r} ({source.location}) holds no records")
    if source.num_samples is not None:
        records = records.select(sampled_indices(len(records), source.num_samples))
    return records


def sampled_indices(count: int, samples: int) -> np.ndarray:
    """A registry entry's `num_samples` of its `count` records, as LLaMA-Factory samples them (the first ones would be
    a sorted file's biased slice): a random `samples` of them, or where more are asked every record and the rest drawn
    at random (upsampling). Seeded, so that a run's data are the same at every read."""
    rng = np.random.default_rng(0)
    if samples <= count:
        return rng.permutation(count)[:samples]
    return np.concatenate([np.arange(count), rng.choice(count, samples - count)])


def _load_split(source: Source, path: Path):
    """The source's split, as `datasets` reads it from `path` (a file or a saved directory) or the hub."""
    import datasets

    files = _files_of_a_folder(source, path) if path.is_dir() else [path]
    if files is None:  # (a directory Dataset.save_to_disk wrote)
        loaded = datasets.load_from_disk(str(path))
        splits = list(loaded) if isinstance(loaded, datasets.DatasetDict) else ["train"]
        _check_split(source, splits)
        return loaded[source.split] if isinstance(loaded, datasets.DatasetDict) else loaded
    if path.is_dir() or path.suffix in RECORD_SUFFIXES:
        _check_split(source, ["train"])
        for file in files:
            _check_utf8(source, file)
            if file.suffix == ".jsonl":
                _check_first_record(source, file)
        builder = "parquet" if files[0].suffix == ".parquet" else "json"
        return datasets.load_dataset(builder, data_files=[str(file) for file in files], split="train")
    if path.exists():
        raise DataError(
            f"dataset {path}: unknown file type {path.suffix!r}; use .jsonl, .json, .parquet "
            "or a directory written by Dataset.save_to_disk"
        )
    unreachable = _hub_unreachable()
    if unreachable is None:
        return datasets.load_dataset(source.location, source.subset, data_dir=source.folder, split=source.split)
    with _hub_offline():  # datasets' cache alone: no half a minute of retries before the same failure
        try:
            return datasets.load_dataset(source.location, source.subset, data_dir=source.folder, split=source.split)
        except Exception as error:
            raise DataError(
                f"dataset {source.name!r} ({source.location}) is not a local path, and the Hugging Face Hub, where "
                f"it would be a dataset's name, cannot be reached ({unreachable}) with no copy of it in datasets' "
                "cache: give a local file or saved directory, or download it where the Hub is reachable"
            ) from error


# proxies reach the Hub by their own ways: not probed
PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _files_of_a_folder(source: Source, path: Path) -> list[Path] | None:
    """The files of records a folder holds, read as one dataset (LLaMA-Factory's file_name of a folder), all of one
    type; None where it is a directory `Dataset.save_to_disk` wrote."""
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        return None
    files = sorted(file for file in path.iterdir() if file.suffix in RECORD_SUFFIXES)
    kinds = sorted({"parquet" if file.suffix == ".parquet" else "json" for file in files})
    if len(kinds) != 1:
        found = "files of both JSON and Parquet" if kinds else "no .jsonl, .json or .parquet file"
        raise DataError(
            f"dataset {source.name!r}: the folder {path} holds {found}; give a folder of records of one type, or a "
            "directory written by Dataset.save_to_disk"
        )
    return files


def _hub_unreachable(timeout_s: float = 3.0) -> str | None:
    """Why this machine cannot open a connection to the Hub's endpoint as huggingface_hub has it (HF_ENDPOINT): a
    name that does not resolve, no route, refused, no answer in `timeout_s`; None where it can, is told to stay
    offline (HF_HUB_OFFLINE: datasets reads its cache at once) or goes through a proxy."""
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE or any(os.environ.get(name) for name in PROXY_VARIABLES):
        return None
    url = urlsplit(hub.ENDPOINT)
    host, port = url.hostname, url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as error:
        return f"{host}:{port}: {error.strerror or error}"
    return None


@contextmanager
def _hub_offline():
    """`datasets` and huggingface_hub in offline mode (the cache alone), as they were afterwards."""
    import datasets
    import huggingface_hub.constants as hub

    were = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = were


@contextmanager
def _datasets_quiet(progress_bars: bool):
    """`datasets` without its own log lines (its errors become one `DataError` line here), and without its progress
    bars unless `progress_bars`; as it was afterwards."""
    import datasets

    verbosity, bars_were_on = datasets.logging.get_verbosity(), not datasets.are_progress_bars_disabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if not progress_bars:
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars_were_on:
            datasets.enable_progress_bars()


def _check_split(source: Source, splits: list[str]) -> None:
    """Refuse a split a local dataset does not have: a file, or a saved Dataset, is one split, which `datasets`
    would give whatever split was asked for (a validation "split" that is the training data itself)."""
    if source.split not in splits:
        raise DataError(
            f"dataset {source.name!r} ({source.location}) has no split {source.split!r}, only {splits}; for held-out "
            "data set data.validation to a fraction (e.g. 0.05), a file of held-out records, or one of its splits"
        )


def _check_utf8(source: Source, path: Path) -> None:
    """Refuse a JSON (Lines) file holding a byte that is not UTF-8 before `datasets` reads it: it fails deep in a
    later step with a traceback (JSON Lines) or with no word of the byte (JSON)."""
    if path.suffix != ".parquet":
        where = not_utf8_where(path)
        if where is not None:
            raise DataError(f"dataset {source.name!r}: {where}; save the file as UTF-8 (or fix that byte)")


def _check_first_record(source: Source, path: Path) -> None:
    """Refuse a JSON Lines file whose first record is no JSON object (`datasets` reads a file of arrays as records of
    a column 'text', which then fails as "field 'text' is a int")."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return  # (datasets' own error, then `_first_bad_json_line`, names it)
                if not isinstance(record, dict):
                    raise DataError(
                        f"dataset {source.name!r}: {path} line {number} is a JSON {type(record).__name__}, not an "
                        'object of fields; write each record as {"field": value, ...}'
                    )
                return


def _first_bad_json_line(path: Path) -> str | None:
    """Where a JSON Lines file that `datasets` could not read holds a line that is no JSON object, or one with a field
    the first record lacks (`datasets` takes a file's columns from its first records, and a field seen later fails
    its whole read, deep in a large file), in words."""
    first = None  # (its line, its fields)
    with open(path, encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                return f"{path} line {number} is not JSON ({error})"
            if not isinstance(record, dict):
                return f"{path} line {number} is a JSON {type(record).__name__}, not an object of fields"
            first = first or (number, set(record))
            if not record.keys() <= first[1]:
                return (
                    f"{path} line {number} has fields {sorted(record.keys() - first[1])} that the records before it "
                    f"lack (line {first[0]}'s: {sorted(first[1])}), and a file's records are read as the columns of its "
                    "first ones; give every record the same fields (null where one has no value) or drop the others"
                )
    return None


# ------------------------------------------------------------- tokenizing
@dataclass
class Examples:
    """Tokenized examples of one source and what happened to the records on the way."""

    # each example's own arrays (int32 ids, bool flags): 5 bytes a token, where Python lists of ints and bools took
    # about 50 and a 1.5 GB corpus's examples did not fit a 23 GiB machine
    ids: list[np.ndarray]
    trained: list[np.ndarray]
    records: int = 0
    truncated: int = 0
    dropped_long: int = 0
    dropped_untrained: int = 0
    turns: int = 0  # trained ranges (assistant turns) whose end-of-turn token is looked for
    unended: dict[str, int] = field(default_factory=dict)  # what follows those with no special token after: count

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, indices) -> "Examples":
        return Examples([self.ids[i] for i in indices], [self.trained[i] for i in indices], len(indices))

    def extend(self, other: "Examples") -> None:
        """`other`'s examples after these (a mix's parts)."""
        self.ids += other.ids
        self.trained += other.trained

    def drop_notes(self, data: DataSection) -> list[str]:
        """What happened to the records on the way, for the report line; each count is also a lost record where it
        says "dropped"."""
        notes = []
        if self.truncated:
            notes.append(f"{self.truncated} truncated to seq_len {data.seq_len}")
        if self.dropped_long:
            notes.append(f"{self.dropped_long} dropped as longer than seq_len {data.seq_len}")
        if self.dropped_untrained:
            notes.append(f"{self.dropped_untrained} dropped with no trained token within seq_len")
        return notes

    def count_turn_ends(self, turns: int, unended: list[str]) -> None:
        """Count an example's trained turns and what follows those that end in no special token (`trained_tokens`)."""
        self.turns += turns
        for marker in unended:
            self.unended[marker] = self.unended.get(marker, 0) + 1

    @property
    def lost(self) -> int:
        """Records that became no example."""
        return self.dropped_long + self.dropped_untrained


def render_error(source: Source, index: int, error: Exception) -> DataError:
    return DataError(
        f"{record_where(source, index)} cannot be rendered with the chat template: "
        f"{type(error).__name__}: {error}; fix the record, or set data.chat_template (simple, or a .jinja file)"
    )


def tokenize_source(
    records, source: Source, data: DataSection, template: ChatTemplate, tokenizer, eos: str, batch: int = 512
) -> Examples:
    """Token ids and trained flags per record, after truncation or dropping of long examples."""
    import jinja2

    special = special_token_ids(tokenizer)
    document_start = document_start_ids(tokenizer) if source.formatting == "text" else []
    examples = Examples([], [], len(records))
    for start in progress(range(0, len(records), batch), desc=f"tokenize {source.name}", unit="batch", leave=False):
        rows = records[start : start + batch]
        keys = list(rows)
        rendered = []
        for offset in range(len(rows[keys[0]])):
            index, record = start + offset, {k: rows[k][offset] for k in keys}
            if source.formatting == "text":
                column = source.columns.get("prompt", data.text_field)
                text = record_field(record, column, index, source, "text")
                if not isinstance(text, str):
                    raise DataError(
                        f"{record_where(source, index)} field {column!r} is a {type(text).__name__}, not text: "
                        "fix the record, or name the text column in data.text_field"
                    )
                text += eos
                rendered.append((text, [(0, len(text))], False))
                continue
            messages, tools = to_conversation(record, source, index)
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(
                    f"{record_where(source, index)} has no assistant turn, so nothing to learn from; "
                    "remove it or fix its roles"
                )
            try:
                rendered.append(render_conversation(template, messages, tools))
            except (jinja2.TemplateError, ValueError, TypeError) as error:
                raise render_error(source, index, error) from error
        encoded = tokenizer.encode_batch([text for text, _, _ in rendered], add_special_tokens=False)
        for (text, spans, end_of_turn), encoding in zip(rendered, encoded):
            ids = document_start + encoding.ids
            trained = [True] * len(ids)
            if not (data.train_on_prompt or source.formatting == "text"):
                unended = []
                trained = trained_tokens(text, spans, end_of_turn, ids, encoding.offsets, special, unended)
                examples.count_turn_ends(len(spans) if end_of_turn else 0, unended)
            if source.formatting != "text" and len(ids) > data.seq_len:
                if data.too_long == "drop":
                    examples.dropped_long += 1
                    continue
                ids, trained = ids[: data.seq_len], trained[: data.seq_len]
                examples.truncated += 1
            if source.formatting != "text" and not any(trained[1:]):  # the first token is never a target
                examples.dropped_untrained += 1
                continue
            examples.ids.append(np.asarray(ids, dtype=np.int32))
            examples.trained.append(np.asarray(trained, dtype=bool))
    return examples


def report_line(source: Source, examples: Examples, data: DataSection) -> str:
    notes = examples.drop_notes(data)
    detail = f" ({'; '.join(notes)})" if notes else ""
    return f"dataset {source.name}: {examples.records} records -> {len(examples.ids)} examples{detail}"


def end_of_turn_warning(source: Source, examples: Examples) -> str | None:
    """A report line where trained turns end in no special token: the marker their template writes is no single
    token of the tokenizer, so the end of a turn is never trained and the model never learns to stop."""
    if not examples.unended:
        return None
    marker, _ = max(examples.unended.items(), key=lambda item: item[1])
    what = f"the chat template ends assistant turns with {marker!r}" if marker else "assistant turns end the text"
    return (
        f"warning: dataset {source.name}: {what}, which is no special token of the tokenizer: "
        f"{sum(examples.unended.values())} of {examples.turns} trained turns end with no trained end-of-turn token, "
        "so the model does not learn to stop; add the marker to the tokenizer as a special token, or set "
        "data.chat_template to a template that ends turns with one (its eos_token)"
    )


def check_kept(source: Source, examples: Examples, data: DataSection) -> None:
    """Refuse a dataset most of whose records would be skipped: that is a wrong setting, not data noise."""
    if examples.lost * 2 > examples.records:
        raise DataError(
            f"{report_line(source, examples, data)}: most records would be skipped; raise data.seq_len"
            + (", or set data.too_long: truncate" if examples.dropped_long else "")
        )


def mix_indices(sizes: list[int], weights: tuple[float, ...] | None, seed: int) -> list[list[int]]:
    """Which examples of each source (by index, repeats included) a mix takes: all of every source, or with
    weights, source i contributes weight_i / sum(weights) of the total count (whole repeats of its
    examples, then a seeded sample of them)."""
    if not weights:
        return [list(range(size)) for size in sizes]
    total = sum(sizes)
    rng = np.random.default_rng([seed, 1])
    chosen = []
    for size, weight in zip(sizes, weights):
        want = round(total * weight / sum(weights))
        repeats, rest = divmod(want, size)
        chosen.append(list(range(size)) * repeats + sorted(rng.choice(size, rest, replace=False)))
    return chosen


def mix(parts: list[Examples], weights: tuple[float, ...] | None, seed: int, kind: type = Examples) -> Examples:
    """The examples of every source (`kind`, or a subclass's, such as multimodal.py's), mixed as `mix_indices`
    says."""
    mixed = kind([], [])
    for part, indices in zip(parts, mix_indices([len(p) for p in parts], weights, seed)):
        mixed.extend(part.select(indices))
    return mixed


def examples_of(sources: list[Source], all_records: list, validation_records, data: DataSection, seed: int, encode):
    """(the training examples of every source, mixed; the validation examples or None; the report lines), each
    source's records made examples by `encode(records, source)` (an `Examples` or a subclass's) and checked."""
    lines, parts, held_out = [], [], []
    for source, records in zip(sources, all_records):
        examples = encode(records, source)
        check_kept(source, examples, data)
        lines.append(report_line(source, examples, data))
        warning = end_of_turn_warning(source, examples)
        if warning is not None:
            lines.append(warning)
        if isinstance(data.validation, float):
            examples, validation_part = hold_out(examples, data.validation, seed)
            held_out.append(validation_part)
        parts.append(examples)
    kind = type(parts[0]) if parts else Examples
    validation = mix(held_out, None, seed, kind)
    if validation_records is not None:
        source = validation_source(data, sources[0])
        validation = encode(validation_records, source)
        lines.append(report_line(source, validation, data))
    if data.validation is not None:
        lines.append(f"validation: {len(validation.ids)} examples")
    if data.mix_weights:
        taken = mix_indices([len(part) for part in parts], data.mix_weights, seed)
        counts = (f"{source.name} {len(part)} -> {len(t)}" for source, part, t in zip(sources, parts, taken))
        lines.append(f"data.mix_weights {list(data.mix_weights)}: examples {', '.join(counts)}")
    train = mix(parts, data.mix_weights, seed, kind)
    return train, validation if data.validation is not None else None, lines


# ----------------------------------------------------------------- rows
def pack_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Examples per row, best-fit decreasing: each example (longest first) goes to the row with the
    least room that still holds it, so rows fill up and no example is split."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (free tokens, row)
    for example in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        need = lengths[example]
        k = bisect.bisect_left(room, (need, -1))
        if k == len(room):
            rows.append([example])
            free, row = seq_len - need, len(rows) - 1
        else:
            free, row = room.pop(k)
            rows[row].append(example)
            free -= need
        if free:
            bisect.insort(room, (free, row))
    return rows


def to_rows(examples: Examples, seq_len: int, pack: bool, pad_id: int) -> Tokens:
    """One example per row (padded; padding is never trained), or whole examples packed per row with
    positions restarting at each (padding at a row's end is a document of its own)."""
    groups = pack_rows([len(ids) for ids in examples.ids], seq_len) if pack else [[i] for i in range(len(examples.ids))]
    tokens = np.full((len(groups), seq_len), pad_id, dtype=np.int32)
    mask = np.zeros((len(groups), seq_len), dtype=bool)
    valid = np.zeros((len(groups), seq_len), dtype=bool)
    positions = np.zeros((len(groups), seq_len), dtype=np.int32) if pack else None
    for row, members in enumerate(groups):
        cursor = 0
        for example in members:
            ids, trained = examples.ids[example], examples.trained[example]
            tokens[row, cursor : cursor + len(ids)] = ids
            mask[row, cursor : cursor + len(ids)] = trained
            valid[row, cursor : cursor + len(ids)] = True
            if positions is not None:
                positions[row, cursor : cursor + len(ids)] = np.arange(len(ids))
            cursor += len(ids)
        if positions is not None:
            positions[row, cursor:] = np.arange(seq_len - cursor)
    return Tokens(tokens, mask, positions, valid)


@dataclass
class RecordData:
    """What records become: training rows (or a token stream for text records), validation rows, the report."""

    train: Tokens
    validation: Tokens | None
    report: list[str]
    template_source: str | None


def validation_source(data: DataSection, first: Source) -> Source:
    """data.validation given as a string: a file of the same format, else a split of the first dataset (refused
    where it names a file, by a folder or a suffix, that does not exist)."""
    path = Path(data.validation)
    if path.exists():
        return replace(first, name=f"{first.name} (validation)", location=data.validation, split="train")
    if len(path.parts) > 1 or path.suffix in RECORD_SUFFIXES:
        raise DataError(
            f"data.validation {data.validation} does not exist; name a file of held-out records, a split of the "
            "dataset, or a fraction to hold out (e.g. 0.05)"
        )
    return replace(first, name=f"{first.name} ({data.validation})", split=data.validation)


def hold_out(examples, fraction: float, seed: int) -> tuple:
    """(training, validation) parts of `examples` (anything with `len` and `select`): a seeded
    `fraction` of them held out."""
    order = np.random.default_rng([seed, 2]).permutation(len(examples))
    n_val = max(1, round(fraction * len(order)))
    if n_val >= len(order):
        raise DataError(f"data.validation {fraction} holds out all {len(order)} examples; use a smaller fraction")
    return examples.select(sorted(order[n_val:])), examples.select(sorted(order[:n_val]))


def _stream(examples: Examples) -> Tokens:
    return Tokens(np.concatenate(examples.ids) if examples.ids else np.zeros(0, dtype=np.int32))


@dataclass
class ReadSources:
    """The datasets a run names, read: each source and its records, the validation records (data.validation as a
    file or split; else None), whether they are plain text, and the chat template conversations are rendered with
    (None for text)."""

    sources: list[Source]
    records: list
    validation: object
    text: bool
    template: ChatTemplate | None


def read_sources(data: DataSection, tokenizer_path: Path, eos: str) -> ReadSources:
    """Resolve and read the configured datasets (mixes of text and chat records refused before any is read)."""
    sources = resolve_sources(data)
    text = _is_text(data, sources)
    template = None if text else _chat_template(tokenizer_path, data.chat_template, eos)
    all_records = [load_records(s) for s in sources]
    if text and data.pack:
        _refuse_packed_text(sources, all_records)
    validation_records = load_records(validation_source(data, sources[0])) if isinstance(data.validation, str) else None
    return ReadSources(sources, all_records, validation_records, text, template)


def records_to_rows(
    data: DataSection, read: ReadSources, tokenizer, tokenizer_path: Path, eos: str, cache_dir: Path, seed: int
) -> RecordData:
    """Render, tokenize, mix and pack the datasets `read_sources` read (cached under `cache_dir`)."""
    sources, all_records, validation_records, template = read.sources, read.records, read.validation, read.template
    fingerprints = [getattr(r, "_fingerprint", "") or s.location for r, s in zip(all_records, sources)]
    if validation_records is not None:
        fingerprints.append(getattr(validation_records, "_fingerprint", "") or data.validation)
    settings = json.dumps(
        [CACHE_FORMAT, data.as_key(), eos, seed, fingerprints, template and template.template], default=str
    )
    key = hashlib.sha256(settings.encode() + Path(tokenizer_path).read_bytes()).hexdigest()[:16]
    prefix = cache_dir / f"records-{key}"
    report_path = Path(f"{prefix}.report.json")
    if report_path.exists():
        report = json.loads(report_path.read_text())
        validation = Tokens.load(f"{prefix}.val") if report["validation"] else None
        return RecordData(Tokens.load(str(prefix)), validation, report["lines"], template and template.source)

    def encode(records, source: Source) -> Examples:
        return tokenize_source(records, source, data, template, tokenizer, eos)

    train_examples, validation_examples, lines = examples_of(
        sources, all_records, validation_records, data, seed, encode
    )
    pad = pad_token_id(tokenizer, eos)
    train, validation = _rows_of(train_examples, validation_examples, data, read.text, pad, lines)
    cache_dir.mkdir(parents=True, exist_ok=True)
    train.save(str(prefix))
    if validation is not None:
        validation.save(f"{prefix}.val")
    # written last: the cache is whole
    atomic_write_text(report_path, json.dumps({"lines": lines, "validation": validation is not None}))
    return RecordData(train, validation, lines, template and template.source)


def _is_text(data: DataSection, sources: list[Source]) -> bool:
    """Whether the sources are plain text (pre-training) rather than chat records; mixes refused."""
    if any(s.is_preference for s in sources):  # (load_token_data sends these to preference.preference_rows)
        raise DataError("data.dataset names preference pairs: read them with megatrain_data.preference.preference_rows")
    text = sources[0].formatting == "text"
    if any((s.formatting == "text") != text for s in sources):
        raise DataError("data.dataset mixes text (pre-training) and chat datasets; train them in separate runs")
    return text


def _refuse_packed_text(sources: list[Source], all_records: list) -> None:
    """Refuse data.pack on text records. Records with a chat format's fields (a `messages` file read as text) are
    told that format first: data.pack: false alone only fails next on their missing text field."""
    for source, records in zip(sources, all_records):
        fields = set(records.column_names)
        chats = [name for name, needs in FORMAT_BY_FIELDS if name in ("messages", "alpaca") and needs <= fields]
        if chats:
            raise DataError(
                f"dataset {source.name!r} holds {chats[0]} records (fields {sorted(fields)}) but data.format is text: "
                f"set data.format: {chats[0]} to pack them as examples"
            )
    raise DataError(
        "data.pack packs chat and instruction examples; text records are already one stream cut into "
        "windows (set data.pack: false, or data.format to the records' chat format)"
    )


def _chat_template(tokenizer_path: Path, chat_template: str | None, eos: str):
    """The chat template configured or the tokenizer's own; the simple template (said on stderr) where it has none."""
    template = load_chat_template(tokenizer_path.parent, chat_template, eos)
    if template is None:
        template = load_chat_template(None, "simple", eos)
        print(
            f"megatrain: the tokenizer at {tokenizer_path.parent} has no chat template; using the simple "
            "template (docs/guide.md). Set data.chat_template to a .jinja file to use another.",
            file=sys.stderr,
        )
    return template


def _rows_of(train_examples, validation_examples, data: DataSection, text: bool, pad: int, lines: list[str]):
    """(training, validation or None) tokens: text as one stream; chat examples as rows of seq_len, packed where
    data.pack says (a line for the report)."""
    has_validation = data.validation is not None
    if text:
        return _stream(train_examples), _stream(validation_examples) if has_validation else None
    train = to_rows(train_examples, data.seq_len, data.pack, pad)
    validation = to_rows(validation_examples, data.seq_len, data.pack, pad) if has_validation else None
    if data.pack:
        used = sum(len(ids) for ids in train_examples.ids) / max(1, train.tokens.size)
        lines.append(
            f"packed {len(train_examples.ids)} examples into {len(train.tokens)} rows ({used:.0%} tokens used)"
        )
    return train, validation
