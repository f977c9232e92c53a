"""A MoE router's decision (`Routing`) and the step's routing statistics (`RouterLoad`).

The load-balancing loss is a property of the whole step (all MoE layers, all micro-batches), so its
statistics live in a `RouterLoad` shared by the model's MoE layers: forward records, backward adds the
loss's gradient w.r.t. the router probabilities.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .attention import Documents
from .ops import upcast


@dataclass
class Routing:
    """A router's decision for [tokens] rows: probabilities in fp32 (fp64 when computing in fp64), as
    transformers' routers ([tokens, n_experts]; sigmoid scoring: the scores normalised per token, the
    affinities DeepSeek's balance losses use), the chosen experts and their weights ([tokens, k]), and
    the logits the probabilities came from (for the router z-loss)."""

    probs: Tensor
    top_index: Tensor
    top_weight: Tensor
    logits: Tensor


class RouterLoad:
    """Routing statistics of one optimizer step over every MoE layer and micro-batch: the
    Switch-Transformer load-balancing loss exactly as transformers' `load_balancing_loss_func`
    computes it over one forward of the whole batch:

        aux = n_experts * sum_e f_e * P_e,  f_e = top-k picks of e / rows,  P_e = sum of p_e / rows

    where rows = tokens x MoE layers. Its gradient w.r.t. a router probability p_e is
    n_experts * f_e / rows, the same for every token and layer, known once the forward is done.
    `coef` 0 records the statistics (the loss is still reported) but adds no gradient.

    Each layer's expert loads are kept too, for `max_violation`: the forwards of a step record layer
    by layer (the pipeline is layer-major), each of the `n_layers` MoE layers once per micro-batch, in each of
    the step's sweeps (`sweeps`: how many micro-batches each ran) in turn.

    `seq_coef` adds DeepSeek-V3's complementary sequence-wise balance loss, alpha times the sum over MoE
    layers of the mean over the step's `sequences` of

        sum_e f_e * P_e,  f_e = n_experts * picks of e / (top_k * tokens),  P_e = sum of p_e / tokens

    over each sequence's own tokens (DeepSeek's and Megatron's `seq_aux_loss`). It is local to a layer and
    a micro-batch: its gradient w.r.t. p_e is alpha * f_e / (tokens * sequences), from that sequence alone.

    `z_coef` adds ST-MoE's router z-loss, the sum over MoE layers of the mean over the step's tokens of
    logsumexp(router logits)^2, which keeps the logits small (OLMoE pre-trained with 0.001)."""

    def __init__(
        self,
        n_experts: int,
        top_k: int,
        coef: float = 0.0,
        n_layers: int = 1,
        seq_coef: float = 0.0,
        z_coef: float = 0.0,
    ):
        self.n_experts, self.top_k, self.coef, self.n_layers = n_experts, top_k, coef, n_layers
        self.seq_coef, self.z_coef = seq_coef, z_coef
        self.sequences = 1  # the step's sequences over all ranks: the sequence-wise loss is a mean over them
        # with data parallelism: sums a tensor over the ranks in place, so that the statistics
        # (and the loss's gradient) are those of the global batch
        self.reduce: Callable[[Tensor], Tensor] | None = None
        self.reset()

    @property
    def routes_in_backward(self) -> bool:
        """Whether a backward needs the routing again for a loss's gradient."""
        return bool(self.coef or self.seq_coef or self.z_coef)

    def reset(self, sweeps: list[int] | None = None) -> None:
        """Forget the records, for a pass whose `sweeps` ran so many micro-batches each (None: one sweep)."""
        self.sweeps = sweeps
        # [picks per expert, probability sums per expert, rows, sequence-wise loss summed over sequences,
        # squared logsumexp summed over tokens]
        self._stats: Tensor | None = None
        self._records: list[Tensor] = []  # picks per expert of each forward, in record order
        self._layer_loads: Tensor | None = None  # [n_layers, n_experts], once final
        self._final = False

    def record(self, routing: Routing, valid: Tensor | None = None, sequences: int = 1) -> None:
        """One layer's routing of a micro-batch; valid: [tokens] bool, False for padding, which is left out
        (as transformers' attention_mask does); the tokens are `sequences` sequences of equal length, one
        after another."""
        top_index, probs = routing.top_index, routing.probs.detach()
        stats = torch.zeros(2 * self.n_experts + 3, dtype=probs.dtype, device=probs.device)
        weight = _token_weights(valid, probs)
        stats[: self.n_experts] = _expert_picks(top_index, weight, self.n_experts)
        stats[self.n_experts : 2 * self.n_experts] = (probs * weight.unsqueeze(1)).sum(0)
        stats[-3] = weight.sum()
        if self.seq_coef:
            shares, tokens = self._sequence_shares(top_index, weight, sequences)
            per_token = probs.view(sequences, -1, self.n_experts) * weight.view(sequences, -1, 1)
            stats[-2] = (shares * per_token.sum(1) / tokens.unsqueeze(1)).sum()
        if self.z_coef:
            stats[-1] = (upcast(routing.logits.detach()).logsumexp(dim=-1).square() * weight).sum()
        self._stats = stats if self._stats is None else self._stats + stats
        self._records.append(stats[: self.n_experts])

    def _finished(self) -> Tensor | None:
        """The step's statistics, summed over the ranks the first time they are read after the forward."""
        if self._stats is not None and not self._final:
            if len(self._records) % self.n_layers:
                raise ValueError(f"{len(self._records)} routing records for {self.n_layers} MoE layers")
            sweeps = self.sweeps or [len(self._records) // self.n_layers]
            sweep_records = torch.stack(self._records).split([self.n_layers * n for n in sweeps])
            layers = sum(records.view(self.n_layers, -1, self.n_experts).sum(1) for records in sweep_records)
            both = torch.cat([self._stats, layers.view(-1)])  # one collective for both
            if self.reduce is not None:
                self.reduce(both)
            self._stats, self._layer_loads = both[: self._stats.numel()], both[self._stats.numel() :].view_as(layers)
            self._records = []
            self._final = True
        return self._stats

    def max_violation(self) -> Tensor | None:
        """The "MaxVio" (DeepSeek-V3) of the step's least balanced MoE layer: max over its experts of load /
        mean load - 1; 0 when every expert of every layer got as many tokens; None before any record."""
        if self._finished() is None:
            return None
        loads = self._layer_loads
        return (loads.amax(dim=1) / loads.mean(dim=1).clamp_min(1e-30) - 1).max()

    def loss(self) -> Tensor | None:
        """The (uncoefficiented) auxiliary loss of the step recorded so far; None before any record."""
        stats = self._finished()
        if stats is None:
            return None
        picks, prob_sums, rows = stats[: self.n_experts], stats[self.n_experts : 2 * self.n_experts], stats[-3]
        return self.n_experts * (picks / rows * prob_sums / rows).sum()

    def sequence_loss(self) -> Tensor | None:
        """The (uncoefficiented) sequence-wise balance loss of the step; None when it is off or before any record."""
        stats = self._finished()
        return None if stats is None or not self.seq_coef else stats[-2] / self.sequences

    def z_loss(self) -> Tensor | None:
        """The (uncoefficiented) router z-loss of the step; None when it is off or before any record."""
        stats = self._finished()
        return None if stats is None or not self.z_coef else stats[-1] / self._tokens(stats)

    def _tokens(self, stats: Tensor) -> Tensor:
        """The step's tokens (not padding) over all ranks: rows counts each once per MoE layer."""
        return stats[-3] / self.n_layers

    def z_lse_grad(self, lse: Tensor, valid: Tensor | None) -> Tensor:
        """d(z_coef * z-loss) / d(logsumexp of a token's logits), [tokens]."""
        stats = self._finished()
        return self.z_coef * 2 * lse.detach() * _token_weights(valid, lse) / self._tokens(stats)

    def probs_grad(self) -> Tensor | None:
        """d(coef * aux) / d(router probability), [n_experts]; None when the loss is off."""
        if not self.coef:
            return None
        stats = self._finished()
        if stats is None:
            return None
        return self.coef * self.n_experts * stats[: self.n_experts] / stats[-3] / stats[-3]

    def _sequence_shares(self, top_index: Tensor, weight: Tensor, sequences: int) -> tuple[Tensor, Tensor]:
        """(f [sequences, n_experts]: each sequence's picks of each expert over an even share of them,
        its tokens [sequences])."""
        picks = torch.zeros(sequences, self.n_experts, dtype=weight.dtype, device=weight.device)
        slots = weight.repeat_interleave(self.top_k).view(sequences, -1)
        picks.scatter_add_(1, top_index.reshape(sequences, -1), slots)
        tokens = weight.view(sequences, -1).sum(1).clamp_min(1)
        return picks * self.n_experts / (self.top_k * tokens.unsqueeze(1)), tokens

    def sequence_probs_grad(self, top_index: Tensor, probs: Tensor, valid: Tensor | None, sequences: int) -> Tensor:
        """d(seq_coef * sequence-wise loss) / d(router probability) of one layer's micro-batch, [tokens, n_experts]."""
        weight = _token_weights(valid, probs)
        shares, tokens = self._sequence_shares(top_index, weight, sequences)
        per_sequence = shares * (self.seq_coef / self.sequences) / tokens.unsqueeze(1)
        return (per_sequence.unsqueeze(1) * weight.view(sequences, -1, 1)).view_as(probs)


def _token_weights(valid: Tensor | None, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """[tokens]: 1 for a real token, 0 for padding, for `like`'s rows ([tokens, ...]), in `dtype` (default
    `like`'s) on its device."""
    dtype = dtype or like.dtype
    if valid is None:
        return torch.ones(like.shape[0], dtype=dtype, device=like.device)
    return valid.to(dtype)


def _expert_picks(top_index: Tensor, weight: Tensor, n_experts: int) -> Tensor:
    """[n_experts]: how many (real) tokens chose each expert, in `weight`'s dtype."""
    picks = torch.zeros(n_experts, dtype=weight.dtype, device=weight.device)
    return picks.scatter_add_(0, top_index.reshape(-1), weight.repeat_interleave(top_index.shape[1]))


def _valid_tokens(documents: Documents | None) -> Tensor | None:
    """[tokens] bool: False for padding, in the routing's token order; None when nothing is padding."""
    return None if documents is None or documents.valid is None else documents.valid.reshape(-1)
