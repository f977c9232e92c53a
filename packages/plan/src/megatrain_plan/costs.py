"""The cost model of a run (`CostModel`): what a `Placement` takes of host memory (`host_items.HostItems`, every
allocation in one place) and of the GPU's, and how long its step lasts, one method per phase (GPU compute, the
copies in and out, the CPU optimizer, the disk tier, the network), overlapped as the engine runs them. The
constants are the rules' shares and margins, each with the measurement that set it; `search.Planner` decides with
them."""

import math

import torch

from megatrain_sched import Placement, StageCosts, extras_that_fit, staging_buffers
from megatrain_templates import Lora
from megatrain_zoo import (
    ModelConfig,
    ModelSpec,
    build_model,
    linear_attention_flops_per_token,
    softmax_attention_flops_per_token,
)

from .host_items import MOMENT_BYTES, HostItems
from .inputs import EngineChoices, Machine, ObjectiveMemory, StepShape
from .rates import Rates, block_rates, forward_work, layer_works

# a step runs in sweeps only where they are predicted this much faster than one (the cost model's margin) ...
SWEEPS_GAIN = 0.97
# ... and where their copies alone (weights in each sweep, gradient sums out and back) take at most this share
# of the GPU's work: beyond it the GPU waited between sweeps (H100, 128k tokens a step: Gemma-3-4B in 4 sweeps,
# whose copies the planner puts at 0.44 of its work, ran 3-7.5% faster than in one sweep; Qwen2.5-7B in 4, at
# 0.52, 2.7% slower, through two 128 MiB staging buffers; OLMoE-1B-7B in 2, at 0.68, 24% slower, where its CPU
# AdamW, starting in the last sweep, outlasted it: a limit the cost model's phases do not yet see)
SWEEPS_PCIE_SHARE = 0.48
MOST_SWEEPS = 8
# With clipping the CPU's AdamW starts once the backward is done, and the step is bound by it when the backward and
# the optimizer outlast the GPU's work: the share of the sweep it waits behind. A backward is 3/4 of a recomputing
# layer's work and 2/3 of a kept one's (`forward_share`), but the optimizer's rate, timed alone, overstates its rate
# beside the forward's weight copies, which read the same host memory: planned at the backward's share, the 97
# CPU-bound rows of results/ (the generic-template file's aside) came out a median 3.3% shorter than they ran
# (quartiles 6.3, 2.2); at 3/4, 2.3% (5.7, 1.3), each on the placement it ran (`benchmarks/replan.py`)
CLIPPED_OPTIMIZER_WAIT_SHARE = 0.75
# Device memory a run takes after it is planned that no buffer of megatrain's accounts for: cuBLAS's workspaces,
# compiled kernels, the allocator's rounding. (Qwen2.5-7B on an H100 found 0.1-1.1 GiB free beyond its plan with
# this and the CUDA context counted: `device_headroom_gib` in benchmarks/results/placement-qwen2.5-7b-h100.json.)
RUNTIME_DEVICE_BYTES = 3 * 2**28
LOGITS_CHUNK_BYTES = 3 * 2**30  # the head's fp32 logits chunk with its gradient
# Device memory a step takes beside its checkpoints, products, gradients and recompute: the head's chunk and the
# allocator's slack.
STEP_SLACK_BYTES = LOGITS_CHUNK_BYTES + 2 * 2**30
# With engine.experts_per_stage auto, a MoE layer streams in parts once its two slots, two gradients
# and recompute would take more than this share of the GPU: the rest is for activation checkpoints.
LAYER_GPU_SHARE = 0.5
# With engine.offload_checkpoints auto, checkpoints stay on the GPU in at most this share of its room for a step.
CHECKPOINT_GPU_SHARE = 0.5
# Landing buffers when updates run as gradients arrive, in largest groups (the embedding's room
# holds several layers'): at least enough for the optimizer to lag the backward by a few layers;
# more where it is slower than the backward (small steps), see `gradient_pool_size`.
GRADIENT_POOL = 3
# A deeper gradient pool only where the plan then stays within this share of the host's memory.
POOL_HOST_SHARE = 0.9
# With engine.disk_state_fraction auto, moments go to disk until the plan fits this share of
# host memory: the rest is page cache for the disk tier's read-ahead and write-behind.
DISK_TIER_RAM_SHARE = 0.85
# With engine.held_layers auto, the blocks' weights stay on the GPU from forward to backward, in at most
# this share of its memory, where the CPU optimizer takes longer than the GPU's work (small steps): the
# second copy in of every weight then no longer competes with the optimizer for host memory bandwidth.
HELD_GPU_SHARE = 0.25
# With engine.gpu_updated_layers auto, the first blocks' masters and moments live and are updated on the GPU,
# in at most this share of its memory, where the CPU optimizer is slower than the GPU's work (small steps)...
GPU_UPDATED_SHARE = 0.75
# ... until the CPU optimizer's time (and the head's, which waits for it) is within this share of the GPU's
# work: its rate varies by 20% between machines and in a step, and a step it holds back loses more than
# the kept layers that memory would have held save.
CPU_OPTIMIZER_MARGIN = 0.8
# With clipping, a resident block more is chosen only where it is predicted to make the step this much faster
RESIDENT_GAIN = 0.99
# The GPU's idle at the step boundary that the phases do not count: the host's turnaround (it reads the step's loss
# and norm, then begins the next: its batches in, its placement fitted, its first weights queued; 10-14 ms a step in
# results/traces/trace-qwen2.5-7b-16384-gpu-updated.json) and the first forward stages' waits for their GPU updates.
# 23-37 ms a step on one H200 in compute-bound rows with the embedding on the GPU (Qwen2.5-7B at 32k, OLMoE-1B-7B at
# 128k, Qwen3-30B-A3B's first 8 layers at 64k, 2026-12-01..03: `gpu_compute_idle` in results/clipping-*-h200.json).
STEP_TURNAROUND_S = 0.025
# The share of its own rate (`Rates.gpu_adam_params_per_s`, timed alone) a resident block's AdamW runs at beside the
# next forward's GEMMs: a Qwen2.5-7B block's took 8.2 ms there on an H200 against 2.6 ms alone (traces of
# `benchmarks/results/device-clip-h200.json`, 8k tokens a step), and the forward, 7.0 ms a block, waited for it.
GPU_ADAM_BESIDE_SHARE = 0.32
# With engine.host_kept_layers auto (large steps), kept products also go to pinned host memory, up to this
# share of it with the rest of the plan, and only as many as the forward's idle copy-out carries at
# HOST_KEPT_PCIE_SHARE of the link while the layers between two of them compute (each waits for the one
# before to be out; the backward, three times longer, brings them back beside the weights).
HOST_KEPT_RAM_SHARE = 0.85
HOST_KEPT_PCIE_SHARE = 0.8
# ... and only where the CPU optimizer takes under this share of the GPU's work: their copies go through the
# host memory the optimizer's updates are bound by (Qwen2.5-7B at 32k on an H100, optimizer 1.6-1.9 s of a
# 2.8 s step: 2 such layers 2.80-2.82 s against 2.80 with none; 7B at 128k, 1-1.6 of 7.7 s: +0.7%)
HOST_KEPT_OPTIMIZER_SHARE = 0.5


def layout_sizes(spec: ModelSpec) -> tuple[list[int], list[int], int]:
    """(parameters per store group in store order, parameters each stage binds, how many [tokens,
    d_model] activation checkpoints a micro-batch keeps) of a model megatrain_zoo built."""
    groups = [sum(p.numel for p in group.params) for group in spec.groups]
    stages = [sum(groups[g] for g in stage.groups) for stage in spec.stages]
    planes = sum(stage.template.checkpoint_planes for stage in spec.stages[1:-1])
    return groups, stages, planes


def resident_stages(spec, layers: int) -> tuple[int, ...]:
    """The stages (of a built model `spec`) whose masters and moments live on the GPU for `layers` resident
    blocks: the first `layers` blocks and, with any, the embedding: it is the last gradient of a step and the
    first weight of the next, so the step boundary then waits for no copy out, CPU update or copy in. A later
    stage binding one of their groups too (a head tied to the table, which an image-text model's first blocks
    reach: a stage binds resident groups only, or none)."""
    if not layers:
        return ()
    resident = {g for stage in spec.stages[: layers + 1] for g in stage.groups}
    tied = tuple(i for i, stage in enumerate(spec.stages) if i > layers and resident & set(stage.groups))
    return (*range(layers + 1), *tied)


def gpu_updated_groups(spec, layers: int) -> list[int]:
    """The groups of `resident_stages`."""
    return spec.groups_of(resident_stages(spec, layers))


def mlp_width_per_token(model: ModelConfig) -> int:
    """The widest MLP hidden state one token makes in any layer (k experts + shared expert, or d_ff)."""
    moe = model.n_experts_per_tok * model.moe_d_ff + model.shared_expert_d_ff
    return max(moe if model.layer_is_moe(layer) else model.d_ff for layer in range(model.n_layers))


def kept_bytes_per_token(spec: ModelSpec, element_size: int) -> int:
    """GPU bytes per token that one kept layer's products hold (the largest kind's) in a model built of whole
    layers; 0 where the layers always recompute."""
    layers = [
        StageCosts.of(spec.stages[spec.layer_stage(layer)].template, element_size)
        for layer in range(spec.config.n_layers)
    ]
    keeps = all(costs.keeps_products for costs in layers)
    return max(costs.product_bytes_per_token for costs in layers) if keeps else 0


def extra_forward_s(model: ModelConfig, block, seq_len: int, tokens: int, rates: Rates) -> float:
    """The kernel forward that extra products spare the recompute of a layer of template `block` (a
    `DecoderBlock`: only blocks keep extras) for `tokens`: a recurrence's at `Rates.recurrence_tflops`, causal
    attention's at the block's rate (cuDNN's at Qwen2.5-7B's shape, 16k tokens, on an H200: 0.95 ms, 506 TFLOPS)."""
    if block.shape.linear_attention is not None:
        return linear_attention_flops_per_token(model) / 3 * tokens / (rates.recurrence_tflops * 1e12)
    forward = softmax_attention_flops_per_token(model, seq_len) / 3 * tokens  # (a third of forward + backward)
    return forward / (rates.gpu_tflops * 1e12)


def slowest(parts: dict[str, float]) -> str:
    """The phase that bounds a step; the first of those within rounding of it (compute wins ties: a pass
    whose copies are hidden sums to the same seconds by another path)."""
    longest = max(parts.values())
    return next(name for name, seconds in parts.items() if seconds >= longest * (1 - 1e-9))


def gradient_pool_size(optimizer_s: float, backward_s: float, sizes: list[int], rates: Rates) -> float:
    """The gradient pool, in largest groups (`sizes`: parameters per group): GRADIENT_POOL, or where the
    optimizer takes longer than the part of the backward that lands its gradients (`backward_s`), room for
    the gradients it has not taken when that part ends plus two of the largest (the embedding's, which
    lands last, and room for first-fit's gaps), so that the backward never waits for it (one did at a pool
    one smaller, on a machine whose optimizer ran below its rate: a 16k-token 7B step waited 0.2 s for
    room for the embedding's gradient)."""
    left = max(0.0, optimizer_s - backward_s) * rates.cpu_adam_params_per_s
    return max(float(GRADIENT_POOL), math.ceil(2 + left / max(sizes)))


def whole_step_statistics(model: ModelConfig, shape: StepShape) -> str | None:
    """What makes a step's backward read statistics of all its micro-batches' forwards, which a step in sweeps
    lacks when its first backward runs (a MoE router's load-balancing loss or z-loss: their gradients divide by
    the step's loads and tokens); None: nothing does."""
    if not model.is_moe:
        return None
    if model.router_aux_loss_coef and model.output_router_logits:
        return "the router's load-balancing loss"
    if shape.router_z_loss:
        return "train.router_z_loss_coef"
    return None


def recompute_bytes(model: ModelConfig, micro_tokens: int, element: int) -> int:
    """One micro-batch's recompute of a layer: q/k/v/attention/outputs/norms ~ 8 x d_model, MLP 3 x its width, in
    the compute dtype (a MoE layer's width is that of its k experts and shared expert, plus the tokens' copies)."""
    width = mlp_width_per_token(model) + (model.n_experts_per_tok * model.d_model if model.is_moe else 0)
    return micro_tokens * (8 * model.d_model + 3 * width) * element


def experts_per_stage(
    model: ModelConfig, setting: int | str, shape: StepShape, gpu_memory: int | None, adapter: Lora | None = None
) -> int:
    """engine.experts_per_stage (`setting`) resolved, 0 for whole layers (and dense models): what the caller builds
    the model with. auto: whole layers unless a layer's slots, gradients and recompute would take over
    LAYER_GPU_SHARE of the GPU, then the fewest parts (2, 4, 8, ...) that do not, so that the rest stays for
    activation checkpoints. A frozen group has no gradient (with LoRA's `adapter`: all but the adapters')."""
    n = model.n_experts
    if not model.is_moe:
        return 0
    if setting != "auto":
        return setting if setting < n else 0
    element = torch.finfo(shape.dtype).bits // 8
    recompute = recompute_bytes(model, shape.micro_tokens, element)

    def layer_bytes(per_stage: int) -> int:
        spec = build_model(model, per_stage, adapter)
        groups, stages, _ = layout_sizes(spec)
        frozen = spec.frozen_groups(shape.frozen_parts)
        trained = [size for g, size in enumerate(groups) if g not in frozen]
        return 2 * max(stages) * element + 2 * max(trained) * 4 + recompute + LOGITS_CHUNK_BYTES

    parts = 1
    while gpu_memory is not None and parts < n and layer_bytes(-(-n // parts)) > LAYER_GPU_SHARE * gpu_memory:
        parts *= 2
    return 0 if parts == 1 else -(-n // min(parts, n))


def packed_base(spec: ModelSpec, dtype: torch.dtype) -> tuple[dict[int, int], int, str | None]:
    """QLoRA: (the bytes of each group whose base is packed, nf4 or int8, as the store lays them out; the packed
    matrices' values, each dequantized on the GPU every time its layer is bound; the base's format, None where none
    is packed)."""
    layouts = spec.packed_layouts(dtype)
    values = sum(p.entry.numel for layout in layouts.values() for p in layout.entries if p.format)
    return {g: layout.nbytes for g, layout in layouts.items()}, values, spec.adapter.base_format if layouts else None


def first_in_backward(spec: ModelSpec) -> list[set[int]]:
    """Each stage's groups that no later stage binds: their gradients are whole from its backward on."""
    last_stage = {g: i for i, stage in enumerate(spec.stages) for g in stage.groups}
    return [{g for g in stage.groups if last_stage[g] == i} for i, stage in enumerate(spec.stages)]


class CostModel(HostItems):
    """The cost model of one run: a built model (`spec`) trained in steps of `shape` with the engine's settings
    (`engine`) and an objective holding `objective` in memory, on `machine` at `rates`.

    Memory: `host_items` (every host allocation), `persistent_device_bytes` (slots, staging, held weights,
    resident state) and `step_device_bytes` (checkpoints and products kept on the GPU, gradients, a recompute, the
    head's chunk) count what the store and the pipeline allocate. Time, one method per phase: `compute_s`,
    `copy_passes_s`, `optimizer_s`, `disk_s`, `network_s`, `boundary_s`; `phases` overlaps them as the engine
    does."""

    def __init__(
        self,
        spec: ModelSpec,
        rates: Rates,
        machine: Machine,
        shape: StepShape,
        engine: EngineChoices = EngineChoices(),
        objective: ObjectiveMemory = ObjectiveMemory(),
    ):
        self.spec, self.model, self.rates, self.machine = spec, spec.config, rates, machine
        self.shape, self.engine, self.objective = shape, engine, objective
        self.dtype, self.element = shape.dtype, torch.finfo(shape.dtype).bits // 8
        self.full_grads = shape.clipping
        self.split = engine.shard_across_hosts and machine.hosts > 1
        self.wire_copy = (engine.wire_copy or self.split) and self.dtype != torch.float32
        self.reference_copy = objective.reference_copy  # (the KL's reference weights, streamed per step)
        self.world = machine.gpus * machine.hosts
        self.micro_tokens = shape.micro_tokens
        self.recompute_bytes = recompute_bytes(self.model, self.micro_tokens, self.element)
        # tokens -> (`layer_works`, `forward_work`): a search asks often
        self._layer_works: dict[int, tuple[float, float, float]] = {}
        if spec.adapter is not None and spec.adapter.dropout:  # a member's keep-mask and dropped input at a time
            widest = max(self.model.d_model, mlp_width_per_token(self.model))
            self.recompute_bytes += 2 * self.micro_tokens * widest * self.element
        self.experts_per_stage = spec.experts_per_stage
        self.group_sizes, self.stage_sizes, _ = layout_sizes(spec)
        self.n_stages = len(self.spec.stages)
        self.blocks = range(1, self.n_stages - 1)
        self.costs = [StageCosts.of(stage.template, self.element) for stage in self.spec.stages]
        self.planes = [costs.checkpoint_planes if i in self.blocks else 0 for i, costs in enumerate(self.costs)]
        keeps = [costs.keeps_products for costs in self.costs]
        self.keepable = next((n for n, i in enumerate(reversed(self.blocks)) if not keeps[i]), len(self.blocks))
        keepers = [self.costs[i] for i in self.blocks[len(self.blocks) - self.keepable :]]
        self.product_bytes_per_token = max((costs.product_bytes_per_token for costs in keepers), default=0)
        self.extra_bytes_per_token = {i: self.costs[i].extra_bytes_per_token for i in self.blocks}
        weightless = {i for i, stage in enumerate(self.spec.stages) if not stage.template.backward_reads_weights}
        self.holdable = [i for i in range(1, self.n_stages - 2) if i not in weightless]
        self.table_group = self.spec.stages[0].groups[0]
        # an image-text model's frozen parts: their groups keep weights only (no gradient, no optimizer state)
        self.frozen = self.spec.frozen_groups(shape.frozen_parts)
        self.frozen_params = sum(self.group_sizes[g] for g in self.frozen)
        # the parameters of each stage whose gradients it makes (a frozen group's: none, no buffer on the GPU)
        self.trained_sizes = [sum(self.group_sizes[g] for g in s.groups if g not in self.frozen) for s in spec.stages]
        # LoRA: the frozen base is held once in the compute dtype (no master) and sends no gradient out
        self.adapter = spec.adapter is not None
        # the parameters stored: the model's and its adapters' (which the model's count leaves out)
        self.stored_params = self.model.n_params + (spec.adapter_params or 0)
        self.grad_share = 1 - self.frozen_params / self.stored_params if self.adapter else 1.0
        self.packed, self.dequantized_values, self.base_format = packed_base(spec, self.dtype)
        self.packed_params = sum(self.group_sizes[g] for g in self.packed)
        # the parameters of each stage that cross PCIe as fp32 masters, cast on the GPU (not a base held apart)
        apart = self.frozen if self.adapter else frozenset()
        self.cast_sizes = [sum(self.group_sizes[g] for g in s.groups if g not in apart) for s in self.spec.stages]
        self.generation_host_bytes = objective.generation_host_bytes
        self.names = [stage.name for stage in self.spec.stages]
        self.first_in_backward = first_in_backward(spec)

    # ------------------------------------------------------------------ memory
    def checkpoint_bytes(self, stage: int, tokens: int) -> int:
        """Bytes the stage's checkpoint of `tokens` tokens takes (0 where it shares another stage's)."""
        return tokens * self.costs[stage].checkpoint_bytes_per_token if self.planes[stage] else 0

    def params(self, stages: tuple[int, ...]) -> int:
        """Parameters of the groups these stages bind (each group once)."""
        return sum(self.group_sizes[g] for g in self.spec.groups_of(stages))

    def resident_state_bytes(self, placement: Placement) -> int:
        """GPU bytes of the resident groups' fp32 masters and moments (their gradients are the step's:
        `step_device_bytes`)."""
        return self.params(placement.resident) * (4 + MOMENT_BYTES)

    def parked_moment_bytes(self, placement: Placement) -> int:
        """GPU bytes of the parked stages' moments: out of the GPU from their update until brought back."""
        return self.params(placement.parked) * MOMENT_BYTES

    def persistent_device_bytes(self, placement: Placement) -> int:
        """GPU bytes that outlive a step: the rotating slots (and the resident blocks' cast slot), the fp32 staging
        buffers (and the packed base's two byte buffers), held weights and resident blocks' copies, resident state,
        and the gradient buffers kept from step to step (`Placement.persistent_gradients`)."""
        slots = self.engine.n_slots * max(self.stage_sizes) * self.element
        cast = [i for i in placement.resident if i in self.blocks and i not in placement.copied]
        slots += max((self.stage_sizes[i] for i in cast), default=0) * self.element
        casts = self.element < 4 and not self.wire_copy and max(self.cast_sizes) > 0
        staging = math.prod(staging_buffers(max(self.cast_sizes))) * 4 if casts else 0
        packed_ring = 2 * max(self.packed.values(), default=0)
        own_buffers = sum(self.stage_sizes[i] for i in placement.held + placement.copied) * self.element
        state = self.resident_state_bytes(placement) - self.parked_moment_bytes(placement)
        return slots + staging + packed_ring + own_buffers + state + self.persistent_gradient_bytes(placement)

    def persistent_gradient_bytes(self, placement: Placement) -> int:
        """GPU bytes of the fp32 gradient buffers kept from step to step (`Placement.persistent_gradients`)."""
        return 4 * sum(
            self.group_sizes[g] for g in self.spec.groups_of(placement.persistent_gradients) if g not in self.frozen
        )

    def working_device_bytes(self) -> int:
        """GPU bytes a step works in whatever it keeps: two blocks' fp32 gradients (their trained groups'), a
        micro-batch's recompute, the head's chunk and slack."""
        gradients = 2 * max(self.trained_sizes[i] for i in self.blocks) * 4
        recompute = max(self.recompute_bytes, 2 * self.micro_tokens * self.product_bytes_per_token)
        return gradients + recompute + STEP_SLACK_BYTES

    def step_device_bytes(self, placement: Placement) -> int:
        """GPU bytes a step takes beside the persistent ones: its activations and held gradients at their most
        (`backward_peak`), one offloaded stage's checkpoint back a stage ahead of its backward, one host-kept
        stage's products on their way, what sweeps carry, and its working memory."""
        tokens, offloaded = placement.tokens, placement.offloaded
        back = max((self.checkpoint_bytes(i, tokens) for i in offloaded), default=0)
        in_flight = tokens * self.product_bytes_per_token if placement.host_kept else 0
        return (
            self.backward_peak(placement)
            + back
            + in_flight
            + self.sweeps_device_bytes(placement)
            + self.working_device_bytes()
        )

    def backward_peak(self, placement: Placement, kept: tuple[int, ...] | None = None) -> int:
        """The most GPU bytes a step's kept activations (block checkpoints, the products of `kept`, else of the
        placement's) and, with clipping in one sweep, its resident groups' fp32 gradients take at once. The
        backward frees a stage's activations as it makes its gradients, and a resident group's is held from its
        first stage in the backward to the step's end: at stage i's backward, the activations of stages up to i
        and the held gradients from i on, and the parked moments brought back by then. (The first blocks' gradients
        so take the room the last blocks' products leave: Qwen2.5-7B at 32k tokens with 18 blocks resident peaked
        at 113.8 GiB of a 139.8 GiB H200 where the sum of both counted 136 GiB.)"""
        tokens, kept, offloaded = placement.tokens, set(placement.kept if kept is None else kept), placement.offloaded
        activations = [0 if i in offloaded else self.checkpoint_bytes(i, tokens) for i in range(self.n_stages)]
        for i in kept:
            activations[i] += tokens * self.product_bytes_per_token
        held = [0] * self.n_stages
        if self.full_grads and placement.sweeps == 1:  # (in sweeps they are carried: `sweeps_device_bytes`)
            resident = {g for i in placement.resident for g in self.spec.stages[i].groups} - self.frozen
            held = [sum(4 * self.group_sizes[g] for g in groups & resident) for groups in self.first_in_backward]
        for parked, back in placement.moments_back_after.items():  # (to the forward they leave before, at the least)
            held[max(back, placement.moments_leave_before) - 1] += self.params((parked,)) * MOMENT_BYTES
        peak, below, above = 0, sum(activations), 0
        for stage in reversed(range(self.n_stages)):
            above += held[stage]
            peak = max(peak, below + above)
            below -= activations[stage]
        return peak

    def sweeps_device_bytes(self, placement: Placement) -> int:
        """GPU bytes a step in sweeps takes beside one sweep's: the earlier sweeps' gradient sum of a stage, back
        from host memory, and the resident groups' gradients, kept from sweep to sweep."""
        if placement.sweeps == 1:
            return 0
        return max(self.trained_sizes) * 4 + self.params(placement.resident) * 4

    def device_bytes(self, placement: Placement) -> int:
        """GPU bytes a step under `placement` takes at its peak: the runtime's, the persistent and the step's."""
        return RUNTIME_DEVICE_BYTES + self.persistent_device_bytes(placement) + self.step_device_bytes(placement)

    def _device_room(self, placement: Placement) -> float:
        """GPU bytes left beside everything `placement` takes (inf without a GPU: nothing is decided by it)."""
        if self.machine.gpu_memory is None:
            return math.inf
        return self.machine.gpu_memory - self.device_bytes(placement)

    # ------------------------------------------------------------------- time
    def head_s(self, tokens: int) -> float:
        """The loss head's GPU seconds for `tokens`: its GEMM, the loss and its backward."""
        per_param = 4 if self.adapter else 6  # (a frozen head makes no weight gradient)
        return per_param * self.model.vocab_size * self.model.d_model * tokens / (self.rates.head_tflops * 1e12)

    def blocks_s(self, tokens: int, kept: int, forward_only: bool = False) -> float:
        """The decoder layers' GPU seconds for `tokens`, `kept` of them keeping their products; with `forward_only`
        their forwards alone, each at its layer's rate."""
        layer_rate, kept_rate = block_rates(self.rates, self.model.is_moe)
        if tokens not in self._layer_works:
            whole, kept_layer = layer_works(self.model, self.shape.seq_len, tokens, frozen=self.adapter)
            self._layer_works[tokens] = whole, kept_layer, forward_work(self.model, self.shape.seq_len, tokens)
        whole, kept_layer, forward = self._layer_works[tokens]
        if forward_only:
            whole = kept_layer = forward
        return ((self.model.n_layers - kept) * whole / layer_rate + kept * kept_layer / kept_rate) / 1e12

    def layers_s(self, placement: Placement) -> float:
        """The GPU's forward, recompute and backward of every layer and the head, a sweep."""
        kept = len(placement.kept) + len(placement.host_kept)
        stages, tokens = self.spec.stages, placement.tokens
        skipped = sum(
            extra_forward_s(self.model, stages[i].template, self.shape.seq_len, tokens, self.rates)
            for i in self.extras(placement)
        )
        return self.blocks_s(tokens, kept) - skipped + self.head_s(tokens) + self.dequantize_s()

    def forward_s(self, placement: Placement) -> float:
        """The forwards of `layers_s`: about a quarter of a recomputing layer's work (a third with LoRA's frozen base,
        which makes no weight gradient), a third of one keeping its products (a half); the head's a third (a half),
        a packed base's dequantization half."""
        kept = len(placement.kept) + len(placement.host_kept)
        head_s = self.head_s(placement.tokens) * (0.5 if self.adapter else 1 / 3)
        return self.blocks_s(placement.tokens, kept, forward_only=True) + head_s + self.dequantize_s() / 2

    def forward_share(self, placement: Placement) -> float:
        """`forward_s`'s share of `layers_s`."""
        return self.forward_s(placement) / self.layers_s(placement)

    def dequantize_s(self) -> float:
        """A packed base's dequantization, a sweep: every packed matrix twice (its layer's forward and backward), at
        the GPU time it takes from the layers' kernels beside it (`benchmarks/dequantize.py`)."""
        if not self.dequantized_values:
            return 0.0
        rate = (
            self.rates.nf4_dequantize_values_per_s
            if self.base_format == "nf4"
            else self.rates.int8_dequantize_values_per_s
        )
        return 2 * self.dequantized_values / rate

    def extras(self, placement: Placement) -> tuple[int, ...]:
        """The stages keeping their products on the GPU that the pipeline will let keep their extra products too,
        by its rule (`extras_that_fit`) on the GPU's room beside `placement` (all of them without a GPU)."""
        extra = {i: placement.tokens * self.extra_bytes_per_token[i] for i in placement.kept}
        return tuple(sorted(extras_that_fit(extra, self._device_room(placement))))

    def device_update_s(self, placement: Placement) -> float:
        """What the resident groups' AdamW a step adds to the compute stream's work: all of it where each runs as
        its gradient is made; with clipping, beside the next forward (`DeviceAdamW.update_beside`), the first
        resident stage's, which the forward waits for, and what of the rest the forward's resident stages do not
        cover, where it runs at GPU_ADAM_BESIDE_SHARE of its rate."""
        rate, resident = self.rates.gpu_adam_params_per_s, placement.resident
        if not self.full_grads or not resident:
            return self.params(resident) / rate
        beside_s = self.forward_s(placement) * (len(resident) - 1) / self.n_stages
        rest_s = self.params(resident[1:]) / (GPU_ADAM_BESIDE_SHARE * rate)
        return self.params(resident[:1]) / rate + max(0.0, rest_s - beside_s)

    def step_layers_s(self, placement: Placement) -> float:
        """Every sweep's layers and head: the GPU's work a step, what the CPU optimizer's is weighed against."""
        return placement.sweeps * self.layers_s(placement)

    def optimizer_room_s(self, placement: Placement) -> float:
        """The GPU work the CPU optimizer runs beside: every sweep's layers where updates start as gradients land;
        with clipping only the next step's forward, since they start once the norm is known (`phases`)."""
        if self.full_grads:
            return self.forward_share(placement) * (self.layers_s(placement) + self.device_update_s(placement))
        return self.step_layers_s(placement)

    def compute_s(self, placement: Placement) -> float:
        """Every sweep's layers, and the resident groups' update once a step."""
        return self.step_layers_s(placement) + self.device_update_s(placement)

    def optimizer_s(self, placement: Placement) -> float:
        """The CPU AdamW of every group not resident (this host's part of them where the hosts split the state)."""
        cpu_params = self.stored_params - self.frozen_params - self.params(placement.resident)
        return cpu_params / (self.machine.hosts if self.split else 1) / self.rates.cpu_adam_params_per_s

    def _trained_wire(self) -> int:
        """Bytes a trained weight crosses PCIe in: its fp32 master, or with a wire copy the compute dtype's."""
        return self.element if self.wire_copy else 4

    def _wire(self) -> float:
        """Bytes a weight crosses PCIe in (on average, where LoRA's frozen base crosses in the compute dtype, or packed
        as the store holds it)."""
        trained = self._trained_wire()
        if not self.adapter:
            return trained
        unpacked = 1 - self.grad_share - self.packed_params / self.stored_params
        return self.grad_share * trained + unpacked * self.element + sum(self.packed.values()) / self.stored_params

    def transfer_s(self, placement: Placement) -> float:
        """The copies alone, each sweep: weights in twice (held ones once, resident ones never), fp32 gradients out
        once (and, after the first sweep, the sum so far back in)."""
        streamed = self.model.n_params - self.params(placement.resident)
        held, sweeps = self.params(placement.held), placement.sweeps
        grads = 4 * streamed * self.grad_share
        copies_in = sweeps * (2 * streamed - held) * self._wire() + (sweeps - 1) * grads
        return max(copies_in, sweeps * grads) / (self.rates.pcie_gbps * 1e9)

    def copy_passes_s(self, placement: Placement) -> tuple[float, float]:
        """(forward, backward) seconds of a sweep, each as long as its compute or its copies, whichever is longer: a pass
        runs no faster than its weights arrive (a MoE forward, a quarter of little active work, often waits for
        them); the backward's weights come in beside its gradients and reloads going out, on a duplex link.
        Resident blocks compute first in the forward and last in the backward with no copy to hide behind
        them; held blocks' forward copies, and those of the first stages streamed after them (as many as the
        rotating slots), may start meanwhile. A sweep after the first brings the gradient sums back in beside its
        weights (here, a sweep's average); the resident groups' update, once a step, is `phases`'. Parked moments go
        out beside the resident stages' forward, which ends once they are out, and come back beside the backward."""
        pcie, duplex = self.rates.pcie_gbps * 1e9, self.rates.pcie_duplex_gbps * 1e9
        tokens, wire = placement.tokens, self._wire()
        layers_s = self.layers_s(placement)
        resident = self.params(placement.resident)
        streamed, held = self.model.n_params - resident, self.params(placement.held)
        share = resident / self.model.n_params
        activations_out = sum(self.checkpoint_bytes(i, tokens) for i in placement.offloaded)
        activations_out += len(placement.host_kept) * tokens * self.product_bytes_per_token
        parked = self.parked_moment_bytes(placement)  # out at their stage's forward, back in the backward
        forward_compute = self.forward_s(placement)
        backward_compute = layers_s - forward_compute
        streamed_after = [i for i in range(self.n_stages) if i not in placement.resident and i not in placement.held]
        ahead = self.params(tuple(streamed_after[: self.engine.n_slots])) if placement.resident else 0
        early_s = min((held + ahead) * wire / pcie, share * forward_compute)
        forward_s = share * forward_compute + max(
            (1 - share) * forward_compute, streamed * wire / pcie - early_s, activations_out / pcie
        )
        sums_back = (placement.sweeps - 1) / placement.sweeps * streamed * 4 * self.grad_share
        backward_weights = (streamed - held) * wire + activations_out + sums_back
        backward_s = share * backward_compute + max(
            (1 - share) * backward_compute, backward_weights / duplex, streamed * 4 * self.grad_share / duplex
        )
        forward_s = max(forward_s, (activations_out + parked) / pcie, parked / pcie + (1 - share) * forward_compute)
        return forward_s, max(backward_s, (backward_weights + parked) / duplex)

    def boundary_s(self, placement: Placement) -> float:
        """The GPU's idle between steps: what the phases do not count (`STEP_TURNAROUND_S`; none on the host's CPU,
        whose step runs in turn), and where the embedding is not resident its and the first block's gradients out,
        their CPU update and weights back in (of the table, the rows the next step's tokens read; the rest: beside).
        Only what trains waits for an update: a frozen table (LoRA's) comes in beside, a frozen first block once
        its adapters are updated (counted as trained, its boundary was planned at 0.21 s of an OLMoE LoRA step
        measured at 0.69)."""
        turnaround = 0.0 if self.machine.shares_cores else STEP_TURNAROUND_S
        if 0 in placement.resident:
            return turnaround
        rows = min(self.model.vocab_size, placement.step_tokens) * self.model.d_model
        table = rows if self.trained_sizes[0] else 0
        trained = table + self.trained_sizes[1]  # (their gradients out, then the CPU's update)
        weights_in = table * self._trained_wire() + self.params((1,)) * self._wire()
        pcie_s = (4 * trained + weights_in) / (self.rates.pcie_gbps * 1e9)
        return turnaround + trained / self.rates.cpu_adam_params_per_s + pcie_s

    def disk_s(self, placement: Placement) -> float:
        """Every step reads and writes the disk tier's state."""
        return 2 * self.disk_bytes(placement) / (self.rates.disk_gbps * 1e9)

    def network_bytes(self) -> int:
        """Bytes each host sends a step: its share of a ring all-reduce of the gradients (a replica per host), or
        the others' parts of its gradient sum and its updated part of the weights to each (split state)."""
        fraction = (self.machine.hosts - 1) / self.machine.hosts
        n = self.model.n_params
        return int(fraction * (4 + self.element) * n if self.split else 2 * fraction * 4 * n)

    def network_s(self) -> float:
        """Seconds `network_bytes` take a step at the machine's network rate."""
        return self.network_bytes() / (self.rates.network_gbps * 1e9)

    def exchange_s(self) -> float:
        """Split state: a host's updated part goes out group by group as the optimizer finishes each (beside it)."""
        if not self.split:
            return 0.0
        fraction = (self.machine.hosts - 1) / self.machine.hosts
        return fraction * self.element * self.model.n_params / (self.rates.network_gbps * 1e9)

    def host_backward_s(self, placement: Placement) -> float:
        """The part of the backward that lands gradients in host memory: the last sweep's, all but the resident
        blocks', last."""
        resident_share = self.params(placement.resident) / self.model.n_params
        sweep_s = self.layers_s(placement) + self.device_update_s(placement)
        return (1 - self.forward_share(placement)) * sweep_s * (1 - resident_share)

    def phases(self, placement: Placement) -> dict[str, float]:
        """What each bound would make the step last (before the step boundary's wait). Updates applied as
        gradients land start after the head and, first layers first, run beside the backward and the next
        forward, which reaches the head once the last is done: with a pool deep enough for what the optimizer has
        left when the backward ends, only the head waits for them, else the whole forward does. With clipping
        they start after the backward, and the next backward waits for the forward they pace. Either way they
        start in the last sweep: a step's earlier sweeps add to what waits for them. On the host's own CPU
        (`Machine.shares_cores`) the compute phase holds the copies and updates as well: they take turns."""
        forward_s, backward_s = self.copy_passes_s(placement)
        compute_s, optimizer_s = self.compute_s(placement), self.optimizer_s(placement)
        sweeps, sweep_s, update_s = placement.sweeps, self.layers_s(placement), self.device_update_s(placement)
        pool_needed = gradient_pool_size(optimizer_s, self.host_backward_s(placement), self.group_sizes, self.rates)
        if self.full_grads:
            serial_s = CLIPPED_OPTIMIZER_WAIT_SHARE * (sweep_s + update_s)
        elif placement.gradient_pool is None or placement.gradient_pool >= pool_needed:
            serial_s = self.head_s(placement.tokens)
        else:
            serial_s = forward_s
        serial_s += (sweeps - 1) * sweep_s
        if self.machine.shares_cores:  # (one after another: the compute phase holds them all)
            compute_s += self.transfer_s(placement) + update_s + optimizer_s
        return {
            "compute": compute_s,
            # = compute where both passes hide their copies (compute wins ties)
            "pcie": sweeps * (forward_s + backward_s) + update_s,
            "cpu_optimizer": max(optimizer_s, self.exchange_s()) + serial_s,
            "disk": self.disk_s(placement),
            "network": sweeps * self.network_s(),
        }

    def step_s(self, placement: Placement) -> float:
        """Predicted seconds of an optimizer step under `placement`: its slowest bound (`phases`) plus the idle
        between steps (`boundary_s`)."""
        return max(self.phases(placement).values()) + self.boundary_s(placement)
