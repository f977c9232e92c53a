"""The device bytes a stage's activations take, read once from its template (`StageCosts`), and the memory guard that
fits a placement to the device memory a step finds free. The pipeline and the planner's cost model count with the
same numbers."""

import logging
from dataclasses import dataclass, replace

from .placement import DEVICE, HOST, RECOMPUTE, Placement
from .template import StageTemplate

logger = logging.getLogger("megatrain_sched")

# device memory a step leaves free when it grants extra products out of its headroom (the planner's count of a
# step's bytes leaves out the allocator's pieces and a pass's temporaries)
EXTRAS_MARGIN = 4 * 2**30


@dataclass(frozen=True)
class StageCosts:
    """Bytes per token of a step that one stage's activations take in the compute dtype."""

    checkpoint_planes: int  # [tokens, d_model] tensors its checkpoint holds
    checkpoint_bytes_per_token: int  # its checkpoint: `checkpoint_planes` planes of the stage's d_model
    keeps_products: bool  # whether its forward can keep its matmul products for the backward
    product_bytes_per_token: int  # its kept products (0 where it recomputes)
    extra_bytes_per_token: int  # its extra products, kept where the device has room to spare (0: none)

    @classmethod
    def of(cls, template: StageTemplate, element_size: int) -> "StageCosts":
        """`template`'s costs with activations of `element_size` bytes an element."""
        keeps = template.forward_keeping_products is not None
        return cls(
            checkpoint_planes=template.checkpoint_planes,
            checkpoint_bytes_per_token=template.checkpoint_planes * template.d_model * element_size,
            keeps_products=keeps,
            product_bytes_per_token=template.product_bytes_per_token(element_size) if keeps else 0,
            extra_bytes_per_token=template.extra_product_bytes_per_token(element_size) if keeps else 0,
        )


def extras_that_fit(extra_bytes: dict[int, int], room: float) -> set[int]:
    """Of the stages keeping their products on the device whose extra products take `extra_bytes[stage]` bytes,
    those a step lets keep them: last layers first, as many as `room` (device bytes beyond what the step counts
    on) holds beyond `EXTRAS_MARGIN`. The pipeline's rule, and the planner's prediction of it."""
    room, chosen = room - EXTRAS_MARGIN, set()
    for stage in sorted(extra_bytes, reverse=True):
        if 0 < extra_bytes[stage] <= room:
            chosen.add(stage)
            room -= extra_bytes[stage]
    return chosen


def kept_bytes_per_token(costs: list[StageCosts], placement: Placement) -> int:
    """Device bytes per token of a step that `placement` keeps there: block checkpoints and kept products."""
    blocks = range(1, len(costs) - 1)
    checkpoints = sum(costs[i].checkpoint_bytes_per_token for i in blocks if placement.stages[i].checkpoint == DEVICE)
    return checkpoints + sum(costs[i].product_bytes_per_token for i in placement.kept)


@dataclass(frozen=True)
class Fitted:
    """A placement as a training step runs it, and what the memory guard found."""

    placement: Placement
    headroom: int | None  # device bytes free beyond what the placement counts on (None: not counted)
    fallback: str | None  # what it changed of the placement, and why (None: nothing)


def fit_to_device(placement: Placement, tokens: int, free: int | None, costs: list[StageCosts]) -> Fitted:
    """`placement` for a step of `tokens` with `free` bytes of device memory (None: not known): as given, unless the
    device lacks the memory it counts on. Then the first layers keeping products on the device recompute them
    instead, then more checkpoints go to host memory (first layers first), until it fits."""
    if free is None or placement.device_step_bytes is None:
        return Fitted(placement, None, None)
    need = placement.device_step_bytes
    if placement.tokens and tokens != placement.tokens:  # what it keeps grows with the tokens
        need += (tokens - placement.tokens) * kept_bytes_per_token(costs, placement)
    over = need - free
    if over <= 0:
        return Fitted(placement, -over, None)
    stages = list(placement.stages)
    recomputed = offloaded = 0
    for index in placement.kept:
        if over <= 0:
            break
        stages[index] = replace(stages[index], products=RECOMPUTE)
        over -= tokens * costs[index].product_bytes_per_token
        recomputed += 1
    for index in range(1, len(stages) - 1):
        if over <= 0:
            break
        if stages[index].checkpoint == DEVICE:
            stages[index] = replace(stages[index], checkpoint=HOST)
            over -= tokens * costs[index].checkpoint_bytes_per_token
            offloaded += 1
    fallback = (
        f"the placement for {tokens:,} tokens counts on {need / 2**30:.1f} GiB of device memory beside the "
        f"weights but {free / 2**30:.1f} GiB are free: {recomputed} layers recompute their matmul products "
        f"instead of keeping them, {offloaded} more send their checkpoints to host memory"
        + (" (still short: it may run out of memory)" if over > 0 else "")
    )
    logger.warning("megatrain_sched: %s", fallback)
    return Fitted(replace(placement, stages=tuple(stages)), free - need, fallback)


def extras_of(costs: list[StageCosts], kept: set, tokens: int, headroom: float) -> set:
    """The stages keeping their products on the device that keep their template's extra products too, out of the
    step's `headroom` (`extras_that_fit`; infinite where device memory is not counted): never at the cost of a
    matmul product or a checkpoint."""
    extra = {i: tokens * costs[i].extra_bytes_per_token for i in kept}
    return extras_that_fit(extra, headroom)
