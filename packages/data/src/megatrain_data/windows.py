"""Batches of training rows addressed by optimizer step: token windows, preference pairs, and pairs packed per row.

With shuffle off, step k uses windows k*batch_size .. (k+1)*batch_size-1 of the token
array cut into consecutive non-overlapping seq_len windows (wrapping around at the
end); with shuffle on, each pass over the windows uses a fresh permutation seeded by
(seed, pass). Labels are the next token; the last position of a window has none.
Preference pairs (rows 2i and 2i + 1) are drawn the same way, a pair at a time.
"""

from dataclasses import dataclass, fields

import numpy as np
import torch

from .errors import DataError
from .tokens import Tokens

IGNORE_INDEX = -100  # a label that trains nothing: torch's cross_entropy ignore_index, as the engine's loss reads it


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
        if seq_len < 2 or batch_size < 1:
            raise DataError(
                f"seq_len must be >= 2 (one input and one target) and batch_size must be >= 1, got {seq_len} and "
                f"{batch_size}"
            )
        if not np.issubdtype(array.dtype, np.integer):
            raise DataError(f"token ids must be integers, got {array.dtype}; give the ids as an integer array")
        if array.ndim == 2 and array.shape[1] != seq_len:
            raise DataError(
                f"the data's rows are {array.shape[1]} tokens long, not seq_len {seq_len}: rows are cut as the data "
                "is loaded (DataSection.seq_len); give the windows that seq_len"
            )
        self.n_windows = len(array) if array.ndim == 2 else len(array) // seq_len
        if self.n_windows < batch_size:
            raise DataError(
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
        """The `batch_size` windows of optimizer step `step`, in batch order: steps run through the windows
        epoch after epoch, each epoch in its own order (seeded by (seed, epoch) where `shuffle`)."""
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
        """Windows `indices` as a `Batch` [len(indices), seq_len]: labels are the next tokens, -100 at the last
        position, where the loss mask leaves the next token out, and where the next token starts another document."""
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
            raise DataError(
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
            raise DataError(
                f"the data has {self.n_windows} preference pairs, fewer than one batch of train.batch_size "
                f"{batch_size} pairs; use more data or a smaller train.batch_size"
            )
        self._order_cache = None

    @property
    def n_pairs(self) -> int:
        """How many preference pairs the data holds (each one's chosen and rejected: two rows)."""
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
