"""One optimizer step's forward and backward, layer-major over device weight slots, as a `Placement` says: the
schedule of a step over its three parts, the weight stream (`weights`), the activation store (`activations`) and
the gradient sink (`gradients`).

Positions of a step: forward stages 0..n-2, the head n-1 (loss + its backward), then backward stages n-2..0.
Position n (the last block, backward) finds its weights still in the slot of position n-2, so with two slots they
are not copied again; held stages have a buffer of their own instead, which keeps their weights from forward to
backward. Gradients of a group accumulate in one fp32 device buffer and leave once, when the last stage that binds
the group has run backward. Resident stages' fp32 masters live on the device (the optimizer updates them there):
they are cast into the slot from that master, and their gradient is handed over on the device instead of copied out.
"""

import collections
import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from megatrain_store import HostStore, free_device_bytes

from .activations import ActivationStore
from .costs import StageCosts, extras_of, fit_to_device
from .gradients import GradientSink
from .hooks import Hooks
from .placement import DEVICE, HELD, HOST, RECOMPUTE, RESIDENT, RESIDENT_COPY, Placement, PlacementError
from .streams import Streams
from .template import StageTemplate, StepObjective
from .timeline import Timeline
from .weights import Slot, WeightStream

IGNORE_INDEX = -100  # a label that trains nothing (torch's cross_entropy ignore_index, as the templates' heads read it)


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
    """A template (`StageTemplate`: its layouts, forward and backward, and its capabilities) and the store groups
    it binds, in the template's order."""

    template: StageTemplate
    groups: tuple[int, ...]
    name: str = ""


@dataclass
class MicroBatch:
    """One micro-batch of a step: token ids and their labels (already shifted: the label at t is the target of
    position t), and what every template is given beside them. `to(device)` copies it, non-blocking."""

    input_ids: Tensor  # [micro_batch, seq] int64
    labels: Tensor  # [micro_batch, seq] int64, -100 where no loss (any other negative label is refused)
    # several documents per row (e.g. megatrain_templates.Documents): given to every template as
    # `documents=`, moved to the device with `.to(device, non_blocking=True)`; None: one sequence per row
    documents: Any = None
    # an image-text model's inputs besides the token ids (e.g. megatrain_templates.Media): given to every template as
    # `media=`, moved to the device with `.to(device, non_blocking=True)`; None: a text model's micro-batch
    media: Any = None
    # a training pass's key of its dropout masks (e.g. megatrain_templates.DropoutKey): `dropout.at(stage name)` is
    # given as `dropout=` to the templates that `takes_dropout`; None: no dropout
    dropout: Any = None

    def to(self, device: torch.device) -> "MicroBatch":
        """A copy on `device`, queued non-blocking (the dropout key stays as is)."""
        documents, media = (
            None if x is None else x.to(device, non_blocking=True) for x in (self.documents, self.media)
        )
        ids, labels = self.input_ids.to(device, non_blocking=True), self.labels.to(device, non_blocking=True)
        return MicroBatch(ids, labels, documents, media, self.dropout)

    def stage_kwargs(self, stage: Stage, train: bool) -> dict:
        """`template_kwargs`, and in a training pass the dropout key at `stage`'s name where its template takes one."""
        if not train or self.dropout is None or not stage.template.takes_dropout:
            return self.template_kwargs
        return self.template_kwargs | {"dropout": self.dropout.at(stage.name)}

    @property
    def template_kwargs(self) -> dict:
        """What every template's forward and backward is given beside the tensors: `documents=`, `media=` where set."""
        kwargs = {} if self.documents is None else {"documents": self.documents}
        return kwargs if self.media is None else kwargs | {"media": self.media}


@dataclass
class StepResult:
    """What `LayerPipeline.run` gives for one step: its tensors stay on the device (reading them waits for it)."""

    loss_sum: Tensor  # scalar in the store's master dtype (fp32 or wider): summed token losses of the step
    group_sq_norms: Tensor  # [n_groups], the store's master dtype (fp32 or wider): squared gradient norm per group
    log: list[tuple] = field(default_factory=list)  # ("copy_in"|"reuse"|"compute"|"grad_out", stage or group, slot)
    token_logps: list[Tensor] | None = None  # per micro-batch [rows, seq], where the head was asked for them


@dataclass
class _Step:
    """What one sweep's run of the stages carries from position to position."""

    batches: list[MicroBatch]  # on the device
    train: bool
    warm_up: bool
    placement: Placement | None  # as this sweep runs it (None: evaluation)
    loss_scale: float
    acts: list[Any]  # each micro-batch's activation between stages (token ids first)
    loss_sum: Tensor
    order: list[int]  # the stage of each position
    token_logps: list[Tensor] | None = None  # the head's per-token log-probabilities, where asked for (forward only)
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

    The update policy meets it through `hooks` (`Hooks`: `before_fetch`, `updates_done`, `first_rows`,
    `on_grads_landed`, `on_device_grads`, `before_cast`, `bring_back`, `let_go_parked`, `held_device_bytes`; none
    given: a step updates nothing) and, with several processes, `reduce_grad` (`GradientSink`). A stage's
    template declares what it can do (`StageTemplate`): keep its products (`forward_keeping_products`, and its
    extra products where a step has the device memory to spare: `extras` says where), prepare a micro-batch early,
    read no weights in its backward (then the wait for their last update comes before its gradient is sent), read
    only the rows its tokens select (a first stage: a training step asks `first_rows` for them).

    Resident stages are cast from `device_masters` (group -> fp32 master on the device, updated there by
    work queued on the compute stream): no copy from the store, no `before_fetch`, and instead of being
    copied out their gradient goes to `on_device_grads`. A stage binds only such groups or none. A copied block
    (`Placement.copied`) binds `device_copies[group]` instead, its compute-dtype copy, which the update refreshes
    (the compute stream waits for it at the stage's turn, `before_cast`): it is never cast.

    A step-level `objective` (`StepObjective`, e.g. `megatrain_templates.DPO`) replaces the summed cross-entropy:
    the head gives it every micro-batch's target log-probabilities (and their entropy where it asks) before any
    backward, and it returns the step's loss and each token's coefficient, which the head's backward applies.
    """

    def __init__(
        self,
        stages: list[Stage],
        store: HostStore,
        device: torch.device,
        n_slots: int = 2,
        placement: Placement | None = None,
        device_masters: dict[int, Tensor] | None = None,
        device_copies: dict[int, Tensor] | None = None,
        hooks: Hooks | None = None,
        timeline: Timeline | None = None,
        reduce_grad: Callable[[int, Tensor], Tensor] | None = None,
        objective: StepObjective | None = None,
    ):
        _check_stages(stages, store)
        if n_slots < 2:
            raise SchedError(f"n_slots must be >= 2 to overlap copies with compute, got {n_slots}")
        self.stages, self.store, self.device = stages, store, torch.device(device)
        self.streams = Streams(self.device)
        if self.streams.cuda:
            expandable_device_memory()
        self.hooks = hooks or Hooks()
        self.objective = objective
        self.timeline = timeline or Timeline(enabled=False)
        self.costs = [StageCosts.of(stage.template, store.compute_dtype.itemsize) for stage in stages]
        self._init_order()
        parts = (stages, store, self.streams, self.timeline, self.hooks)
        self.weights = WeightStream(*parts, n_slots, self._weightless_backward)
        self.activations = ActivationStore(stages, self.streams, self.timeline, self.costs)
        self.gradients = GradientSink(*parts, reduce_grad, self._weightless_backward)
        self.fallback: str | None = None  # what the last step changed of its placement, and why; None: nothing
        self.device_headroom: int | None = None  # device bytes the last step found free beyond what it counts on
        self.extras: tuple[int, ...] = ()  # stages whose forwards the last step let keep their extra products
        self.executed: Placement | None = None  # the placement the last training step ran
        # bytes of device memory free for a step (None: not known, as on the CPU; no placement is changed), with
        # what the update policy still holds of the last step's gradients (given back as this step's casts come)
        self.free_device_memory: Callable[[], int] | None = (
            (lambda: free_device_bytes(self.device) + self.hooks.held_device_bytes()) if self.streams.cuda else None
        )
        self._fitted_placement: Placement | None = None  # the step's placement as its first sweep fitted it
        self.place(placement or Placement.build(len(stages)), device_masters, device_copies)

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
        self._weightless_backward = {i for i, s in enumerate(stages) if not s.template.backward_reads_weights}

    # --------------------------------------------------------------- placement
    def place(
        self,
        placement: Placement,
        device_masters: dict[int, Tensor] | None = None,
        device_copies: dict[int, Tensor] | None = None,
    ) -> None:
        """Run the next steps as `placement` says, resident stages cast from `device_masters` (group -> fp32
        master on the device), copied ones bound to `device_copies` (group -> its compute-dtype copy). Between
        steps only: held buffers are (re)allocated, pinned host memory no longer used is given back."""
        device_masters, device_copies = device_masters or {}, device_copies or {}
        self._check_placement(placement, device_masters, set(device_copies))
        self.placement = placement
        self._moments_back: dict[int, list[int]] = {}  # stage -> the parked groups brought back after its backward
        for parked, stage in placement.moments_back_after.items():
            self._moments_back.setdefault(stage, []).extend(self.stages[parked].groups)
        if self.streams.cuda:
            torch.cuda.synchronize(self.device)  # nothing in flight reads the buffers given back below
        self.weights.place(placement, device_masters, device_copies)
        self.gradients.place(placement, device_masters)
        self.activations.place(placement)

    def _check_placement(self, placement: Placement, device_masters: dict[int, Tensor], copies: set[int]) -> None:
        """Refuse a placement these stages cannot run, naming the stage and what it lacks."""
        if len(placement.stages) != len(self.stages):
            raise PlacementError(
                f"the placement places {len(placement.stages)} stages; the model has {len(self.stages)}"
            )
        if device_masters and self.gradients.reduces_over_processes:
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
        binders = collections.Counter(g for stage in self.stages for g in stage.groups)
        shared = [i for i in placement.parked if any(binders[g] > 1 for g in self.stages[i].groups)]
        if shared:
            raise PlacementError(
                f"parked stages {shared} bind groups other stages bind too: only a stage's own groups' moments are "
                "parked (they come back once, ahead of the stage's backward)"
            )
        for index, stage in enumerate(self.stages):
            on_device = [g in device_masters for g in stage.groups]
            if any(on_device) and not all(on_device):
                raise SchedError(f"stage {index} ({stage.name}) binds groups with device masters and groups without")
        for index, (stage, choice) in enumerate(zip(self.stages, placement.stages)):
            _check_stage_choice(
                index, stage, choice, len(self.stages), device_masters, copies, self._weightless_backward
            )

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
        (a scalar on the device, in the store's master dtype: fp32 or wider). Nothing is kept for a backward and no
        gradient is made."""
        return self._run(micro_batches, 0.0, train=False).loss_sum

    def token_logps(self, micro_batches: list[MicroBatch], reference: bool = False) -> list[Tensor]:
        """Forward only, as `evaluate`: each micro-batch's target log-probabilities ([rows, seq], 0 where a label
        is -100; the head's `token_logps`): what a reference model's pass or an objective's evaluation reads.
        `reference`: of the store's reference copy (`HostStore.reference`) instead of the current weights."""
        self.weights.reference = reference
        try:
            return self._run(micro_batches, 0.0, train=False, token_logps=True).token_logps
        finally:
            self.weights.reference = False

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
                self.activations.rooms(tokens, self.placement)
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
        """One sweep: at each position, queue the weights the slots can take, reload what the next backward needs,
        compute the stage on every micro-batch, and send out the gradients no later backward adds to."""
        if not micro_batches:
            raise SchedError("a step needs at least one micro-batch")
        _check_micro_batches(micro_batches)
        streams, n_stages = self.streams, len(self.stages)
        # (traced: the host's part of a step's start, which the GPU waits for where it has finished the step before)
        with self.timeline.host_span(f"begin sweep {sweep}", "step_start"):
            step = self._begin(micro_batches, loss_scale, train, warm_up, sweep, last_sweep)
        step.token_logps = [] if token_logps else None
        for position, stage_index in enumerate(step.order):
            slot_name, slot = self.weights.slot(position)
            last = self._queue_copies(step, position)
            self.weights.cast(position, step.log)
            if train and position >= n_stages - 1:
                self.activations.reload_ahead(step.order[position] - 1 if position >= n_stages else n_stages - 2)
            streams.wait(streams.compute, slot.ready)
            if train and position == self.placement.moments_leave_before and self.placement.parked:
                self.hooks.let_go_parked()
            weights = self.weights.views(slot, stage_index)
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
                self.gradients.send(stage_index, step.log)
                if stage_index in self._moments_back and position >= n_stages and last_sweep and not warm_up:
                    # (the updates follow the last sweep; a warm-up's, none)
                    self.hooks.bring_back(tuple(self._moments_back[stage_index]))
            while step.fetched < min(last, position + 1):  # what the optimizer had not finished, waiting now
                step.fetched += 1
                self.weights.fetch(step.fetched, step.log)
        # the squared norms are written on the copy-out stream, behind each group's reduction
        streams.wait(streams.compute, streams.record(streams.copy_out))
        return StepResult(step.loss_sum, self.gradients.sq_norms, step.log, step.token_logps)

    def _begin(
        self,
        micro_batches: list[MicroBatch],
        loss_scale: float,
        train: bool,
        warm_up: bool,
        sweep: int,
        last_sweep: bool,
    ) -> _Step:
        """A sweep's state: the micro-batches on the device, the placement as it runs, its activations' host memory,
        its gradients (the resident groups' of the step's earlier sweeps), its first weights."""
        if sweep == 0:
            self.timeline.start_step(self.streams)
        batches = [mb.to(self.device) for mb in micro_batches]
        tokens = sum(mb.input_ids.numel() for mb in micro_batches)
        dtype = self.store.master_dtype
        step = _Step(
            batches,
            train,
            warm_up,
            self._sweep_placement(tokens, train, warm_up, sweep),
            loss_scale,
            acts=[mb.input_ids for mb in batches],
            loss_sum=torch.zeros((), dtype=dtype, device=self.device),
            order=self._train_order if train else self._eval_order,
        )
        self.gradients.begin_step(sweep, last_sweep, warm_up)
        self.activations.begin_step(len(batches))
        if train:
            self._place_step(step, tokens)
        first_pending = train and not self.hooks.updates_done(self.stages[0].groups)  # else the whole table at once
        input_ids = [mb.input_ids for mb in micro_batches] if first_pending else None
        self.weights.begin_step(step.order, input_ids, step.log)
        return step

    def _place_step(self, step: _Step, tokens: int) -> None:
        """A training sweep's choices as it runs them (a warm-up keeps one stage's products and nothing in host
        memory) and its host memory; `executed` and `extras` say what they are."""
        warm_up, placement = step.warm_up, step.placement
        kept = set(placement.keeping[-1:]) if warm_up else set(placement.kept)
        room = math.inf if self.free_device_memory is None else (self.device_headroom or 0)
        extras = set() if warm_up else extras_of(self.costs, kept, tokens, room)
        host_kept = {} if warm_up else {stage: rank for rank, stage in enumerate(placement.host_kept)}
        self.activations.place_step(tokens, placement, kept, extras, host_kept)
        self.extras = tuple(sorted(extras))
        self.executed = replace(
            placement,
            stages=tuple(
                replace(s, products=DEVICE if i in kept else HOST if i in host_kept else RECOMPUTE)
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
            free = None if self.free_device_memory is None else self.free_device_memory()
            fitted = fit_to_device(self.placement, tokens, free, self.costs)
            self._fitted_placement, self.device_headroom, self.fallback = (
                fitted.placement,
                fitted.headroom,
                fitted.fallback,
            )
        return self._fitted_placement

    def _queue_copies(self, step: _Step, position: int) -> int:
        """Queue the weights of every position up to `position` (waiting for their updates where need be), then
        those of the next positions whose updates are done, up to the last the slots can take (`last_to_fetch`).
        (A template that waits for the GPU, a MoE part reading its row count, would otherwise hold the next
        copies back until its compute is nearly done, and the next stage would wait for them.)"""
        weights = self.weights
        while step.fetched < position:
            step.fetched += 1
            weights.fetch(step.fetched, step.log)
        last = weights.last_to_fetch(position)
        while step.fetched < last and self.hooks.updates_done(self.stages[step.order[step.fetched + 1]].groups):
            step.fetched += 1
            weights.fetch(step.fetched, step.log)
        if step.train:
            weights.fetch_held_ahead(step.fetched, step.log)
        return last

    def _forward(self, step: _Step, stage_index: int, weights: list[Tensor], slot: Slot) -> None:
        """Every micro-batch through a stage, keeping what its backward needs: the checkpoint (on the device or on
        its way to host memory) and, where placed, the forward's products."""
        template, activations = self.stages[stage_index].template, self.activations
        kwargs = [mb.stage_kwargs(self.stages[stage_index], step.train) for mb in step.batches]
        if template.prepare is not None:  # every micro-batch's, before the first forward
            step.prepared[stage_index] = [template.prepare(weights, x, **kw) for x, kw in zip(step.acts, kwargs)]
            kwargs = [kw | {"prepared": p} for kw, p in zip(kwargs, step.prepared[stage_index])]
        activations.before_forward(stage_index)
        for m, x in enumerate(step.acts):
            if step.train and stage_index >= self.first_backward:
                activations.keep(stage_index, m, x)
            rows = self.weights.table_rows(slot, m) if stage_index == 0 else None
            if activations.keeps_products(stage_index):
                extras = activations.extras_of(stage_index)
                step.acts[m], products = template.forward_keeping_products(weights, x, **kwargs[m], **extras)
                activations.keep_products(stage_index, m, products)
            elif rows is not None:
                step.acts[m] = template.forward_rows(*rows, **kwargs[m])
            else:
                step.acts[m] = template.forward(weights, x, **kwargs[m])

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
        self.activations.forward_done()
        grads = self.gradients.of(stage_index)
        scales = [step.loss_scale] * len(step.acts)
        if self.objective is not None and not step.warm_up:
            loss, scales = self._objective(template, weights, step.acts, labels)
            step.loss_sum += loss
        for m, x in enumerate(step.acts):
            loss, step.acts[m] = template.loss(weights, x, labels[m], scales[m], grads)
            if self.objective is None:
                step.loss_sum += loss

    def _objective(self, head: StageTemplate, weights: list[Tensor], acts: list, labels: list) -> tuple[Tensor, list]:
        """The step objective's (loss, each token's coefficient) of every micro-batch's target log-probabilities
        (and their entropy, where it asks)."""
        if not self.objective.wants_entropy:
            return self.objective([head.token_logps(weights, x, t) for x, t in zip(acts, labels)], None)
        scored = [head.token_logps(weights, x, t, entropy=True) for x, t in zip(acts, labels)]
        return self.objective([logps for logps, _ in scored], [entropy for _, entropy in scored])

    def _backward(self, step: _Step, stage_index: int, weights: list[Tensor]) -> None:
        """Each micro-batch's backward through a stage from its checkpoint (and kept products), weight gradients
        accumulating in the stage's groups' device buffers."""
        template = self.stages[stage_index].template
        grads = self.gradients.of(stage_index)
        prepared = step.prepared.pop(stage_index, None)
        for m, grad_out in enumerate(step.acts):
            x, products = self.activations.take(stage_index, m)
            kwargs = step.batches[m].stage_kwargs(self.stages[stage_index], train=True)
            if products is not None:
                kwargs = kwargs | {"products": products}
            if prepared is not None:
                kwargs = kwargs | {"prepared": prepared[m]}
            step.acts[m] = template.backward(weights, x, grad_out, grads, **kwargs)
        self.activations.drop(stage_index)


def _check_stage_choice(
    index: int, stage: Stage, choice, n: int, device_masters: dict, copies: set, weightless: set
) -> None:
    """Refuse a stage's placement it cannot run, naming the stage and what it lacks."""
    on_device = [g in device_masters for g in stage.groups]
    if (choice.weights in (RESIDENT, RESIDENT_COPY)) != all(on_device):
        raise PlacementError(
            f"stage {index} ({stage.name}) is {choice.weights} but its groups "
            f"{'have' if all(on_device) else 'lack'} device masters"
        )
    block = 0 < index < n - 1
    if choice.weights == RESIDENT_COPY and not (block and len(stage.groups) == 1 and stage.groups[0] in copies):
        raise PlacementError(
            f"stage {index} ({stage.name}) cannot be {RESIDENT_COPY}: only a block of one group whose compute-dtype "
            "copy is given (device_copies) is"
        )
    if choice.weights == HELD and not (block and index < n - 2 and index not in weightless):
        raise PlacementError(
            f"stage {index} ({stage.name}) cannot be held: only blocks before the last (whose backward "
            "finds its rotating slot still full) hold their weights"
        )
    if (choice.checkpoint == HOST or choice.products != RECOMPUTE) and not block:
        raise PlacementError(f"stage {index} ({stage.name}) is no block: it has no checkpoint or products")
    if choice.products != RECOMPUTE and stage.template.forward_keeping_products is None:
        raise PlacementError(f"stage {index} ({stage.name}) cannot keep its products: its template recomputes")


def _check_micro_batches(micro_batches: list[MicroBatch]) -> None:
    """Refuse micro-batches the templates would misread, before any stage runs: token ids and labels are [rows, seq]
    of one shape, and a label is a token id or -100 (read where the labels are on the host: no device sync)."""
    for index, mb in enumerate(micro_batches):
        ids, labels = mb.input_ids, mb.labels
        if ids.ndim != 2 or labels.shape != ids.shape:
            raise SchedError(
                f"micro-batch {index}: input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must both be "
                "[rows, seq], of one shape (labels[r, t]: the target of position t, -100 where none)"
            )
        if labels.device.type == "cpu":
            wrong = labels[(labels < 0) & (labels != IGNORE_INDEX)]
            if wrong.numel():
                raise SchedError(
                    f"micro-batch {index}: label {int(wrong[0])} is neither a token id nor -100; mark the positions "
                    "that train nothing with -100 (a head would read it as token 0)"
                )


def _check_stages(stages: list[Stage], store: HostStore) -> None:
    """Refuse a stage list the pipeline cannot run, naming the stage."""
    if len(stages) < 2:
        raise SchedError("a model needs at least two stages: an input stage and a loss stage")
    if stages[-1].template.loss is None:
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
