"""The last stage: final RMSNorm, LM head and next-token cross-entropy, forward and backward in one call.

Logits are made `chunk_rows` rows at a time and differentiated by hand, so the full
[tokens, vocab] fp32 logits tensor never exists; only the final norm goes through
autograd. With tied embeddings the LM head matrix is the embedding table, passed in as
a second flat buffer, and its gradient lands in that buffer's gradient.
"""

import torch
from torch import Tensor

from .layout import ParamSpec, Span, accumulate, add_matmul_, check_buffers, leaf
from .ops import IGNORE_INDEX, compiled_on_cuda, rms_norm_as, upcast
from .template import Template

# Rows per logits chunk are chosen so one chunk holds about this many fp32 logits (2 GiB):
# thousands of rows per chunk keep the head's GEMMs efficient and the number of full
# [vocab, d_model] weight-gradient accumulations small.
CHUNK_LOGITS = 1 << 29


class Head(Template):
    """Stateless final norm + LM head + loss.

    Untied: one buffer [lm_head.weight, norm.weight].
    Tied: two buffers, the embedding's [embed_tokens.weight] and [norm.weight].
    The final norm applies its weight the `norm_scale` way (`ops.NORM_SCALES`); Gemma 2's logits are soft-capped to
    (-logit_softcap, logit_softcap) by logit_softcap * tanh(logits / logit_softcap) (in fp32 here). Granite's are
    divided by `logit_divisor` (its logits_scaling): here the normed rows are, before the GEMM.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        rms_eps: float = 1e-6,
        tied: bool = False,
        norm_scale: str = "cast_first",
        logit_softcap: float | None = None,
        logit_divisor: float | None = None,
    ):
        self.vocab_size, self.d_model, self.rms_eps, self.tied = vocab_size, d_model, rms_eps, tied
        self.logit_softcap, self.logit_divisor = logit_softcap, logit_divisor
        self.norm_scale = norm_scale
        norm = ParamSpec("norm.weight", (d_model,), weight_decay=False)
        if tied:
            self.groups = ((ParamSpec("embed_tokens.weight", (vocab_size, d_model)),), (norm,))
            self._matrix_group, self._norm_group = 0, 1
            self._norm_span = Span(0, (d_model,))
        else:
            self.groups = ((ParamSpec("lm_head.weight", (vocab_size, d_model)), norm),)
            self._matrix_group, self._norm_group = 0, 0
            self._norm_span = Span(vocab_size * d_model, (d_model,))
        self._matrix_span = Span(0, (vocab_size, d_model))
        self.chunk_rows = max(1, CHUNK_LOGITS // vocab_size)
        # what the logits are divided by before their softmax: GRPO's sampling temperature, at which TRL scores its
        # completions (the policy's, the old policy's and the reference's log-probabilities); 1 for every other loss
        self.temperature = 1.0

    def logits(self, weights: list[Tensor], hidden: Tensor) -> Tensor:
        """Full logits [batch, seq, vocab] in fp32 or wider, for inference and checks on small inputs."""
        check_buffers(weights, self.groups, "Head.logits")
        normed = self._normed_rows(hidden, self._norm_span.view(weights[self._norm_group]))
        return _capped(upcast(normed @ self._matrix_span.view(weights[self._matrix_group]).T), self.logit_softcap)

    def _normed_rows(self, hidden: Tensor, weight: Tensor) -> Tensor:
        """The final norm, and Granite's logit divisor and the temperature (dividing the rows divides the logits,
        where no soft cap comes between: `megatrain.parts` refuses a temperature with one)."""
        normed = rms_norm_as(self.norm_scale, hidden, weight, self.rms_eps)
        divisor = (self.logit_divisor or 1.0) * self.temperature
        return normed if divisor == 1.0 else normed / divisor

    @torch.no_grad()
    def loss_sum(self, weights: list[Tensor], hidden: Tensor, labels: Tensor) -> Tensor:
        """Summed cross-entropy over labels != -100, forward only (evaluation), chunk by chunk
        with the arithmetic of `loss`. hidden: [batch, seq, d_model]; labels: [batch, seq]."""
        check_buffers(weights, self.groups, "Head.loss_sum")
        matrix = self._matrix_span.view(weights[self._matrix_group])
        normed = self._normed_rows(hidden, self._norm_span.view(weights[self._norm_group]))
        rows, targets = normed.reshape(-1, self.d_model), labels.reshape(-1)
        loss_sum = torch.zeros((), dtype=upcast(rows[:0]).dtype, device=hidden.device)
        for start in range(0, rows.shape[0], self.chunk_rows):
            logits = _capped(upcast(rows[start : start + self.chunk_rows] @ matrix.T), self.logit_softcap)
            loss_sum += _loss_terms(logits, targets[start : start + self.chunk_rows])[2]
        return loss_sum

    @torch.no_grad()
    def token_logps(
        self, weights: list[Tensor], hidden: Tensor, labels: Tensor, entropy: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Each target's log-probability, forward only: [batch, seq] in fp32 or wider, 0 where labels are -100
        (what a step-level objective sums per sequence: DPO's log-probability of a completion). Chunk by chunk
        with the arithmetic of `loss`: -token_logps.sum() is `loss_sum`. With `entropy`, also each position's
        entropy of the next-token distribution (0 where labels are -100)."""
        check_buffers(weights, self.groups, "Head.token_logps")
        matrix = self._matrix_span.view(weights[self._matrix_group])
        normed = self._normed_rows(hidden, self._norm_span.view(weights[self._norm_group]))
        rows, targets = normed.reshape(-1, self.d_model), labels.reshape(-1)
        logps = torch.empty(rows.shape[0], dtype=upcast(rows[:0]).dtype, device=hidden.device)
        entropies = torch.empty_like(logps) if entropy else None
        for start in range(0, rows.shape[0], self.chunk_rows):
            logits = _capped(upcast(rows[start : start + self.chunk_rows] @ matrix.T), self.logit_softcap)
            chunk_targets = targets[start : start + self.chunk_rows]
            log_norm, safe_target, _ = _loss_terms(logits, chunk_targets)
            valid = (chunk_targets != IGNORE_INDEX).to(logits.dtype)
            span = slice(start, start + logits.shape[0])
            logps[span] = (logits.gather(1, safe_target) - log_norm).squeeze(1) * valid
            if entropy:
                entropies[span] = distribution_entropy(logits, log_norm) * valid
        logps = logps.view(labels.shape)
        return (logps, entropies.view(labels.shape)) if entropy else logps

    def loss(
        self,
        weights: list[Tensor],
        hidden: Tensor,
        labels: Tensor,
        loss_scale: float | Tensor,
        grads: list[Tensor],
    ) -> tuple[Tensor, Tensor]:
        """Summed cross-entropy over labels != -100 and its gradient.

        hidden: [batch, seq, d_model]; labels: [batch, seq] int64 (already shifted: the
        target of position t). The gradient is that of `loss_scale * sum`, so with
        loss_scale = 1 / (labels counted over the whole optimizer step) micro-batches add
        up to the gradient of the mean; `loss_scale` may also be a [batch, seq] tensor, each token's
        d(loss)/d(its cross-entropy) (a step-level objective's coefficients). Returns (sum as a scalar
        tensor in fp32 or wider, grad w.r.t. hidden); weight gradients are added into `grads` (flat, fp32 or wider).
        """
        check_buffers(weights, self.groups, "Head.loss")
        check_buffers(grads, self.groups, "Head.loss grads")
        matrix = self._matrix_span.view(weights[self._matrix_group])
        # a frozen group's gradient is None: the hidden state's gradient alone (LoRA's frozen head)
        trains_matrix, trains_norm = grads[self._matrix_group] is not None, grads[self._norm_group] is not None
        grad_matrix = self._matrix_span.view(grads[self._matrix_group]) if trains_matrix else None
        norm_flat = weights[self._norm_group]
        norm_weight = leaf(norm_flat, self._norm_span) if trains_norm else self._norm_span.view(norm_flat)
        x = hidden.detach().requires_grad_(True)
        with torch.enable_grad():
            normed = self._normed_rows(x, norm_weight)
        rows = normed.detach().reshape(-1, self.d_model)
        targets = labels.reshape(-1)
        grad_rows = torch.empty_like(rows)
        loss_dtype = upcast(rows[:0]).dtype
        loss_sum = torch.zeros((), dtype=loss_dtype, device=hidden.device)
        # d(scaled loss)/d(row loss), kept in fp32 so that a bf16 rounding of loss_scale never biases gradients
        if isinstance(loss_scale, Tensor):
            loss_scale = loss_scale.reshape(-1).to(device=hidden.device, dtype=loss_dtype)
        row_scale = (targets != IGNORE_INDEX).to(loss_dtype) * loss_scale
        for start in range(0, rows.shape[0], self.chunk_rows):
            chunk = rows[start : start + self.chunk_rows]
            scale = row_scale[start : start + self.chunk_rows].unsqueeze(1)
            grad_logits, chunk_loss = logits_grad(
                chunk @ matrix.T, targets[start : start + self.chunk_rows], self.logit_softcap
            )
            loss_sum += chunk_loss
            # the per-row scale is applied to the [rows, d_model] operands, not the [rows, vocab] one
            grad_rows[start : start + chunk.shape[0]] = upcast(grad_logits @ matrix) * scale
            if trains_matrix:
                add_matmul_(grad_matrix, grad_logits.T, (upcast(chunk) * scale).to(chunk.dtype))
        inputs = [x, norm_weight] if trains_norm else [x]
        grad_hidden, *grad_norm = torch.autograd.grad(normed, inputs, grad_rows.view_as(normed))
        if trains_norm:
            accumulate(grads[self._norm_group], self._norm_span, grad_norm[0])
        return loss_sum, grad_hidden


def distribution_entropy(logits: Tensor, log_norm: Tensor) -> Tensor:
    """Each row's entropy of softmax(logits) [..., vocab] -> [...], given log Z [..., 1]: log Z - sum p * logits
    (one temporary of the logits' size)."""
    return log_norm.squeeze(-1) - (logits - log_norm).exp_().mul_(logits).sum(-1)


def _capped(logits: Tensor, softcap: float | None) -> Tensor:
    return _cap(logits, softcap)[0]


def _cap(logits: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """(softcap * tanh(logits / softcap), the tanh, whose 1 - tanh^2 is the cap's slope), or (logits, None)."""
    if softcap is None:
        return logits, None
    tanh = torch.tanh(logits / softcap)
    return tanh * softcap, tanh


def _loss_terms(logits: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log-sum-exp [rows, 1], targets clamped to valid indices [rows, 1], summed cross-entropy over
    targets != -100) of upcast logits [rows, vocab]."""
    log_norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    safe_target = target.clamp_min(0).unsqueeze(1)
    valid = (target != IGNORE_INDEX).to(logits.dtype)
    return log_norm, safe_target, ((log_norm - logits.gather(1, safe_target)).squeeze(1) * valid).sum()


def _logits_grad_in_place(logits: Tensor, target: Tensor, softcap: float | None) -> tuple[Tensor, Tensor]:
    """Eager `logits_grad`: softmax - one_hot built in place in the upcast logits (no second [rows, vocab]
    unless the logits are capped)."""
    upcast_logits, tanh = _cap(upcast(logits), softcap)
    log_norm, safe_target, loss = _loss_terms(upcast_logits, target)
    grad = upcast_logits.sub_(log_norm).exp_()
    grad.scatter_add_(1, safe_target, torch.full_like(safe_target, -1, dtype=grad.dtype))
    if tanh is not None:  # d(cap * tanh(z / cap))/dz = 1 - tanh^2
        grad.mul_(1 - tanh.square_())
    return grad.to(logits.dtype), loss


def _logits_grad_fused(logits: Tensor, target: Tensor, softcap: float | None) -> tuple[Tensor, Tensor]:
    """The same arithmetic written for Inductor: one pass reads the [rows, vocab] logits for the
    log-sum-exp, one more writes the gradient in their dtype; the one-hot is a comparison with the
    column index instead of a scatter, so nothing in between is materialised in fp32."""
    upcast_logits, tanh = _cap(upcast(logits), softcap)
    log_norm, safe_target, loss = _loss_terms(upcast_logits, target)
    probs = (upcast_logits - log_norm).exp()
    is_target = torch.arange(logits.shape[1], device=logits.device) == safe_target
    grad = torch.where(is_target, probs - 1, probs)
    if tanh is not None:
        grad = grad * (1 - tanh * tanh)
    return grad.to(logits.dtype), loss


# Eager, the fp32 copy of a chunk's logits, its log-sum-exp, exp, scatter and cast were a quarter of the head's time
logits_grad = compiled_on_cuda(_logits_grad_fused, eager=_logits_grad_in_place)
logits_grad.__doc__ = """(d(row loss)/d(logits) = softmax - one_hot(target) in the logits' dtype, summed cross-entropy
over targets != -100 in fp32 or wider) for one chunk: logits [rows, vocab], target [rows] int64; with `softcap`,
of the capped logits (and the gradient through the cap)."""
