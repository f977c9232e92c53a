"""The activation store of a step: what each block's backward needs of its forward (its input's checkpoint and,
where placed, its kept products and their extras), kept on the device or sent to pinned host memory on the copy-out
stream and brought back a stage ahead of its backward on the copy-in stream."""

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from megatrain_store import pin_in_place, unpin

from .costs import StageCosts
from .placement import Placement
from .streams import Streams
from .timeline import Timeline


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


@dataclass
class _Kept:
    x: Any  # the checkpoint, as for any layer
    products: dict  # what the template's forward_keeping_products gave: its backward skips those GEMMs


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

    def keep_only(self, uses: set) -> None:
        """Give back the buffers of other uses (a new placement offloads or keeps other stages; nothing may be
        in flight)."""
        for use in [use for use in self.buffers if use not in uses]:
            if use in self._pinned:
                unpin(self._pinned.pop(use))
            del self.buffers[use]


@dataclass
class _Cursor:
    buffer: Tensor
    pin: bool  # whether what the buffer has no room for is taken pinned
    offset: int = 0

    def take(self, like: Tensor) -> Tensor:
        """The next tensor of the buffer shaped and laid out as `like` (`host_strides`), or of the CUDA host
        allocator where it is full (a model whose templates give no `d_model`, or whose `checkpoint_planes`
        undercount)."""
        nbytes = like.numel() * like.element_size()
        self.offset = -(-self.offset // like.element_size()) * like.element_size()  # (products of mixed dtypes)
        if self.offset + nbytes > self.buffer.numel():
            return torch.empty_strided(like.shape, host_strides(like), dtype=like.dtype, pin_memory=self.pin)
        flat = self.buffer[self.offset : self.offset + nbytes].view(like.dtype)
        self.offset += nbytes
        return flat.as_strided(like.shape, host_strides(like))


def host_strides(like: Tensor) -> tuple[int, ...]:
    """The strides a host copy of `like` takes: its own where they lay it out densely, in any order of dimensions
    (a compiled graph saves tensors so, and its backward asserts the strides it saved; the copy back keeps them),
    else those of a contiguous tensor."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(like.stride(), like.shape) if sz != 1):
        if stride != expected:
            return torch.empty(like.shape, device="meta").stride()
        expected *= size
    return like.stride()


@dataclass
class _StepActivations:
    """Where one sweep keeps what each stage's backward needs."""

    checkpoints: list[list[Any] | None]  # stage -> each micro-batch's checkpoint (or _Kept, _Offloaded)
    offloaded: set = field(default_factory=set)  # block stages whose checkpoints go to host memory
    kept: set = field(default_factory=set)  # stages keeping their products on the device
    extras: set = field(default_factory=set)  # kept stages keeping their extra products too
    host_kept: dict = field(default_factory=dict)  # stage -> its host buffer's rank, products in host memory
    checkpoint_rooms: dict = field(default_factory=dict)
    product_rooms: dict = field(default_factory=dict)
    copies: dict[int, tuple] = field(default_factory=dict)  # the sweep's offloaded tensors, by identity
    last_host_copy: Any = None  # event: the last host-kept stage's products are in host memory


class ActivationStore:
    """Each block's checkpoints and kept products from its forward to its backward, on the device or in pinned host
    memory (`costs`: each stage's bytes per token, which size that memory)."""

    def __init__(self, stages: list, streams: Streams, timeline: Timeline, costs: list[StageCosts]):
        self.stages, self.streams, self.timeline, self.costs = stages, streams, timeline, costs
        self.device = streams.device
        self.host_memory = _HostMemory(streams)
        self.step = _StepActivations([])

    def place(self, placement: Placement) -> None:
        """Give back the pinned host memory `placement` no longer uses (nothing in flight: between steps)."""
        host_kept = dict(enumerate(placement.host_kept))
        self.host_memory.keep_only(
            {("checkpoint", s) for s in placement.offloaded} | {("products", r) for r in host_kept}
        )

    def rooms(self, tokens: int, placement: Placement) -> tuple[dict[int, _Cursor], dict[int, _Cursor]]:
        """A step's pinned host memory, by block stage: (for the checkpoints of each offloaded one, for the products
        of each host-kept one). A buffer each, so that a step offloading one more stage pins only that one's."""
        checkpoints = {
            stage: self.host_memory.room(("checkpoint", stage), tokens * self.costs[stage].checkpoint_bytes_per_token)
            for stage in placement.offloaded
        }
        products = {
            stage: self.host_memory.room(("products", rank), tokens * self.costs[stage].product_bytes_per_token)
            for rank, stage in enumerate(placement.host_kept)
        }
        return checkpoints, products

    def begin_step(self, n_micro_batches: int) -> None:
        """A sweep that keeps every checkpoint on the device and no product (as an evaluation's)."""
        self.step = _StepActivations([[None] * n_micro_batches for _ in self.stages])

    def place_step(self, tokens: int, placement: Placement, kept: set, extras: set, host_kept: dict) -> None:
        """This sweep's choices: offloaded checkpoints as `placement` says, products `kept` on the device (`extras`
        with their extra products) or `host_kept` (stage -> rank) in host memory, for `tokens`."""
        step = self.step
        step.offloaded, step.kept, step.extras, step.host_kept = set(placement.offloaded), kept, extras, host_kept
        step.checkpoint_rooms, step.product_rooms = self.rooms(tokens, placement)

    def keeps_products(self, stage: int) -> bool:
        """Whether this sweep keeps the stage's forward products (on the device or in host memory)."""
        return stage in self.step.kept or stage in self.step.host_kept

    def extras_of(self, stage: int) -> dict:
        """The keyword that asks `forward_keeping_products` for the stage's extra products, where it keeps them."""
        return {"extras": True} if stage in self.step.extras else {}

    def before_forward(self, stage: int) -> None:
        """The previous host-kept stage's products out first: one stage of them on the device at a time."""
        if stage in self.step.host_kept:
            self.streams.wait(self.streams.compute, self.step.last_host_copy)

    def keep(self, stage: int, micro_batch: int, x: Any) -> None:
        """Keep what a block's backward needs of its input (all of it, unless its template's `checkpoint(x)` says),
        on the device or on its way to host memory."""
        kept = self.stages[stage].template.checkpoint(x)
        if stage in self.step.offloaded:
            name = f"checkpoint {self.stages[stage].name}"
            kept = self._offload(kept, name, self.step.checkpoint_rooms[stage])
        self.step.checkpoints[stage][micro_batch] = kept

    def keep_products(self, stage: int, micro_batch: int, products: dict) -> None:
        """Keep a micro-batch's products of a stage's forward beside its checkpoint, on the device or on their way
        to host memory."""
        step = self.step
        if stage in step.host_kept:
            room, name = step.product_rooms[stage], f"products {self.stages[stage].name}"
            products = {k: self._offload(v, name, room) for k, v in products.items()}
            step.last_host_copy = self.streams.record(self.streams.copy_out)
        step.checkpoints[stage][micro_batch] = _Kept(step.checkpoints[stage][micro_batch], products)

    def forward_done(self) -> None:
        """The forward is done: nothing is offloaded again (nor kept alive by the sweep's map of copies)."""
        self.step.copies.clear()

    def take(self, stage: int, micro_batch: int) -> tuple[Any, dict | None]:
        """(checkpoint, kept products or None) of a micro-batch for the stage's backward, given up by the store,
        on the device once the compute stream has waited for any copy back."""
        inputs = self.step.checkpoints[stage]
        x, inputs[micro_batch] = inputs[micro_batch], None
        products = None
        if isinstance(x, _Kept):
            products = {name: self._arrived(product) for name, product in x.products.items()}
            x = x.x
        return self._arrived(x), products

    def drop(self, stage: int) -> None:
        """Let go of the stage's checkpoints once its backward has taken them all."""
        self.step.checkpoints[stage] = None

    def _offload(self, x: Tensor, name: str, room: _Cursor) -> _Offloaded:
        """Start moving a checkpoint or kept product (`name`d) to pinned host memory, the next of `room` (once per
        tensor and sweep, for stages that keep the same tensor)."""
        copies = self.step.copies
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

    def _reload(self, offloaded: _Offloaded, after: Any) -> _Reloaded:
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

    def reload_ahead(self, stage: int) -> None:
        """Start bringing back the offloaded checkpoints (and host-kept products) of `stage`, whose backward comes
        next, behind the compute work queued so far (the current position runs meanwhile)."""
        step = self.step
        if stage <= 0 or (stage not in step.offloaded and stage not in step.host_kept):
            return
        after = self.streams.record(self.streams.compute)

        def back(value: Any) -> Any:
            return self._reload(value, after) if isinstance(value, _Offloaded) else value

        checkpoints = step.checkpoints[stage]
        for m, checkpoint in enumerate(checkpoints):
            if isinstance(checkpoint, _Kept):
                checkpoint.x = back(checkpoint.x)
                if stage in step.host_kept:
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
