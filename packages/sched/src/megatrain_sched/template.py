"""What the scheduler (and the planner) know of a stage's template: one declared protocol, with the defaults of a
plain layer, and the step objective the head hands its log-probabilities to. The scheduler reads these members
and nothing else; `megatrain_templates.Template` is the base every template of the templates and the zoo inherits,
with the same defaults."""

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor


class StageTemplate(Protocol):
    """A stage's template: its layouts and pure forward / backward on flat weight buffers, and its capabilities.

    `groups`: one tuple of parameter specs (`.name`, `.shape`, `.numel`) per store group it binds, in order.
    `forward(weights, x, **kw) -> y` and `backward(weights, x, grad_out, grads, **kw) -> grad_x` (`kw`: the
    micro-batch's `documents=` / `media=`, and where declared below `prepared=` / `products=` / `dropout=`; `x` is what
    `checkpoint(x)` keeps of the input; `grads` holds None for a group the store keeps frozen).

    Capabilities, with the defaults of a plain layer (a subclass inherits them; a template states only what differs):
    """

    groups: tuple[tuple[Any, ...], ...]
    # the width of the [tokens, d_model] planes this stage's checkpoint keeps (0: not known, nothing counted)
    d_model: int = 0
    # how many [tokens, d_model] tensors the checkpoint of its input holds (0: it shares another stage's)
    checkpoint_planes: int = 1
    # False: its backward reads none of its weights (an embedding's scatters its gradient), so none are copied in
    backward_reads_weights: bool = True
    # True: a training micro-batch's `dropout` key, at the stage's name (`dropout.at(name)`), is given to its forward
    # and backward as `dropout=` (LoRA dropout's masks: the backward's recompute draws the forward's)
    takes_dropout: bool = False
    # `forward_keeping_products(weights, x, extras=False, **kw) -> (y, products)`, whose backward then gets
    # `products=` and recomputes no GEMM; None: it always recomputes
    forward_keeping_products: Callable[..., tuple[Any, dict]] | None = None
    # `prepare(weights, x, **kw)`, run for every micro-batch before the first forward, given to forward and backward
    # as `prepared=` (work that waits for the GPU, started early); None: nothing to prepare
    prepare: Callable[..., Any] | None = None
    # `forward_rows(rows, local_ids, **kw)`: a first stage of one group reading only the rows its tokens select
    # (an embedding), computed from those rows alone; None: it reads its whole group
    forward_rows: Callable[..., Tensor] | None = None
    # the last stage's: `loss(weights, x, labels, loss_scale, grads) -> (loss, grad_x)`, and for forward-only
    # passes `loss_sum(weights, x, labels)` and `token_logps(weights, x, labels, entropy=False)`
    loss: Callable[..., tuple[Tensor, Tensor]] | None = None

    def forward(self, weights: list[Tensor], x: Any, **kwargs: Any) -> Any:
        """The stage's output for input `x` (a first stage: the micro-batch's token ids [micro_batch, seq]; else the
        previous stage's output, e.g. hidden [micro_batch, seq, d_model]); `weights`: one flat compute-dtype view per
        group of `groups`. Called by `LayerPipeline` on the compute stream, per micro-batch, in the forward sweep."""
        ...

    def backward(self, weights: list[Tensor], x: Any, grad_out: Any, grads: list, **kwargs: Any) -> Any:
        """The gradient of the stage's input (shaped as the input; None from a first stage), given `grad_out` shaped
        as the forward's output and `x` = `checkpoint(input)`, from which it recomputes what it needs; adds each
        group's weight gradient into `grads` (flat device buffers, one per group; None for a frozen group). Called by
        `LayerPipeline` per micro-batch on the compute stream, for the stages before the head in reverse order, after
        the head's `loss` (for a stage not `backward_reads_weights`, `weights` were not copied: not to be read)."""
        ...

    def checkpoint(self, x: Any) -> Any:
        """What the backward needs of the stage's input: all of it."""
        return x

    def product_bytes_per_token(self, element_size: int) -> int:
        """Device bytes a token's products take (`forward_keeping_products`, without extras)."""
        return 0

    def extra_product_bytes_per_token(self, element_size: int) -> int:
        """Device bytes a token's extra products take (`forward_keeping_products(..., extras=True)`: a
        linear-attention layer's recurrence results, which spare its backward the recurrence's forward)."""
        return 0


class StepObjective(Protocol):
    """A step-level objective (e.g. `megatrain_templates.DPO`): the head gives it every micro-batch's target
    log-probabilities ([rows, seq] each) before any backward, and, where it `wants_entropy`, each position's entropy
    of the head's distribution too (else None); it returns the step's loss and each token's coefficient, which the
    head's backward applies (`loss` with a tensor scale)."""

    wants_entropy: bool

    def __call__(
        self, token_logps: list[Tensor], token_entropy: list[Tensor] | None
    ) -> tuple[Tensor, list[Tensor]]: ...
