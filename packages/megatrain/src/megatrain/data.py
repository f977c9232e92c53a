"""Token data for training: arrays of token ids cut into fixed windows, batched per optimizer step.

With shuffle off, step k uses windows k*batch_size .. (k+1)*batch_size-1 of the token
array cut into consecutive non-overlapping seq_len windows (wrapping around at the
end); with shuffle on, each pass over the windows uses a fresh permutation seeded by
(seed, pass). Labels are the next token; the last position of a window has none.
Preference pairs (rows 2i and 2i + 1) are drawn the same way, a pair at a time.
"""

import hashlib
import json
import os
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from megatrain_templates import IGNORE_INDEX

from .config import ConfigError, DataSection, DPOSection

EOS_TOKEN = "<|endoftext|>"


def builtin_corpus() -> Path:
    """The small English corpus shipped with megatrain (see data/SOURCE.md)."""
    return Path(str(resources.files("megatrain") / "data" / "python_reference.txt"))


def check_tokens(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"{where}: expected a 1-D integer array of token ids, got {tokens.dtype} {tokens.shape}")
    if tokens.size == 0:
        raise ConfigError(f"{where} is empty; point data.tokens at a non-empty array of token ids")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise ConfigError(
            f"{where}: token ids span [{low}, {high}] but the model's vocab_size is {vocab_size}; "
            "use the tokenizer the model was built for, or a model with a larger vocabulary"
        )


def not_utf8_where(path: Path, chunk_bytes: int = 1 << 24) -> str | None:
    """Where the file's first byte that is not UTF-8 lies, in words ("PATH line 3, byte offset 41 (0xff) is not
    UTF-8"); None where the whole file is UTF-8. Read in chunks: a dataset may be larger than memory."""
    offset, line, carried = 0, 1, b""
    with open(path, "rb") as file:
        while True:
            chunk = carried + file.read(chunk_bytes)
            at_end = len(chunk) == len(carried)
            try:
                chunk.decode("utf-8")
                carried = b""
            except UnicodeDecodeError as error:
                # (a character cut by the chunk's end is whole in the next one)
                if error.reason == "unexpected end of data" and not at_end:
                    chunk, carried = chunk[: error.start], chunk[error.start :]
                else:
                    line += chunk.count(b"\n", 0, error.start)
                    return (
                        f"{path} line {line}, byte offset {offset + error.start} "
                        f"(0x{chunk[error.start]:02x}) is not UTF-8"
                    )
            if at_end:
                return None
            line += chunk.count(b"\n")
            offset += len(chunk)


# Bumped whenever the tokenizer megatrain trains changes for the same text and vocabulary (its cache key)
TOKENIZER_FORMAT = 2  # 2: the text's own bytes where the model's vocabulary cannot hold all 256 beside EOS


def train_tokenizer(text_path: Path | list[Path] | None, vocab_size: int, out_path: Path, texts=None):
    """Train a byte-level BPE tokenizer of at most `vocab_size` tokens on text files (or an iterator of texts);
    save it as `out_path`. Its alphabet is every byte where the vocabulary holds them all beside EOS, else (the
    tiny test models' 256) the bytes the texts use: any other byte cannot be encoded. Refused (`ConfigError`)
    where the texts use more distinct bytes than the vocabulary holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    every_byte = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=every_byte if len(every_byte) + 1 <= vocab_size else [],
        show_progress=False,
    )
    if texts is not None:
        tokenizer.train_from_iterator(texts, trainer)
    else:
        paths = text_path if isinstance(text_path, list) else [text_path]
        tokenizer.train([str(p) for p in paths], trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"the text uses {tokenizer.get_vocab_size() - 1} distinct bytes: a tokenizer of them and EOS needs "
            f"{tokenizer.get_vocab_size()} tokens, more than the model's vocab_size of {vocab_size}; train a model "
            "with a larger vocabulary, or set data.tokenizer to a tokenizer.json that fits it"
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    staged = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    tokenizer.save(str(staged))
    os.replace(staged, out_path)  # (a run reading the cache never sees half a file)
    return tokenizer


def cached_tokenizer(key: str, vocab_size: int, cache_dir: Path, train) -> Path:
    """The tokenizer megatrain trains for data whose content `key` names (with the vocabulary size and
    TOKENIZER_FORMAT), trained by `train(path)` only the first time: a resumed or repeated run reuses it."""
    settings = json.dumps([TOKENIZER_FORMAT, vocab_size, key])
    path = cache_dir / f"tokenizer-{hashlib.sha256(settings.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        train(path)
    return path


def text_tokenizer(text_paths: list[Path], vocab_size: int, cache_dir: Path) -> Path:
    """The BPE tokenizer trained on plain-text files (the training text and a validation file, so that it
    knows every byte of both), cached by their content."""
    digest = hashlib.sha256()
    for path in text_paths:
        digest.update(_read_text(path, "data.text").encode() + b"\0")
    return cached_tokenizer(
        digest.hexdigest(), vocab_size, cache_dir, lambda out: train_tokenizer(list(text_paths), vocab_size, out)
    )


def _read_text(path: Path, what: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {not_utf8_where(path)}; save it as UTF-8") from None
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path}: {error}") from error
    if not text.strip():
        raise ConfigError(f"{what} {path} is empty")
    return text


def load_tokenizer(path: Path, what: str = "data.tokenizer"):
    """A tokenizers.Tokenizer from a tokenizer.json, or a `ConfigError` naming the file and the fix."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; name the tokenizer.json in it ({path / 'tokenizer.json'})")
    if not path.is_file():
        raise ConfigError(
            f"{what} {path} does not exist; point it at a tokenizer.json, or leave data.tokenizer out to use the "
            "model directory's (or, for plain text, one trained on it)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own exception type
        raise ConfigError(f"{what} {path} is not a tokenizer.json that tokenizers reads: {error}") from error


def tokenize_text(
    text_path: Path, tokenizer_path: Path | None, vocab_size: int, cache_dir: Path
) -> tuple[np.ndarray, Path]:
    """Token ids of a text file (cached on disk by content + tokenizer) and the tokenizer used (None: one
    trained on the text, see `text_tokenizer`)."""
    text_path = Path(text_path)
    text = _read_text(text_path, "data.text")
    if tokenizer_path is None:
        tokenizer_path = text_tokenizer([text_path], vocab_size, cache_dir)
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_path} has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer or a model with a larger vocabulary"
        )
    key = hashlib.sha256(text.encode() + Path(tokenizer_path).read_bytes()).hexdigest()[:16]
    cached = cache_dir / f"tokens-v2-{key}.npy"  # v2: the document's start tokens once, not per paragraph
    if cached.exists():
        return np.load(cached, mmap_mode="r"), Path(tokenizer_path)
    from .records import document_start_ids

    # one document (starting as the tokenizer starts a text: Gemma's and Llama's <bos>); encoded paragraph by
    # paragraph so the tokenizer can use all cores
    paragraphs = [p + "\n\n" for p in text.split("\n\n")]
    encoded = tokenizer.encode_batch(paragraphs, add_special_tokens=False)
    ids = document_start_ids(tokenizer) + [i for encoding in encoded for i in encoding.ids]
    tokens = np.asarray(ids, dtype=np.int32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staged = cached.with_name(f".{cached.name}.tmp-{os.getpid()}.npy")
    np.save(staged, tokens)
    os.replace(staged, cached)  # (an evaluation reading the cache beside a run never sees half a file)
    return tokens, Path(tokenizer_path)


@dataclass
class Tokens:
    """Token ids: a 1-D stream cut into consecutive windows, or [rows, seq_len] rows with a loss mask
    (the tokens that are targets) and, when several documents are packed per row, position ids."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    position_ids: np.ndarray | None = None
    valid: np.ndarray | None = None  # rows: False where a row is padding

    def save(self, prefix: str) -> None:
        """prefix.tokens.npy and, when present, prefix.loss_mask.npy, ... (the tokenized-data cache)."""
        for item in fields(self):
            if getattr(self, item.name) is not None:
                np.save(f"{prefix}.{item.name}.npy", getattr(self, item.name))

    @classmethod
    def load(cls, prefix: str) -> "Tokens":
        """What `save` wrote, memory-mapped."""
        paths = {item.name: Path(f"{prefix}.{item.name}.npy") for item in fields(cls)}
        return cls(**{name: np.load(path, mmap_mode="r") for name, path in paths.items() if path.exists()})


@dataclass
class TokenData:
    """Training tokens, held-out validation tokens (or None), the tokenizer, and what reading the data did."""

    train: Tokens
    validation: Tokens | None
    tokenizer: Path | None
    report: list[str] = field(default_factory=list)
    pairs: bool = False  # preference pairs: rows 2i and 2i + 1 are pair i's chosen and rejected (PairWindows)


def eos_token_text(tokenizer, eos_token_id: int | None) -> str:
    """The text of the token that ends a document: the model's EOS where the tokenizer has it, else megatrain's."""
    if eos_token_id is not None and tokenizer.id_to_token(eos_token_id) is not None:
        return tokenizer.id_to_token(eos_token_id)
    return EOS_TOKEN if tokenizer.token_to_id(EOS_TOKEN) is not None else ""


def _split_stream(tokens: np.ndarray, data: DataSection, validation: np.ndarray | None) -> tuple[Tokens, Tokens | None]:
    """A stream and its validation stream: the one given, or the last `data.validation` fraction (whole windows)."""
    if isinstance(data.validation, float):
        n_windows = len(tokens) // data.seq_len
        held = max(1, round(data.validation * n_windows))
        if held >= n_windows:
            raise ConfigError(
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
        raise ConfigError(f"cannot read {what} {path}: {error}; it must be a .npy array of token ids") from error
    check_tokens(tokens, vocab_size, f"{what} {path}")
    return tokens


def _check_npy_header(path: Path, what: str) -> None:
    """Refuse a file that is no .npy array (numpy would speak of `allow_pickle`, which is no fix for it)."""
    try:
        with open(path, "rb") as file:
            header = file.read(6)
    except OSError:
        return  # (np.load says what is wrong with the path)
    if header != b"\x93NUMPY":
        raise ConfigError(
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
    dpo: DPOSection | None = None,
) -> TokenData:
    """The training (and validation) tokens `data` describes, tokenized once and cached under `cache_dir`.
    Preference datasets give pairs (`TokenData.pairs`), truncated as `dpo` says (None: its defaults)."""
    as_file = isinstance(data.validation, str)
    if data.tokens is not None:
        validation = _read_npy(Path(data.validation), vocab_size, "data.validation") if as_file else None
        train, held = _split_stream(_read_npy(Path(data.tokens), vocab_size, "data.tokens"), data, validation)
        return TokenData(train, held, None)
    tokenizer = _named_tokenizer(data, model_dir)
    if data.dataset is None:
        return _text_token_data(data, tokenizer, vocab_size, cache_dir)
    return _dataset_token_data(data, tokenizer, vocab_size, cache_dir, model_dir, eos_token_id, seed, dpo)


def _named_tokenizer(data: DataSection, model_dir: Path | None) -> Path | None:
    """The tokenizer the config names: data.tokenizer, else the model directory's; None where neither does."""
    tokenizer = Path(data.tokenizer) if data.tokenizer else None
    if tokenizer is not None:
        load_tokenizer(tokenizer)  # (a missing or unreadable file named before anything is read)
    if tokenizer is None and model_dir is not None:
        if not (model_dir / "tokenizer.json").exists():  # (a tokenizer trained here would give its ids other meanings)
            raise ConfigError(
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
    dpo: DPOSection | None,
) -> TokenData:
    """The rows of the records data.dataset names: examples, or preference pairs, under the named tokenizer (one
    trained on the records where none is named and they are plain text)."""
    from .preference import preference_rows, uses_pairs
    from .records import records_to_rows

    pairs = uses_pairs(data)
    if tokenizer is None:
        if data.format != "text" or pairs:
            raise ConfigError(
                "fine-tuning data needs the model's tokenizer: set data.tokenizer or use model.hf_dir "
                "with a tokenizer.json"
            )
        tokenizer = _dataset_tokenizer(data, vocab_size, cache_dir)
    loaded = load_tokenizer(tokenizer)
    if loaded.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer} has {loaded.get_vocab_size()} tokens but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer or a model with a larger vocabulary"
        )
    eos = eos_token_text(loaded, eos_token_id)
    if pairs:
        rows = preference_rows(data, dpo or DPOSection(), loaded, tokenizer, eos, cache_dir, seed)
    else:
        rows = records_to_rows(data, loaded, tokenizer, eos, cache_dir, seed, model_dir)
    check_tokens(np.asarray(rows.train.tokens).reshape(-1), vocab_size, f"tokens of {data.dataset}")
    report = list(rows.report)
    if rows.template_source is not None:
        report.insert(0, f"chat template: {rows.template_source}")
    return TokenData(rows.train, rows.validation, tokenizer, report, pairs)


def _text_token_data(data: DataSection, tokenizer: Path | None, vocab_size: int, cache_dir: Path) -> TokenData:
    """A text file's tokens (the built-in corpus without `data.text`), with a tokenizer trained on it where none is
    given, split into training and held-out tokens."""
    as_file = isinstance(data.validation, str)
    text = Path(data.text) if data.text is not None else builtin_corpus()
    tokenizer = tokenizer or _trained_text_tokenizer(data, vocab_size, cache_dir)
    tokens, tokenizer = tokenize_text(text, tokenizer, vocab_size, cache_dir)
    check_tokens(tokens, vocab_size, f"tokens of {text}")
    validation = None
    if as_file:
        validation, _ = tokenize_text(Path(data.validation), tokenizer, vocab_size, cache_dir)
        check_tokens(validation, vocab_size, f"tokens of data.validation {data.validation}")
    train, held = _split_stream(tokens, data, validation)
    return TokenData(train, held, tokenizer)


def run_tokenizer(data: DataSection, vocab_size: int, run_dir: Path, model_dir: Path | None) -> Path | None:
    """The tokenizer file the run in `run_dir` read its text with: data.tokenizer, the model directory's
    tokenizer.json, the one its final/ export holds, or the one megatrain trained on its text (cached in the run,
    trained the same again where the cache is gone); None where its data brought none (token arrays)."""
    configured = data.tokenizer or (model_dir / "tokenizer.json" if model_dir is not None else None)
    if configured is not None and Path(configured).exists():
        return Path(configured)
    exported = run_dir / "final" / "tokenizer.json"
    if exported.exists():
        return exported
    if data.tokens is None and data.dataset is None:
        return _trained_text_tokenizer(data, vocab_size, run_dir / "cache")
    if data.dataset is not None and data.format == "text":
        return _dataset_tokenizer(data, vocab_size, run_dir / "cache")
    return None


def _trained_text_tokenizer(data: DataSection, vocab_size: int, cache_dir: Path) -> Path:
    """The tokenizer megatrain trains on data.text (the built-in corpus without one) and a data.validation file."""
    texts = [Path(data.text) if data.text is not None else builtin_corpus()]
    texts += [Path(data.validation)] if isinstance(data.validation, str) else []
    return text_tokenizer(texts, vocab_size, cache_dir)


def _dataset_tokenizer(data: DataSection, vocab_size: int, cache_dir: Path) -> Path:
    """A tokenizer trained (once, cached) on the `data.text_field` of a plain-text dataset that brings none."""
    from .records import load_records, resolve_sources

    source = resolve_sources(data)[0]
    records = load_records(source)
    if data.text_field not in records.column_names:
        raise ConfigError(
            f"dataset {source.name!r} has no field {data.text_field!r} (fields: {records.column_names}); "
            "set data.text_field"
        )
    key = json.dumps([getattr(records, "_fingerprint", "") or source.location, data.text_field])
    texts = (str(r[data.text_field]) for r in records)
    return cached_tokenizer(key, vocab_size, cache_dir, lambda out: train_tokenizer(None, vocab_size, out, texts=texts))


def load_token_array(data: DataSection, vocab_size: int, cache_dir: Path, model_dir: Path | None):
    """(1-D training token ids, tokenizer) for pre-training sources; see `load_token_data` for all sources."""
    loaded = load_token_data(data, vocab_size, cache_dir, model_dir)
    return loaded.train.tokens, loaded.tokenizer


@dataclass
class Batch:
    """Rows of one step: input_ids and next-token labels (-100: no loss), [rows, seq_len] int64 each,
    position ids (restarting at each packed document) or None, real tokens (bool; False: padding) or None, and
    for packed preference pairs the sequence each trained token belongs to (`sequences`; None: a row each)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    sequences: torch.Tensor | None = None


def sequence_of_tokens(labels: torch.Tensor, sequences: torch.Tensor | None = None) -> torch.Tensor:
    """Which of a batch's sequences each trained token belongs to ([rows, seq] int64, -1 where the label is
    -100): `sequences` where given (packed pairs), else the token's row."""
    if sequences is not None:
        return sequences
    rows = torch.arange(labels.shape[0]).unsqueeze(1)
    return torch.where(labels != IGNORE_INDEX, rows, -1)


def sequence_lengths(labels: torch.Tensor, sequences: torch.Tensor | None = None) -> torch.Tensor:
    """Each sequence's number of trained tokens ([sequences] float64)."""
    owner = sequence_of_tokens(labels, sequences)
    count = labels.shape[0] if sequences is None else int(sequences.max()) + 1
    return torch.bincount(owner[owner >= 0], minlength=count).to(torch.float64)


class TokenWindows:
    """Batches of fixed-length windows over tokens, addressed by optimizer step."""

    def __init__(self, tokens: Tokens | np.ndarray, seq_len: int, batch_size: int, shuffle: bool, seed: int):
        tokens = Tokens(tokens) if isinstance(tokens, np.ndarray) else tokens
        self.data, self.seq_len, self.batch_size, self.shuffle, self.seed = tokens, seq_len, batch_size, shuffle, seed
        array = tokens.tokens
        self.n_windows = len(array) if array.ndim == 2 else len(array) // seq_len
        if self.n_windows < batch_size:
            raise ConfigError(
                f"the data has {array.size} tokens = {self.n_windows} windows of seq_len {seq_len}, fewer than "
                f"one batch of {batch_size}; use more data, a smaller data.seq_len or a smaller train.batch_size"
            )
        self._order_cache: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_windows)
        if self._order_cache is None or self._order_cache[0] != epoch:
            self._order_cache = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_windows))
        return self._order_cache[1]

    def window_indices(self, step: int) -> list[int]:
        out = []
        for flat in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, within = divmod(flat, self.n_windows)
            out.append(int(self._order(epoch)[within]))
        return out

    def batch(self, step: int) -> Batch:
        """The rows of optimizer step `step`."""
        return self.rows(self.window_indices(step))

    def in_order(self, rows_per_batch: int):
        """Every window once, in order, `rows_per_batch` at a time (the last batch may be short): for evaluation."""
        for start in range(0, self.n_windows, rows_per_batch):
            yield self.rows(list(range(start, min(start + rows_per_batch, self.n_windows))))

    def rows(self, indices: list[int]) -> Batch:
        data = self.data
        if data.tokens.ndim == 2:
            rows = [np.asarray(data.tokens[i]) for i in indices]
        else:
            rows = [np.asarray(data.tokens[i * self.seq_len : (i + 1) * self.seq_len]) for i in indices]
        input_ids = torch.from_numpy(np.stack(rows).astype(np.int64))
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, :-1] = input_ids[:, 1:]
        if data.loss_mask is not None:
            mask = torch.from_numpy(np.stack([np.asarray(data.loss_mask[i]) for i in indices]))
            labels[:, :-1][~mask[:, 1:]] = IGNORE_INDEX  # a position learns its next token only if that token counts
        positions = None
        if data.position_ids is not None:
            positions = torch.from_numpy(np.stack([np.asarray(data.position_ids[i]) for i in indices]).astype(np.int64))
            labels[:, :-1][positions[:, 1:] == 0] = IGNORE_INDEX  # the next token starts another document
        valid = None
        if data.valid is not None:
            valid = torch.from_numpy(np.stack([np.asarray(data.valid[i]) for i in indices]))
        return Batch(input_ids, labels, positions, valid)


class PairWindows(TokenWindows):
    """Batches of whole preference pairs, addressed by optimizer step: `batch(step)` holds `batch_size` pairs as
    2 * batch_size rows, the j-th pair drawn at rows 2j (chosen) and 2j + 1 (rejected). Pairs are what is
    ordered: step k takes pairs k*batch_size .. (k+1)*batch_size-1 of the order (wrapping around), the order
    being 0, 1, ... or, shuffled, a fresh permutation of the pairs each pass, seeded by (seed, pass).

    With `pack`, a batch's pairs share rows instead (`pack_pairs`), `shares` parts of them packed apart, so that
    each of that many ranks takes whole rows of its own pairs."""

    def __init__(self, tokens: Tokens, batch_size: int, shuffle: bool, seed: int, pack: bool = False, shares: int = 1):
        self.pack, self.shares = pack, shares
        rows = tokens.tokens
        if rows.ndim != 2 or len(rows) % 2:
            raise ConfigError(
                f"preference pairs are an even number of rows (chosen, rejected), got tokens of shape {rows.shape}"
            )
        self.data, self.seq_len, self.batch_size, self.shuffle, self.seed = (
            tokens,
            rows.shape[1],
            batch_size,
            shuffle,
            seed,
        )
        self.n_windows = len(rows) // 2  # (the unit TokenWindows orders: here a pair)
        if self.n_windows < batch_size:
            raise ConfigError(
                f"the data has {self.n_windows} preference pairs, fewer than one batch of train.batch_size "
                f"{batch_size} pairs; use more data or a smaller train.batch_size"
            )
        self._order_cache = None

    @property
    def n_pairs(self) -> int:
        return self.n_windows

    def pair_indices(self, step: int) -> list[int]:
        """The pairs of optimizer step `step`, in batch order."""
        return self.window_indices(step)

    def batch(self, step: int) -> Batch:
        """The 2 * batch_size rows of optimizer step `step`: chosen, rejected of each of its pairs."""
        return self.pair_rows(self.pair_indices(step))

    def in_order(self, pairs_per_batch: int):
        """Every pair once, in order, `pairs_per_batch` at a time (the last batch may be short): for evaluation."""
        for start in range(0, self.n_pairs, pairs_per_batch):
            yield self.pair_rows(list(range(start, min(start + pairs_per_batch, self.n_pairs))))

    def pair_rows(self, pairs: list[int]) -> Batch:
        """Pair pairs[j]'s chosen and rejected sequences: rows 2j and 2j + 1 of the batch, or with `pack` its
        sequences 2j and 2j + 1, packed."""
        rows = self.rows([row for pair in pairs for row in (2 * pair, 2 * pair + 1)])
        if not self.pack:
            return rows
        bounds = [len(pairs) * share // self.shares for share in range(self.shares + 1)]
        parts = [pack_pairs(_row_slice(rows, 2 * lo, 2 * hi), 2 * lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        joined = {f.name: [getattr(part, f.name) for part in parts] for f in fields(Batch)}
        return Batch(**{name: torch.cat(tensors) for name, tensors in joined.items()})


def _row_slice(batch: Batch, start: int, stop: int) -> Batch:
    return Batch(*(None if t is None else t[start:stop] for t in (batch.input_ids, batch.labels, None, batch.valid)))


def pack_pairs(batch: Batch, first_sequence: int = 0) -> Batch:
    """Preference pairs (rows 2j, 2j + 1, right-padded) packed several to a row: each pair's chosen then rejected
    sequence side by side (position ids restarting at each, so each attends only to itself) in the first row with
    room for both, in the batch's order; a pair too long for one row takes two of its own. `sequences` numbers
    the pairs' sequences from `first_sequence` on, as the unpacked rows were."""
    seq_len = batch.input_ids.shape[1]
    lengths = (batch.valid.sum(1) if batch.valid is not None else torch.full((len(batch.labels),), seq_len)).tolist()
    placed: list[list[int]] = []  # per packed row, the batch rows (sequences) it holds, in order
    room: list[int] = []
    for pair in range(len(lengths) // 2):
        chosen, rejected = 2 * pair, 2 * pair + 1
        need = lengths[chosen] + lengths[rejected]
        if need > seq_len:
            placed += [[chosen], [rejected]]
            room += [seq_len - lengths[chosen], seq_len - lengths[rejected]]
            continue
        target = next((i for i, free in enumerate(room) if free >= need), None)
        if target is None:
            placed.append([])
            room.append(seq_len)
            target = len(placed) - 1
        placed[target] += [chosen, rejected]
        room[target] -= need
    shape = (len(placed), seq_len)
    ids, labels = torch.zeros(shape, dtype=torch.long), torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    positions, valid = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.bool)
    sequences = torch.full(shape, -1, dtype=torch.long)
    for row, members in enumerate(placed):
        cursor = 0
        for member in members:
            span = slice(cursor, cursor + lengths[member])
            ids[row, span] = batch.input_ids[member, : lengths[member]]
            labels[row, span] = batch.labels[member, : lengths[member]]
            positions[row, span] = torch.arange(lengths[member])
            valid[row, span] = True
            sequences[row, span] = torch.where(labels[row, span] != IGNORE_INDEX, first_sequence + member, -1)
            cursor += lengths[member]
        positions[row, cursor:] = torch.arange(seq_len - cursor)  # (the padding is a document of its own)
    return Batch(ids, labels, positions, valid, sequences)
