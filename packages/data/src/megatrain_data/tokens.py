"""Token ids for training: text files and tokenizers (trained, cached, read), and the arrays they give.

The base of the data package beside records.py: everything else turns data into `Tokens`, and load.py picks which
path a run's data takes.
"""

import hashlib
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

import numpy as np

from megatrain_store import atomic_write, atomic_write_text
from megatrain_store.progress import progress

from .chat import special_token_ids
from .errors import DataError, missing_path
from .files import read_text_file

EOS_TOKEN = "<|endoftext|>"


def builtin_corpus() -> Path:
    """The small English corpus shipped with megatrain (see corpus/SOURCE.md)."""
    return Path(str(resources.files("megatrain_data") / "corpus" / "python_reference.txt"))


def check_tokens(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Refuse (`DataError`, its message starting with `where`) token ids that are not a non-empty 1-D integer array
    with every id in [0, vocab_size)."""
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{where}: expected a 1-D integer array of token ids, got {tokens.dtype} {tokens.shape}")
    if tokens.size == 0:
        raise DataError(f"{where} is empty; point data.tokens at a non-empty array of token ids")
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise DataError(
            f"{where}: token ids span [{low}, {high}] but the model's vocab_size is {vocab_size}; "
            "use the tokenizer the model was built for, or a model with a larger vocabulary"
        )


# Bumped whenever the tokenizer megatrain trains changes for the same text and vocabulary (its cache key)
TOKENIZER_FORMAT = 2  # 2: the text's own bytes where the model's vocabulary cannot hold all 256 beside EOS

# How transformers 5 splits text for a model of these config.json model_types, whatever tokenizer_config.json names:
# it builds Qwen2Tokenizer or Qwen3_5Tokenizer (its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), which keep only the
# vocabulary and merges of tokenizer.json and split by their own PRETOKENIZE_REGEX (digits one by one), after NFC,
# before a byte-level step without GPT-2's regex. A tokenizer megatrain trains for such a model splits as they do, so
# that transformers encodes its export as training did; for any other model it splits as GPT-2 does.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
QWEN3_5_SPLIT = (  # (Qwen2's, with combining marks kept in words)
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
TRANSFORMERS_SPLITS = {
    "qwen2": QWEN2_SPLIT,
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp"), QWEN3_5_SPLIT),
}


def train_tokenizer(
    text_path: Path | list[Path] | None, vocab_size: int, out_path: Path, texts=None, model_type: str | None = None
):
    """Train a byte-level BPE tokenizer of at most `vocab_size` tokens on text files (or an iterator of texts);
    save it as `out_path`. Its alphabet is every byte where the vocabulary holds them all beside EOS, else (the
    tiny test models' 256) the bytes the texts use: any other byte cannot be encoded. Text is split as transformers
    splits it for a model of `model_type` (config.json's) in TRANSFORMERS_SPLITS, else as GPT-2 splits it. Refused
    (`DataError`) where the texts use more distinct bytes than the vocabulary holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    _split_as_served(tokenizer, model_type)
    tokenizer.decoder = decoders.ByteLevel()
    every_byte = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=every_byte if len(every_byte) + 1 <= vocab_size else [],
        show_progress=sys.stderr.isatty(),  # (tokenizers' own bars, on a terminal only: no log lines of them)
    )
    if texts is not None:
        tokenizer.train_from_iterator(texts, trainer)
    else:
        paths = text_path if isinstance(text_path, list) else [text_path]
        tokenizer.train([str(p) for p in paths], trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise DataError(
            f"the text uses {tokenizer.get_vocab_size() - 1} distinct bytes: a tokenizer of them and EOS needs "
            f"{tokenizer.get_vocab_size()} tokens, more than the model's vocab_size of {vocab_size}; train a model "
            "with a larger vocabulary, or set data.tokenizer to a tokenizer.json that fits it"
        )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out_path, tokenizer.to_str(pretty=True))  # (a run reading the cache never sees half a file)
    return tokenizer


def _split_as_served(tokenizer, model_type: str | None) -> None:
    """Give `tokenizer` the normalizer and pre-tokenizer transformers builds for `model_type` (TRANSFORMERS_SPLITS:
    Qwen2Tokenizer's and Qwen3_5Tokenizer's), else GPT-2's byte-level pre-tokenizer."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    split = TRANSFORMERS_SPLITS.get(model_type)
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        return
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# data from which training a tokenizer takes long enough to say so first (about a second a MiB on two cores;
# minutes on a large corpus, whose progress a log shows nothing of)
ANNOUNCED_TOKENIZER_BYTES = 4 * 2**20


def cached_tokenizer(
    key: str, vocab_size: int, cache_dir: Path, train, data_bytes: int = 0, model_type: str | None = None
) -> Path:
    """The tokenizer megatrain trains for data whose content `key` names (with the vocabulary size,
    TOKENIZER_FORMAT and the split of `model_type` in TRANSFORMERS_SPLITS), trained by `train(path)` only the first
    time: a resumed or repeated run reuses it. Training on `data_bytes` past ANNOUNCED_TOKENIZER_BYTES is said
    first."""
    settings = [TOKENIZER_FORMAT, vocab_size, key]
    split = TRANSFORMERS_SPLITS.get(model_type)
    path = _cache_path(cache_dir, settings + ([split] if split else []))
    started_with = _cache_path(cache_dir, settings)
    # a run started before megatrain split as transformers does for its model holds GPT-2's splits under the key
    # without one: it goes on with them (the ids its model learned), never with a tokenizer trained anew
    if not path.exists() and started_with.exists():
        return started_with
    if not path.exists():
        if data_bytes > ANNOUNCED_TOKENIZER_BYTES:
            print(
                f"megatrain: training a {vocab_size}-token BPE tokenizer on {data_bytes / 2**20:,.0f} MiB of data, "
                f"once (kept as {path})",
                file=sys.stderr,
            )
        train(path)
    return path


def _cache_path(cache_dir: Path, settings: list) -> Path:
    return cache_dir / f"tokenizer-{hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]}.json"


def text_tokenizer(text_paths: list[Path], vocab_size: int, cache_dir: Path, model_type: str | None = None) -> Path:
    """The BPE tokenizer trained on plain-text files (the training text and a validation file, so that it
    knows every byte of both) for a model of `model_type` (`train_tokenizer`), cached by their content."""
    digest = hashlib.sha256()
    for path, what in zip(text_paths, ["data.text", "data.validation"]):
        digest.update(read_text_file(path, what).encode() + b"\0")
    size = sum(Path(path).stat().st_size for path in text_paths)
    train = lambda out: train_tokenizer(list(text_paths), vocab_size, out, model_type=model_type)  # noqa: E731
    return cached_tokenizer(digest.hexdigest(), vocab_size, cache_dir, train, size, model_type)


def load_tokenizer(path: Path, what: str = "data.tokenizer"):
    """A tokenizers.Tokenizer from a tokenizer.json, or a `DataError` naming the file and the fix."""
    from tokenizers import Tokenizer

    path = Path(path)
    if path.is_dir():
        raise DataError(f"{what} {path} is a directory; name the tokenizer.json in it ({path / 'tokenizer.json'})")
    if not path.is_file():
        raise DataError(
            f"{what} {missing_path(path)} does not exist; point it at a tokenizer.json, or leave data.tokenizer out to use the "
            "model directory's (or, for plain text, one trained on it)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises its own exception type
        raise DataError(f"{what} {path} is not a tokenizer.json that tokenizers reads: {error}") from error


def tokenize_text(
    text_path: Path, tokenizer_path: Path | None, vocab_size: int, cache_dir: Path, what: str = "data.text"
) -> tuple[np.ndarray, Path]:
    """Token ids of a text file (cached on disk by content + tokenizer) and the tokenizer used (None: one
    trained on the text, see `text_tokenizer`); `what`: the key that names the file."""
    text_path = Path(text_path)
    text = read_text_file(text_path, what)
    if tokenizer_path is None:
        tokenizer_path = text_tokenizer([text_path], vocab_size, cache_dir)
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.get_vocab_size() > vocab_size:
        raise DataError(
            f"tokenizer {tokenizer_path} has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer or a model with a larger vocabulary"
        )
    key = hashlib.sha256(text.encode() + Path(tokenizer_path).read_bytes()).hexdigest()[:16]
    cached = cache_dir / f"tokens-v4-{key}.npy"  # v4: the ids of the whole text (v3 ended each paragraph in "\n\n")
    if cached.exists():
        return np.load(cached, mmap_mode="r"), Path(tokenizer_path)
    tokens = _encoded_text(text, tokenizer, text_path.name)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # (an evaluation reading the cache beside a run never sees half a file; a failed write leaves none on the disk)
    atomic_write(cached, lambda handle: np.save(handle, tokens))
    return tokens, Path(tokenizer_path)


# Text encoded at a time: its encodings (offsets, masks: ~100 bytes a token) are freed as each batch's ids become
# int32, so a text's tokenizing holds its ids at 4 bytes a token (a list of all its encodings took ~200)
BATCH_CHARS = 1 << 21
# A text is encoded in pieces of about this many characters, so that a large file is not one encode call on one core
# holding every token's encoding. A piece ends at a newline between two non-space characters, where byte-level
# pre-tokenizers (GPT-2's, Llama 3's, Qwen's) split anyway; a cut is kept only where the characters around it encode
# to the same ids whole as apart (`_same_ids_apart`), so the ids are `tokenizer(whole text)`'s. A SentencePiece
# tokenizer, which starts each text it encodes with a space, keeps no cut: its text is one piece, up to
# MAX_PIECE_CHARS (~3 GB of encodings), where a cut is made anyway (its first token may then differ).
PIECE_CHARS = 1 << 16
MAX_PIECE_CHARS = 1 << 26
_PIECE_END = re.compile(r"(?<=\S)\n(?=\S)")
_CUT_CHECK_CHARS = 256  # on each side of a cut


def _pieces(text: str, tokenizer) -> Iterator[str]:
    """The text in pieces of about PIECE_CHARS characters or more, cut at `_PIECE_END` where `_same_ids_apart` or
    the piece reached MAX_PIECE_CHARS (a line longer than PIECE_CHARS, or a text with no such cut, stays whole)."""
    start = at = 0
    while len(text) - at > PIECE_CHARS and (cut := _PIECE_END.search(text, at + PIECE_CHARS)):
        at = cut.end()
        if at - start >= MAX_PIECE_CHARS or _same_ids_apart(tokenizer, text, at):
            yield text[start:at]
            start = at
    yield text[start:]


def _same_ids_apart(tokenizer, text: str, at: int) -> bool:
    """Whether the _CUT_CHECK_CHARS characters on each side of `at` encode to the same ids whole as the two sides
    encoded apart."""
    left, right = text[max(0, at - _CUT_CHECK_CHARS) : at], text[at : at + _CUT_CHECK_CHARS]
    ids = [tokenizer.encode(part, add_special_tokens=False).ids for part in (left + right, left, right)]
    return ids[0] == ids[1] + ids[2]


def _batches(pieces: Iterator[str]) -> Iterator[list[str]]:
    """`pieces` in lists of about BATCH_CHARS characters."""
    batch, size = [], 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded_text(text: str, tokenizer, name: str) -> np.ndarray:
    """A text's token ids as one document, as `tokenizer(text)` gives them (starting as the tokenizer starts a text:
    Gemma's and Llama's <bos>), encoded in pieces (`_pieces`) so that the tokenizer uses every core, a batch of
    them at a time, with progress by characters."""
    parts = [np.asarray(document_start_ids(tokenizer), dtype=np.int32)]
    bar = progress(total=len(text), desc=f"tokenize {name}", unit="char", leave=False)
    for batch in _batches(_pieces(text, tokenizer)):
        encoded = tokenizer.encode_batch(batch, add_special_tokens=False)
        parts.extend(np.asarray(encoding.ids, dtype=np.int32) for encoding in encoded)
        bar.update(sum(map(len, batch)))
    bar.close()
    return np.concatenate(parts)


@dataclass
class Tokens:
    """Token ids: a 1-D stream cut into consecutive windows, or [rows, seq_len] rows with a loss mask
    (the tokens that are targets) and, when several documents are packed per row, position ids."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None = None
    position_ids: np.ndarray | None = None
    valid: np.ndarray | None = None  # rows: False where a row is padding

    def save(self, prefix: str) -> None:
        """prefix.tokens.npy and, when present, prefix.loss_mask.npy, ... (the tokenized-data cache), each written
        whole or not at all (`atomic_write`: a full disk leaves no partial array behind)."""
        for item in fields(self):
            if (array := getattr(self, item.name)) is not None:
                atomic_write(Path(f"{prefix}.{item.name}.npy"), lambda handle, array=array: np.save(handle, array))

    @classmethod
    def load(cls, prefix: str) -> "Tokens":
        """What `save` wrote, memory-mapped."""
        paths = {item.name: Path(f"{prefix}.{item.name}.npy") for item in fields(cls)}
        return cls(**{name: np.load(path, mmap_mode="r") for name, path in paths.items() if path.exists()})


# end-of-text tokens a tokenizer.json brought without its tokenizer_config.json may hold, for a model that names none
# (a preset): megatrain's and GPT-2's / Qwen's, Llama 2's and Mistral's, Llama 3's, Gemma's. Without one, documents
# were joined with nothing between them.
EOS_TEXTS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")


def eos_token_text(tokenizer, eos_token_id: int | None, tokenizer_dir: Path | None) -> str:
    """The text of the token that ends a document, a completion and a template's `eos_token`: the tokenizer's own EOS
    (its tokenizer_config.json's `eos_token` in `tokenizer_dir`: transformers' `tokenizer.eos_token`, which TRL
    appends and chat templates render), else the model's where the tokenizer has it, else megatrain's. The first two
    differ for Llama 3.1-3.3 Instruct: <|eot_id|>, where the model's first EOS is <|end_of_text|>."""
    settings = tokenizer_settings(tokenizer_dir) if tokenizer_dir is not None else {}
    named = special_token_text(settings.get("eos_token"))
    if named and tokenizer.token_to_id(named) is not None:
        return named
    if special_ids_of(tokenizer, eos_token_id):
        return tokenizer.id_to_token(eos_token_id)
    return next((text for text in EOS_TEXTS if tokenizer.token_to_id(text) is not None), "")


def special_ids_of(tokenizer, ids: int | list[int] | None) -> list[int]:
    """Of a model's special token ids (config.json's bos, eos or pad: one, a list or None), those the tokenizer holds
    as special tokens. A preset's ids name ordinary tokens of a tokenizer megatrain trained: its EOS 2 is `"`."""
    special = special_token_ids(tokenizer)
    return [i for i in id_list(ids) if i in special]


def id_list(ids: int | list[int] | None) -> list[int]:
    """Token ids as config.json and generation_config.json write them (one, a list or None), as a list."""
    return ids if isinstance(ids, list) else [] if ids is None else [ids]


def tokenizer_settings(tokenizer_dir: Path) -> dict:
    """A tokenizer's tokenizer_config.json in its directory; {} where there is none (or it does not read)."""
    try:
        values = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def special_token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def document_start_ids(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text, as transformers' `tokenizer(text)` adds them
    (`<bos>`: Gemma, Llama, Mistral; none: Qwen): each document of pre-training text starts with them."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def pad_token_id(tokenizer, eos: str) -> int:
    """The id of the first of "<|endoftext|>", "<pad>", "[PAD]" and `eos` (the tokenizer's EOS text) that the
    tokenizer (a `tokenizers.Tokenizer`) has, else 0: the id that pads short rows and prompts."""
    for text in ("<|endoftext|>", "<pad>", "[PAD]", eos):
        if text and tokenizer.token_to_id(text) is not None:
            return tokenizer.token_to_id(text)
    return 0
