"""When each group's AdamW runs during training, and where: the two update policies (as its gradient lands;
once the clip coefficient is known), the CPU worker that runs host groups' updates in the order the next
forward needs them, the GPU's for resident groups, and the embedding's rows updated first.

Both policies give what a synchronous `torch.optim.AdamW` step gives. A training loop wires them to a
pipeline: `grads_landed` / `device_grads_made` are its gradient hooks, `HostUpdates.wait` / `.done` its
`before_fetch` / `updates_done`, `EmbeddingRowsFirst.rows` its `first_rows`.
"""

import math
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor

from .adamw import DeviceAdamW, DeviceClip, HostAdamW, OptimError
from .stepper import BackgroundStepper

Span = Callable[[str], AbstractContextManager]


def _finite(sq_norm: Tensor | None) -> bool:
    """Whether a landed gradient may be applied: its squared norm is finite (None: not checked per group)."""
    return sq_norm is None or math.isfinite(float(sq_norm))


def _synchronize(event: Any) -> None:
    if event is not None:
        event.synchronize()


class Sharing:
    """What happens once a group is updated, for other processes to see: nothing with one process. A data-parallel
    run gives its own (marking shared flags, exchanging a split state's parts) with the same methods; `steps`
    counts the optimizer steps the group's weights must hold."""

    def updated(self, group: int, steps: int) -> None:
        """Runs on the worker after the group's update (skipped or not)."""

    def mark(self, group: int, steps: int) -> None:
        """The group holds `steps` steps without an update of this process's (a skipped step, a resume)."""

    def wait(self, groups: Iterable[int], steps: int) -> None:
        """Until every process has applied `steps` steps to `groups`."""

    def done(self, groups: Iterable[int], steps: int) -> bool:
        """Whether `wait(groups, steps)` would return at once."""
        return True

    def close(self) -> None:
        """Stop whatever the sharing runs (threads, exchanges); called once, by `HostUpdates.close`."""
        pass


class HostUpdates:
    """Host groups' AdamW on one CPU worker thread. Of the landed gradients the worker takes the one the next
    forward needs first (`forward_order`: group -> its first stage), the oldest when none has landed: where the
    optimizer is slower than the backward, whose gradients land last layer first, the next forward still starts
    while it works on the last layers. A group whose gradient is not finite is not updated. Optimizer state on
    disk is read ahead of the updates (`read_ahead`) and written behind them.

    Where the layers compute on the host's CPU too (`shares_cores`), the worker's torch operations run on one thread:
    a second OpenMP team beside the training thread's (the worker's, once it has run a parallel operation) made
    every layer pass of the default job about 20% slower on two cores, whether or not the worker was busy."""

    def __init__(
        self,
        optimizer: HostAdamW,
        forward_order: dict[int, int],
        names: list[str],
        sharing: Sharing | None = None,
        span: Span | None = None,
        shares_cores: bool = False,
    ):
        self.optimizer, self.store = optimizer, optimizer.store
        self.forward_order, self.names = forward_order, names
        self.last_place = max(forward_order.values()) + 1  # after every place in the forward
        self.sharing = sharing or Sharing()
        self.span = span or (lambda name: nullcontext())
        self.stepper = BackgroundStepper(torch_threads=1 if shares_cores else None)
        self.rows_first: EmbeddingRowsFirst | None = None  # where the embedding's rows go first
        self.steps = 0  # optimizer steps the weights must hold before the next forward reads them
        self.read_direction = -1  # the order updates come in: the backward's (last groups first), or +1

    def queue(
        self, group: int, lr: float, clip: float, landed: Any, step: Tensor, steps: int, sq_norm=None, hold=True
    ) -> None:
        """Queue `group`'s update (its gradient ready once `landed` completes), or with `hold` keep the embedding's
        for its rows first."""
        update = (group, lr, clip, landed, step, steps, sq_norm)
        if hold and self.rows_first is not None and self.rows_first.hold(update):
            return
        self.stepper.submit(
            group,
            lambda: self.update(*update),
            priority=(steps, self.forward_order[group]),  # what the next forward needs first
            ready=None if landed is None else landed.query,
        )

    def update(self, group: int, lr: float, clip: float, landed: Any, step: Tensor, steps: int, sq_norm=None) -> None:
        """Runs on the worker: wait for the gradient to land, update, free its buffer, share the result."""
        _synchronize(landed)
        self.read_ahead(group, 1)
        if _finite(sq_norm):
            with self.span(f"adamw {self.names[group]}"):
                self.optimizer.update_group(group, lr, clip, step)
        self.store.write_behind_state(group)
        self.store.release_grad(group)
        self.sharing.updated(group, steps)

    def read_ahead(self, group: int, first: int, ahead: int = 2) -> None:
        """Start reading the disk-tier state of the groups updated `first` .. `ahead` after `group` (two keep the
        disk busy while one group's read would otherwise wait for the previous update)."""
        for distance in range(first, ahead + 1):
            other = group + self.read_direction * distance
            if 0 <= other < self.store.n_groups:
                self.store.prefetch_state(other)

    def wait(self, groups: Iterable[int]) -> None:
        """Until `groups` hold `steps` updates (a held one queued whole first): before their weights are read. (A
        frozen group, `HostStore.frozen`, is never updated: nothing to wait for.)"""
        groups = tuple(g for g in groups if g not in self.store.frozen)
        for group in groups:
            if self.rows_first is not None:
                self.rows_first.release(group)
            self.stepper.wait(group)
        self.sharing.wait(groups, self.steps)

    def done(self, groups: Iterable[int]) -> bool:
        """Whether `wait(groups)` would return at once."""
        groups = tuple(g for g in groups if g not in self.store.frozen)
        if any(self.stepper.busy(g) or (self.rows_first is not None and self.rows_first.holds(g)) for g in groups):
            return False
        return self.sharing.done(groups, self.steps)

    def first_rows(self, group: int, rows: Tensor) -> Tensor | None:
        """The pipeline's first_rows hook: the embedding's `rows` updated first, or None (the whole table goes)."""
        return None if self.rows_first is None else self.rows_first.rows(group, rows)

    def wait_all(self) -> None:
        """Until every queued update has been applied (re-raising the worker's errors), by every process."""
        self.wait(range(self.store.n_groups))

    def close(self) -> None:
        """Stop the worker thread and the sharing; queue nothing after."""
        self.stepper.close()
        self.sharing.close()


class EmbeddingRowsFirst:
    """The first stage's table (the embedding) is the last gradient of a step and the first weight of the next: its
    update is held until the next step says which rows its tokens read (`rows`, the pipeline's first_rows hook);
    those rows are updated first, into `rows_out` (pinned, [rows, d_model]), and sent alone, while the rest of the
    table is updated beside the forward; then the rows are written back, so that the master holds what the GPU was
    given (the fused kernel's lanes may differ in the last bit). Only where a step's tokens read at most
    `rows_out`'s rows (beyond that, updating them first would not pay)."""

    def __init__(self, host: HostUpdates, group: int, rows_out: Tensor):
        self.host, self.group, self.rows_out = host, group, rows_out
        self.tokens = 0  # this process's tokens of the next step (the last step's: the next is expected alike)
        self._held: tuple | None = None  # the held update's arguments

    def hold(self, update: tuple) -> bool:
        """Keep `update` (`HostUpdates.queue`'s arguments) back until the next step's rows are known, where it is
        the table's and `tokens` fit `rows_out`; False: not held, the caller queues it."""
        if update[0] != self.group or self.tokens > len(self.rows_out):
            return False
        self._held = update
        return True

    def holds(self, group: int) -> bool:
        """Whether `group`'s update is held back (so `HostUpdates.done` says not done)."""
        return group == self.group and self._held is not None

    def release(self, group: int) -> None:
        """Queue the held update as it is (whole), where something needs it before the next step's rows."""
        if self.holds(group):
            update, self._held = self._held, None
            self.host.queue(*update, hold=False)

    def rows(self, group: int, rows: Tensor) -> Tensor | None:
        """The table's `rows` (sorted unique indices) updated before the rest, in pinned memory: [len(rows), row],
        valid until the next step. None where no update is held (or too many rows): the whole table is copied."""
        if not self.holds(group) or len(rows) > len(self.rows_out):
            return None
        (_, lr, clip, landed, step, steps, sq_norm), self._held = self._held, None
        out = self.rows_out[: len(rows)]
        host, optimizer = self.host, self.host.optimizer

        def rows_first() -> None:
            _synchronize(landed)
            with host.span(f"adamw {host.names[group]} rows"):
                if _finite(sq_norm):
                    optimizer.update_rows(group, rows, out, lr, clip, step)
                else:  # not updated, as the rest will not be
                    torch.index_select(host.store.master(group).view(-1, out.shape[1]), 0, rows, out=out)

        def the_rest() -> None:
            host.update(group, lr, clip, None, step, steps, sq_norm)
            if _finite(sq_norm):
                optimizer.write_rows(group, rows, out)

        # the rows before anything else; the rest after the updates this step's forward waits for and before
        # those of its own gradients (the tied head of the forward, or the table's backward, waits for it)
        rows_done = host.stepper.submit(group, rows_first, priority=(steps, -1))
        host.stepper.submit(group, the_rest, priority=(steps, host.last_place))
        rows_done.result()
        return out


class _Policy:
    """What both update policies share: the host's worker, the GPU's optimizer of resident groups (`device`, None
    where none is), the span that times a resident group's update on the GPU (on the stream it is queued on)."""

    def __init__(self, host: HostUpdates, device: DeviceAdamW | None, device_span: Span | None):
        self.host, self.device = host, device
        self.device_span = device_span or (lambda name: nullcontext())
        self.lr, self.steps = 0.0, 0

    def before_cast(self, groups: Iterable[int]) -> None:
        """The pipeline's before_cast hook: a resident stage's cast (on the compute stream) follows its groups'
        updates queued beside that stream."""
        if self.device is not None:
            self.device.wait_for(groups)

    def bring_back(self, groups: Iterable[int]) -> None:
        """The pipeline's bring_back hook: parked groups' moments back on the device ahead of their update."""
        if self.device is not None:
            self.device.bring_back(groups)

    def let_go_parked(self) -> None:
        """The pipeline's let_go_parked hook: the parked moments' device memory back to the compute stream."""
        if self.device is not None:
            self.device.let_go_parked()

    def held_device_bytes(self) -> int:
        """The pipeline's held_device_bytes hook: the resident gradients that updates beside the compute stream
        still hold."""
        return 0 if self.device is None else self.device.held_bytes

    def gradients_complete(self, loss_sum: Tensor, sq_norm_sum: Tensor) -> None:
        """The step's backward is queued: its summed loss and squared gradient norm (0-dim, on the device, over
        every process), not read yet. Call it before reading them, then `end_step`."""

    def end_step(self, skipped: bool) -> None:
        """The host has read the step's loss and norm: `skipped` where either is not finite."""


class UpdatesAsGradientsLand(_Policy):
    """Clipping off: each group is updated the moment its gradient lands (host groups by the CPU worker, overlapping
    the rest of the backward; resident ones on the GPU's compute stream right after their backward), so gradients
    need only a small pool of landing buffers. A group whose gradient is not finite is not updated."""

    def __init__(self, host: HostUpdates, device: DeviceAdamW | None = None, device_span: Span | None = None):
        super().__init__(host, device, device_span)
        host.read_direction = -1

    def begin_step(self, step_index: int, lr: float) -> None:
        """Called by the trainer before step `step_index` (0-based) runs, with its learning rate: the updates its
        gradients queue as they land use them; the host worker reads the head's state ahead first."""
        self.lr, self.steps = lr, step_index + 1  # (the next step may begin before these updates run)
        self.host.steps = step_index
        self.host.optimizer.begin_step()
        self.host.read_ahead(self.host.store.n_groups - 1, 0)  # the head updates first, after the forward

    def grads_landed(self, group: int, landed: Any, sq_norm: Tensor) -> None:
        """The pipeline's on_grads_landed hook: queue the host group's update on the worker (it waits for `landed`;
        not applied where `sq_norm` is not finite)."""
        self.host.queue(group, self.lr, 1.0, landed, self.host.optimizer.step_tensor, self.steps, sq_norm)

    def device_grads_made(self, group: int, grad: Tensor, sq_norm: Tensor) -> None:
        """The pipeline's on_device_grads hook: queue the resident group's update on the current (compute) stream."""
        with self.device_span(f"adamw {self.host.names[group]}"):
            self.device.update(group, grad, self.lr, 1.0, self.host.optimizer.step_tensor, sq_norm)

    def end_step(self, skipped: bool) -> None:
        """Nothing left to queue: every group was updated (or not, where not finite) as its gradient landed."""
        self.host.steps = self.steps


class UpdatesAfterClipping(_Policy):
    """Clipping on: every gradient is held (a landing buffer per group, or on the GPU for resident groups) until the
    global norm is known after the last layer; then the clip coefficient is fixed and the updates are queued in
    layer order, overlapping the next step's forward, which needs layer 0 first: resident groups' beside the compute
    stream as soon as the backward is queued, their coefficient computed on the GPU (`gradients_complete`; each
    resident stage's cast waits for its own, `before_cast`), host groups' on the CPU worker once the host has read
    the norm (`end_step`). A non-finite norm or loss skips the step. The store must land every group's gradient
    at once (`HostStore(grad_pool=None)`): a pooled one is refused."""

    def __init__(
        self, host: HostUpdates, max_norm: float, device: DeviceAdamW | None = None, device_span: Span | None = None
    ):
        if host.store.grad_pool is not None:  # (the held gradients would fill the pool and wait on it forever)
            raise OptimError(
                "clipping holds every group's gradient until the global norm is known: give the HostStore a gradient "
                f"buffer per group (grad_pool=None), not a pool of {host.store.grad_pool:g} largest groups"
            )
        super().__init__(host, device, device_span)
        self.max_norm = max_norm
        self.landed: dict[int, Any] = {}
        self.clip: DeviceClip | None = None  # the step's, once its gradients are complete
        host.read_direction = 1

    def begin_step(self, step_index: int, lr: float) -> None:
        """Called by the trainer before step `step_index` (0-based) runs, with its learning rate; forgets the last
        step's gradients."""
        self.lr, self.steps, self.landed = lr, step_index + 1, {}
        self.host.steps = step_index

    def grads_landed(self, group: int, landed: Any, sq_norm: Tensor) -> None:
        """The pipeline's on_grads_landed hook: hold the host group's gradient (its landing event) until `end_step`."""
        self.landed[group] = landed

    def device_grads_made(self, group: int, grad: Tensor, sq_norm: Tensor) -> None:
        """The pipeline's on_device_grads hook: hold the resident group's gradient until `gradients_complete`."""
        self.landed[group] = grad

    def gradients_complete(self, loss_sum: Tensor, sq_norm_sum: Tensor) -> None:
        """Fix the step's clip coefficient and skip flag on the device (`DeviceClip`: the host groups' updates read
        the same coefficient in `end_step`) and queue the resident groups' updates beside the compute stream now, in
        layer order, in the step count `end_step` begins: the GPU updates them while the host waits for the
        backward to read the norm and queues the next step. (Queued after that read, they kept the GPU waiting:
        Qwen2.5-7B on an H200, one call, one placement: 8k tokens 515.3 -> 523.8 model TFLOPS, 32k 507.7 -> 521.1.)"""
        self.clip = DeviceClip.of_sums(loss_sum, sq_norm_sum, self.max_norm)
        if self.device is None:
            return
        step = torch.tensor(float(self.host.optimizer.step_count + 1))
        for group in sorted(set(self.landed) & set(self.device.masters)):
            span = partial(self.device_span, f"adamw {self.host.names[group]}")  # (timed on the stream it runs on)
            self.device.update_beside(group, self.landed.pop(group), self.lr, self.clip, step, span=span)

    def end_step(self, skipped: bool) -> None:
        """The host has read the step's loss and norm (after `gradients_complete`): queue the host groups' updates
        in layer order with the clip coefficient, or, `skipped`, mark every group as holding the step unchanged."""
        host, landed, self.landed = self.host, self.landed, {}
        if self.clip is None:
            raise OptimError("call gradients_complete(loss_sum, sq_norm_sum) after the backward, before end_step")
        clip, self.clip = self.clip.coef.item(), None
        host.steps = self.steps
        if skipped:  # no update, so nothing to exchange, on every process
            for group in range(host.store.n_groups):
                host.sharing.mark(group, self.steps)
            return
        host.optimizer.begin_step()
        host.read_ahead(0, 0)
        step = host.optimizer.step_tensor
        for group in sorted(landed):  # layer order: the next forward needs layer 0 first
            host.queue(group, self.lr, clip, landed[group], step, self.steps)
