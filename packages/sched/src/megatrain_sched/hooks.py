"""How the update policy meets the scheduler: the hooks a step calls around each group's weights and gradient."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class Hooks:
    """`before_fetch(groups)` is called before a stage's weights are read from the store, and before the gradient
    of a stage that reads none in its backward is sent (the optimizer must have finished updating them);
    `updates_done(groups)` says, without waiting, whether it has (so that copies can be queued early);
    `first_rows(group, rows)` gives a first stage's rows (sorted unique input ids) up to date, a host tensor
    [len(rows), row], while the rest of the group may still be updating (so not preceded by `before_fetch`), or
    None to copy the whole group; `on_grads_landed(group, event, sq_norm)` is called when a group's gradient
    copy-out has been queued (`event` completes when the host buffer holds it, None on the CPU; `sq_norm` a host
    scalar tensor, valid from then on); `on_device_grads(group, grad, sq_norm)` takes a resident group's gradient
    on the device (called on the compute stream once its last backward is queued; the buffer is the callee's);
    `before_cast(groups)` is called on the compute stream before a resident stage's weights are cast from their
    device masters, or its compute-dtype copy is read (the stream must wait there for updates of them queued
    elsewhere, which refresh that copy); `bring_back(groups)` is called on the compute stream once a stage's
    backward is queued, with the groups whose moments the placement parks and brings back there
    (`Placement.moments_back_after`): into the memory that backward let go of, ahead of their update;
    `let_go_parked()` is called on the compute stream before the forward of `Placement.moments_leave_before`, where
    the parked moments' device memory is given back to it; `held_device_bytes()` says how much device memory the
    policy holds of gradients it was given, and of parked moments, to be let go as the next forward goes (free for
    the next step, which counts on it)."""

    before_fetch: Callable[[tuple[int, ...]], None] = lambda groups: None
    updates_done: Callable[[tuple[int, ...]], bool] = lambda groups: True
    first_rows: Callable[[int, Tensor], Tensor | None] = lambda group, rows: None
    on_grads_landed: Callable[[int, Any, Tensor], None] = lambda group, event, sq_norm: None
    on_device_grads: Callable[[int, Tensor, Tensor], None] = lambda group, grad, sq_norm: None
    before_cast: Callable[[tuple[int, ...]], None] = lambda groups: None
    bring_back: Callable[[tuple[int, ...]], None] = lambda groups: None
    let_go_parked: Callable[[], None] = lambda: None
    held_device_bytes: Callable[[], int] = lambda: 0
