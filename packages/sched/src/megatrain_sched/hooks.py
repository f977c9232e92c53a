"""How the update policy meets the scheduler: the hooks a step calls around each group's weights and gradient."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor


@dataclass
class Hooks:
    """The update policy's callbacks, which `LayerPipeline` calls as a training step runs (megatrain builds them from
    its `megatrain_optim` update policy; the defaults, a policy that has always finished, do nothing). `groups` are
    store group indices, a stage's in its template's order. Per position of a step's order (forwards, the head, then
    backwards): `updates_done` may be polled to queue copies early, then the copy-in calls `first_rows` or
    `before_fetch`, a resident stage's cast calls `before_cast`, `let_go_parked` comes before that position's compute
    where the placement says, and after a backward's compute its groups' gradients go out (`on_device_grads`, or
    `before_fetch` then `on_grads_landed`) before `bring_back`. `held_device_bytes` is read whenever the pipeline
    measures free device memory (fitting a placement)."""

    # `before_fetch(groups)`: called before a stage's weights are read from the store (host thread, before queueing
    # the copy-in), and before the gradient of a stage that reads none in its backward is sent: it returns once the
    # optimizer has finished updating those groups
    before_fetch: Callable[[tuple[int, ...]], None] = lambda groups: None
    # `updates_done(groups) -> bool`: whether they are updated, without waiting (so that copies can be queued early)
    updates_done: Callable[[tuple[int, ...]], bool] = lambda groups: True
    # `first_rows(group, rows) -> Tensor | None`: a first stage's rows (`rows`: sorted unique input ids, int64) up to
    # date, a host tensor [len(rows), row], while the rest of the group may still be updating (so not preceded by
    # `before_fetch`); None: copy the whole group (then `before_fetch` is called)
    first_rows: Callable[[int, Tensor], Tensor | None] = lambda group, rows: None
    # `on_grads_landed(group, event, sq_norm)`: in the step's last sweep, a host group's gradient copy-out (reduced
    # to this process's shard) has been queued; `event` completes when the host grad buffer holds it (None on the
    # CPU); `sq_norm` a host scalar tensor (master dtype), the shard's squared norm, valid from then on
    on_grads_landed: Callable[[int, Any, Tensor], None] = lambda group, event, sq_norm: None
    # `on_device_grads(group, grad, sq_norm)`: a resident group's whole gradient on the device ([numel], flat; the
    # buffer is the callee's from then on) and its squared norm (device scalar), called on the compute stream once
    # its last backward is queued
    on_device_grads: Callable[[int, Tensor, Tensor], None] = lambda group, grad, sq_norm: None
    # `before_cast(groups)`: called on the compute stream before a resident stage's weights are cast from their
    # device masters, or its compute-dtype copy is read; the stream must wait there for updates of them queued
    # elsewhere (which refresh that copy)
    before_cast: Callable[[tuple[int, ...]], None] = lambda groups: None
    # `bring_back(groups)`: called on the compute stream once a stage's backward is queued (last sweep, not in a
    # warm-up), with the groups whose moments the placement parks and brings back there
    # (`Placement.moments_back_after`): into the memory that backward let go of, ahead of their update
    bring_back: Callable[[tuple[int, ...]], None] = lambda groups: None
    # `let_go_parked()`: called on the compute stream before the forward of `Placement.moments_leave_before`, where
    # the parked moments' device memory is given back to it
    let_go_parked: Callable[[], None] = lambda: None
    # `held_device_bytes() -> int`: device bytes the policy holds of gradients it was given, and of parked moments,
    # to be let go as the next forward goes (free for the next step, which counts on it)
    held_device_bytes: Callable[[], int] = lambda: 0
