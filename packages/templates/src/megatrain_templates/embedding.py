"""The token-embedding template: the first stage of every model."""

import torch
import torch.nn.functional as F
from torch import Tensor

from .layout import ParamSpec, check_buffers
from .template import Template


class Embedding(Template):
    """Stateless token embedding over one flat buffer holding `embed_tokens.weight`."""

    # the backward scatters the output's gradient into the table's rows: the pipeline need not stream the
    # table in for it (2.2 GB of fp32 for a 152k-token vocabulary at d_model 3584)
    backward_reads_weights = False

    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = None, scale: float | None = None):
        # padding_idx: a row that never learns (its gradient is zero), as in nn.Embedding; scale: the rows
        # are multiplied by it, rounded to their dtype as transformers does (Gemma: sqrt(d_model))
        self.vocab_size, self.d_model, self.padding_idx, self.scale = vocab_size, d_model, padding_idx, scale
        self.groups = ((ParamSpec("embed_tokens.weight", (vocab_size, d_model)),),)
        self.numel = vocab_size * d_model

    def forward(self, weights: list[Tensor], token_ids: Tensor, documents=None) -> Tensor:
        """token_ids: [batch, seq] int64 -> hidden [batch, seq, d_model] in the weights' dtype
        (`documents`, packed rows, change nothing here)."""
        check_buffers(weights, self.groups, "Embedding.forward")
        return self._scaled(F.embedding(token_ids, weights[0].view(self.vocab_size, self.d_model)))

    def forward_rows(self, rows: Tensor, local_ids: Tensor, documents=None) -> Tensor:
        """The forward given only the table rows the tokens read: `rows` flat ([n, d_model] in a row-major
        buffer), `local_ids` [batch, seq] indices into them (what the pipeline streams at a step's start,
        while the rest of the table is still being updated)."""
        return self._scaled(F.embedding(local_ids, rows.view(-1, self.d_model)))

    def _scaled(self, hidden: Tensor) -> Tensor:
        return hidden if self.scale is None else hidden * self._scale_in(hidden.dtype)

    def _scale_in(self, dtype: torch.dtype) -> float:
        """The scale rounded to `dtype` (bf16: sqrt(1152) = 33.94 is 34)."""
        return torch.tensor(self.scale, dtype=dtype).item()

    def backward(
        self, weights: list[Tensor], token_ids: Tensor, grad_out: Tensor, grads: list[Tensor], documents=None
    ) -> None:
        """Scatter-add grad_out [batch, seq, d_model] into the rows of `grads[0]` (flat, fp32)."""
        check_buffers(grads, self.groups, "Embedding.backward")
        table = grads[0].view(self.vocab_size, self.d_model)
        rows = grad_out.reshape(-1, self.d_model).to(table.dtype)
        if self.scale is not None:  # the forward's factor, as rounded there
            rows = rows * self._scale_in(grad_out.dtype)
        if self.padding_idx is not None:
            rows = rows * (token_ids.reshape(-1, 1) != self.padding_idx)
        table.index_add_(0, token_ids.reshape(-1), rows)
        return None
