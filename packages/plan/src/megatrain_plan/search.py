"""`megatrain plan`: where each layer's weights and activations go, whether a run fits, and how fast it runs.

The `Planner` searches a step size's placement (`place`) over its cost model (`costs.CostModel`) and reports
what it costs (`plan`). The Trainer executes that placement as it is (`megatrain_sched.LayerPipeline`),
`megatrain plan` prints it (`report.format_plan`) and benchmark rows record it: one object, decided in one place.

How `place` decides, in order (each choice the fewest or most that a rule allows; `engine.*` settings other
than auto override a rule):
1. activation checkpoints that do not fit in half the GPU's room for a step go to host memory (first layers
   first: produced first, needed last);
2. a small step, whose CPU optimizer would take longer than the GPU's work it runs beside (with clipping: the
   next step's forward), makes the embedding and the first blocks resident (fp32 state on the GPU, updated
   there): until the optimizer fits beside the GPU's work, or with clipping as many as give the fastest
   predicted step (each displaces kept products: its backward recomputes); a large one makes the embedding and
   first block resident where the step boundary costs more than the kept products their state displaces;
3. a small step holds the next blocks' weights from forward to backward (one copy a step instead of two);
4. a large step offloads the fewest first checkpoints that let the most layers keep their matmul products;
5. the gradient pool is deepened where the optimizer lags the backward, and the last groups' moments go to
   disk where the host cannot hold them;
6. in a large step more layers keep their products in pinned host memory, as the host and PCIe allow;
7. the last layers keep their products on the GPU, as many as its memory holds, and the first resident stages park
   their moments in host memory from update to backward where that lets more keep them and is predicted faster;
8. resident blocks keep their weights in the compute dtype beside their masters (refreshed by their update, never
   cast again), as many as the GPU's room beside all that and the products' extras holds;
9. a large step whose GPU work bounds it, and whose layers do not all keep their products, runs in sweeps (its
   micro-batches in consecutive parts, forward and backward each, gradients summed before the one update),
   each placed as a step of its size, where that is predicted faster: each sweep keeps more products, at the
   price of the weights and gradient sums crossing PCIe once more per sweep.
"""

import collections
import functools
import itertools
import json
from dataclasses import replace
from pathlib import Path

from megatrain_sched import EXTRAS_MARGIN, Placement, PlacementError
from megatrain_zoo import ModelSpec, flops_per_token

from .costs import (
    CHECKPOINT_GPU_SHARE,
    CPU_OPTIMIZER_MARGIN,
    GPU_UPDATED_SHARE,
    HELD_GPU_SHARE,
    HOST_KEPT_RAM_SHARE,
    MOST_SWEEPS,
    POOL_HOST_SHARE,
    RESIDENT_GAIN,
    RUNTIME_DEVICE_BYTES,
    SWEEPS_GAIN,
    SWEEPS_PCIE_SHARE,
    CostModel,
    resident_stages,
    slowest,
    whole_step_statistics,
)
from .counts import Counts
from .errors import PlanError
from .host_rules import HostRules
from .report import Plan


class Planner(HostRules, CostModel):
    """The placement of one run's steps: `place` searches it by the rules of the module's docstring over the cost
    model; `plan` reports what one costs and how long its step is predicted to take."""

    @functools.cached_property
    def copyable(self) -> set[int]:
        """The blocks a copy may bind (as the stage's weights): those of one group, which no other stage binds."""
        return {i for i in own_group_stages(self.spec) if i in self.blocks and len(self.spec.stages[i].groups) == 1}

    @property
    def step_tokens(self) -> int:
        """Tokens per GPU of the step the run is configured for (`shape`)."""
        return self.shape.rows_per_step * self.shape.seq_len // self.world

    def compute_bound_tokens(self) -> int:
        """Tokens per step (all GPUs') from which the GPU's work bounds the step, each size placed for itself
        (compute grows with the tokens, the rest nearly does not)."""

        def compute_bound(tokens: int) -> bool:
            return slowest(self.phases(self.place(tokens, explain=False))) == "compute"

        low, high = 0, max(1, self.step_tokens)
        while not compute_bound(high) and high < 2**40:
            low, high = high, 2 * high
        while high - low > max(1, high // 1000):  # to 0.1%: a plan per probe
            middle = (low + high) // 2
            low, high = (low, middle) if compute_bound(middle) else (middle, high)
        return high * self.world

    # ------------------------------------------------------------------ search
    def placement_of(self, counts: Counts, **step) -> Placement:
        """`counts` as stage indices, by the rules: the first blocks resident (with the embedding, and the head
        where tied), then held; the first blocks' checkpoints offloaded; the last keepable blocks keeping their
        products on the GPU, and before those, spread evenly from the first keepable one (the copies out keep
        pace with the forward, and the first layers' backward, last, leaves the copies back the most time), the
        host-kept ones."""
        resident = resident_stages(self.spec, counts.resident)
        copied = tuple(i for i in resident if i in self.copyable)[: counts.copied]
        parked = parkable_stages(self.spec, resident)[: counts.parked] if counts.parked else ()  # (a hot path)
        holdable = [i for i in self.holdable if i not in resident]
        last_block = self.n_stages - 2
        kept = self._last_blocks(counts.kept)
        candidates = list(range(max(1, last_block + 1 - self.keepable), last_block + 1 - counts.kept))
        n = min(counts.host_kept, len(candidates))
        host_kept = tuple(candidates[i * len(candidates) // n] for i in range(n))
        placement = Placement.build(
            self.n_stages,
            resident=resident,
            held=tuple(holdable[: counts.held]),
            offloaded=tuple(self.blocks[: counts.offloaded]),
            kept=kept,
            host_kept=host_kept,
            copied=copied,
            parked=parked,
            tokens=counts.tokens,
            sweeps=counts.sweeps,
            wire_copy=self.wire_copy,
            experts_per_stage=self.experts_per_stage,
            **step,
        )
        return replace(placement, device_step_bytes=self.step_device_bytes(placement))

    def _last_blocks(self, count: int) -> tuple[int, ...]:
        last_block = self.n_stages - 2
        return tuple(range(last_block - count + 1, last_block + 1))

    def place(
        self, tokens: int, first_disk_group: int | None = None, explain: bool = True, sweeps: int | None = None
    ) -> Placement:
        """The placement for steps of `tokens` per GPU (see the module's docstring for the order of the choices).
        `first_disk_group`: the disk tier of a store already allocated (else decided here). With `explain`, the
        placement's `why` says in words what decided each choice. `sweeps`: so many (else engine.sweeps's)."""
        setting = sweeps or self.engine.sweeps
        if setting != "auto":
            return self._place_sweeps(tokens, setting, first_disk_group, explain)
        one = self._place_sweeps(tokens, 1, first_disk_group, explain)
        best = one
        for sweeps in self._sweep_counts(one):
            placed = self._place_sweeps(tokens, sweeps, first_disk_group, explain)
            hidden = self.transfer_s(placed) <= SWEEPS_PCIE_SHARE * self.compute_s(placed)
            faster = self.step_s(placed) < SWEEPS_GAIN * self.step_s(best)
            roomier = leaves_more_room(self.host_bytes(placed), self.host_bytes(best), self.machine.host_memory)
            if hidden and self._host_holds(placed) and (faster or roomier):
                best = placed
        if best is not one and explain:
            roomier = leaves_more_room(self.host_bytes(best), self.host_bytes(one), self.machine.host_memory)
            room = ", which the host does not hold" if not self._host_holds(one) else ", which leaves it little room"
            best.why["sweeps"] = (
                f"the step runs in {best.sweeps} sweeps of {best.tokens:,} tokens: each lets "
                f"{len(best.keeping)} layers keep their products where the whole step would let {len(one.keeping)} "
                f"(predicted {self.step_s(best):.2f} s a step against {self.step_s(one):.2f} s{room if roomier else ''})"
            )
        return best

    def _sweep_counts(self, one: Placement) -> range:
        """The sweeps worth predicting beside one: where no step objective reads all micro-batches first, no
        optimizer state is on disk, the GPU bounds the step, and some layers recompute their products."""
        micro_batches = self.shape.micro_batches(one.tokens)
        if (
            not self.objective.sweepable
            or whole_step_statistics(self.model, self.shape)
            or self.engine.optimizer_state_dir
            or self.machine.gpu_memory is None
            or len(one.keeping) >= self.keepable
            or slowest(self.phases(one)) != "compute"
        ):
            return range(0)
        return range(2, min(micro_batches, MOST_SWEEPS) + 1)

    def _place_sweeps(self, tokens: int, sweeps: int, first_disk_group: int | None, explain: bool) -> Placement:
        """The placement for steps of `tokens` per GPU run in `sweeps`, each placed for its micro-batches' tokens."""
        micro_batches = self.shape.micro_batches(tokens)
        sweeps = min(sweeps, micro_batches)
        sweep_tokens = min(tokens, -(-micro_batches // sweeps) * self.micro_tokens) if sweeps > 1 else tokens
        why: dict[str, str] = {}
        counts = Counts(sweep_tokens, sweeps, offloaded=self._offloaded_to_fit(sweep_tokens))
        small = self.optimizer_room_s(self.placement_of(replace(counts, kept=self._kept(counts)))) < self.optimizer_s(
            self.placement_of(counts)
        )
        counts = replace(counts, resident=self._resident(counts, small, why))
        counts = replace(counts, held=self._held(counts, small, why))
        counts = replace(counts, offloaded=self._offloaded_for_products(counts, small, why))
        pool = self._gradient_pool(replace(counts, kept=self._kept(counts)), why)
        if first_disk_group is None:
            first_disk_group = self._first_disk_group(self.placement_of(counts, gradient_pool=pool), why)
        step = {"gradient_pool": pool, "first_disk_group": first_disk_group}
        counts = replace(counts, host_kept=self._host_kept(counts, small, step, why))
        counts = replace(counts, kept=self._kept(counts))
        counts = self._parked(counts, step, why)
        counts = replace(counts, host_kept=min(counts.host_kept, self.keepable - counts.kept))
        if self.machine.gpu_memory is not None and self.keepable and self.engine.kept_layers == "auto":
            which = {0: "no layer keeps its", 1: "the last layer keeps its"}
            what = which.get(counts.kept, f"the last {counts.kept} layers keep their")
            why["kept"] = f"{what} matmul products: as many as the GPU's memory holds"
        counts = replace(counts, copied=self._copied(counts, step, why))
        return self.placement_of(counts, **step, why=why if explain else {})

    def _parked(self, counts: Counts, step: dict, why: dict) -> Counts:
        """`counts` with the first resident stages parking their moments from update to backward (crossing PCIe twice),
        and the layers keeping their products then: as set; else the fewest giving the fastest predicted step."""
        most = len(parkable_stages(self.spec, resident_stages(self.spec, counts.resident)))
        setting = self.engine.parked_layers
        if setting == "auto" and (self.machine.gpu_memory is None or counts.kept >= self.keepable):
            setting = 0
        drafts = [replace(counts, parked=n) for n in (range(most + 1) if setting == "auto" else [min(setting, most)])]
        drafts = [replace(draft, kept=self._kept(draft)) for draft in drafts]
        placed = [self.placement_of(draft, **step) for draft in drafts]
        times = [self.step_s(placement) for placement in placed]
        fastest = times.index(min(times))  # (the fewest of the fastest)
        best = drafts[fastest]
        if best.parked and setting == "auto":
            head = self.persistent_gradient_bytes(placed[fastest])
            held = f"; the head's gradient stays on the GPU from step to step ({head / 2**30:.1f} GiB)" if head else ""
            why["parked"] = (
                f"the first {best.parked} GPU-updated stages park their moments in host memory from update to backward: "
                f"{best.kept} layers keep their products, not {counts.kept} (predicted {min(times):.2f} s, not {times[0]:.2f})"
                f"{held}"
            )
        return best

    def _copied(self, counts: Counts, step: dict, why: dict) -> int:
        """Resident blocks keeping a compute-dtype copy of their weights on the GPU, which their update refreshes:
        each saves a cast a pass on the compute stream (0.9 ms of a Qwen3-30B-A3B layer's 20 ms forward, and of its
        backward) and displaces nothing that saves a recompute, so as many as the room beside the placement's
        products and their extras holds (beyond EXTRAS_MARGIN)."""
        blocks = [i for i in resident_stages(self.spec, counts.resident) if i in self.copyable]
        if self.engine.copied_layers != "auto":
            return min(self.engine.copied_layers, len(blocks))
        if self.machine.gpu_memory is None or not blocks:
            return 0
        placed = self.placement_of(counts, **step)
        extras = sum(placed.tokens * self.extra_bytes_per_token[i] for i in self.extras(placed))
        room = self._device_room(placed) - extras - EXTRAS_MARGIN
        copies = itertools.accumulate(self.stage_sizes[i] * self.element for i in blocks)
        copied = sum(1 for _ in itertools.takewhile(lambda total: total <= room, copies))
        if copied:
            which = (
                "every resident block keeps its" if copied == len(blocks) else f"the first {copied} blocks keep their"
            )
            why["copied"] = f"{which} weights in the compute dtype on the GPU, in the room the step leaves"
        return copied

    def _room_for_products(self, counts: Counts) -> float:
        """GPU bytes left for kept products beside everything else `counts` places."""
        return self._device_room(self.placement_of(replace(counts, kept=0)))

    def _kept(self, counts: Counts) -> int:
        """Layers keeping their products on the GPU: as set, else as many as its memory holds."""
        setting = self.engine.kept_layers
        if setting != "auto":
            return min(setting, self.keepable)
        if self.machine.gpu_memory is None or not self.keepable:
            return 0
        none = self.placement_of(replace(counts, kept=0))
        room = self._device_room(none) + self.backward_peak(none)  # for the step's activations and held gradients
        low, high = 0, self.keepable  # the most that fit (the peak grows with them: a bisection)
        while low < high:
            middle = (low + high + 1) // 2
            fits = self.backward_peak(none, kept=self._last_blocks(middle)) <= room
            low, high = (middle, high) if fits else (low, middle - 1)
        return low

    def _offloaded_to_fit(self, tokens: int) -> int:
        """First blocks whose checkpoints go to host memory: all or none as set; auto, those that do not fit in
        CHECKPOINT_GPU_SHARE of the GPU's room for a step (the last layers' stay: needed first)."""
        setting = self.engine.offload_checkpoints
        if setting != "auto":
            return len(self.blocks) if setting else 0
        if self.machine.gpu_memory is None:
            return 0
        persistent = self.persistent_device_bytes(self.placement_of(Counts(tokens)))
        room = self.machine.gpu_memory - RUNTIME_DEVICE_BYTES - persistent - self.working_device_bytes()
        room *= CHECKPOINT_GPU_SHARE
        on_gpu = itertools.accumulate(self.checkpoint_bytes(i, tokens) for i in reversed(self.blocks))
        return len(self.blocks) - sum(1 for _ in itertools.takewhile(lambda total: total <= room, on_gpu))

    def _resident(self, counts: Counts, small: bool, why: dict) -> int:
        """Blocks (the first) resident on the GPU, with the embedding (and the head where tied): as set; none
        with several processes (each updates a shard of every group) or checkpoints that crowd the GPU; in a
        small step the fewest that bring the CPU optimizer (and the head, which waits for it) within the GPU's
        work, in up to GPU_UPDATED_SHARE of it; in a large one the first, where the step boundary's wait costs
        more than the kept products its state displaces."""
        setting, n_blocks = self.engine.gpu_updated_layers, len(self.blocks)
        if self.frozen:  # (the first stages are a frozen tower's, whose groups keep no state to update)
            return 0
        if setting != "auto":
            return min(setting, n_blocks)
        if self.machine.gpu_memory is None or counts.offloaded or self.world > 1:
            return 0
        if not small:
            return 1 if self._boundary_pays(counts, why) else 0
        budget = min(GPU_UPDATED_SHARE * self.machine.gpu_memory, self._room_for_products(counts))
        if self.full_grads:
            return self._resident_fastest(counts, budget, why)
        resident, out_of_room = 0, False
        while resident < n_blocks:
            draft = replace(counts, resident=resident)
            placed = self.placement_of(replace(draft, kept=self._kept(draft)))
            cpu_s = self.optimizer_s(placed) + self.head_s(counts.tokens)
            if cpu_s <= CPU_OPTIMIZER_MARGIN * self.step_layers_s(placed):
                break
            if self.resident_state_bytes(self.placement_of(replace(counts, resident=resident + 1))) > budget:
                out_of_room = True
                break
            resident += 1
        cpu_adam = f"the CPU's AdamW of every weight ({self.optimizer_s(self.placement_of(counts)):.2f} s)"
        if resident:
            why["resident"] = (
                f"the embedding and the first {resident} blocks are updated on the GPU: {cpu_adam} would take longer "
                "than the GPU's work"
            )
        elif out_of_room:
            why["resident"] = (
                f"{cpu_adam} takes longer than the GPU's work, and the GPU has no room to update the first block "
                "there: the step waits for the CPU"
            )
        return resident

    def _resident_fastest(self, counts: Counts, budget: float, why: dict) -> int:
        """With clipping, the CPU's update runs beside the next forward alone, a quarter of the GPU's work: the
        blocks resident (within `budget`) that give the fastest predicted step, the fewest of those within
        RESIDENT_GAIN of it; each takes its update off the CPU and displaces kept products. Where the fastest
        displaces none of the fewest's, it is taken: the margin is for the products a block's state displaces
        (the cost model's trade), and a block more that displaces none only takes work off the CPU and PCIe
        (Qwen3-30B-A3B's first 8 layers at 64k, all keeping their products: 7 blocks predicted 0.9% slower
        than 8)."""
        times, kept = {}, {}
        for resident in range(len(self.blocks) + 1):
            draft = replace(counts, resident=resident)
            state = self.resident_state_bytes(self.placement_of(draft))
            if resident and (state > budget or self._room_for_products(draft) < 0):  # (their gradients too)
                break
            kept[resident] = self._kept(draft)
            times[resident] = self.step_s(self.placement_of(replace(draft, kept=kept[resident])))
        fastest = min(times, key=times.get)
        resident = min(n for n, seconds in times.items() if seconds <= times[fastest] / RESIDENT_GAIN)
        if kept[fastest] >= kept[resident]:
            resident = fastest
        which = "no block is" if not resident else f"the embedding and the first {resident} blocks are"
        why["resident"] = (
            f"{which} updated on the GPU: with clipping the CPU's AdamW "
            f"of every weight ({self.optimizer_s(self.placement_of(counts)):.2f} s) runs beside the next forward "
            f"alone; predicted {times[0]:.2f} s a step with none, {times[resident]:.2f} s with {resident}"
        )
        return resident

    def _boundary_pays(self, counts: Counts, why: dict) -> bool:
        """Whether the embedding's and first block's state on the GPU saves more of the step boundary's wait than
        the recompute of the kept products that memory would have held costs."""
        host = self.placement_of(counts)
        one = self.placement_of(replace(counts, resident=1))
        state = self.resident_state_bytes(one)
        kept = self._kept(counts)
        displaced = state / (counts.tokens * self.product_bytes_per_token) if kept < self.keepable else 0.0
        recompute_saved_s = self.blocks_s(counts.tokens, 0) - self.blocks_s(counts.tokens, 1)
        fits = state <= min(GPU_UPDATED_SHARE * self.machine.gpu_memory, self._room_for_products(counts))
        wait_s = self.boundary_s(host) - self.boundary_s(one)  # (the host's turnaround is in both)
        pays = fits and wait_s > displaced * recompute_saved_s
        if pays:
            why["resident"] = (
                f"the embedding and first block are updated on the GPU: the step boundary would wait "
                f"{wait_s:.2f} s for their update on the CPU"
            )
        return pays

    def _held(self, counts: Counts, small: bool, why: dict) -> int:
        """Blocks after the resident ones whose weights stay on the GPU from forward to backward: as set; in a
        small step as many as fit in HELD_GPU_SHARE of the GPU and the room the step leaves; none otherwise (the
        memory keeps activations instead, which a step the GPU bounds needs)."""
        holdable = [i for i in self.holdable if i not in resident_stages(self.spec, counts.resident)]
        setting = self.engine.held_layers
        if setting != "auto":
            return min(setting, len(holdable))
        if self.machine.gpu_memory is None or counts.offloaded or not small:
            return 0
        budget = min(HELD_GPU_SHARE * self.machine.gpu_memory, self._room_for_products(counts))
        held_so_far = itertools.accumulate(self.stage_sizes[i] * self.element for i in holdable)
        held = sum(1 for _ in itertools.takewhile(lambda total: total <= budget, held_so_far))
        if held:
            why["held"] = (
                f"{held} blocks hold their weights from forward to backward: the CPU optimizer bounds the step"
            )
        return held

    def _offloaded_for_products(self, counts: Counts, small: bool, why: dict) -> int:
        """In a large step (the GPU the bound, PCIe with time to spare), the fewest first checkpoints sent to host
        memory that let the most layers keep their products, as many as the host holds beside its state."""
        engine = self.engine
        if engine.offload_checkpoints != "auto" or engine.kept_layers != "auto" or not self.keepable or small:
            return counts.offloaded
        if self.machine.gpu_memory is None:
            return counts.offloaded
        limit = len(self.blocks)
        if self.machine.host_memory is not None:
            state = self.placement_of(replace(counts, offloaded=0), gradient_pool=self._least_pool(counts))
            room = HOST_KEPT_RAM_SHARE * self.machine.host_memory - self.host_bytes(state)
            per_layer = self.machine.gpus * self.checkpoint_bytes(1, counts.tokens)
            limit = max(counts.offloaded, min(limit, int(room // per_layer)))
        most = self._kept(replace(counts, offloaded=limit))
        offloaded = counts.offloaded
        while offloaded < limit and self._kept(replace(counts, offloaded=offloaded)) < most:
            offloaded += 1
        if offloaded > counts.offloaded:
            why["offloaded"] = (
                f"the first {offloaded} blocks' checkpoints go to host memory: that lets {most} layers keep their "
                f"products instead of {self._kept(counts)}"
            )
        return offloaded

    # ------------------------------------------------------------------ report
    def _frozen_parts(self) -> tuple[str, ...]:
        """What the frozen parameters are, for the report: an image-text model's parts (train.freeze_*), or the
        base model under LoRA adapters."""
        if self.spec.adapter is not None:
            return ("base model under LoRA adapters",)
        return tuple(sorted({self.spec.group_parts[g] for g in self.frozen} - {"unused"}))

    def plan(self, placement: Placement, compute_bound: bool = True) -> Plan:
        """What `placement` costs and how long its step is predicted to take; with `compute_bound`, from how many
        tokens a step the GPU would bound it (`compute_bound_tokens`: a dozen placements, seconds at 7B, which the
        report reads and the checks do not)."""
        return Plan(
            placement=placement,
            **_machine_and_model(self),
            **_memory_of(self, placement),
            **_times_of(self, placement, compute_bound),
        )


def _reference_tokens_per_s(planner: Planner, placement: Placement) -> float:
    """DPO's reference pass (forward only, before training): tokens per second, the weights streamed once for
    `objective.reference_pass_steps` steps' rows; 0 where the objective needs no reference."""
    steps = planner.objective.reference_pass_steps
    if not steps:
        return 0.0
    forward_s = planner.forward_s(placement) * steps
    weights_s = planner.model.n_params * planner._wire() / (planner.rates.pcie_gbps * 1e9)
    return steps * placement.tokens * planner.world / max(forward_s, weights_s)


def own_group_stages(spec: ModelSpec) -> set[int]:
    """The stages binding groups that no other stage binds."""
    binders = collections.Counter(g for stage in spec.stages for g in stage.groups)
    return {i for i, stage in enumerate(spec.stages) if all(binders[g] == 1 for g in stage.groups)}


def parkable_stages(spec: ModelSpec, resident: tuple[int, ...]) -> tuple[int, ...]:
    """Of the `resident` stages, those whose moments may be parked, first ones first: stages of groups no other stage
    binds (brought back once, ahead of the stage's backward), as many as come back before their own backward
    (`Placement.moments_back_after`: the j-th after the j-th block's backward from the last down)."""
    own, last_block = own_group_stages(spec), len(spec.stages) - 2
    return tuple(stage for j, stage in enumerate(i for i in resident if i in own) if stage < last_block - j)


def leaves_more_room(host_bytes: int, than_bytes: int, budget: int | None) -> bool:
    """Whether a step of `host_bytes` fits the host's `budget`, or POOL_HOST_SHARE of it, where one of `than_bytes`
    does not: smaller sweeps offload smaller checkpoints, and such a step beats a faster one (QLoRA's 405B on a
    256 GiB host). Other steps in sweeps are taken where faster, within the budget itself: Qwen2.5-7B at 128k tokens
    with clipping on a 125 GiB host takes 97% of it in one sweep or eight (taken at POOL_HOST_SHARE, its steps ran in
    one, keeping 8 layers' products where 8 sweeps keep all 28: 497 against 540 model TFLOPS)."""
    return budget is not None and any(host_bytes <= share * budget < than_bytes for share in (1.0, POOL_HOST_SHARE))


def _machine_and_model(planner: Planner) -> dict:
    """`Planner.plan`'s fields that no placement changes: the model's sizes and parts, the machine, its rates."""
    model, machine = planner.model, planner.machine
    return {
        "n_params": model.n_params,
        "active_params": model.active_params,
        "moe": model.is_moe,
        "host_available": machine.host_memory,
        "gpu_available": machine.gpu_memory,
        "shares_cores": machine.shares_cores,
        "rates": planner.rates,
        "gpus": machine.gpus,
        "hosts": machine.hosts,
        "split_state": planner.split,
        "stage_names": planner.names,
        "frozen_params": planner.frozen_params,
        "frozen_parts": planner._frozen_parts(),
        "reference_copy": planner.reference_copy,
        "host_source": machine.host_source,
        "process_bytes": machine.process_bytes,
    }


def _memory_of(planner: Planner, placement: Placement) -> dict:
    """`Planner.plan`'s fields of what `placement` holds: host, GPU and disk bytes, item by item."""
    host_items = planner.host_items(placement)
    host_bytes = sum(host_items.values())
    first_disk_group = placement.first_disk_group
    return {
        "host_bytes": host_bytes,
        "host_bytes_per_param": host_bytes / planner.model.n_params,
        "host_items": host_items,
        "disk_bytes": planner.disk_bytes(placement),
        "first_disk_group": len(planner.group_sizes) if first_disk_group is None else first_disk_group,
        "gpu_bytes": planner.device_bytes(placement),
        "checkpoint_bytes": sum(planner.checkpoint_bytes(i, placement.tokens) for i in planner.blocks),
        "checkpoint_stages": sum(planner.planes),
        "kept_bytes": len(placement.kept) * placement.tokens * planner.product_bytes_per_token,
        "extra_kept_layers": len(planner.extras(placement)),
        "held_bytes": planner.params(placement.held) * planner.element,
        "copied_bytes": planner.params(placement.copied) * planner.element,
        "parked_bytes": planner.parked_moment_bytes(placement),
        "gpu_updated_bytes": planner.resident_state_bytes(placement),
        "host_kept_bytes": host_items.get("host-kept products", 0),
        "generation_host_bytes": planner.generation_host_bytes,
        "packed_cache_bytes": sum(planner.packed.values()),
        "largest_params": planner.largest_params(placement),
        "network_bytes": planner.network_bytes(),
    }


def _times_of(planner: Planner, placement: Placement, compute_bound: bool) -> dict:
    """`Planner.plan`'s fields of how long `placement`'s step takes: its phases, what bounds it, its rates."""
    phases = planner.phases(placement)
    bound, step_s = slowest(phases), planner.step_s(placement)
    global_tokens = placement.step_tokens * planner.world
    flops = flops_per_token(planner.model, planner.shape.seq_len, planner.spec.active_adapter_params) * global_tokens
    return {
        "tokens_per_step": global_tokens,
        "compute_s": planner.compute_s(placement),
        "transfer_s": planner.transfer_s(placement),
        "optimizer_s": planner.optimizer_s(placement),
        "disk_s": phases["disk"],
        "network_s": phases["network"],
        "bubble_s": planner.boundary_s(placement),
        "dequantize_s": placement.sweeps * planner.dequantize_s(),
        "step_s": step_s,
        "tokens_per_s": global_tokens / step_s,
        "model_tflops": flops / step_s / 1e12,
        "phases": phases,
        "bound": bound,
        "compute_bound_tokens": planner.compute_bound_tokens() if compute_bound and phases["compute"] else 0,
        "reference_tokens_per_s": _reference_tokens_per_s(planner, placement),
    }


def read_placement(path: Path, planner: Planner) -> Placement:
    """The placement a file holds (`placement.json`, as a run writes), checked against the model it is to place."""
    try:
        data = json.loads(path.read_text())
        placement = Placement.from_dict(data.get("placement", data))
    except (OSError, ValueError, PlacementError) as error:
        raise PlanError(f"engine.placement: cannot read a placement from {path}: {error}; use auto") from error
    if len(placement.stages) != planner.n_stages or placement.experts_per_stage != planner.experts_per_stage:
        raise PlanError(
            f"engine.placement {path} places {len(placement.stages)} stages (experts in parts of "
            f"{placement.experts_per_stage}); this model has {planner.n_stages} (parts of {planner.experts_per_stage}): "
            "use the placement of this model and engine.experts_per_stage, or auto"
        )
    return placement
