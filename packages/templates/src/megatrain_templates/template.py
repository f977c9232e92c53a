"""The base every template inherits: the capabilities the scheduler and the planner read of a stage
(`megatrain_sched.StageTemplate`, the protocol), with the defaults of a plain layer. A template overrides only
what differs."""

from collections.abc import Callable
from typing import Any

from torch import Tensor


class Template:
    """A stage's template with a plain layer's capabilities: its checkpoint is its whole input (one [tokens,
    d_model] plane), its backward reads its weights and recomputes its forward, it prepares nothing and reads its
    whole group. Subclasses give `groups`, `forward` and `backward` (the last stage `loss`, `loss_sum` and
    `token_logps`), and `d_model`, the width of their input."""

    groups: tuple[tuple[Any, ...], ...]
    d_model: int = 0  # the width of the [tokens, d_model] planes the checkpoint keeps (0: not counted)
    checkpoint_planes = 1  # [tokens, d_model] tensors the checkpoint of its input holds (0: another stage's)
    backward_reads_weights = True  # False: no weights are copied in for its backward
    takes_dropout = False  # True: its training passes are given `dropout=` (its LoRA dropout masks' key)
    # `forward_keeping_products(weights, x, extras=False, **kw) -> (y, products)`, given back to its backward as
    # `products=`; None: it recomputes
    forward_keeping_products: Callable[..., tuple[Any, dict]] | None = None
    prepare: Callable[..., Any] | None = None  # `prepare(weights, x, **kw)`, given as `prepared=`; None: nothing
    forward_rows: Callable[..., Tensor] | None = None  # `forward_rows(rows, local_ids, **kw)`; None: the whole group
    loss: Callable[..., tuple[Tensor, Tensor]] | None = None  # the last stage's; None: a stage before it
    # what sets the layer's speed where its shape does not say it (a generic layer's module and layer type): the
    # planner measures one layer of each kind; None: its block shape does
    kind: tuple | None = None

    def checkpoint(self, x: Any) -> Any:
        """What the backward needs of the stage's input: all of it."""
        return x

    def product_bytes_per_token(self, element_size: int) -> int:
        """Device bytes a token's kept products take (`forward_keeping_products`, without extras)."""
        return 0

    def extra_product_bytes_per_token(self, element_size: int) -> int:
        """Device bytes a token's extra products take (`forward_keeping_products(..., extras=True)`)."""
        return 0
