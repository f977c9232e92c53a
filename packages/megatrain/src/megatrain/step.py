"""A step's input as the Trainer takes it (`StepBatch`: tokens, labels, documents, images and the objective's
extras in one value), and how the ranks share its rows and cut their share into the pipeline's micro-batches
(`RowShares`)."""

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from megatrain_data import Batch, sequence_lengths, sequence_of_tokens
from megatrain_optim import Ranks
from megatrain_sched import MicroBatch
from megatrain_templates import Documents, DropoutKey, Lora, Media, Rollout, Sequences
from megatrain_zoo import ModelConfig

from .config import ConfigError


@dataclass(frozen=True)
class StepBatch:
    """The rows of one step (or of one forward pass): [rows, seq] each.

    With the DPO objective rows 2i and 2i + 1 are pair i's chosen and rejected sequences, and `extras` the reference
    model's summed log-probabilities of every sequence (`Trainer.sequence_logps`; None where the loss needs none);
    packed pairs share rows, `sequences` numbering each trained token's sequence (`megatrain_data.pack_pairs`).
    With GRPO each row is a prompt and a completion (its tokens trained) and `extras` the `Rollout` of the rows
    (their advantages, and log-probabilities)."""

    input_ids: Tensor  # [rows, seq] int64
    labels: Tensor  # [rows, seq] int64, -100: no loss
    position_ids: Tensor | None = None  # restarting at 0 where each packed document begins; None: a sequence a row
    valid: Tensor | None = None  # bool, False for padding (MoE routing statistics leave it out); None: all real
    sequences: Tensor | None = None  # packed preference pairs: each trained token's sequence, -1 for none
    media: list[dict[str, Tensor]] | None = None  # an image-text model's rows' processor outputs ({}: no image)
    extras: Sequences | Rollout | None = None  # what the objective needs beside the tokens (DPO, GRPO)

    @classmethod
    def of(
        cls, batch: Batch, media: list[dict[str, Tensor]] | None = None, extras: Sequences | Rollout | None = None
    ) -> "StepBatch":
        """The step of a data `Batch`, with its rows' images and the objective's extras."""
        return cls(batch.input_ids, batch.labels, batch.position_ids, batch.valid, batch.sequences, media, extras)

    @property
    def n_targets(self) -> int:
        """The trained tokens of every rank's rows."""
        return int((self.labels != -100).sum())


def dropout_key(adapter: Lora | None, seed: int, step: int) -> DropoutKey | None:
    """The key of training step `step`'s LoRA dropout masks (None: no dropout); `RowShares.micro_batches` gives each
    micro-batch's."""
    return DropoutKey(seed, step, 0) if adapter is not None and adapter.dropout > 0 else None


@dataclass(frozen=True)
class RankShare:
    """What an objective is told of a step on this rank: per micro-batch which of this rank's sequences each trained
    token belongs to ([rows, seq] int64, -1: none), this rank's sequences among the step's, and the trained tokens of
    each of the step's sequences ([n_sequences], every rank's)."""

    sequence_of: list[Tensor]
    mine: slice
    lengths: Tensor


class RowShares:
    """Which rows of a step this rank runs (all of them in one process; a contiguous share of whole examples with
    several: a preference pair's two rows stay on one rank), cut into micro-batches of train.micro_batch_size
    examples."""

    def __init__(self, ranks: Ranks | None, rows_per_example: int, rows_per_micro_batch: int, model: ModelConfig):
        self.ranks, self.rows_per_example, self.rows_per_micro_batch = ranks, rows_per_example, rows_per_micro_batch
        self.model = model

    def share(self, n: int, unit: int = 1) -> range:
        """This rank's contiguous share of `n` items taken in whole units of `unit` (a pair's two rows, a GRPO
        group's completions): all of them in one process."""
        world, rank = (1, 0) if self.ranks is None else (self.ranks.world_size, self.ranks.rank)
        units = n // unit
        return range(units * rank // world * unit, units * (rank + 1) // world * unit)

    def my_rows(self, n_rows: int, sequences: Tensor | None = None) -> range:
        """The rows of a batch this rank runs (packed pairs: the rows of its share of the pairs, which
        `megatrain_data.PairWindows` packs apart)."""
        if self.ranks is None:
            return range(n_rows)
        if sequences is None:
            return self.share(n_rows, self.rows_per_example)
        share = self.my_sequences(sequences)
        mine = [r for r, row in enumerate(sequences) if (row >= 0).any() and int(row[row >= 0].min()) in share]
        rows = range(mine[0], mine[-1] + 1) if mine else range(0)
        owned = sequences[rows.start : rows.stop]
        if any(int(s) not in share for s in owned[owned >= 0].unique()):
            raise ValueError("packed pairs: each rank's share of the pairs must be packed apart (PairWindows shares)")
        return rows

    def my_sequences(self, sequences: Tensor) -> range:
        """The sequences (of packed pairs) of this rank's share of the pairs."""
        return self.share(int(sequences.max()) + 1, 2)

    def micro_batches(self, batch: StepBatch, dropout: DropoutKey | None = None) -> list[MicroBatch]:
        """This rank's rows of `batch` in micro-batches (the last may be short); `dropout`: a training step's key of
        LoRA dropout's masks, each micro-batch's naming it by its first row."""
        mine, size = self.my_rows(batch.input_ids.shape[0], batch.sequences), self.rows_per_micro_batch
        if not self.model.image_text and batch.media is not None and any(batch.media):
            raise ConfigError(
                f"the data has images but {self.model.arch} trains as a text model; set "
                "model.image_text: true to train the whole image-text model"
            )
        micro = []
        for start in range(mine.start, mine.stop, size):
            part = slice(start, min(start + size, mine.stop))
            documents = None
            if batch.position_ids is not None or batch.valid is not None:
                documents = Documents(*(None if t is None else t[part] for t in (batch.position_ids, batch.valid)))
            rows_media = None
            if self.model.image_text:  # (its stages read the tokens and images of every micro-batch)
                rows_media = Media.of_rows(batch.input_ids[part], batch.media[part] if batch.media is not None else [])
            key = None if dropout is None else replace(dropout, micro_batch=start)
            micro.append(MicroBatch(batch.input_ids[part], batch.labels[part], documents, rows_media, key))
        return micro

    def rank_share(self, batch: StepBatch, micro: list[MicroBatch]) -> RankShare:
        """Which of this rank's sequences each trained token of its micro-batches belongs to (a row each, or as
        `sequences` says for packed pairs), and its sequences among the step's."""
        labels, sequences = batch.labels, batch.sequences
        owner = sequence_of_tokens(labels, sequences)
        lengths = sequence_lengths(labels, sequences)
        share = self.my_rows(len(lengths)) if sequences is None else self.my_sequences(sequences)
        owners, row = [], self.my_rows(labels.shape[0], sequences).start
        for mb in micro:
            part = owner[row : row + mb.labels.shape[0]]
            owners.append(torch.where(part >= 0, part - share.start, -1))
            row += mb.labels.shape[0]
        return RankShare(owners, slice(share.start, share.stop), lengths)
