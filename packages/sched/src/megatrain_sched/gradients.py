"""The gradient sink of a step: one fp32 device buffer per group that its stages' backwards add to (new each step, or
kept from step to step: `GradientSink.place`), and, after the group's last user, its reduction over processes, its
squared norm and its hand-off to the update policy: copied out to the store's landing buffer on the copy-out stream,
or handed over on the device for a resident group."""

from collections.abc import Callable

import torch
from torch import Tensor

from megatrain_store import HostStore

from .hooks import Hooks
from .placement import Placement
from .streams import Streams
from .timeline import Timeline

# elements a norm kernel sums at a time in `sq_norm`
NORM_CHUNK = 1024


def sq_norm(flat: Tensor) -> Tensor:
    """The squared L2 norm of a flat fp32 buffer, in float64: its chunks' norms, their squares summed in float64.
    torch's fp32 vector_norm of a whole layer's buffer on the CPU loses precision with its length (4.2M elements:
    4e-4 relative, 50M: 7e-3, where torch's clip_grad_norm_ takes a norm per parameter); by chunks it stays near
    fp32's rounding, with no float64 copy of the buffer (vector_norm's dtype=float64 makes one)."""
    whole = flat.numel() - flat.numel() % NORM_CHUNK
    total = torch.linalg.vector_norm(flat[whole:]).double().square()
    if whole:
        total = total + torch.linalg.vector_norm(flat[:whole].view(-1, NORM_CHUNK), dim=1).double().square().sum()
    return total


class GradientSink:
    """Where a step's weight gradients accumulate and how each group's leaves, once whole.

    `reduce_grad(group, buffer)`, with several processes, sums a group's gradient over them and returns this
    process's shard of the sum (`store.shard_range`), which alone is sent to host memory; it is called on the
    copy-out stream, so collectives there never hold up compute. `buffer` is padded to a whole number of shards."""

    def __init__(
        self,
        stages: list,
        store: HostStore,
        streams: Streams,
        timeline: Timeline,
        hooks: Hooks,
        reduce_grad: Callable[[int, Tensor], Tensor] | None,
        weightless_backward: set[int],
    ):
        self.stages, self.store, self.streams, self.timeline, self.hooks = stages, store, streams, timeline, hooks
        self.device = streams.device
        self.reduces_over_processes = reduce_grad is not None
        self.reduce_grad = reduce_grad or self._own_shard
        self.weightless_backward = weightless_backward
        self.device_masters: dict[int, Tensor] = {}  # resident groups: their gradient stays on the device
        # squared gradient norms as they land, readable by the optimizer thread without a device sync
        self._host_sq_norms = torch.zeros(store.n_groups, dtype=store.master_dtype, pin_memory=streams.cuda)
        # what of each group's gradient buffer is gradient, where not all of it (load-balanced biases' statistics)
        self._gradient_runs = [
            runs if runs != [(0, layout.numel)] else None
            for layout, runs in ((layout, layout.gradient_runs()) for layout in store.layouts)
        ]
        # how many stages bind each group in backward: its gradient leaves after the last one
        self._users = [0] * store.n_groups
        for stage in stages:
            for group in stage.groups:
                self._users[group] += 1
        self._carried: dict[int, Tensor] = {}  # resident groups' gradient buffers, from sweep to sweep
        # groups whose buffers persist from step to step (`place`): each with the event its last copy out ended at
        self._persistent: dict[int, tuple[Tensor, object]] = {}
        self._spare: Tensor | None = None  # on the CPU: the last buffer whose gradient left (`_new_buffer`)
        self.begin_step(sweep=0, last_sweep=True, warm_up=False)

    def place(self, placement: Placement, device_masters: dict[int, Tensor]) -> None:
        """Send the resident groups' (`device_masters`) gradients to the update on the device, and keep the buffers of
        `placement.persistent_gradients`' groups from step to step: allocated here, before a step's products and
        parked moments cut the device's memory up, so that they keep their range. Between steps only."""
        self.device_masters = device_masters
        groups = {g for i in placement.persistent_gradients for g in self.stages[i].groups}
        groups -= set(self.store.frozen) | set(device_masters)
        self._persistent = {
            g: self._persistent.get(g) or (self._new_buffer(self._padded_numel(g)), None) for g in sorted(groups)
        }

    def begin_step(self, sweep: int, last_sweep: bool, warm_up: bool) -> None:
        """A sweep's gradients: zero norms, the resident groups' buffers of the step's earlier sweeps; those of the
        last sweep land (and go to the hooks), none of a warm-up's."""
        self.sweep, self.last_sweep, self.warm_up = sweep, last_sweep, warm_up
        self.sq_norms = torch.zeros(self.store.n_groups, dtype=self.store.master_dtype, device=self.device)
        self.remaining = list(self._users)  # group -> stages yet to run its backward
        self.buffers = self._carried if sweep else {}
        self._carried, self._spare = {}, None

    def of(self, stage: int) -> list[Tensor | None]:
        """The stage's groups' device gradient buffers (padded to whole shards), as exact-size views; None for a
        frozen group."""
        buffers = []
        for group in self.stages[stage].groups:
            if group in self.store.frozen:
                buffers.append(None)  # (the template computes no gradient for it)
                continue
            if group not in self.buffers:
                self.buffers[group] = self._buffer_for(group)
            buffers.append(self.buffers[group][: self.store.layouts[group].numel])
        return buffers

    def _buffer_for(self, group: int) -> Tensor:
        """A zeroed gradient buffer for `group`, padded to whole shards: its persistent one once its last gradient
        has left (the compute stream waits for that copy out), else a new one."""
        if group not in self._persistent:
            return self._new_buffer(self._padded_numel(group))
        buffer, copied_out = self._persistent[group]
        self.streams.wait(self.streams.compute, copied_out)
        return buffer.zero_()

    def _padded_numel(self, group: int) -> int:
        """A group's elements padded to a whole number of shards (what `reduce_grad` is given)."""
        return self.store.shard_size(group) * self.store.shard[1]

    def _new_buffer(self, numel: int) -> Tensor:
        """A zeroed gradient buffer. On the CPU the last one whose gradient left is zeroed again where it has the
        size (the next layer's, in a backward): a new one of a layer's size is mapped and faulted in page by page (a
        0.5B model's step spent more time so than in its update). One such buffer at most, and none past its sweep:
        the host memory the plan counts. On a GPU the caching allocator reuses freed memory in stream order."""
        spare, self._spare = self._spare, None
        if spare is not None and spare.numel() == numel:
            return spare.zero_()
        return torch.zeros(numel, dtype=self.store.master_dtype, device=self.device)

    def _release(self, group: int, buffer: Tensor, copied_out=None) -> None:
        """A buffer whose gradient has left, the copy out ending at event `copied_out` (on the CPU it is done when
        `_copy_out` returns): a persistent one waits for the group's next gradient, else the CPU's is the spare."""
        if group in self._persistent:
            self._persistent[group] = (buffer, copied_out)
        elif not self.streams.cuda:
            self._spare = buffer

    def _own_shard(self, group: int, buffer: Tensor) -> Tensor:
        start, end = self.store.shard_range(group)
        return buffer[start:end]

    def _sq_norm(self, group: int, grad: Tensor, start: int) -> Tensor:
        """The squared norm of a group's gradient buffer holding its flat range from `start` on, less the
        load-balanced biases' slots: they hold load statistics, not gradients (megatrain_store.LOAD_BIAS)."""
        runs = self._gradient_runs[group]
        if runs is None:
            return sq_norm(grad)
        end = start + grad.numel()
        pieces = [grad[max(o, start) - start : min(o + n, end) - start] for o, n in runs if o < end and o + n > start]
        if not pieces:
            return grad.new_zeros(())
        return torch.stack([sq_norm(piece) for piece in pieces]).sum()

    def send(self, stage: int, log: list) -> None:
        """Send out the gradients of stage's groups that no later backward adds to: to host memory on the
        copy-out stream, or to `on_device_grads` for resident groups (none in a warm-up). Before a step's last
        sweep a resident group's buffer stays for the next sweep to add to, and a host group's sum so far lands
        unannounced: the next sweep adds it back on the device before its own copy out."""
        for group in self.stages[stage].groups:
            self.remaining[group] -= 1
            if self.remaining[group] or group in self.store.frozen:
                continue
            if group in self.device_masters and not self.last_sweep:
                self._carried[group] = self.buffers.pop(group)
                continue
            buffer = self.buffers.pop(group)
            if self.warm_up:
                self._release(group, buffer)
                continue
            if group in self.device_masters:
                self.sq_norms[group] = self._sq_norm(group, buffer, 0)
                self.hooks.on_device_grads(group, buffer[: self.store.layouts[group].numel], self.sq_norms[group])
                log.append(("grad_on_device", group, None))
                continue
            if stage in self.weightless_backward:
                # no weight copy waited for the group's last update; its gradient must not land before it
                self.hooks.before_fetch((group,))
            self._release(group, buffer, self._copy_out(stage, group, buffer, log))

    def _copy_out(self, stage: int, group: int, buffer: Tensor, log: list):
        """Queue a host group's gradient, reduced, into its landing buffer on the copy-out stream (and, in the last
        sweep, its squared norm), and tell the update policy; the event the copy out ends at (None on the CPU)."""
        streams = self.streams
        done = streams.record(streams.compute)
        destination = self.store.acquire_grad(group)  # may wait for the optimizer to free a buffer
        streams.wait(streams.copy_out, done)
        with (
            streams.on(streams.copy_out),
            self.timeline.device_span(f"grad_out {self.stages[stage].name}", "copy_out", streams, streams.copy_out),
        ):
            shard = self.reduce_grad(group, buffer)
            if self.sweep:  # the earlier sweeps' sum (the same copy-out stream wrote it: no wait)
                shard.add_(destination.to(self.device, non_blocking=True))
            destination.copy_(shard, non_blocking=True)
            if self.last_sweep:
                self.sq_norms[group] = self._sq_norm(group, shard, self.store.shard_range(group)[0])
                self._host_sq_norms[group].copy_(self.sq_norms[group], non_blocking=True)
            landed = streams.record(streams.copy_out)
        streams.keep_alive(buffer, streams.copy_out)
        log.append(("grad_out", group, None))
        if self.last_sweep:
            self.hooks.on_grads_landed(group, landed, self._host_sq_norms[group])
        return landed
