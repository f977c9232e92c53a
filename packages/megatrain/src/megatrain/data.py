"""Token data for training: arrays of token ids cut into fixed windows, batched per optimizer step.

With shuffle off, step k uses windows k*batch_size .. (k+1)*batch_size-1 of the token
array cut into consecutive non-overlapping seq_len windows (wrapping around at the
end); with shuffle on, each pass over the windows uses a fresh permutation seeded by
(seed, pass). Labels are the next token; the last position of a window has none.
"""

import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from megatrain_templates import IGNORE_INDEX

from .config import ConfigError, DataSection

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


def train_tokenizer(text_path: Path | None, vocab_size: int, out_path: Path, texts=None):
    """Train a byte-level BPE tokenizer on a text file (or an iterator of texts); save it as tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    if texts is not None:
        tokenizer.train_from_iterator(texts, trainer)
    else:
        tokenizer.train([str(text_path)], trainer)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_path))
    return tokenizer


def tokenize_text(
    text_path: Path, tokenizer_path: Path | None, vocab_size: int, cache_dir: Path
) -> tuple[np.ndarray, Path]:
    """Token ids of a text file (cached on disk by content + tokenizer) and the tokenizer used."""
    from tokenizers import Tokenizer

    text_path = Path(text_path)
    try:
        text = text_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read data.text {text_path}: {error}") from error
    if not text.strip():
        raise ConfigError(f"data.text {text_path} is empty")
    if tokenizer_path is None:
        tokenizer_path = cache_dir / "tokenizer.json"
        tokenizer = train_tokenizer(text_path, vocab_size, tokenizer_path)
    else:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer_path} has {tokenizer.get_vocab_size()} tokens but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer or a model with a larger vocabulary"
        )
    key = hashlib.sha256(text.encode() + Path(tokenizer_path).read_bytes()).hexdigest()[:16]
    cached = cache_dir / f"tokens-{key}.npy"
    if cached.exists():
        return np.load(cached, mmap_mode="r"), Path(tokenizer_path)
    # one document; encoded paragraph by paragraph so the tokenizer can use all cores
    paragraphs = [p + "\n\n" for p in text.split("\n\n")]
    ids = [i for encoding in tokenizer.encode_batch(paragraphs) for i in encoding.ids]
    tokens = np.asarray(ids, dtype=np.int32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cached, tokens)
    return tokens, Path(tokenizer_path)


@dataclass
class TokenData:
    """Training tokens: a 1-D stream cut into windows, or [examples, seq_len] rows with a loss mask."""

    tokens: np.ndarray
    loss_mask: np.ndarray | None
    tokenizer: Path | None


def _eos_token(tokenizer, eos_token_id: int | None) -> str:
    if eos_token_id is not None and tokenizer.id_to_token(eos_token_id) is not None:
        return tokenizer.id_to_token(eos_token_id)
    return EOS_TOKEN if tokenizer.token_to_id(EOS_TOKEN) is not None else ""


def load_token_data(
    data: DataSection, vocab_size: int, cache_dir: Path, model_dir: Path | None, eos_token_id: int | None = None
) -> TokenData:
    """The training tokens `data` describes, tokenized once and cached under `cache_dir`."""
    if data.tokens is not None:
        path = Path(data.tokens)
        try:
            tokens = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"cannot read data.tokens {path}: {error}; it must be a .npy array of token ids"
            ) from error
        check_tokens(tokens, vocab_size, f"data.tokens {path}")
        return TokenData(tokens, None, None)
    tokenizer = Path(data.tokenizer) if data.tokenizer else None
    if tokenizer is None and model_dir is not None and (model_dir / "tokenizer.json").exists():
        tokenizer = model_dir / "tokenizer.json"
    if data.dataset is None:
        text = Path(data.text) if data.text is not None else builtin_corpus()
        tokens, tokenizer = tokenize_text(text, tokenizer, vocab_size, cache_dir)
        check_tokens(tokens, vocab_size, f"tokens of {text}")
        return TokenData(tokens, None, tokenizer)

    from tokenizers import Tokenizer

    from .records import load_records, records_to_arrays

    if tokenizer is None:
        if data.format != "text":
            raise ConfigError(
                "fine-tuning data needs the model's tokenizer: set data.tokenizer or use model.hf_dir "
                "with a tokenizer.json"
            )
        records = load_records(data.dataset)
        tokenizer = cache_dir / "tokenizer.json"
        train_tokenizer(None, vocab_size, tokenizer, texts=(str(r[data.text_field]) for r in records))
    loaded = Tokenizer.from_file(str(tokenizer))
    if loaded.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"tokenizer {tokenizer} has {loaded.get_vocab_size()} tokens but the model's vocab_size is "
            f"{vocab_size}; use the model's own tokenizer or a model with a larger vocabulary"
        )
    tokens, mask = records_to_arrays(data, loaded, tokenizer, _eos_token(loaded, eos_token_id), cache_dir)
    check_tokens(np.asarray(tokens).reshape(-1), vocab_size, f"tokens of {data.dataset}")
    return TokenData(tokens, mask, tokenizer)


def load_token_array(data: DataSection, vocab_size: int, cache_dir: Path, model_dir: Path | None):
    """(1-D token ids, tokenizer) for pre-training sources; see `load_token_data` for all sources."""
    loaded = load_token_data(data, vocab_size, cache_dir, model_dir)
    return loaded.tokens, loaded.tokenizer


class TokenWindows:
    """Batches of fixed-length windows over a token array, addressed by optimizer step.

    `tokens` is a 1-D stream (cut into consecutive windows) or [examples, seq_len] rows;
    `loss_mask` (same shape, optional) marks the tokens that count as targets."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        batch_size: int,
        shuffle: bool,
        seed: int,
        loss_mask: np.ndarray | None = None,
    ):
        self.tokens, self.seq_len, self.batch_size, self.shuffle, self.seed = tokens, seq_len, batch_size, shuffle, seed
        self.loss_mask = loss_mask
        self.n_windows = len(tokens) if tokens.ndim == 2 else len(tokens) // seq_len
        if self.n_windows < batch_size:
            raise ConfigError(
                f"the data has {len(tokens)} tokens = {self.n_windows} windows of seq_len {seq_len}, fewer than "
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

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each [batch_size, seq_len] int64, for optimizer step `step`."""
        indices = self.window_indices(step)
        if self.tokens.ndim == 2:
            rows = [np.asarray(self.tokens[i]) for i in indices]
        else:
            rows = [np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len]) for i in indices]
        input_ids = torch.from_numpy(np.stack(rows).astype(np.int64))
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, :-1] = input_ids[:, 1:]
        if self.loss_mask is not None:
            mask = torch.from_numpy(np.stack([np.asarray(self.loss_mask[i]) for i in indices]))
            labels[:, :-1][~mask[:, 1:]] = IGNORE_INDEX  # a position learns its next token only if that token counts
        return input_ids, labels
