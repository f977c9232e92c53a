"""A run's data, loaded: the one module that knows every source (token arrays, text, records of each format,
preference pairs, records with images or videos) and sends each to the module that reads it.

`load_token_data` gives the training and validation `Tokens` that windows.py batches; `run_tokenizer` finds the
tokenizer a finished run read its text with.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megatrain_store.checkpoints import MANIFEST
from megatrain_store.rundir import FINAL

from .errors import DataError, missing_path
from .multimodal import media_columns, media_rows
from .preference import preference_rows, uses_pairs
from .records import RecordData, load_records, read_sources, records_to_rows
from .section import DataSection, fix_for_record
from .sources import resolve_sources
from .tokens import (
    Tokens,
    builtin_corpus,
    cached_tokenizer,
    check_tokens,
    eos_token_text,
    load_tokenizer,
    pad_token_id,
    text_tokenizer,
    tokenize_text,
    train_tokenizer,
)


@dataclass
class TokenData:
    """Training tokens, held-out validation tokens (or None), the tokenizer, and what reading the data did."""

    train: Tokens
    validation: Tokens | None
    tokenizer: Path | None
    report: list[str] = field(default_factory=list)
    pairs: bool = False  # preference pairs: rows 2i and 2i + 1 are pair i's chosen and rejected (PairWindows)


def _split_stream(tokens: np.ndarray, data: DataSection, validation: np.ndarray | None) -> tuple[Tokens, Tokens | None]:
    """A stream and its validation stream: the one given, or the last `data.validation` fraction (whole windows)."""
    if isinstance(data.validation, float):
        n_windows = len(tokens) // data.seq_len
        held = max(1, round(data.validation * n_windows))
        if held >= n_windows:
            raise DataError(
                f"data.validation {data.validation} holds out all {n_windows} windows of seq_len {data.seq_len}; "
                "use a smaller fraction or more data"
            )
        cut = (n_windows - held) * data.seq_len
        return Tokens(tokens[:cut]), Tokens(tokens[cut : n_windows * data.seq_len])
    return Tokens(tokens), None if validation is None else Tokens(validation)


def _read_npy(path: Path, vocab_size: int, what: str) -> np.ndarray:
    _check_npy_header(path, what)
    try:
        tokens = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {what} {path}: {error}; it must be a .npy array of token ids") from error
    check_tokens(tokens, vocab_size, f"{what} {path}")
    return tokens


def _check_npy_header(path: Path, what: str) -> None:
    """Refuse a file that is no .npy array (numpy would speak of `allow_pickle`, which is no fix for it)."""
    try:
        with open(path, "rb") as file:
            header = file.read(6)
    except FileNotFoundError:
        raise DataError(f"{what} {missing_path(path)} does not exist; check the path") from None
    except OSError:
        return  # (np.load says what is wrong with the path)
    if header != b"\x93NUMPY":
        raise DataError(
            f"{what} {path} is not a .npy file (no numpy header); save the token ids with numpy.save, or set "
            "data.text (a text file) or data.dataset (records) instead"
        )


def load_token_data(
    data: DataSection,
    vocab_size: int,
    cache_dir: Path,
    model_dir: Path | None,
    eos_token_id: int | None = None,
    seed: int = 0,
    max_prompt_length: int | None = None,
    model_type: str | None = None,
) -> TokenData:
    """The training (and validation) tokens `data` describes, tokenized once and cached under `cache_dir`.
    Preference datasets give pairs (`TokenData.pairs`), each prompt cut to its last `max_prompt_length` tokens
    (train.dpo.max_prompt_length; None: data.seq_len // 2). A tokenizer megatrain trains splits text as transformers
    does for a model of `model_type` (its config.json's; `train_tokenizer`)."""
    as_file = isinstance(data.validation, str)
    if data.tokens is not None:
        if data.tokenizer:  # (the export's: a misspelled one was dropped without a word)
            load_tokenizer(Path(data.tokenizer))
        validation = _read_npy(Path(data.validation), vocab_size, "data.validation") if as_file else None
        train, held = _split_stream(_read_npy(Path(data.tokens), vocab_size, "data.tokens"), data, validation)
        return TokenData(train, held, None)
    tokenizer = _named_tokenizer(data, model_dir)
    if data.dataset is None:
        return _text_token_data(data, tokenizer, vocab_size, cache_dir, model_type)
    return _dataset_token_data(
        data, tokenizer, vocab_size, cache_dir, model_dir, eos_token_id, seed, max_prompt_length, model_type
    )


def _named_tokenizer(data: DataSection, model_dir: Path | None) -> Path | None:
    """The tokenizer the config names: data.tokenizer, else the model directory's; None where neither does."""
    tokenizer = Path(data.tokenizer) if data.tokenizer else None
    if tokenizer is not None:
        load_tokenizer(tokenizer)  # (a missing or unreadable file named before anything is read)
    if tokenizer is None and model_dir is not None:
        if not (model_dir / "tokenizer.json").exists():  # (a tokenizer trained here would give its ids other meanings)
            raise DataError(
                f"model.hf_dir {model_dir} has no tokenizer.json: its weights read the ids of the tokenizer they were "
                "trained with; set data.tokenizer to that tokenizer.json (or give token ids in data.tokens)"
            )
        tokenizer = model_dir / "tokenizer.json"
    return tokenizer


def _dataset_token_data(
    data: DataSection,
    tokenizer: Path | None,
    vocab_size: int,
    cache_dir: Path,
    model_dir: Path | None,
    eos_token_id: int | None,
    seed: int,
    max_prompt_length: int | None,
    model_type: str | None,
) -> TokenData:
    """The rows of the records data.dataset names: examples, or preference pairs, under the named tokenizer (one
    trained on the records for a model of `model_type` where none is named and they are plain text)."""
    pairs = uses_pairs(data)
    if tokenizer is None:
        resolve_sources(data)  # (its files' absence is said first: a tokenizer would not make them)
        if data.format != "text" or pairs:
            raise DataError(
                "fine-tuning data needs the model's tokenizer: set data.tokenizer or use model.hf_dir "
                "with a tokenizer.json"
            )
        tokenizer = _dataset_tokenizer(data, vocab_size, cache_dir, model_type)
    loaded = load_tokenizer(tokenizer)
    if loaded.get_vocab_size() > vocab_size:
        raise DataError(
            f"tokenizer {tokenizer} has {loaded.get_vocab_size()} tokens but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer or a model with a larger vocabulary"
        )
    eos = eos_token_text(loaded, eos_token_id, Path(tokenizer).parent)
    if pairs:
        rows = preference_rows(data, max_prompt_length, loaded, tokenizer, eos, cache_dir, seed)
    else:
        rows = _record_rows(data, loaded, tokenizer, eos, cache_dir, seed, model_dir)
    check_tokens(np.asarray(rows.train.tokens).reshape(-1), vocab_size, f"tokens of {data.dataset}")
    report = list(rows.report)
    if rows.template_source is not None:
        report.insert(0, f"chat template: {rows.template_source}")
    return TokenData(rows.train, rows.validation, tokenizer, report, pairs)


def _record_rows(
    data: DataSection, tokenizer, tokenizer_path: Path, eos: str, cache_dir: Path, seed: int, model_dir: Path | None
) -> RecordData:
    """The rows of supervised or text records (`records_to_rows`, cached under `cache_dir`); records with images or
    videos go through the processor of `model_dir` instead (`media_rows`), uncached."""
    read = read_sources(data, tokenizer_path, eos)
    if any(media_columns(source, records) for source, records in zip(read.sources, read.records)):
        pad = pad_token_id(tokenizer, eos)
        args = (data, read.sources, read.records, read.validation, tokenizer, read.template, pad, seed, model_dir)
        train, validation, lines = media_rows(*args)
        return RecordData(train, validation, lines, read.template.source)
    return records_to_rows(data, read, tokenizer, tokenizer_path, eos, cache_dir, seed)


def _text_token_data(
    data: DataSection, tokenizer: Path | None, vocab_size: int, cache_dir: Path, model_type: str | None
) -> TokenData:
    """A text file's tokens (the built-in corpus without `data.text`), with a tokenizer trained on it for a model of
    `model_type` where none is given, split into training and held-out tokens."""
    as_file = isinstance(data.validation, str)
    text = Path(data.text) if data.text is not None else builtin_corpus()
    tokenizer = tokenizer or _trained_text_tokenizer(data, vocab_size, cache_dir, model_type)
    tokens, tokenizer = tokenize_text(text, tokenizer, vocab_size, cache_dir)
    check_tokens(tokens, vocab_size, f"tokens of {text}")
    validation = None
    if as_file:
        validation, _ = tokenize_text(Path(data.validation), tokenizer, vocab_size, cache_dir, "data.validation")
        check_tokens(validation, vocab_size, f"tokens of data.validation {data.validation}")
    train, held = _split_stream(tokens, data, validation)
    return TokenData(train, held, tokenizer)


def run_tokenizer(
    data: DataSection, vocab_size: int, run_dir: Path | None, model_dir: Path | None, model_type: str | None = None
) -> Path | None:
    """The tokenizer file the run in `run_dir` read its text with: data.tokenizer, the model directory's
    tokenizer.json, the one its final/ export holds, or the one megatrain trained on its text for its model of
    `model_type` (cached in the run, trained the same again where the cache is gone); None where its data brought
    none (token arrays). Weights of no run (`run_dir` None: a PEFT directory's adapters, say) take the first two
    alone (their base model's)."""
    configured = data.tokenizer or (model_dir / "tokenizer.json" if model_dir is not None else None)
    if configured is not None and Path(configured).exists():
        return Path(configured)
    if run_dir is None:
        return None
    exported = run_dir / "final" / "tokenizer.json"
    if exported.exists():
        return exported
    if data.tokens is None and data.dataset is None:
        return _trained_text_tokenizer(data, vocab_size, run_dir / "cache", model_type)
    if data.dataset is not None and data.format == "text":
        return _dataset_tokenizer(data, vocab_size, run_dir / "cache", model_type)
    return None


def weights_tokenizer(
    data: DataSection, weights: Path, model_dir: Path | None, vocab_size: int, model_type: str | None = None
) -> Path:
    """The tokenizer of the model in `weights` (a model directory, a run's final/ or checkpoint, a PEFT directory of
    adapters): the tokenizer.json beside them, else data.tokenizer, else `run_tokenizer`'s for their run (the
    model directory `model_dir`'s for adapters), for a model of `vocab_size` and `model_type`."""
    if (weights / "tokenizer.json").exists():
        return weights / "tokenizer.json"
    if data.tokenizer:
        return Path(data.tokenizer)
    run_dir = (
        weights.parent.parent if (weights / MANIFEST).exists() else weights.parent if weights.name == FINAL else None
    )
    found = run_tokenizer(data, vocab_size, run_dir, model_dir, model_type)
    if found is None:
        raise DataError(f"{weights} holds no tokenizer.json: set data.tokenizer to the model's tokenizer.json")
    return found


def renders_conversations(data: DataSection) -> bool:
    """Whether the records data.dataset names are conversations (or preference pairs) rendered with a chat
    template, rather than plain text."""
    return uses_pairs(data) or resolve_sources(data)[0].formatting != "text"


def _trained_text_tokenizer(data: DataSection, vocab_size: int, cache_dir: Path, model_type: str | None) -> Path:
    """The tokenizer megatrain trains on data.text (the built-in corpus without one) and a data.validation file."""
    texts = [Path(data.text) if data.text is not None else builtin_corpus()]
    texts += [Path(data.validation)] if isinstance(data.validation, str) else []
    return text_tokenizer(texts, vocab_size, cache_dir, model_type)


def _dataset_tokenizer(data: DataSection, vocab_size: int, cache_dir: Path, model_type: str | None) -> Path:
    """A tokenizer trained (once, cached) on the `data.text_field` of a plain-text dataset that brings none."""
    source = resolve_sources(data)[0]
    records = load_records(source)
    if data.text_field not in records.column_names:
        raise DataError(
            f"dataset {source.name!r} has no field {data.text_field!r} (fields: {records.column_names}); "
            + (fix_for_record(records[0], "text") if len(records) else "set data.text_field")
        )
    key = json.dumps([getattr(records, "_fingerprint", "") or source.location, data.text_field])
    texts = (str(r[data.text_field]) for r in records)
    size = records.data.nbytes if hasattr(records, "data") else 0  # (the records' Arrow table: about the text's)
    train = lambda out: train_tokenizer(None, vocab_size, out, texts=texts, model_type=model_type)  # noqa: E731
    return cached_tokenizer(key, vocab_size, cache_dir, train, size, model_type)


def load_token_array(data: DataSection, vocab_size: int, cache_dir: Path, model_dir: Path | None):
    """(1-D training token ids, tokenizer) for pre-training sources; see `load_token_data` for all sources."""
    loaded = load_token_data(data, vocab_size, cache_dir, model_dir)
    return loaded.train.tokens, loaded.tokenizer
