"""The weight stream of a step: device slots the stages' weights are copied into, the staging ring of fp32 masters
cast on the device, the buffers of held stages, the casts of resident stages, and the first stage's rows.

The positions whose weights are copied take the n_slots rotating slots in turn; while one computes, the weights of the
next n_slots-1 such positions are copied in on the copy-in stream (a slot is refilled only after the compute that used
it has finished). A held stage has a buffer of its own; a resident block is cast at its turn into one more buffer,
the cast slot, so that a streamed stage after resident ones is copied in while they compute (Qwen2.5-7B at 8k tokens
on an H200 with 28 resident blocks: the head's 41 ms copy, queued behind the last two blocks' casts in the rotating
slots, had the GPU wait 35 ms of each 0.77 s step); a resident table (the embedding, a head tied to it), larger than a
block and first in the forward, is cast into a rotating slot instead. Weights
travel as the store keeps them: an fp32 master is copied in through a ring of fp32 staging buffers and cast to the
compute dtype on a cast stream, so the host needs no second, bf16 copy of the model (a group the store keeps in the
compute dtype, a frozen one or a wire copy, is copied straight into its slot; a packed one, a QLoRA base's layer, is
copied at its packed size into a ring of byte buffers and unpacked, dequantized, into its slot on the cast stream).
The casts run on their own stream so that the copy engine never waits for one: a cast is a kernel, and it waits for
SMs behind the compute stream's GEMMs (about one cast gets in where a GEMM ends), so the ring holds a whole stage
where it can and the copy engine runs up to a stage ahead of the casts.
"""

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatrain_store import HostStore

from .hooks import Hooks
from .placement import Placement
from .streams import Streams
from .timeline import Timeline

# Staged host->device copies of fp32 masters go in chunks of at most STAGING_NUMEL elements (256 MiB), through a
# ring of up to STAGING_BUFFERS of them (a 7B layer, 0.93 GB, fits whole). On an H100, a 7B layer's copy under a
# stage's worth of 32k-token GEMMs took 24.2 ms through two 128 MiB buffers and 20.5 ms through four of 256 MiB,
# nearly as fast as an fp32 copy with no cast at all (20.0 ms; `benchmarks/staging_copy.py`).
STAGING_NUMEL = 2**26
STAGING_BUFFERS = 4


def staging_buffers(largest_stage_numel: int) -> tuple[int, int]:
    """(buffers, elements each) of the staging ring for stages of at most `largest_stage_numel` elements: enough
    to hold the largest whole, up to STAGING_BUFFERS, at least two (one fills while the other's cast waits)."""
    numel = min(largest_stage_numel, STAGING_NUMEL)
    return min(STAGING_BUFFERS, max(2, -(-largest_stage_numel // numel))), numel


def cast_numels(stages: list, store: HostStore) -> list[int]:
    """Per stage, the elements of its groups that travel as fp32 masters, to be cast on the device (a frozen group
    held in the compute dtype, or a group with a wire copy, travels as it computes; a packed one as bytes)."""
    cast = [store.wire(g).dtype not in (store.compute_dtype, torch.uint8) for g in range(store.n_groups)]
    return [sum(store.layouts[group].numel for group in stage.groups if cast[group]) for stage in stages]


def packed_nbytes(stages: list, store: HostStore) -> list[int]:
    """Per stage, the largest packed group's bytes (what one buffer of the packed ring holds), 0 where none."""
    packings = [store.packing(g) for g in range(store.n_groups)]
    return [max((packings[g].nbytes for g in stage.groups if packings[g]), default=0) for stage in stages]


@dataclass
class Slot:
    buffer: Tensor
    stage: int | None = None  # which stage's weights it holds (valid within a step)
    ready: Any = None  # event: its copy-in finished
    free: Any = None  # event: the last compute reading it finished


@dataclass
class _Rows:
    ids: Tensor  # the sorted unique input ids of a step (host)
    local: list[Tensor]  # each micro-batch's input ids as indices into `ids` (device)
    table: Tensor | None = None  # what first_rows gave for them (None: the whole table was copied)

    @classmethod
    def of(cls, input_ids: list[Tensor], device: torch.device) -> "_Rows":
        unique, local = torch.unique(torch.cat([i.reshape(-1) for i in input_ids]), return_inverse=True)
        pieces = local.split([i.numel() for i in input_ids])
        return cls(unique, [p.view_as(i).to(device, non_blocking=True) for p, i in zip(pieces, input_ids)])


class WeightStream:
    """Where each position of a step finds its stage's weights, and the copies and casts that put them there.

    `stages`: (groups, name) per stage; `weightless_backward`: the stages whose backward reads no weights (no copy
    for it). `place` says which stages are held (a buffer of their own, from forward to backward) and which are
    resident (cast on the compute stream from their fp32 masters on the device: no copy, no `before_fetch`), and of
    those which are copied (bound to their compute-dtype copy on the device, which their update refreshes)."""

    def __init__(
        self,
        stages: list,
        store: HostStore,
        streams: Streams,
        timeline: Timeline,
        hooks: Hooks,
        n_slots: int,
        weightless_backward: set[int],
    ):
        self.stages, self.store, self.streams, self.timeline, self.hooks = stages, store, streams, timeline, hooks
        self.device = streams.device
        self.weightless_backward = weightless_backward
        self.stage_numels = [sum(store.layouts[g].numel for g in stage.groups) for stage in stages]
        self.slots = [self._new_buffer(max(self.stage_numels)) for _ in range(n_slots)]
        self.held: dict[int, Slot] = {}
        self.cast_slot: Slot | None = None  # resident stages' weights, each cast at its turn
        self.copies: dict[int, Slot] = {}  # copied stages' compute-dtype copies, each its own slot
        self.device_masters: dict[int, Tensor] = {}
        self.on_device: set[int] = set()  # resident stages
        self.reference = False  # a forward-only pass streaming the store's reference copy
        self.order: list[int] = []  # the step's positions' stages
        self.slot_names: list = []  # each position's slot: "held STAGE", "cast" or a rotating slot's index
        self.rotating: list[int] = []  # the positions taking the rotating slots, in order
        self.rows: _Rows | None = None  # this step's first-stage rows, where the template takes them
        self._init_staging()

    def _new_buffer(self, numel: int) -> Slot:
        return Slot(torch.empty(numel, dtype=self.store.compute_dtype, device=self.device))

    def _init_staging(self) -> None:
        """The staging ring and the cast stream, where fp32 masters are cast on the device: sized for the largest
        stage's groups that travel as masters (`cast_numels`), whichever groups those are."""
        largest, packed = max(cast_numels(self.stages, self.store)), max(packed_nbytes(self.stages, self.store))
        cast_on_device = self.streams.cuda and largest > 0
        buffers, numel = staging_buffers(largest) if cast_on_device else (0, 0)
        self._staging = _Ring.of(buffers, numel, self.store.master_dtype, self.device) if cast_on_device else None
        # packed groups: two byte buffers, one filling while the other is unpacked
        self._packed = _Ring.of(2, packed, torch.uint8, self.device) if self.streams.cuda and packed else None
        self._cast_stream = torch.cuda.Stream(self.device) if cast_on_device or self._packed else None

    def place(self, placement: Placement, device_masters: dict[int, Tensor], device_copies: dict[int, Tensor]) -> None:
        """Hold, cast and bind copies as `placement` says (nothing in flight: between steps)."""
        self.device_masters, self.on_device = device_masters, set(placement.resident)
        self.held = {
            i: self.held[i] if i in self.held else self._new_buffer(self.stage_numels[i]) for i in placement.held
        }
        self.copies = {i: Slot(device_copies[self.stages[i].groups[0]], stage=i) for i in placement.copied}
        blocks = range(1, len(self.stages) - 1)
        cast = self.on_device - set(self.copies)
        largest = max((self.stage_numels[i] for i in cast if i in blocks), default=0)
        if largest != (0 if self.cast_slot is None else self.cast_slot.buffer.numel()):
            self.cast_slot = self._new_buffer(largest) if largest else None

    def begin_step(self, order: list[int], input_ids: list[Tensor] | None, log: list) -> None:
        """A step in `order`: every slot is stale (the optimizer has changed the host weights since the last step).
        `input_ids`: each micro-batch's, where the first stage's rows may go first (`first_rows`), else None."""
        self.order = order
        self.slot_names, self.rotating = [], []
        for position, stage in enumerate(order):
            if stage in self.held:
                self.slot_names.append(f"held {stage}")
            elif stage in self.copies and not self.reference:
                self.slot_names.append("copy")
            elif self._casts(stage) and self.cast_slot and self.stage_numels[stage] <= self.cast_slot.buffer.numel():
                self.slot_names.append("cast")
            else:
                self.slot_names.append(len(self.rotating) % len(self.slots))
                self.rotating.append(position)
        for slot in [*self.slots, *self.held.values(), *([self.cast_slot] if self.cast_slot else [])]:
            slot.stage = None
        self.rows = None
        first = self.stages[0]
        if input_ids is not None and first.template.forward_rows is not None and len(first.groups) == 1:
            self.rows = _Rows.of(input_ids, self.device)
            if self.hooks.updates_done(self.stages[order[1]].groups):
                # the first layer's update is done before the table's rows: its copy goes first, not behind them
                self.fetch(1, log)

    def _casts(self, stage: int) -> bool:
        """Whether the stage's weights are cast from its device masters (resident, and not a reference pass)."""
        return stage in self.on_device and not self.reference

    def slot(self, position: int) -> tuple[Any, Slot]:
        """(name in the step's log, slot) of position's weights: its stage's own buffer where held, its copy where
        copied, the cast slot where resident, else its rotating slot."""
        name = self.slot_names[position]
        if name == "cast":
            return name, self.cast_slot
        if name == "copy":
            return name, self.copies[self.order[position]]
        if isinstance(name, str):
            return name, self.held[self.order[position]]
        return name, self.slots[name]

    def last_to_fetch(self, position: int) -> int:
        """The last position whose weights may be queued before `position` computes: a rotating slot's copy waits
        for the compute that last read it, which must be queued already (a position before `position`)."""
        queued = bisect.bisect_left(self.rotating, position)  # rotating positions whose compute is queued
        after = queued + len(self.slots)  # the first rotating position whose slot's last reader is not
        return self.rotating[after] - 1 if after < len(self.rotating) else len(self.order) - 1

    def views(self, slot: Slot, stage: int) -> list[Tensor]:
        """The stage's groups' weights in `slot`, one flat view each."""
        views, offset = [], 0
        for group in self.stages[stage].groups:
            numel = self.store.layouts[group].numel
            views.append(slot.buffer[offset : offset + numel])
            offset += numel
        return views

    def table_rows(self, slot: Slot, micro_batch: int) -> tuple[Tensor, Tensor] | None:
        """(the rows in `slot`, the micro-batch's ids as indices into them) where the first stage's rows were
        copied instead of its group, else None."""
        if self.rows is None or self.rows.table is None:
            return None
        return slot.buffer[: self.rows.table.numel()], self.rows.local[micro_batch]

    def fetch(self, position: int, log: list) -> None:
        """Queue the copy of position's weights into its slot (or reuse what is there); a resident block's cast
        waits for its turn (`cast`)."""
        slot_name, slot = self.slot(position)
        if slot_name in ("cast", "copy") or self._bound_without_copy(position, slot_name, slot, log):  # (at its turn)
            return
        stage = self.order[position]
        streams, groups = self.streams, self.stages[stage].groups
        rows = None
        if position == 0 and self.rows is not None:
            rows = self.rows.table = self.hooks.first_rows(groups[0], self.rows.ids)
        if rows is None:
            self.hooks.before_fetch(groups)
        streams.wait(streams.copy_in, slot.free)  # before the span opens: the span times the transfer alone
        with (
            streams.on(streams.copy_in),
            self.timeline.device_span(f"copy_in {self.stages[stage].name}", "copy_in", streams, streams.copy_in),
        ):
            if rows is not None:
                self._copy(slot.buffer[: rows.numel()], rows.reshape(-1))
            else:
                source = self.store.reference if self.reference else self.store.wire
                for view, group in zip(self.views(slot, stage), groups):
                    self._copy(view, source(group), self.store.packing(group))
            if self._cast_stream is not None:  # the slot is complete once the last cast has run
                streams.wait(streams.copy_in, streams.record(self._cast_stream))
            slot.ready = streams.record(streams.copy_in)
        slot.stage = stage if rows is None else None  # (some rows are not the stage's weights)
        log.append(("copy_in", stage, slot_name))

    def fetch_held_ahead(self, fetched: int, log: list) -> None:
        """Queue the forward copies of held stages beyond `fetched` whose updates are done, in order: their
        buffers are their own, so the copy engine need not wait for the rotating slots (while resident stages
        compute, it would otherwise idle). Their turn in the order then finds them there."""
        for stage, slot in self.held.items():  # (forward position = stage index)
            if stage <= fetched or slot.stage == stage:
                continue
            if not self.hooks.updates_done(self.stages[stage].groups):
                return
            self.fetch(stage, log)

    def cast(self, position: int, log: list) -> None:
        """Where position's stage takes the cast slot (a resident block), queue the cast of its device masters
        there (unless it holds them) on the compute stream, which orders it after the slot's last reader and before
        the stage's compute with no event (a cast is under a millisecond; on the cast stream it would queue behind
        the copies' casts), and after their last update (`before_cast`). Where it is copied, the compute stream
        waits for that update alone, which refreshed the copy."""
        if self.slot_names[position] == "cast":
            self._bound_without_copy(position, "cast", self.cast_slot, log)
        elif self.slot_names[position] == "copy":
            stage = self.order[position]
            with self.streams.on(self.streams.compute):
                self.hooks.before_cast(self.stages[stage].groups)
            log.append(("copy", stage, "copy"))

    def _bound_without_copy(self, position: int, slot_name: Any, slot: Slot, log: list) -> bool:
        """Whether position's weights need no copy, logged as what binds them: its slot holds them already, its
        backward binds none, or its stage is resident (then cast from its device masters into `slot` here)."""
        stage = self.order[position]
        if slot.stage == stage:
            log.append(("reuse", stage, slot_name))
        elif position >= len(self.stages) and stage in self.weightless_backward:
            log.append(("no_copy", stage, slot_name))  # its backward binds no weights
        elif self._casts(stage):
            self._cast_device_masters(slot, stage, slot_name, log)
        else:
            return False
        return True

    def _cast_device_masters(self, slot: Slot, stage: int, slot_name: Any, log: list) -> None:
        """Queue the cast of the stage's device masters into `slot` on the compute stream, after their updates."""
        with self.streams.on(self.streams.compute):
            self.hooks.before_cast(self.stages[stage].groups)
            for view, group in zip(self.views(slot, stage), self.stages[stage].groups):
                view.copy_(self.device_masters[group])
        slot.ready = None
        slot.stage = stage
        log.append(("cast", stage, slot_name))

    def _copy(self, view: Tensor, source: Tensor, packing=None) -> None:
        """Queue host `source` -> device `view` on the copy-in stream, or through a ring of staging buffers and
        the cast stream when the device casts or unpacks (`packing`: how `source`'s bytes unpack; then `view` is
        complete when the cast stream's work is)."""
        if packing is not None:
            if self._packed is None:  # the CPU: unpacked in place
                packing.unpack(source, view)
            else:
                self._through_ring(self._packed, source, lambda staged: packing.unpack(staged, view))
            return
        if self._staging is None or source.dtype == view.dtype:  # the CPU (where copy_ casts), or nothing to cast
            view.copy_(source, non_blocking=True)
            return
        chunk_numel = self._staging.buffers[0].numel()
        for start in range(0, source.numel(), chunk_numel):
            chunk = source[start : start + chunk_numel]
            self._through_ring(
                self._staging, chunk, lambda staged, start=start: view[start : start + staged.numel()].copy_(staged)
            )

    def _through_ring(self, ring: "_Ring", chunk: Tensor, cast) -> None:
        """Copy host `chunk` into the ring's next buffer on the copy-in stream, then run cast(staged) on the cast
        stream once it has arrived; the buffer is reused once that cast has run."""
        streams = self.streams
        index = ring.take()
        staged = ring.buffers[index][: chunk.numel()]
        streams.wait(streams.copy_in, ring.free[index])
        staged.copy_(chunk, non_blocking=True)
        arrived = streams.record(streams.copy_in)
        with streams.on(self._cast_stream):
            streams.wait(self._cast_stream, arrived)
            cast(staged)
            ring.free[index] = streams.record(self._cast_stream)


@dataclass
class _Ring:
    """Device buffers that host copies go round: each reused once the cast that last read it has run."""

    buffers: list[Tensor]
    free: list  # events: the cast that last read each buffer finished
    next: int = 0

    @classmethod
    def of(cls, count: int, numel: int, dtype: torch.dtype, device: torch.device) -> "_Ring":
        return cls([torch.empty(numel, dtype=dtype, device=device) for _ in range(count)], [None] * count)

    def take(self) -> int:
        index, self.next = self.next, (self.next + 1) % len(self.buffers)
        return index
