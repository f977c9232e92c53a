"""One optimizer step's forward and backward, layer-major over device weight slots, as a `Placement` says.

Positions of a step: forward stages 0..n-2, the head n-1 (loss + its backward), then
backward stages n-2..0. Position p computes in slot p % n_slots; while it computes,
the weights of positions p+1 .. p+n_slots-1 are copied in on the copy-in stream (a
slot is refilled only after the compute that used it has finished). Position n (the
last block, backward) finds its weights still in the slot of position n-2, so with two
slots they are not copied again; held stages have a buffer of their own instead, which
keeps their weights from forward to backward. Gradients of a group accumulate in one fp32
device buffer and are copied out once, when the last stage that binds the group has run
backward. Resident stages' fp32 masters live on the device (the optimizer updates them
there): they are cast into the slot from that master, and their gradient is handed over on
the device instead of copied out.

Weights travel as the store keeps them: an fp32 master is copied in through a ring of
fp32 staging buffers and cast to the compute dtype on a cast stream, so the host needs no
second, bf16 copy of the model. The casts run on their own stream so that the copy
engine never waits for one: a cast is a kernel, and it waits for SMs behind the
compute stream's GEMMs (about one cast gets in where a GEMM ends), so the ring holds a
whole stage where it can and the copy engine runs up to a stage ahead of the casts.
"""

import itertools
import logging
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from megatrain_store import HostStore, pin_in_place, unpin

from .placement import DEVICE, HELD, HOST, RECOMPUTE, RESIDENT, Placement, PlacementError
from .streams import Streams
from .timeline import Timeline

logger = logging.getLogger("megatrain_sched")

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


def free_device_bytes(device: torch.device) -> int:
    """Device memory free now, with what the caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


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


# device memory a step leaves free when it grants extra products out of its headroom (the planner's count of a
# step's bytes leaves out the allocator's pieces and a pass's temporaries)
EXTRAS_MARGIN = 4 * 2**30


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


class SchedError(Exception):
    """A stage list or batch the scheduler cannot run, with the fix in the message."""


@dataclass(frozen=True)
class Stage:
    """A template and the store groups it binds, in the template's order.

    The template provides `groups` (its layouts), `forward(weights, x)` and
    `backward(weights, x, grad_out, grads)` (both also taking `documents=` when a micro-batch
    packs documents; `x` is what the optional `checkpoint(x)` keeps of the input, a tensor, else the
    input; activations between stages may be tuples of tensors; `grads` holds None for a group the store
    keeps frozen: no gradient for it). A template may also provide
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
    # an image-text model's inputs besides the token ids (e.g. megatrain_templates.Media): given to every template as
    # `media=`, moved to the device with `.to(device, non_blocking=True)`; None: a text model's micro-batch
    media: Any = None

    def to(self, device: torch.device) -> "MicroBatch":
        documents, media = (
            None if x is None else x.to(device, non_blocking=True) for x in (self.documents, self.media)
        )
        return MicroBatch(
            self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True), documents, media
        )

    @property
    def template_kwargs(self) -> dict:
        kwargs = {} if self.documents is None else {"documents": self.documents}
        return kwargs if self.media is None else kwargs | {"media": self.media}


@dataclass
class StepResult:
    loss_sum: Tensor  # fp32 scalar on the device: summed token losses of the step
    group_sq_norms: Tensor  # [n_groups] fp32 on the device: squared gradient norm per group
    log: list[tuple] = field(default_factory=list)  # ("copy_in"|"reuse"|"compute"|"grad_out", stage or group, slot)
    token_logps: list[Tensor] | None = None  # per micro-batch [rows, seq], where the head was asked for them


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
        """The next `like`-shaped tensor of the buffer, or of the CUDA host allocator where it is full (a model
        whose head template gives no `d_model`, or whose block templates' `checkpoint_planes` undercount)."""
        nbytes = like.numel() * like.element_size()
        self.offset = -(-self.offset // like.element_size()) * like.element_size()  # (products of mixed dtypes)
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

    @classmethod
    def of(cls, micro_batches: list[MicroBatch], device: torch.device) -> "_Rows":
        ids = [mb.input_ids for mb in micro_batches]
        unique, local = torch.unique(torch.cat([i.reshape(-1) for i in ids]), return_inverse=True)
        pieces = local.split([i.numel() for i in ids])
        return cls(unique, [p.view_as(i).to(device, non_blocking=True) for p, i in zip(pieces, ids)])


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


@dataclass
class _Step:
    """What one step's run of the stages carries from position to position."""

    batches: list[MicroBatch]  # on the device
    train: bool
    warm_up: bool
    token_logps: list[Tensor] | None  # the head's per-token log-probabilities, where asked for (forward only)
    placement: Placement | None  # as this step runs it (None: evaluation)
    loss_scale: float
    acts: list[Any]  # each micro-batch's activation between stages (token ids first)
    checkpoints: list[list[Any] | None]  # stage -> each micro-batch's checkpoint (or _Kept, _Offloaded)
    sq_norms: Tensor
    loss_sum: Tensor
    remaining: list[int]  # group -> stages yet to run its backward
    sweep: int = 0  # which of the step's sweeps this is (`Placement.sweeps`)
    last_sweep: bool = True  # the step's gradients are whole after this one: they land (and go to the hooks)
    offloaded: set = field(default_factory=set)  # block stages whose checkpoints go to host memory
    kept: set = field(default_factory=set)  # stages keeping their products on the device
    extras: set = field(default_factory=set)  # kept stages keeping their extra products too (`_extras_that_fit`)
    host_kept: dict = field(default_factory=dict)  # stage -> its host buffer's rank, products in host memory
    checkpoint_rooms: dict = field(default_factory=dict)
    product_rooms: dict = field(default_factory=dict)
    grad_buffers: dict[int, Tensor] = field(default_factory=dict)
    offloaded_copies: dict[int, tuple] = field(default_factory=dict)
    last_host_copy: Any = None  # event: the last host-kept stage's products are in host memory
    prepared: dict[int, list] = field(default_factory=dict)  # stage -> what its template's prepare() gave
    fetched: int = -1  # highest position whose weights have been queued
    log: list[tuple] = field(default_factory=list)


class LayerPipeline:
    """Runs forward and backward of all stages for a list of micro-batches, placed by a `Placement`.

    The placement (`place`, or `placement=` at construction; by default every stage streamed, every
    checkpoint on the device, nothing kept) says per stage where its weights live between uses
    (streamed each pass, held from forward to backward, resident on the device), where a block's
    activation checkpoint waits for its backward (device or pinned host memory, then reloaded a stage
    ahead), and whether its forward's matmul products are kept for the backward (on the device or in
    pinned host memory: copied out on the copy-out stream, idle in the forward, back a stage ahead), in
    which case the backward recomputes no GEMM. The pipeline runs it as given; only where the device
    lacks the memory the placement counts on (`Placement.device_step_bytes`) does it keep fewer products
    and offload more checkpoints, and says so (`fallback`, and a warning on the "megatrain_sched" logger).
    `executed` is the placement the last training step ran.

    Hooks: `before_fetch(groups)` is called before a stage's weights are read from the store, and before
    the gradient of a stage that reads none in its backward is sent (the optimizer must have
    finished updating them); `updates_done(groups)` says, without waiting, whether it has (so that copies
    can be queued early); `on_grads_landed(group, event, sq_norm)` is called when a group's gradient
    copy-out has been queued: `event` completes when the host buffer holds it (None on the CPU, where it
    already does) and `sq_norm` is a host scalar tensor, valid from then on, with the gradient's squared
    norm. With several processes, `reduce_grad(group, buffer)` sums a group's gradient over them and
    returns this process's shard of the sum (`store.shard_range`), which alone is sent to host memory; it
    is called on the copy-out stream, so collectives there never hold up compute. `buffer` is padded to a
    whole number of shards.

    A block template that provides `forward_keeping_products(weights, x) -> (y, products)` (and
    `product_bytes_per_token(element_size)`) may keep its products; its backward gets them as `products=`.
    One that also provides `extra_product_bytes_per_token(element_size)` keeps more of its forward where a
    step has the device memory to spare (`forward_keeping_products(..., extras=True)`; `extras` says where).
    A template whose backward reads none of its weights (`backward_reads_weights = False`: an embedding's
    only scatters its gradient) gets no copy of them for it; the wait for their last update comes before
    its gradient is sent instead.

    Resident stages are cast from `device_masters` (group -> fp32 master on the device, updated there by
    work queued on the compute stream): no copy from the store, no `before_fetch`, and instead of being
    copied out their gradient goes to `on_device_grads(group, grad, sq_norm)` (both device tensors;
    called on the compute stream once the group's last backward is queued; the buffer is the callee's
    from then on). A stage binds only such groups or none.

    A step-level `objective` (e.g. `megatrain_templates.DPO`) replaces the summed cross-entropy: the head gives it
    every micro-batch's target log-probabilities (`token_logps`) before any backward, and it returns the step's
    loss and each token's coefficient, which the head's backward applies (`loss` with a tensor scale).

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
        placement: Placement | None = None,
        device_masters: dict[int, Tensor] | None = None,
        on_device_grads: Callable[[int, Tensor, Tensor], None] = lambda group, grad, sq_norm: None,
        before_fetch: Callable[[tuple[int, ...]], None] = lambda groups: None,
        updates_done: Callable[[tuple[int, ...]], bool] = lambda groups: True,
        first_rows: Callable[[int, Tensor], Tensor | None] = lambda group, rows: None,
        on_grads_landed: Callable[[int, Any, Tensor], None] = lambda group, event, sq_norm: None,
        timeline: Timeline | None = None,
        reduce_grad: Callable[[int, Tensor], Tensor] | None = None,
        objective: Callable[[list[Tensor]], tuple[Tensor, list[Tensor]]] | None = None,
    ):
        _check_stages(stages, store)
        if n_slots < 2:
            raise SchedError(f"n_slots must be >= 2 to overlap copies with compute, got {n_slots}")
        self.stages, self.store, self.device = stages, store, torch.device(device)
        self.streams = Streams(self.device)
        if self.streams.cuda:
            expandable_device_memory()
        self.before_fetch, self.updates_done, self.on_grads_landed = before_fetch, updates_done, on_grads_landed
        self.first_rows, self.on_device_grads = first_rows, on_device_grads
        self.objective = objective
        self._reduce_grad = reduce_grad
        self.reduce_grad = reduce_grad or self._own_shard
        self.timeline = timeline or Timeline(enabled=False)
        self._host_memory = _HostMemory(self.streams)
        self._rows: _Rows | None = None  # this step's first-stage rows, where the template takes them
        self._init_gradient_bookkeeping()
        self._init_slots(n_slots)
        self._init_order()
        self.fallback: str | None = None  # what the last step changed of its placement, and why; None: nothing
        self.device_headroom: int | None = None  # device bytes the last step found free beyond what it counts on
        self.extras: tuple[int, ...] = ()  # stages whose forwards the last step let keep their extra products
        self.executed: Placement | None = None  # the placement the last training step ran
        # bytes of device memory free for a step (None: not known, as on the CPU; no placement is changed)
        self.free_device_memory: Callable[[], int] | None = (
            (lambda: free_device_bytes(self.device)) if self.streams.cuda else None
        )
        self._held: dict[int, _Slot] = {}
        self._carried_grads: dict[int, Tensor] = {}  # resident groups' gradient buffers, from sweep to sweep
        self._fitted_placement: Placement | None = None  # the step's placement as its first sweep fitted it
        self._reference = False  # a forward-only pass streaming the store's reference copy (`token_logps`)
        self.place(placement or Placement.build(len(stages)), device_masters)

    def _init_gradient_bookkeeping(self) -> None:
        store = self.store
        # squared gradient norms as they land, readable by the optimizer thread without a device sync
        self._host_sq_norms = torch.zeros(store.n_groups, dtype=store.master_dtype, pin_memory=self.streams.cuda)
        # what of each group's gradient buffer is gradient, where not all of it (load-balanced biases' statistics)
        self._gradient_runs = [
            runs if runs != [(0, layout.numel)] else None
            for layout, runs in ((layout, layout.gradient_runs()) for layout in store.layouts)
        ]

    def _init_slots(self, n_slots: int) -> None:
        """The device slots the stages' weights stream into, each as large as the largest stage, and the host
        staging buffers of the copies."""
        self._stage_numels = [sum(self.store.layouts[g].numel for g in stage.groups) for stage in self.stages]
        self.slots = [
            _Slot(torch.empty(max(self._stage_numels), dtype=self.store.compute_dtype, device=self.device))
            for _ in range(n_slots)
        ]
        self._init_staging(max(self._stage_numels))

    def _init_order(self) -> None:
        """The order a training step and an evaluation pass run the stages in, and what each backward needs."""
        stages, store, n = self.stages, self.store, len(self.stages)
        # the backward stops at the first stage that trains a group: before it, nothing needs a gradient (a frozen
        # vision tower's store groups keep none, `HostStore.frozen`)
        trains = [i for i, stage in enumerate(stages) if any(g not in store.frozen for g in stage.groups)]
        if not trains:
            raise SchedError("every group is frozen: nothing to train")
        self.first_backward = trains[0]
        self._train_order = list(range(n - 1)) + [n - 1] + list(range(n - 2, self.first_backward - 1, -1))
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

    def _init_staging(self, slot_numel: int) -> None:
        """The staging ring and the cast stream, where fp32 masters are cast on the device."""
        cast_on_device = self.streams.cuda and self.store.wire(0).dtype != self.store.compute_dtype
        buffers, numel = staging_buffers(slot_numel)
        self._staging = (
            [torch.empty(numel, dtype=self.store.wire(0).dtype, device=self.device) for _ in range(buffers)]
            if cast_on_device
            else None
        )
        self._cast_stream = torch.cuda.Stream(self.device) if cast_on_device else None
        self._staging_free = [None] * buffers  # events: the cast that last read each staging buffer finished
        self._next_staging = 0  # the ring's next buffer: copies go round it from stage to stage

    # --------------------------------------------------------------- placement
    def place(self, placement: Placement, device_masters: dict[int, Tensor] | None = None) -> None:
        """Run the next steps as `placement` says, resident stages cast from `device_masters` (group -> fp32
        master on the device). Between steps only: held buffers are (re)allocated, pinned host memory no longer
        used is given back."""
        self._check_placement(placement, device_masters or {})
        self.placement, self.device_masters = placement, device_masters or {}
        self._on_device = set(placement.resident)
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)  # nothing in flight reads the buffers given back below
        self._held = {i: self._held[i] if i in self._held else _Slot(self._new_slot_buffer(i)) for i in placement.held}
        host_kept = dict(enumerate(placement.host_kept))
        self._host_memory.keep_only(
            {("checkpoint", s) for s in placement.offloaded} | {("products", r) for r in host_kept}
        )

    def _new_slot_buffer(self, stage: int) -> Tensor:
        return torch.empty(self._stage_numels[stage], dtype=self.store.compute_dtype, device=self.device)

    def _check_placement(self, placement: Placement, device_masters: dict[int, Tensor]) -> None:
        """Refuse a placement these stages cannot run, naming the stage and what it lacks."""
        n = len(self.stages)
        if len(placement.stages) != n:
            raise PlacementError(f"the placement places {len(placement.stages)} stages; the model has {n}")
        if device_masters and self._reduce_grad is not None:
            raise SchedError("resident groups cannot be reduced over processes (reduce_grad)")
        if placement.sweeps < 1:
            raise PlacementError(f"a step runs in 1 or more sweeps; the placement says {placement.sweeps}")
        if placement.sweeps > 1 and self.store.grad_pool is not None:
            raise SchedError(
                f"a step in {placement.sweeps} sweeps holds every group's gradient until the last: the store needs a "
                "landing buffer per group (grad_pool=None)"
            )
        if placement.sweeps > 1 and self.objective is not None:
            raise SchedError("a step-level objective reads every micro-batch before any backward: run it in one sweep")
        for index, stage in enumerate(self.stages):
            on_device = [g in device_masters for g in stage.groups]
            if any(on_device) and not all(on_device):
                raise SchedError(f"stage {index} ({stage.name}) binds groups with device masters and groups without")
        for index, (stage, choice) in enumerate(zip(self.stages, placement.stages)):
            on_device = [g in device_masters for g in stage.groups]
            if (choice.weights == RESIDENT) != all(on_device):
                raise PlacementError(
                    f"stage {index} ({stage.name}) is {choice.weights} but its groups "
                    f"{'have' if all(on_device) else 'lack'} device masters"
                )
            block = 0 < index < n - 1
            if choice.weights == HELD and not (block and index < n - 2 and index not in self._weightless_backward):
                raise PlacementError(
                    f"stage {index} ({stage.name}) cannot be held: only blocks before the last (whose backward "
                    "finds its rotating slot still full) hold their weights"
                )
            if (choice.checkpoint == HOST or choice.products != RECOMPUTE) and not block:
                raise PlacementError(f"stage {index} ({stage.name}) is no block: it has no checkpoint or products")
            keeps = callable(getattr(stage.template, "forward_keeping_products", None))
            if choice.products != RECOMPUTE and not keeps:
                raise PlacementError(f"stage {index} ({stage.name}) cannot keep its products: its template recomputes")

    def _fitted(self, placement: Placement, tokens: int) -> Placement:
        """The placement as a training step of `tokens` runs it: as given, unless the device lacks the memory it
        counts on. Then the first layers keeping products on the device recompute them instead, then more
        checkpoints go to host memory (first layers first), until it fits; `fallback` says what and why."""
        self.fallback = self.device_headroom = None
        if self.free_device_memory is None or placement.device_step_bytes is None:
            return placement
        need = placement.device_step_bytes
        if placement.tokens and tokens != placement.tokens:  # what it keeps grows with the tokens
            need += (tokens - placement.tokens) * self._kept_bytes_per_token(placement)
        free = self.free_device_memory()
        over = need - free
        self.device_headroom = -over
        if over <= 0:
            return placement
        stages = list(placement.stages)
        recomputed = offloaded = 0
        for index in placement.kept:
            if over <= 0:
                break
            stages[index] = replace(stages[index], products=RECOMPUTE)
            over -= tokens * self._product_bytes_per_token(index)
            recomputed += 1
        for index in range(1, len(stages) - 1):
            if over <= 0:
                break
            if stages[index].checkpoint == DEVICE:
                stages[index] = replace(stages[index], checkpoint=HOST)
                over -= tokens * self._checkpoint_bytes_per_token(index)
                offloaded += 1
        self.fallback = (
            f"the placement for {tokens:,} tokens counts on {need / 2**30:.1f} GiB of device memory beside the "
            f"weights but {free / 2**30:.1f} GiB are free: {recomputed} layers recompute their matmul products "
            f"instead of keeping them, {offloaded} more send their checkpoints to host memory"
            + (" (still short: it may run out of memory)" if over > 0 else "")
        )
        logger.warning("megatrain_sched: %s", self.fallback)
        return replace(placement, stages=tuple(stages))

    def _extras_that_fit(self, kept: set, tokens: int) -> set:
        """The stages keeping their products on the device that keep their template's extra products too
        (`extra_product_bytes_per_token`: a linear-attention layer's recurrence results, which spare its backward
        the recurrence's forward), out of the step's headroom (`extras_that_fit`): never at the cost of a matmul
        product or a checkpoint. All of them where device memory is not counted (the CPU)."""
        extra = {i: getattr(self.stages[i].template, "extra_product_bytes_per_token", None) for i in kept}
        extra = {i: tokens * f(self.store.compute_dtype.itemsize) for i, f in extra.items() if f is not None}
        room = math.inf if self.free_device_memory is None else (self.device_headroom or 0)
        return extras_that_fit(extra, room)

    def _checkpoint_bytes_per_token(self, stage: int) -> int:
        """Device bytes a token of a step takes in stage's checkpoint: its input, or what its template's
        `checkpoint(x)` keeps of it (`checkpoint_planes` [tokens, d_model] tensors, default 1; 0 where it is
        another stage's)."""
        d_model = getattr(self.stages[-1].template, "d_model", 0)
        planes = getattr(self.stages[stage].template, "checkpoint_planes", 1)
        return d_model * self.store.compute_dtype.itemsize * planes

    def _product_bytes_per_token(self, stage: int) -> int:
        return self.stages[stage].template.product_bytes_per_token(self.store.compute_dtype.itemsize)

    def _kept_bytes_per_token(self, placement: Placement) -> int:
        """Device bytes per token of a step that `placement` keeps there: checkpoints and products."""
        blocks = range(1, len(self.stages) - 1)
        checkpoints = sum(
            self._checkpoint_bytes_per_token(i) for i in blocks if placement.stages[i].checkpoint == DEVICE
        )
        return checkpoints + sum(self._product_bytes_per_token(i) for i in placement.kept)

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
        if stage in self._on_device and not self._reference:
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
                source = self.store.reference if self._reference else self.store.wire
                for view, group in zip(self._slot_weights(slot, stage), groups):
                    self._copy_weights(view, source(group))
            if self._cast_stream is not None:  # the slot is complete once the last cast has run
                streams.wait(streams.copy_in, streams.record(self._cast_stream))
            slot.ready = streams.record(streams.copy_in)
        slot.stage = stage if rows is None else None  # (some rows are not the stage's weights)
        log.append(("copy_in", stage, slot_name))

    def _fetch_held_ahead(self, fetched: int, log: list) -> None:
        """Queue the forward copies of held stages beyond `fetched` whose updates are done, in order: their
        buffers are their own, so the copy engine need not wait for the rotating slots (while resident stages
        compute, it would otherwise idle). Their turn in the order then finds them there."""
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
        if self._staging is None or source.dtype == view.dtype:  # the CPU (where copy_ casts), or nothing to cast
            view.copy_(source, non_blocking=True)
            return
        streams, chunk_numel = self.streams, self._staging[0].numel()
        for start in range(0, source.numel(), chunk_numel):
            chunk = source[start : start + chunk_numel]
            buffer, self._next_staging = self._next_staging, (self._next_staging + 1) % len(self._staging)
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
            if group in self.store.frozen:
                buffers.append(None)  # (the template computes no gradient for it)
                continue
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

    def _send_grads(self, stage: int, step: _Step) -> None:
        """Send out the gradients of stage's groups that no later backward adds to: to host memory on the
        copy-out stream, or to `on_device_grads` for resident groups (none in a warm-up). Before a step's last
        sweep a resident group's buffer stays for the next sweep to add to, and a host group's sum so far lands
        unannounced: the next sweep adds it back on the device before its own copy out."""
        streams = self.streams
        for group in self.stages[stage].groups:
            step.remaining[group] -= 1
            if step.remaining[group] or group in self.store.frozen:
                continue
            if group in self.device_masters and not step.last_sweep:
                self._carried_grads[group] = step.grad_buffers.pop(group)
                continue
            buffer = step.grad_buffers.pop(group)
            if step.warm_up:
                continue
            if group in self.device_masters:
                step.sq_norms[group] = self._gradient_sq_norm(group, buffer, 0)
                self.on_device_grads(group, buffer[: self.store.layouts[group].numel], step.sq_norms[group])
                step.log.append(("grad_on_device", group, None))
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
                if step.sweep:  # the earlier sweeps' sum (the same copy-out stream wrote it: no wait)
                    shard.add_(destination.to(self.device, non_blocking=True))
                destination.copy_(shard, non_blocking=True)
                if step.last_sweep:
                    step.sq_norms[group] = self._gradient_sq_norm(group, shard, self.store.shard_range(group)[0])
                    self._host_sq_norms[group].copy_(step.sq_norms[group], non_blocking=True)
                landed = streams.record(streams.copy_out)
            streams.keep_alive(buffer, streams.copy_out)
            step.log.append(("grad_out", group, None))
            if step.last_sweep:
                self.on_grads_landed(group, landed, self._host_sq_norms[group])

    # ------------------------------------------------ checkpoints and products
    def _host_rooms(self, tokens: int, placement: Placement) -> tuple[dict[int, "_Cursor"], dict[int, "_Cursor"]]:
        """A step's pinned host memory, by block stage: (for the checkpoints of each offloaded one, for the products
        of each host-kept one). A buffer each, so that a step offloading one more stage pins only that one's."""
        checkpoints = {
            stage: self._host_memory.room(("checkpoint", stage), tokens * self._checkpoint_bytes_per_token(stage))
            for stage in placement.offloaded
        }
        products = {
            stage: self._host_memory.room(("products", rank), tokens * self._product_bytes_per_token(stage))
            for rank, stage in enumerate(placement.host_kept)
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

    def _reload_ahead(self, step: _Step, position: int) -> None:
        """Start bringing back the offloaded checkpoints (and host-kept products) of the stage whose backward
        comes after `position`'s, behind the compute work queued so far (this position runs meanwhile)."""
        n_stages = len(self.stages)
        stage = self.order[position] - 1 if position >= n_stages else n_stages - 2
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

    # -------------------------------------------------------------------- step
    def run(self, micro_batches: list[MicroBatch], loss_scale: float) -> StepResult:
        """Forward + backward of one optimizer step, in the placement's sweeps. Gradients land in the store's grad
        buffers once the last sweep has added to them."""
        parts = self.sweeps_of(micro_batches)
        results = [
            self._run(part, loss_scale, train=True, sweep=sweep, last_sweep=sweep == len(parts) - 1)
            for sweep, part in enumerate(parts)
        ]
        if len(results) == 1:
            return results[0]
        loss_sum = torch.stack([result.loss_sum for result in results]).sum()
        log = [entry for result in results for entry in result.log]
        return StepResult(loss_sum, results[-1].group_sq_norms, log, None)

    def sweeps_of(self, micro_batches: list[MicroBatch]) -> list[list[MicroBatch]]:
        """The step's micro-batches in `placement.sweeps` consecutive parts (fewer where there are fewer micro-batches),
        their counts differing by one at most, the larger first (the first sweep fits the placement to the device)."""
        n = min(self.placement.sweeps, len(micro_batches)) or 1
        sizes = [len(micro_batches) // n + (k < len(micro_batches) % n) for k in range(n)]
        bounds = list(itertools.accumulate(sizes, initial=0))
        return [micro_batches[start:stop] for start, stop in zip(bounds, bounds[1:])]

    def evaluate(self, micro_batches: list[MicroBatch]) -> Tensor:
        """Forward only, streaming the weights once for all micro-batches: the summed token loss
        (fp32 scalar on the device). Nothing is kept for a backward and no gradient is made."""
        return self._run(micro_batches, 0.0, train=False).loss_sum

    def token_logps(self, micro_batches: list[MicroBatch], reference: bool = False) -> list[Tensor]:
        """Forward only, as `evaluate`: each micro-batch's target log-probabilities ([rows, seq], 0 where a label
        is -100; the head's `token_logps`): what a reference model's pass or an objective's evaluation reads.
        `reference`: of the store's reference copy (`HostStore.reference`) instead of the current weights."""
        self._reference = reference
        try:
            return self._run(micro_batches, 0.0, train=False, token_logps=True).token_logps
        finally:
            self._reference = False

    def warm_up(self, micro_batches: list[MicroBatch], step: list[MicroBatch] | None = None) -> None:
        """Forward and backward of one step on `micro_batches`, its gradients dropped (nothing reaches the
        store or the optimizer): what is built on first use (torch.compile's kernels for each shape and
        grad mode, cuBLAS's plans, the allocator's pools) is built here, at setup, instead of inside the
        first step. Of the layers placed to keep their products only the last one does (on the device), so
        that both kinds of backward are built. `step`: a whole training step's micro-batches (only their sizes
        are read), whose pinned host memory for offloaded checkpoints and host-kept products is taken here too
        (pinning 20 GB takes seconds: the first step would run at half speed)."""
        enabled, self.timeline.enabled = self.timeline.enabled, False
        try:
            if step:
                tokens = max(sum(mb.input_ids.numel() for mb in part) for part in self.sweeps_of(step))
                self._host_rooms(tokens, self.placement)
            self._run(micro_batches, 1.0, train=True, warm_up=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.timeline.enabled = enabled

    def _run(
        self,
        micro_batches: list[MicroBatch],
        loss_scale: float,
        train: bool,
        warm_up: bool = False,
        token_logps: bool = False,
        sweep: int = 0,
        last_sweep: bool = True,
    ) -> StepResult:
        if not micro_batches:
            raise SchedError("a step needs at least one micro-batch")
        streams, n_stages = self.streams, len(self.stages)
        step = self._begin(micro_batches, loss_scale, train, warm_up, sweep, last_sweep)
        step.token_logps = [] if token_logps else None
        for position, stage_index in enumerate(self.order):
            slot_name, slot = self._slot(position)
            last = self._queue_copies(step, position)
            if train and position >= n_stages - 1:
                self._reload_ahead(step, position)
            streams.wait(streams.compute, slot.ready)
            weights = self._slot_weights(slot, stage_index)
            span = f"{'bwd' if position >= n_stages else 'fwd'} {self.stages[stage_index].name}"
            with self.timeline.device_span(span, "compute", streams, streams.compute):
                if position < n_stages - 1:
                    self._forward(step, stage_index, weights, slot)
                elif position == n_stages - 1:
                    self._loss(step, stage_index, weights)
                else:
                    self._backward(step, stage_index, weights)
            step.log.append(("compute", stage_index, slot_name))
            slot.free = streams.record(streams.compute)
            if train and position >= n_stages - 1:
                self._send_grads(stage_index, step)
            while step.fetched < last:  # what the optimizer had not finished before, waiting for it now
                step.fetched += 1
                self._fetch(step.fetched, step.log)
        # the squared norms are written on the copy-out stream, behind each group's reduction
        streams.wait(streams.compute, streams.record(streams.copy_out))
        return StepResult(step.loss_sum, step.sq_norms, step.log, step.token_logps)

    def _begin(
        self,
        micro_batches: list[MicroBatch],
        loss_scale: float,
        train: bool,
        warm_up: bool,
        sweep: int,
        last_sweep: bool,
    ) -> _Step:
        """A sweep's state: the micro-batches on the device, the placement as it runs, its host memory, the resident
        groups' gradients of the step's earlier sweeps."""
        self.order = self._train_order if train else self._eval_order
        if sweep == 0:
            self.timeline.start_step(self.streams)
        for slot in [*self.slots, *self._held.values()]:
            slot.stage = None  # the optimizer has changed the host weights since the last step
        batches = [mb.to(self.device) for mb in micro_batches]
        tokens = sum(mb.input_ids.numel() for mb in micro_batches)
        dtype, device = self.store.master_dtype, self.device
        step = _Step(
            batches,
            train,
            warm_up,
            None,
            self._sweep_placement(tokens, train, warm_up, sweep),
            loss_scale,
            acts=[mb.input_ids for mb in batches],
            checkpoints=[[None] * len(batches) for _ in self.stages],
            sq_norms=torch.zeros(self.store.n_groups, dtype=dtype, device=device),
            loss_sum=torch.zeros((), dtype=dtype, device=device),
            remaining=list(self._users),
            sweep=sweep,
            last_sweep=last_sweep,
            grad_buffers=self._carried_grads if sweep else {},
        )
        self._carried_grads = {}
        if train:
            self._place_step(step, tokens)
        self._rows = None
        first_pending = train and not self.updates_done(self.stages[0].groups)  # else the whole table goes at once
        if first_pending and hasattr(self.stages[0].template, "forward_rows") and len(self.stages[0].groups) == 1:
            self._rows = _Rows.of(micro_batches, self.device)
            if self.updates_done(self.stages[self.order[1]].groups):
                # the first layer's update is done before the table's rows: its copy goes first, not behind them
                self._fetch(1, step.log)
        return step

    def _place_step(self, step: _Step, tokens: int) -> None:
        """A training sweep's choices as it runs them (a warm-up keeps one stage's products and nothing in host
        memory) and its host memory; `executed` and `extras` say what they are."""
        warm_up, placement = step.warm_up, step.placement
        step.offloaded = set(placement.offloaded)
        step.kept = set(placement.keeping[-1:]) if warm_up else set(placement.kept)
        step.extras = set() if warm_up else self._extras_that_fit(step.kept, tokens)
        step.host_kept = {} if warm_up else {stage: rank for rank, stage in enumerate(placement.host_kept)}
        step.checkpoint_rooms, step.product_rooms = self._host_rooms(tokens, placement)
        self.extras = tuple(sorted(step.extras))
        self.executed = replace(
            placement,
            stages=tuple(
                replace(s, products=DEVICE if i in step.kept else HOST if i in step.host_kept else RECOMPUTE)
                for i, s in enumerate(placement.stages)
            ),
        )

    def _sweep_placement(self, tokens: int, train: bool, warm_up: bool, sweep: int) -> Placement | None:
        """The placement a sweep runs: the step's, fitted to the device by its first sweep, the largest (a later one
        finds the resident groups' gradients it carries allocated, which the placement counts on already)."""
        if not train:
            return None
        if warm_up:
            return self.placement
        if sweep == 0:
            self._fitted_placement = self._fitted(self.placement, tokens)
        return self._fitted_placement

    def _queue_copies(self, step: _Step, position: int) -> int:
        """Queue the weights of every position up to `position` (waiting for their updates where need be), then
        those of the next positions whose updates are done; the last position the slots hold meanwhile.
        (A template that waits for the GPU, a MoE part reading its row count, would otherwise hold the next
        copies back until its compute is nearly done, and the next stage would wait for them.)"""
        while step.fetched < position:
            step.fetched += 1
            self._fetch(step.fetched, step.log)
        last = min(position + len(self.slots) - 1, len(self.order) - 1)
        while step.fetched < last and self.updates_done(self.stages[self.order[step.fetched + 1]].groups):
            step.fetched += 1
            self._fetch(step.fetched, step.log)
        if step.train:
            self._fetch_held_ahead(step.fetched, step.log)
        return last

    def _forward(self, step: _Step, stage_index: int, weights: list[Tensor], slot: _Slot) -> None:
        """Every micro-batch through a stage, keeping what its backward needs: the checkpoint (on the device or on
        its way to host memory) and, where placed, the forward's products."""
        stage = self.stages[stage_index]
        template = stage.template
        kwargs = [mb.template_kwargs for mb in step.batches]
        if hasattr(template, "prepare"):  # every micro-batch's, before the first forward
            step.prepared[stage_index] = [template.prepare(weights, x, **kw) for x, kw in zip(step.acts, kwargs)]
            kwargs = [kw | {"prepared": p} for kw, p in zip(kwargs, step.prepared[stage_index])]
        host_kept = stage_index in step.host_kept
        if host_kept:  # the previous host-kept stage's products out first: one stage of them on the device
            self.streams.wait(self.streams.compute, step.last_host_copy)
        for m, x in enumerate(step.acts):
            if step.train and stage_index >= self.first_backward:
                step.checkpoints[stage_index][m] = self._checkpoint(step, stage_index, x)
            if stage_index in step.kept or host_kept:
                extras = {"extras": True} if stage_index in step.extras else {}
                step.acts[m], products = template.forward_keeping_products(weights, x, **kwargs[m], **extras)
                if host_kept:
                    room = step.product_rooms[stage_index]
                    name = f"products {stage.name}"
                    products = {k: self._offload(v, step.offloaded_copies, name, room) for k, v in products.items()}
                    step.last_host_copy = self.streams.record(self.streams.copy_out)
                step.checkpoints[stage_index][m] = _Kept(step.checkpoints[stage_index][m], products)
            elif stage_index == 0 and self._rows is not None and self._rows.table is not None:
                rows = slot.buffer[: self._rows.table.numel()]
                step.acts[m] = template.forward_rows(rows, self._rows.local[m], **kwargs[m])
            else:
                step.acts[m] = template.forward(weights, x, **kwargs[m])

    def _checkpoint(self, step: _Step, stage_index: int, x: Any) -> Any:
        """What a block's backward needs of its input (all of it, unless its template's `checkpoint(x)` says),
        on the device or on its way to host memory."""
        stage = self.stages[stage_index]
        kept = stage.template.checkpoint(x) if hasattr(stage.template, "checkpoint") else x
        if stage_index not in step.offloaded:
            return kept
        room = step.checkpoint_rooms[stage_index]
        return self._offload(kept, step.offloaded_copies, f"checkpoint {stage.name}", room)

    def _loss(self, step: _Step, stage_index: int, weights: list[Tensor]) -> None:
        """The head: each micro-batch's summed loss (or token log-probabilities) and, training, the gradient of its
        input: of the loss scaled by `loss_scale`, or, with an `objective`, of the step's objective, whose
        coefficients for every token come from all micro-batches' log-probabilities before any backward."""
        template = self.stages[stage_index].template
        labels = [mb.labels for mb in step.batches]
        if not step.train:
            for x, target in zip(step.acts, labels):
                if step.token_logps is not None:
                    step.token_logps.append(template.token_logps(weights, x, target))
                else:
                    step.loss_sum += template.loss_sum(weights, x, target)
            return
        step.offloaded_copies.clear()  # the forward is done: no checkpoint is offloaded again (nor kept by this map)
        grads = self._grad_buffers(stage_index, step.grad_buffers)
        scales = [step.loss_scale] * len(step.acts)
        if self.objective is not None and not step.warm_up:
            if getattr(self.objective, "wants_entropy", False):
                scored = [template.token_logps(weights, x, t, entropy=True) for x, t in zip(step.acts, labels)]
                self.objective.token_entropy = [entropy for _, entropy in scored]
                token_logps = [logps for logps, _ in scored]
            else:
                token_logps = [template.token_logps(weights, x, t) for x, t in zip(step.acts, labels)]
            loss, scales = self.objective(token_logps)
            step.loss_sum += loss
        for m, x in enumerate(step.acts):
            loss, step.acts[m] = template.loss(weights, x, labels[m], scales[m], grads)
            if self.objective is None:
                step.loss_sum += loss

    def _backward(self, step: _Step, stage_index: int, weights: list[Tensor]) -> None:
        """Each micro-batch's backward through a stage from its checkpoint (and kept products), weight gradients
        accumulating in the stage's groups' device buffers."""
        template = self.stages[stage_index].template
        grads = self._grad_buffers(stage_index, step.grad_buffers)
        inputs = step.checkpoints[stage_index]
        prepared = step.prepared.pop(stage_index, None)
        for m, grad_out in enumerate(step.acts):
            x, inputs[m] = inputs[m], None
            kwargs = step.batches[m].template_kwargs
            if isinstance(x, _Kept):
                products = {name: self._arrived(product) for name, product in x.products.items()}
                x, kwargs = x.x, kwargs | {"products": products}
            x = self._arrived(x)
            if prepared is not None:
                kwargs = kwargs | {"prepared": prepared[m]}
            step.acts[m] = template.backward(weights, x, grad_out, grads, **kwargs)
        step.checkpoints[stage_index] = None


def _check_stages(stages: list[Stage], store: HostStore) -> None:
    """Refuse a stage list the pipeline cannot run, naming the stage."""
    if len(stages) < 2:
        raise SchedError("a model needs at least two stages: an input stage and a loss stage")
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
