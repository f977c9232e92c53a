"""One optimizer step's forward and backward, layer-major over device weight slots.

Positions of a step: forward stages 0..n-2, the head n-1 (loss + its backward), then
backward stages n-2..0. Position p computes in slot p % n_slots; while it computes,
the weights of positions p+1 .. p+n_slots-1 are copied in on the copy-in stream (a
slot is refilled only after the compute that used it has finished). Position n (the
last block, backward) finds its weights still in the slot of position n-2, so with two
slots they are not copied again; held stages (`held_layers`, the first blocks) have a
buffer of their own instead, which keeps their weights from forward to backward.
Gradients of a group accumulate in one fp32 device buffer and are copied out once, when
the last stage that binds the group has run backward. Groups whose master weights live on
the device (`device_masters`: the optimizer updates them there) are cast into the slot from
that master instead, and their gradient is handed over on the device instead of copied out.

Weights travel as the store keeps them: an fp32 master is copied in through two small
fp32 staging buffers and cast to the compute dtype on a cast stream, so the host needs no
second, bf16 copy of the model. The casts run on their own stream so that the copy
engine never waits for one: a cast is a kernel, and it may wait for SMs behind the
compute stream's GEMMs.
"""

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from megatrain_store import HostStore, pin_in_place, unpin

from .streams import Streams
from .timeline import Timeline

# Elements per staged host->device copy of an fp32 master (128 MiB per buffer, two buffers):
# large enough to run at full PCIe speed and to absorb a cast's wait for SMs, small next to
# the slots.
STAGING_NUMEL = 2**25

# Device memory left free beside kept layers' products, past two gradients and a recompute: the head's
# logits chunk with its gradient (3 GiB) and the allocator's slack.
KEPT_SLACK_BYTES = 5 * 2**30


def expandable_device_memory() -> None:
    """Let the CUDA caching allocator grow its segments in place (`expandable_segments`) unless the user's
    PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF says otherwise. Kept products fill the device to a few GiB, in
    tensors of a few sizes that come and go in a different order each pass: in fixed segments the freed
    pieces end up too small for the head's 1 GB logits chunk (Llama-2-7B at 128k tokens, an H200: 6.6 GiB
    free in pieces, out of memory), grown segments keep the free memory whole."""
    settings = os.environ.get("PYTORCH_ALLOC_CONF", "") + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in settings:
        return
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # (the older name warns)
    if set_settings is None:
        set_settings = torch.cuda.memory._set_allocator_settings
    set_settings("expandable_segments:True")


class SchedError(Exception):
    """A stage list or batch the scheduler cannot run, with the fix in the message."""


@dataclass(frozen=True)
class Stage:
    """A template and the store groups it binds, in the template's order.

    The template provides `groups` (its layouts), `forward(weights, x)` and
    `backward(weights, x, grad_out, grads)` (both also taking `documents=` when a micro-batch
    packs documents; `x` is what the optional `checkpoint(x)` keeps of the input, a tensor, else the
    input; activations between stages may be tuples of tensors). A template may also provide
    `prepare(weights, x)`, run for every micro-batch before the first forward, whose results are
    given to `forward` and `backward` as `prepared=` (work that waits for the GPU, started early).
    The last stage provides `loss(weights, x, labels, loss_scale, grads)` instead, and
    `loss_sum(weights, x, labels)` for forward-only evaluation."""

    template: Any
    groups: tuple[int, ...]
    name: str = ""


@dataclass
class MicroBatch:
    input_ids: Tensor  # [micro_batch, seq] int64
    labels: Tensor  # [micro_batch, seq] int64, -100 where no loss
    # several documents per row (e.g. megatrain_templates.Documents): given to every template as
    # `documents=`, moved to the device with `.to(device, non_blocking=True)`; None: one sequence per row
    documents: Any = None

    def to(self, device: torch.device) -> "MicroBatch":
        documents = None if self.documents is None else self.documents.to(device, non_blocking=True)
        return MicroBatch(
            self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), documents
        )

    @property
    def template_kwargs(self) -> dict:
        return {} if self.documents is None else {"documents": self.documents}


@dataclass
class StepResult:
    loss_sum: Tensor  # fp32 scalar on the device: summed token losses of the step
    group_sq_norms: Tensor  # [n_groups] fp32 on the device: squared gradient norm per group
    log: list[tuple] = field(default_factory=list)  # ("copy_in"|"reuse"|"compute"|"grad_out", stage or group, slot)


@dataclass
class _Reloaded:
    x: Tensor  # the checkpoint back on the device
    ready: Any  # event: its copy finished


@dataclass
class _Offloaded:
    host: Tensor  # pinned
    copied: Any  # event: the copy out finished
    name: str  # what it is, in the timeline: "checkpoint <stage>" or "products <stage>"
    reloaded: _Reloaded | None = None


class _HostMemory:
    """Pinned host memory for what a step sends out and brings back: a flat buffer per use (each offloaded
    stage's checkpoints, each host-kept stage's products), touched and page-locked in place, exact bytes (the CUDA
    host allocator rounds each allocation up to a power of two: a 112 MiB checkpoint would take 128, a
    7B layer's 10 GB of products at 128k tokens 16), grown when a step needs more and kept across steps,
    so that only the first step that needs it (or `LayerPipeline.warm_up`) pays for pinning it. A step's
    copies into a buffer are ordered after the previous step's copies out of it by the compute stream,
    which waited for those before that step's backward read them."""

    def __init__(self, streams: Streams):
        self.streams = streams
        self.buffers: dict[Any, Tensor] = {}
        self._pinned: dict[Any, int] = {}  # use -> data_ptr page-locked
        weakref.finalize(self, lambda pinned: [unpin(ptr) for ptr in pinned.values()], self._pinned)

    def room(self, use: Any, nbytes: int) -> "_Cursor":
        """`nbytes` of the buffer for `use`, handed out in order."""
        if use not in self.buffers or self.buffers[use].numel() < nbytes:
            if use in self._pinned:
                torch.cuda.synchronize(self.streams.device)  # no copy may still read or write it
                unpin(self._pinned.pop(use))
            self.buffers.pop(use, None)  # freed before the larger one is taken
            # touched by torch's threads before it is locked: registering faulted-in pages is faster
            self.buffers[use] = torch.zeros(nbytes, dtype=torch.uint8)
            if self.streams.cuda and pin_in_place(self.buffers[use]):
                self._pinned[use] = self.buffers[use].data_ptr()
        return _Cursor(self.buffers[use], self.streams.cuda)


@dataclass
class _Cursor:
    buffer: Tensor
    pin: bool  # whether what the buffer has no room for is taken pinned
    offset: int = 0

    def take(self, like: Tensor) -> Tensor:
        """The next `like`-shaped tensor of the buffer, or of the CUDA host allocator where it is full (a model
        whose head template gives no `d_model`, or whose block templates' `checkpoint_planes` undercount)."""
        nbytes = like.numel() * like.element_size()
        if self.offset + nbytes > self.buffer.numel():
            return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)
        view = self.buffer[self.offset : self.offset + nbytes].view(like.dtype).view(like.shape)
        self.offset += nbytes
        return view


@dataclass
class _Rows:
    ids: Tensor  # the sorted unique input ids of a step (host)
    local: list[Tensor]  # each micro-batch's input ids as indices into `ids` (device)
    table: Tensor | None = None  # what first_rows gave for them (None: the whole table was copied)


@dataclass
class _Kept:
    x: Any  # the checkpoint, as for any layer
    products: dict  # what the template's forward_keeping_products gave: its backward skips those GEMMs


@dataclass
class _Slot:
    buffer: Tensor
    stage: int | None = None  # which stage's weights it holds (valid within a step)
    ready: Any = None  # event: its copy-in finished
    free: Any = None  # event: the last compute reading it finished


class LayerPipeline:
    """Runs forward and backward of all stages for a list of micro-batches.

    `before_fetch(groups)` is called before a stage's weights are read from the store, and before
    the gradient of a stage that reads none in its backward is sent (the optimizer must have
    finished updating them); `updates_done(groups)` says, without
    waiting, whether it has (so that copies can be queued early); `on_grads_landed(group, event,
    sq_norm)` is called when a group's gradient copy-out has been queued: `event`
    completes when the host buffer holds it (None on the CPU, where it already does) and
    `sq_norm` is a host scalar tensor, valid from then on, with the gradient's squared norm.
    With several processes, `reduce_grad(group, buffer)` sums a group's gradient over them and
    returns this process's shard of the sum (`store.shard_range`), which alone is sent to host
    memory; it is called on the copy-out stream, so collectives there never hold up compute.
    `buffer` is padded to a whole number of shards.

    A block template that provides `forward_keeping_products(weights, x) -> (y, products)` (and
    `product_bytes_per_token(element_size)`) has its forward's matmul products kept beside the
    checkpoint, for the last `kept_layers` block stages (None: as many as fit the free device
    memory), and given to its backward as `products=`, which then recomputes no GEMM. Another
    `host_kept_layers` stages before those, spread evenly over the rest, keep theirs in pinned host
    memory: copied out on the copy-out stream, idle in the forward, and back on the copy-in stream
    a stage ahead of their backward (large steps, whose GPU is the bound and PCIe has time to spare).
    Activation checkpoints (each block stage's input) stay on the device, or go to pinned host memory
    for the first blocks (`offload_checkpoints`: True all, None as the free device memory decides, and
    also as many as make room for more kept layers' products, up to `offload_for_products`), kept
    layers' included.

    A template whose backward reads none of its weights (`backward_reads_weights = False`: an
    embedding's only scatters its gradient) gets no copy of them for it; the wait for their last
    update comes before its gradient is sent instead.

    `device_masters` maps groups whose fp32 master weights live on the device (updated there, by work
    queued on the compute stream) to that master: their stages are cast from it into the slot, with
    no copy from the store, no `before_fetch` and no held buffer, and instead of being copied out
    their gradient goes to `on_device_grads(group, grad, sq_norm)` (both device tensors; called on
    the compute stream once the group's last backward is queued; the buffer is the callee's from then
    on). A stage binds only such groups or none.

    Where the first stage's template reads only the rows of its one group that the tokens select
    (`forward_rows(rows, local_ids)`, an embedding), a training step first asks
    `first_rows(group, rows)` for those (sorted unique input ids): a host tensor [len(rows), row]
    of them, up to date, given while the rest of the group may still be updating (so this is not
    preceded by `before_fetch`), or None to copy the whole group as usual.
    """

    def __init__(
        self,
        stages: list[Stage],
        store: HostStore,
        device: torch.device,
        n_slots: int = 2,
        offload_checkpoints: bool | None = False,
        offload_for_products: int | None = None,
        kept_layers: int | None = 0,
        host_kept_layers: int = 0,
        held_layers: int = 0,
        device_masters: dict[int, Tensor] | None = None,
        on_device_grads: Callable[[int, Tensor, Tensor], None] = lambda group, grad, sq_norm: None,
        before_fetch: Callable[[tuple[int, ...]], None] = lambda groups: None,
        updates_done: Callable[[tuple[int, ...]], bool] = lambda groups: True,
        first_rows: Callable[[int, Tensor], Tensor | None] = lambda group, rows: None,
        on_grads_landed: Callable[[int, Any, Tensor], None] = lambda group, event, sq_norm: None,
        timeline: Timeline | None = None,
        reduce_grad: Callable[[int, Tensor], Tensor] | None = None,
    ):
        if len(stages) < 2:
            raise SchedError("a model needs at least two stages: an input stage and a loss stage")
        if n_slots < 2:
            raise SchedError(f"n_slots must be >= 2 to overlap copies with compute, got {n_slots}")
        if not hasattr(stages[-1].template, "loss"):
            raise SchedError(f"the last stage {stages[-1].name!r} must provide loss()")
        for index, stage in enumerate(stages):
            layouts = stage.template.groups
            if len(layouts) != len(stage.groups):
                raise SchedError(f"stage {index} binds {len(stage.groups)} groups, its template has {len(layouts)}")
            for group, params in zip(stage.groups, layouts):
                need = sum(p.numel for p in params)
                if store.layouts[group].numel != need:
                    raise SchedError(
                        f"stage {index} ({stage.name}) expects {need} elements in group {group}, "
                        f"the store holds {store.layouts[group].numel}"
                    )
        self.stages, self.store, self.device = stages, store, torch.device(device)
        self.streams = Streams(self.device)
        if self.streams.cuda:
            expandable_device_memory()
        # None: decided each step from the checkpoints' size and the free device memory (on the CPU: none; set,
        # they are copied to other host tensors there, the same logic with nothing to gain)
        self.offload_checkpoints = (
            offload_checkpoints if self.streams.cuda or offload_checkpoints is not None else False
        )
        self.offload_for_products = offload_for_products
        # None: as many of the last block stages as the free device memory holds (none on the CPU)
        self.kept_layers = kept_layers if self.streams.cuda or kept_layers is not None else 0
        self.last_kept = 0  # how many block stages the last training step kept the products of
        self.host_kept_layers = host_kept_layers
        self._host_memory = _HostMemory(self.streams)
        self.last_host_kept = 0  # ... of those, how many in host memory
        self.last_offloaded = 0  # how many block stages' checkpoints the last training step sent to host memory
        self.before_fetch, self.updates_done, self.on_grads_landed = before_fetch, updates_done, on_grads_landed
        self.first_rows = first_rows
        self.device_masters, self.on_device_grads = device_masters or {}, on_device_grads
        self._on_device = set()  # stages whose weights are cast from device masters
        for index, stage in enumerate(stages):
            resident = [g in self.device_masters for g in stage.groups]
            if any(resident) and not all(resident):
                raise SchedError(f"stage {index} ({stage.name}) binds groups with device masters and groups without")
            if all(resident):
                self._on_device.add(index)
        if self.device_masters and reduce_grad is not None:
            raise SchedError("groups updated on the device cannot be reduced over processes (reduce_grad)")
        self._rows: _Rows | None = None  # this step's first-stage rows, where the template takes them
        self.reduce_grad = reduce_grad or self._own_shard
        self.timeline = timeline or Timeline(enabled=False)
        # squared gradient norms as they land, readable by the optimizer thread without a device sync
        self._host_sq_norms = torch.zeros(store.n_groups, dtype=store.master_dtype, pin_memory=self.streams.cuda)
        # what of each group's gradient buffer is gradient, where not all of it (load-balanced biases' statistics)
        self._gradient_runs = [
            runs if runs != [(0, layout.numel)] else None
            for layout, runs in ((layout, layout.gradient_runs()) for layout in store.layouts)
        ]
        stage_numels = [sum(store.layouts[g].numel for g in stage.groups) for stage in stages]
        slot_numel = max(stage_numels)
        self.slots = [
            _Slot(torch.empty(slot_numel, dtype=store.compute_dtype, device=self.device)) for _ in range(n_slots)
        ]
        cast_on_device = self.streams.cuda and store.wire(0).dtype != store.compute_dtype
        staging_numel = min(slot_numel, STAGING_NUMEL)
        self._staging = (
            [torch.empty(staging_numel, dtype=store.wire(0).dtype, device=self.device) for _ in range(2)]
            if cast_on_device
            else None
        )
        self._cast_stream = torch.cuda.Stream(self.device) if cast_on_device else None
        self._staging_free = [None, None]  # events: the cast that last read each staging buffer finished
        n = len(stages)
        self._train_order = list(range(n - 1)) + [n - 1] + list(range(n - 2, -1, -1))
        self._eval_order = list(range(n))
        self.order = self._train_order  # the step being run's
        # how many stages bind each group in backward: its gradient leaves after the last one
        self._users = [0] * store.n_groups
        for stage in stages:
            for group in stage.groups:
                self._users[group] += 1
        # stages whose backward reads no weights: no copy for it (`backward_reads_weights = False`)
        self._weightless_backward = {
            index for index, stage in enumerate(stages) if not getattr(stage.template, "backward_reads_weights", True)
        }
        # how many of the last block stages can keep their forward's products (`forward_keeping_products`)
        self._keepable = 0
        for stage in reversed(stages[1:-1]):
            if not callable(getattr(stage.template, "forward_keeping_products", None)):
                break
            self._keepable += 1
        self._largest_block = max(stage_numels[1:-1], default=0)
        # the first `held_layers` block stages keep the weights copied in for their forward in a buffer of their
        # own until their backward: one copy in a step instead of two, half the host memory reads of the
        # weights (the last block's backward finds its rotating slot still holding them anyway)
        holdable = [i for i in range(1, n - 2) if i not in self._weightless_backward | self._on_device]
        if not 0 <= held_layers <= len(holdable):
            raise SchedError(
                f"held_layers must be between 0 and {len(holdable)} (the blocks but the last, not updated on the "
                f"device), got {held_layers}"
            )
        self.held_layers = held_layers
        self._held = {
            i: _Slot(torch.empty(stage_numels[i], dtype=store.compute_dtype, device=self.device))
            for i in holdable[:held_layers]
        }

    # ----------------------------------------------------------------- weights
    def _slot_weights(self, slot: _Slot, stage: int) -> list[Tensor]:
        views, offset = [], 0
        for group in self.stages[stage].groups:
            numel = self.store.layouts[group].numel
            views.append(slot.buffer[offset : offset + numel])
            offset += numel
        return views

    def _slot(self, position: int) -> tuple[Any, _Slot]:
        """(name in the step's log, slot) of position's weights: its stage's own buffer where held, else the
        rotating slot of the position."""
        stage = self.order[position]
        if stage in self._held:
            return f"held {stage}", self._held[stage]
        return position % len(self.slots), self.slots[position % len(self.slots)]

    def _fetch(self, position: int, log: list) -> None:
        """Queue the copy of position's weights into its slot (or reuse what is there)."""
        stage = self.order[position]
        slot_name, slot = self._slot(position)
        if slot.stage == stage:
            log.append(("reuse", stage, slot_name))
            return
        streams, groups = self.streams, self.stages[stage].groups
        if position >= len(self.stages) and stage in self._weightless_backward:
            log.append(("no_copy", stage, slot_name))  # its backward binds no weights
            return
        if stage in self._on_device:
            self._cast_device_masters(slot, stage)
            log.append(("cast", stage, slot_name))
            return
        rows = None
        if position == 0 and self._rows is not None:
            rows = self._rows.table = self.first_rows(groups[0], self._rows.ids)
        if rows is None:
            self.before_fetch(groups)
        streams.wait(streams.copy_in, slot.free)  # before the span opens: the span times the transfer alone
        with (
            streams.on(streams.copy_in),
            self.timeline.device_span(f"copy_in {self.stages[stage].name}", "copy_in", streams, streams.copy_in),
        ):
            if rows is not None:
                self._copy_weights(slot.buffer[: rows.numel()], rows.reshape(-1))
            else:
                for view, group in zip(self._slot_weights(slot, stage), groups):
                    self._copy_weights(view, self.store.wire(group))
            if self._cast_stream is not None:  # the slot is complete once the last cast has run
                streams.wait(streams.copy_in, streams.record(self._cast_stream))
            slot.ready = streams.record(streams.copy_in)
        slot.stage = stage if rows is None else None  # (some rows are not the stage's weights)
        log.append(("copy_in", stage, slot_name))

    def _fetch_held_ahead(self, fetched: int, log: list) -> None:
        """Queue the forward copies of held stages beyond `fetched` whose updates are done, in order: their
        buffers are their own, so the copy engine need not wait for the rotating slots (while stages cast
        from device masters compute, it would otherwise idle). Their turn in the order then finds them there."""
        for stage, slot in self._held.items():  # (forward position = stage index)
            if stage <= fetched or slot.stage == stage:
                continue
            if not self.updates_done(self.stages[stage].groups):
                return
            self._fetch(stage, log)

    def _cast_device_masters(self, slot: _Slot, stage: int) -> None:
        """Queue the cast of a stage's device masters into its slot on the compute stream, which orders it
        after their last update and the slot's last reader, and before the stage's compute, with no event
        (a cast is under a millisecond; on the cast stream it would queue behind the copies' casts)."""
        with self.streams.on(self.streams.compute):
            for view, group in zip(self._slot_weights(slot, stage), self.stages[stage].groups):
                view.copy_(self.device_masters[group])
        slot.ready = None
        slot.stage = stage

    def _copy_weights(self, view: Tensor, source: Tensor) -> None:
        """Queue host `source` -> device `view` on the copy-in stream, or through the staging buffers and
        the cast stream when the device casts (then `view` is complete when the cast stream's work is)."""
        if self._staging is None:  # same dtype, or the CPU, where copy_ casts
            view.copy_(source, non_blocking=True)
            return
        streams, chunk_numel = self.streams, self._staging[0].numel()
        for index, start in enumerate(range(0, source.numel(), chunk_numel)):
            chunk = source[start : start + chunk_numel]
            buffer = index % 2
            staged = self._staging[buffer][: chunk.numel()]
            streams.wait(streams.copy_in, self._staging_free[buffer])
            staged.copy_(chunk, non_blocking=True)
            arrived = streams.record(streams.copy_in)
            with streams.on(self._cast_stream):
                streams.wait(self._cast_stream, arrived)
                view[start : start + chunk.numel()].copy_(staged)
                self._staging_free[buffer] = streams.record(self._cast_stream)

    # ---------------------------------------------------------------- gradients
    def _grad_buffers(self, stage: int, grad_buffers: dict[int, Tensor]) -> list[Tensor]:
        """The stage's groups' device gradient buffers (padded to whole shards), as exact-size views."""
        buffers = []
        for group in self.stages[stage].groups:
            if group not in grad_buffers:
                padded = self.store.shard_size(group) * self.store.shard[1]
                grad_buffers[group] = torch.zeros(padded, dtype=self.store.master_dtype, device=self.device)
            buffers.append(grad_buffers[group][: self.store.layouts[group].numel])
        return buffers

    def _own_shard(self, group: int, buffer: Tensor) -> Tensor:
        start, end = self.store.shard_range(group)
        return buffer[start:end]

    def _gradient_sq_norm(self, group: int, grad: Tensor, start: int) -> Tensor:
        """The squared norm of a group's gradient buffer holding its flat range from `start` on, less the
        load-balanced biases' slots: they hold load statistics, not gradients (megatrain_store.LOAD_BIAS)."""
        runs = self._gradient_runs[group]
        if runs is None:
            return torch.linalg.vector_norm(grad).square()
        end = start + grad.numel()
        pieces = [grad[max(o, start) - start : min(o + n, end) - start] for o, n in runs if o < end and o + n > start]
        if not pieces:
            return grad.new_zeros(())
        return torch.stack([torch.linalg.vector_norm(piece).square() for piece in pieces]).sum()

    def _send_grads(
        self,
        stage: int,
        grad_buffers: dict[int, Tensor],
        remaining: list[int],
        sq_norms: Tensor,
        log: list,
        drop: bool = False,
    ) -> None:
        streams = self.streams
        for group in self.stages[stage].groups:
            remaining[group] -= 1
            if remaining[group]:
                continue
            buffer = grad_buffers.pop(group)
            if drop:
                continue
            if group in self.device_masters:
                sq_norms[group] = self._gradient_sq_norm(group, buffer, 0)
                self.on_device_grads(group, buffer[: self.store.layouts[group].numel], sq_norms[group])
                log.append(("grad_on_device", group, None))
                continue
            if stage in self._weightless_backward:
                # no weight copy waited for the group's last update; its gradient must not land before it
                self.before_fetch((group,))
            done = streams.record(streams.compute)
            destination = self.store.acquire_grad(group)  # may wait for the optimizer to free a buffer
            streams.wait(streams.copy_out, done)
            with (
                streams.on(streams.copy_out),
                self.timeline.device_span(f"grad_out {self.stages[stage].name}", "copy_out", streams, streams.copy_out),
            ):
                shard = self.reduce_grad(group, buffer)
                sq_norms[group] = self._gradient_sq_norm(group, shard, self.store.shard_range(group)[0])
                destination.copy_(shard, non_blocking=True)
                self._host_sq_norms[group].copy_(sq_norms[group], non_blocking=True)
                landed = streams.record(streams.copy_out)
            streams.keep_alive(buffer, streams.copy_out)
            log.append(("grad_out", group, None))
            self.on_grads_landed(group, landed, self._host_sq_norms[group])

    # ---------------------------------------------------------- checkpoints
    def checkpoint_bytes(self, batches: list[MicroBatch]) -> int:
        """Device bytes the activation checkpoints of a step take: every block stage's input, or what its
        template's `checkpoint(x)` keeps of it (`checkpoint_planes`, default 1: how many [tokens, d_model]
        tensors that adds, 0 where it is another stage's)."""
        return self._checkpoint_bytes(sum(mb.input_ids.numel() for mb in batches), self.stages[1:-1])

    def _checkpoint_bytes(self, tokens: int, stages: list[Stage]) -> int:
        d_model = getattr(self.stages[-1].template, "d_model", 0)
        planes = sum(getattr(stage.template, "checkpoint_planes", 1) for stage in stages)
        return tokens * d_model * self.store.compute_dtype.itemsize * planes

    def offloaded_stages(self, batches: list[MicroBatch]) -> int:
        """How many block stages, the first ones, keep this step's checkpoints in pinned host memory:
        all or none when set, else as many as do not fit in half of the free device memory (the
        other half is for the slots, gradients and one layer's recompute), and more where that lets
        more layers keep their products (`kept_layers` None; up to `offload_for_products` stages, None: all):
        the fewest that let the most keep them.
        A checkpoint is a layer's input, a product several times that, and its recompute costs far
        more than its copies (out in the forward, on the idle copy-out stream; back a stage ahead of
        the backward), so where products are short of room checkpoints make way for them."""
        n_blocks = len(self.stages) - 2
        if self.offload_checkpoints is not None:
            return n_blocks if self.offload_checkpoints else 0
        per_stage = self.checkpoint_bytes(batches) // max(1, n_blocks)
        if per_stage == 0:
            return 0
        free = self._free_device_bytes()
        offloaded = max(0, n_blocks - int(0.5 * free // per_stage))
        limit = n_blocks if self.offload_for_products is None else min(n_blocks, self.offload_for_products)
        if self.kept_layers is None and self._keepable and offloaded < limit:
            room = self._product_room(batches, free)
            most = self._kept_count(room, per_stage, limit)
            while offloaded < limit and self._kept_count(room, per_stage, offloaded) < most:
                offloaded += 1
        return offloaded

    def kept_stages(self, batches: list[MicroBatch], n_offloaded: int) -> range:
        """The block stages, the last ones, whose forward keeps its products this step: `kept_layers` of them
        where set, else as many as the device memory holds beside the checkpoints kept there and a
        reserve (two fp32 gradients of the largest stage, one micro-batch's recompute and
        KEPT_SLACK_BYTES); none where a template cannot keep them."""
        n_stages = len(self.stages)
        if self.kept_layers is not None:
            count = min(self.kept_layers, self._keepable)
        elif self._keepable == 0:
            count = 0
        else:
            per_stage = self.checkpoint_bytes(batches) // max(1, n_stages - 2)
            count = self._kept_count(self._product_room(batches, self._free_device_bytes()), per_stage, n_offloaded)
        return range(n_stages - 1 - count, n_stages - 1)

    def _free_device_bytes(self) -> int:
        """Device memory free now, with what the allocator holds unused."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)

    def _product_bytes(self, tokens: int) -> int:
        """Bytes of one stage's products for `tokens`."""
        return tokens * self.stages[-2].template.product_bytes_per_token(self.store.compute_dtype.itemsize)

    def _product_room(self, batches: list[MicroBatch], free: int) -> tuple[int, int]:
        """(device bytes of `free` left for checkpoints and kept products past the reserve, bytes of one
        stage's products) this step."""
        stage_products = self._product_bytes(sum(mb.input_ids.numel() for mb in batches))
        micro_products = self._product_bytes(max(mb.input_ids.numel() for mb in batches))
        # a recompute's graph holds about twice a layer's products (its inputs, attention, activation)
        reserve = 2 * self._largest_block * 4 + 2 * micro_products + KEPT_SLACK_BYTES
        # host-kept products wait on the device for their copy out, and come back a stage ahead
        reserve += stage_products if self.host_kept_layers else 0
        return free - reserve, stage_products

    def _kept_count(self, room: tuple[int, int], per_stage: int, n_offloaded: int) -> int:
        """How many layers' products fit `room` (`_product_room`'s) beside the checkpoints (`per_stage` bytes
        a block) left on the device with `n_offloaded` stages' sent to host memory (and one stage's of those
        back a stage ahead of its backward)."""
        free, stage_products = room
        on_device = len(self.stages) - 2 - n_offloaded + (1 if n_offloaded else 0)
        return min(self._keepable, max(0, int((free - on_device * per_stage) // stage_products)))

    def host_kept_stages(self, kept: range) -> dict[int, int]:
        """The `host_kept_layers` block stages before `kept` that keep their products in host memory, each
        with its rank among them (its host buffer), spread evenly from the first keepable one (the copies
        out then keep pace with the forward, and the first layers' backward, last, leaves the copies back
        the most time)."""
        first_keepable = max(1, len(self.stages) - 1 - self._keepable)
        candidates = list(range(first_keepable, kept.start))
        count = min(self.host_kept_layers, len(candidates))
        return {candidates[i * len(candidates) // count]: i for i in range(count)}

    def _step_choices(self, batches: list[MicroBatch]) -> tuple[int, range, dict[int, int]]:
        """A training step's (`offloaded_stages`, `kept_stages`, `host_kept_stages`) for `batches`."""
        n_offloaded = self.offloaded_stages(batches)
        kept = self.kept_stages(batches, n_offloaded)
        return n_offloaded, kept, self.host_kept_stages(kept)

    def _host_rooms(
        self, batches: list[MicroBatch], n_offloaded: int, host_kept: dict[int, int]
    ) -> tuple[dict[int, "_Cursor"], dict[int, "_Cursor"]]:
        """A step's pinned host memory, by block stage: (for the checkpoints of the first `n_offloaded`, for the
        products of each `host_kept` one). A buffer each, so that a step offloading one more stage pins only
        that one's."""
        tokens = sum(mb.input_ids.numel() for mb in batches)
        checkpoints = {
            stage: self._host_memory.room(
                ("checkpoint", stage), self._checkpoint_bytes(tokens, self.stages[stage : stage + 1])
            )
            for stage in range(1, n_offloaded + 1)
        }
        products = {
            stage: self._host_memory.room(("products", rank), self._product_bytes(tokens))
            for stage, rank in host_kept.items()
        }
        return checkpoints, products

    def _offload(self, x: Tensor, copies: dict, name: str, room: "_Cursor") -> "_Offloaded":
        """Start moving a checkpoint or kept product (`name`d) to pinned host memory, the next of `room` (once per
        tensor and step: `copies` holds the step's, by tensor identity, for stages that keep the same
        tensor)."""
        if id(x) in copies and copies[id(x)][0]() is x:
            return copies[id(x)][1]
        streams = self.streams
        host = room.take(x)
        produced = streams.record(streams.compute)
        streams.wait(streams.copy_out, produced)
        with (
            streams.on(streams.copy_out),
            self.timeline.device_span(f"{name} out", "copy_out", streams, streams.copy_out),
        ):
            host.copy_(x, non_blocking=True)
            copied = streams.record(streams.copy_out)
        streams.keep_alive(x, streams.copy_out)
        copies[id(x)] = (weakref.ref(x), _Offloaded(host, copied, name))  # not keeping x alive: it leaves the device
        return copies[id(x)][1]

    def _reload(self, offloaded: "_Offloaded", after: Any) -> "_Reloaded":
        """Start bringing an offloaded tensor back (once while it is in use), into memory of the compute stream's
        (what the backward frees is there: memory taken on the copy-in stream could not be given what the
        compute stream frees, and the caching allocator would have to synchronize the device to find it), so
        copied once the compute work queued before (`after`, an event), which may have used it, has run."""
        if offloaded.reloaded is None:
            streams = self.streams
            with streams.on(streams.compute):
                x = torch.empty_like(offloaded.host, device=self.device)
            streams.wait(streams.copy_in, offloaded.copied)
            streams.wait(streams.copy_in, after)
            with (
                streams.on(streams.copy_in),
                self.timeline.device_span(f"{offloaded.name} in", "copy_in", streams, streams.copy_in),
            ):
                x.copy_(offloaded.host, non_blocking=True)
                ready = streams.record(streams.copy_in)
            offloaded.reloaded = _Reloaded(x, ready)
        return offloaded.reloaded

    def _reload_checkpoints(self, checkpoints: list[Any], products: bool) -> None:
        """Start bringing a stage's offloaded checkpoints back, and with `products` its kept products (each
        entry replaced in place), behind the compute work queued so far (the stage before it in the backward
        runs meanwhile)."""
        after = self.streams.record(self.streams.compute)

        def back(value: Any) -> Any:
            return self._reload(value, after) if isinstance(value, _Offloaded) else value

        for m, checkpoint in enumerate(checkpoints):
            if isinstance(checkpoint, _Kept):
                checkpoint.x = back(checkpoint.x)
                if products:
                    checkpoint.products = {name: back(value) for name, value in checkpoint.products.items()}
            else:
                checkpoints[m] = back(checkpoint)

    def _arrived(self, value: Any) -> Any:
        """What a backward reads: a tensor brought back from host memory once the compute stream has
        waited for its copy, anything else as it is."""
        if isinstance(value, _Reloaded):
            self.streams.wait(self.streams.compute, value.ready)
            return value.x
        return value

    # -------------------------------------------------------------------- step
    def run(self, micro_batches: list[MicroBatch], loss_scale: float) -> StepResult:
        """Forward + backward of one optimizer step. Gradients land in the store's grad buffers."""
        return self._run(micro_batches, loss_scale, train=True)

    def evaluate(self, micro_batches: list[MicroBatch]) -> Tensor:
        """Forward only, streaming the weights once for all micro-batches: the summed token loss
        (fp32 scalar on the device). Nothing is kept for a backward and no gradient is made."""
        return self._run(micro_batches, 0.0, train=False).loss_sum

    def warm_up(self, micro_batches: list[MicroBatch], step: list[MicroBatch] | None = None) -> None:
        """Forward and backward of one step on `micro_batches`, its gradients dropped (nothing reaches the
        store or the optimizer): what is built on first use (torch.compile's kernels for each shape and
        grad mode, cuBLAS's plans, the allocator's pools) is built here, at setup, instead of inside the
        first step. Where layers may keep their products only the last one does, so that both kinds of
        backward are built. `step`: a whole training step's micro-batches (only their sizes are read), whose
        pinned host memory for offloaded checkpoints and host-kept products is taken here too (pinning
        20 GB takes seconds: the first step would run at half speed)."""
        enabled, self.timeline.enabled = self.timeline.enabled, False
        try:
            if step:
                n_offloaded, _, host_kept = self._step_choices(step)
                self._host_rooms(step, n_offloaded, host_kept)
            self._run(micro_batches, 1.0, train=True, warm_up=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.timeline.enabled = enabled

    def _run(
        self, micro_batches: list[MicroBatch], loss_scale: float, train: bool, warm_up: bool = False
    ) -> StepResult:
        if not micro_batches:
            raise SchedError("a step needs at least one micro-batch")
        streams, stages, timeline = self.streams, self.stages, self.timeline
        n_stages, n_slots = len(stages), len(self.slots)
        self.order = self._train_order if train else self._eval_order
        timeline.start_step(streams)
        log: list[tuple] = []
        for slot in [*self.slots, *self._held.values()]:
            slot.stage = None  # the optimizer has changed the host weights since the last step
        batches = [mb.to(self.device) for mb in micro_batches]
        checkpoints: list[list[Any]] = [[None] * len(batches) for _ in range(n_stages)]
        grad_buffers: dict[int, Tensor] = {}
        remaining = list(self._users)
        sq_norms = torch.zeros(self.store.n_groups, dtype=self.store.master_dtype, device=self.device)
        loss_sum = torch.zeros((), dtype=self.store.master_dtype, device=self.device)

        acts: list[Any] = [mb.input_ids for mb in batches]
        self._rows = None
        first_pending = train and not self.updates_done(stages[0].groups)  # else the whole table goes at once
        if first_pending and hasattr(stages[0].template, "forward_rows") and len(stages[0].groups) == 1:
            ids = [mb.input_ids for mb in micro_batches]
            unique, local = torch.unique(torch.cat([i.reshape(-1) for i in ids]), return_inverse=True)
            pieces = local.split([i.numel() for i in ids])
            self._rows = _Rows(unique, [p.view_as(i).to(self.device, non_blocking=True) for p, i in zip(pieces, ids)])
            if self.updates_done(stages[self.order[1]].groups):
                # the first layer's update is done before the table's rows: its copy goes first, not behind them
                self._fetch(1, log)
        # stages 1 .. n_offloaded send their checkpoints out (evaluation keeps none)
        n_offloaded, kept_products, host_kept = self._step_choices(batches) if train else (0, range(0), {})
        if warm_up:
            kept_products, host_kept = kept_products[-1:], {}
        checkpoint_rooms, product_rooms = self._host_rooms(batches, n_offloaded, host_kept)
        self.last_kept, self.last_host_kept = len(kept_products) + len(host_kept), len(host_kept)
        self.last_offloaded = n_offloaded
        offloaded_copies: dict[int, tuple] = {}
        last_host_copy = None  # event: the last host-kept stage's products are in host memory
        prepared: dict[int, list] = {}  # stage -> what its template's prepare() gave each micro-batch
        fetched = -1  # highest position whose weights have been queued
        for position, stage_index in enumerate(self.order):
            stage = stages[stage_index]
            slot_name, slot = self._slot(position)
            while fetched < position:
                fetched += 1
                self._fetch(fetched, log)
            # Queue the next positions' copies before this compute is launched, where that costs the host no
            # wait: a template that waits for the GPU (a MoE part reads how many rows it has) would otherwise
            # hold them back until its compute is nearly done, and the next stage would wait for its copies.
            last = min(position + n_slots - 1, len(self.order) - 1)
            while fetched < last and self.updates_done(stages[self.order[fetched + 1]].groups):
                fetched += 1
                self._fetch(fetched, log)
            if train:
                self._fetch_held_ahead(fetched, log)
            if position == n_stages - 1:  # forward done: no checkpoint is offloaded again (nor kept by this map)
                offloaded_copies.clear()
            if train and position >= n_stages - 1:  # the next backward stage's offloaded checkpoints
                next_stage = stage_index - 1 if position >= n_stages else n_stages - 2
                if 0 < next_stage <= n_offloaded or next_stage in host_kept:
                    self._reload_checkpoints(checkpoints[next_stage], next_stage in host_kept)
            streams.wait(streams.compute, slot.ready)
            weights = self._slot_weights(slot, stage_index)
            backward = position >= n_stages
            with timeline.device_span(
                f"{'bwd' if backward else 'fwd'} {stage.name}", "compute", streams, streams.compute
            ):
                if position < n_stages - 1:  # forward
                    kwargs = [mb.template_kwargs for mb in batches]
                    if hasattr(stage.template, "prepare"):  # every micro-batch's, before the first forward
                        prepared[stage_index] = [
                            stage.template.prepare(weights, x, **kw) for x, kw in zip(acts, kwargs)
                        ]
                        kwargs = [kw | {"prepared": p} for kw, p in zip(kwargs, prepared[stage_index])]
                    if stage_index in host_kept:  # the previous host-kept stage's products out first: one
                        streams.wait(streams.compute, last_host_copy)  # stage of them on the device
                    for m, x in enumerate(acts):
                        if train:  # what the backward needs of the input: all of it, unless the template says
                            kept = stage.template.checkpoint(x) if hasattr(stage.template, "checkpoint") else x
                            offload = 0 < stage_index <= n_offloaded
                            checkpoints[stage_index][m] = (
                                self._offload(
                                    kept, offloaded_copies, f"checkpoint {stage.name}", checkpoint_rooms[stage_index]
                                )
                                if offload
                                else kept
                            )
                        if stage_index in kept_products or stage_index in host_kept:
                            acts[m], products = stage.template.forward_keeping_products(weights, x, **kwargs[m])
                            if stage_index in host_kept:
                                products = {
                                    k: self._offload(
                                        v, offloaded_copies, f"products {stage.name}", product_rooms[stage_index]
                                    )
                                    for k, v in products.items()
                                }
                                last_host_copy = streams.record(streams.copy_out)
                            checkpoints[stage_index][m] = _Kept(checkpoints[stage_index][m], products)
                        elif position == 0 and self._rows is not None and self._rows.table is not None:
                            rows = slot.buffer[: self._rows.table.numel()]
                            acts[m] = stage.template.forward_rows(rows, self._rows.local[m], **kwargs[m])
                        else:
                            acts[m] = stage.template.forward(weights, x, **kwargs[m])
                elif not train:
                    for m, x in enumerate(acts):
                        loss_sum += stage.template.loss_sum(weights, x, batches[m].labels)
                elif position == n_stages - 1:  # loss and its gradient
                    grads = self._grad_buffers(stage_index, grad_buffers)
                    for m, x in enumerate(acts):
                        loss, acts[m] = stage.template.loss(weights, x, batches[m].labels, loss_scale, grads)
                        loss_sum += loss
                else:  # backward, recomputing from the checkpoint
                    grads = self._grad_buffers(stage_index, grad_buffers)
                    inputs = checkpoints[stage_index]
                    forward_prepared = prepared.pop(stage_index, None)
                    for m, grad_out in enumerate(acts):
                        x = inputs[m]
                        inputs[m] = None
                        kwargs = batches[m].template_kwargs
                        if isinstance(x, _Kept):
                            products = {name: self._arrived(product) for name, product in x.products.items()}
                            x, kwargs = x.x, kwargs | {"products": products}
                        x = self._arrived(x)
                        if forward_prepared is not None:
                            kwargs = kwargs | {"prepared": forward_prepared[m]}
                        acts[m] = stage.template.backward(weights, x, grad_out, grads, **kwargs)
                    checkpoints[stage_index] = None
            log.append(("compute", stage_index, slot_name))
            slot.free = streams.record(streams.compute)
            if train and position >= n_stages - 1:
                self._send_grads(stage_index, grad_buffers, remaining, sq_norms, log, drop=warm_up)
            while fetched < last:  # what the optimizer had not finished before, waiting for it now
                fetched += 1
                self._fetch(fetched, log)
        # the squared norms are written on the copy-out stream, behind each group's reduction
        streams.wait(streams.compute, streams.record(streams.copy_out))
        return StepResult(loss_sum, sq_norms, log)
