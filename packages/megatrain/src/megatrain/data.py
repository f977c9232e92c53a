"""Token data for training: arrays of token ids cut into fixed windows, batched per optimizer step.

With shuffle off, step k uses windows k*batch_size .. (k+1)*batch_size-1 of the token
array cut into consecutive non-overlapping seq_len windows (wrapping around at the
end); with shuffle on, each pass over the windows uses a fresh permutation seeded by
(seed, pass). Labels are the next token; the last position of a window has none.
"""

import hashlib
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


def train_tokenizer(text_path: Path, vocab_size: int, out_path: Path):
    """Train a byte-level BPE tokenizer on a text file and save it as tokenizer.json."""
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
        return np.load(cached), Path(tokenizer_path)
    # one document; encoded paragraph by paragraph so the tokenizer can use all cores
    paragraphs = [p + "\n\n" for p in text.split("\n\n")]
    ids = [i for encoding in tokenizer.encode_batch(paragraphs) for i in encoding.ids]
    tokens = np.asarray(ids, dtype=np.int32)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cached, tokens)
    return tokens, Path(tokenizer_path)


def load_token_array(
    data: DataSection, vocab_size: int, cache_dir: Path, model_dir: Path | None
) -> tuple[np.ndarray, Path | None]:
    """The training token ids for `data` and the tokenizer file, if any."""
    if data.tokens is not None:
        path = Path(data.tokens)
        try:
            tokens = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"cannot read data.tokens {path}: {error}; it must be a .npy array of token ids"
            ) from error
        check_tokens(tokens, vocab_size, f"data.tokens {path}")
        return tokens, None
    text = Path(data.text) if data.text is not None else builtin_corpus()
    tokenizer = Path(data.tokenizer) if data.tokenizer else None
    if tokenizer is None and model_dir is not None and (model_dir / "tokenizer.json").exists():
        tokenizer = model_dir / "tokenizer.json"
    tokens, tokenizer = tokenize_text(text, tokenizer, vocab_size, cache_dir)
    check_tokens(tokens, vocab_size, f"tokens of {text}")
    return tokens, tokenizer


class TokenWindows:
    """Batches of fixed-length windows over a token array, addressed by optimizer step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, shuffle: bool, seed: int):
        self.tokens, self.seq_len, self.batch_size, self.shuffle, self.seed = tokens, seq_len, batch_size, shuffle, seed
        self.n_windows = len(tokens) // seq_len
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
        rows = [np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len]) for i in self.window_indices(step)]
        input_ids = torch.from_numpy(np.stack(rows).astype(np.int64))
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, :-1] = input_ids[:, 1:]
        return input_ids, labels
