"""`megatrain plan`: where each layer's weights and activations go, whether a run fits, and how fast it runs.

The `Planner` is a run's cost model: the model and its settings, the machine's rates (`rates.py`) and its
memory. One method per phase gives a step's seconds under a `Placement` (GPU compute, the copies in and out,
the CPU optimizer, the disk tier, the network); `place` searches the placement for a step size. The Trainer
executes that placement as it is (`megatrain_sched.LayerPipeline`), `megatrain plan` prints it and benchmark
rows record it: one object, decided in one place.

How `place` decides, in order (each choice the fewest or most that a rule allows; `engine.*` settings other
than auto override a rule):
1. activation checkpoints that do not fit in half the GPU's room for a step go to host memory (first layers
   first: produced first, needed last);
2. a small step, whose CPU optimizer would take longer than the GPU's work, makes the embedding and the first
   blocks resident (fp32 state on the GPU, updated there) until the optimizer fits beside the GPU's work; a
   large one makes the embedding and first block resident where the step boundary costs more than the kept
   products their state displaces;
3. a small step holds the next blocks' weights from forward to backward (one copy a step instead of two);
4. a large step offloads the fewest first checkpoints that let the most layers keep their matmul products;
5. the gradient pool is deepened where the optimizer lags the backward, and the last groups' moments go to
   disk where the host cannot hold them;
6. in a large step more layers keep their products in pinned host memory, as the host and PCIe allow;
7. the last layers keep their products on the GPU, as many as its memory holds;
8. a large step whose GPU work bounds it, and whose layers do not all keep their products, runs in sweeps (its
   micro-batches in consecutive parts, forward and backward each, gradients summed before the one update),
   each placed as a step of its size, where that is predicted faster: each sweep keeps more products, at the
   price of the weights and gradient sums crossing PCIe once more per sweep.
"""

import functools
import itertools
import math
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from megatrain_optim import STATE_NAMES
from megatrain_sched import Placement, extras_that_fit, staging_buffers
from megatrain_templates import file_tensors
from megatrain_templates.head import CHUNK_LOGITS
from megatrain_zoo import ModelConfig, build_model, flops_per_token, linear_attention_flops_per_token

from .config import Config, ConfigError, model_config_of, resolve_device, resolve_dtype
from .host_memory import host_budget, process_bytes
from .rates import Rates, layer_works, load_rates

# a step runs in sweeps only where they are predicted this much faster than one (the cost model's margin) ...
SWEEPS_GAIN = 0.97
# ... and where their copies alone (weights in each sweep, gradient sums out and back) take at most this share
# of the GPU's work: beyond it the GPU waited between sweeps (H100, 128k tokens a step: Gemma-3-4B in 4 sweeps,
# whose copies the planner puts at 0.44 of its work, ran 3-7.5% faster than in one sweep; Qwen2.5-7B in 4, at
# 0.52, 2.7% slower, through two 128 MiB staging buffers; OLMoE-1B-7B in 2, at 0.68, 24% slower, where its CPU
# AdamW, starting in the last sweep, outlasted it: a limit the cost model's phases do not yet see)
SWEEPS_PCIE_SHARE = 0.48
MOST_SWEEPS = 8
# the forward's share of a step's GPU work (forward 2, recompute 2, backward 4 FLOPs per weight and token)
FORWARD_SHARE = 0.25
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
# Host memory a run on a GPU takes after it is planned beside the buffers the plan counts: the CUDA host allocator's
# small pinned blocks (batches, norms, rows), kernels loaded and compiled, cuBLAS's and the optimizer threads'
# workspaces. (Qwen2.5-7B on an H200: peak RSS 1.4 GiB over the store's arenas, the process's own footprint at
# planning included: benchmarks/results' host_gib against peak_rss_gib.)
RUNTIME_HOST_BYTES = 2**30
# ... and a run on the CPU beside its compute's memory: the allocator's slack and the optimizer threads' workspaces.
CPU_RUNTIME_HOST_BYTES = 2**26
# Groups of disk-tier moments resident at once: two read ahead, one being updated, two being written behind.
DISK_TIER_GROUPS_IN_MEMORY = 5
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


@dataclass(frozen=True)
class Machine:
    """What a run has: one GPU's memory free for it (None: no GPU), the host memory its plan may take (None:
    unknown; `host_memory.host_budget`) and where that number came from, GPUs per host, hosts, and the resident
    memory the process held when it was planned (outside the plan's host bytes)."""

    gpu_memory: int | None
    host_memory: int | None
    gpus: int = 1
    hosts: int = 1
    host_source: str = "as given"
    process_bytes: int = 0

    @classmethod
    def of(cls, config: Config, gpu_memory: int | None = None, host_memory: int | None = None, gpus=1, hosts=1):
        """This machine for `config`'s device, or one with `gpu_memory` / `host_memory` bytes free for the run (a
        plan for another machine). A GPU's is what it has free now, with what this process's allocator holds unused
        (the CUDA context and other processes' memory are not the run's); the host's is asked after the GPU's, so
        that the CUDA context is already outside it."""
        device = resolve_device(config.device)
        if gpu_memory is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            gpu_memory = free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if host_memory is not None:
            return cls(gpu_memory, host_memory, gpus, hosts, f"{host_memory / 2**30:g} GiB as given")
        budget = host_budget(config.engine.host_memory_gib)
        return cls(gpu_memory, budget.bytes, gpus, hosts, budget.source, process_bytes())


@dataclass
class Plan:
    """A placement with what it costs: memory (host bytes per host, GPU bytes per GPU) and the predicted step."""

    placement: Placement
    n_params: int
    active_params: int
    host_bytes: int  # per host: the sum of host_items
    host_bytes_per_param: float
    host_available: int | None  # what the plan may take (`host_memory.host_budget`); None: unknown
    disk_bytes: int  # optimizer state in the disk tier's files
    first_disk_group: int  # groups from here on keep their optimizer state on disk
    gpu_bytes: int
    gpu_available: int | None
    checkpoint_bytes: int  # all layers' checkpoints
    tokens_per_step: int
    compute_s: float
    transfer_s: float
    optimizer_s: float
    disk_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    model_tflops: float
    rates: Rates
    phases: dict = field(default_factory=dict)  # what each bound would make the step last, seconds
    bound: str = "compute"  # what sets the step time: compute, pcie, cpu_optimizer, disk or network
    compute_bound_tokens: int = 0  # tokens per step from which the GPU's work is the longest part
    gpus: int = 1  # per host
    hosts: int = 1
    network_bytes: int = 0  # sent by each host per step (gradients, and weights where hosts split the state)
    network_s: float = 0.0
    split_state: bool = False  # the hosts split the master weights and moments (engine.shard_across_hosts)
    checkpoint_stages: int = 0  # [tokens, d_model] activation checkpoints a micro-batch keeps
    kept_bytes: int = 0  # GPU memory the kept products hold
    # kept layers that keep their extra products too out of the GPU's room (linear attention's recurrence results)
    extra_kept_layers: int = 0
    held_bytes: int = 0  # GPU memory the held weights take
    gpu_updated_bytes: int = 0  # GPU memory the resident state takes (and, with clipping, their gradients)
    host_kept_bytes: int = 0  # host memory the host-kept products take (in host_bytes)
    stage_names: list[str] = field(default_factory=list)
    reference_tokens_per_s: float = 0.0  # DPO's reference pass, forward only (0: none)
    reference_copy: bool = False  # the store keeps the reference weights GRPO's KL streams (in host_bytes)
    generation_host_bytes: int = 0  # host copies GRPO's streamed generation keeps (in host_bytes)
    frozen_params: int = 0  # an image-text model's frozen parts' parameters: weights only, no gradient or moments
    frozen_parts: tuple[str, ...] = ()  # which (train.freeze_*)
    host_items: dict = field(default_factory=dict)  # every host allocation by name, bytes per host
    host_source: str = ""  # where host_available came from, in words
    process_bytes: int = 0  # the process's resident memory when planned (outside host_bytes)

    @property
    def experts_per_stage(self) -> int:
        return self.placement.experts_per_stage

    @property
    def gradient_pool(self) -> float:
        """Gradient landing pool, in largest groups (0: one buffer per group, as clipping needs)."""
        return self.placement.gradient_pool or 0.0

    @property
    def offloaded_layers(self) -> int:
        return len(self.placement.offloaded)

    @property
    def kept_layers(self) -> int:
        return len(self.placement.kept)

    @property
    def host_kept_layers(self) -> int:
        return len(self.placement.host_kept)

    @property
    def held_layers(self) -> int:
        return len(self.placement.held)

    @property
    def gpu_updated_layers(self) -> int:
        """Blocks (the first) whose masters and moments live and are updated on the GPU."""
        return len([i for i in self.placement.resident if 0 < i < len(self.placement.stages) - 1])

    def as_dict(self) -> dict:
        fields = asdict(self) | {"placement": self.placement.as_dict()}
        return fields | {name: getattr(self, name) for name in _COUNTS}

    def record(self) -> dict:
        """The placement and what it was predicted to cost: what a run writes as placement.json and benchmark rows
        record (`engine.placement: FILE` executes the placement as written)."""
        return {
            "placement": self.placement.as_dict(),
            "predicted": {
                "step_s": round(self.step_s, 4),
                "bound": self.bound,
                "phases_s": {name: round(seconds, 4) for name, seconds in self.phases.items()},
                "gpu_gib": round(self.gpu_bytes / 2**30, 2),
                "host_gib": round(self.host_bytes / 2**30, 2),
                "host_items": self.host_items,  # bytes per host, by allocation
                "host_budget": self.host_source,
                "process_bytes": self.process_bytes,  # resident when planned, outside host_gib
                "rates": self.rates.source,
            },
        }

    def summary(self) -> str:
        """One line: the placement's choices and the predicted step."""
        parts = [
            f"{count} {what}"
            for count, what in (
                (self.gpu_updated_layers, "blocks updated on the GPU"),
                (self.held_layers, "holding their weights"),
                (self.offloaded_layers, "with checkpoints in host memory"),
                (self.kept_layers, "keeping their products on the GPU"),
                (self.extra_kept_layers, "of them their recurrence's results too"),
                (self.host_kept_layers, "in host memory"),
            )
            if count
        ]
        sweeps = self.placement.sweeps
        in_sweeps = f" in {sweeps} sweeps of {self.placement.tokens:,}" if sweeps > 1 else ""
        return (
            f"placed for {self.placement.step_tokens:,} tokens a step per {'GPU' if self.gpu_available else 'device'}"
            f"{in_sweeps}: "
            f"{', '.join(parts) or 'every layer streamed'}"
            f"; predicted {self.step_s:.2f} s a step, bound by {self.bound_name}"
        )

    @property
    def bound_name(self) -> str:
        """What bounds the step, in words."""
        return (
            "the CPU's compute (no GPU)"
            if self.bound == "compute" and not self.gpu_available
            else BOUND_NAMES[self.bound]
        )


_COUNTS = ("experts_per_stage", "gradient_pool", "offloaded_layers", "kept_layers", "host_kept_layers")
_COUNTS += ("held_layers", "gpu_updated_layers")


@functools.cache  # a model's stages, asked for by every planner of it
def _built(model: ModelConfig, experts_per_stage: int):
    return build_model(model, experts_per_stage)


def layout_sizes(model: ModelConfig, experts_per_stage: int = 0) -> tuple[list[int], list[int], int]:
    """(parameters per store group in store order, parameters each stage binds, how many [tokens,
    d_model] activation checkpoints a micro-batch keeps), as megatrain_zoo builds the model."""
    spec = _built(model, experts_per_stage)
    groups = [sum(p.numel for p in group.params) for group in spec.groups]
    stages = [sum(groups[g] for g in stage.groups) for stage in spec.stages]
    planes = sum(getattr(stage.template, "checkpoint_planes", 1) for stage in spec.stages[1:-1])
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
    return sorted({g for i in resident_stages(spec, layers) for g in spec.stages[i].groups})


def mlp_width_per_token(model: ModelConfig) -> int:
    """The widest MLP hidden state one token makes in any layer (k experts + shared expert, or d_ff)."""
    moe = model.n_experts_per_tok * model.moe_d_ff + model.shared_expert_d_ff
    return max(moe if model.layer_is_moe(layer) else model.d_ff for layer in range(model.n_layers))


def kept_bytes_per_token(model: ModelConfig, element_size: int) -> int:
    """GPU bytes per token that one kept layer's products hold (the largest kind's); 0 where the layers always
    recompute."""
    spec = _built(model, 0)
    templates = [spec.stages[spec.layer_stage(layer)].template for layer in range(model.n_layers)]
    keeps = all(callable(getattr(t, "forward_keeping_products", None)) for t in templates)
    return max(t.product_bytes_per_token(element_size) for t in templates) if keeps else 0


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


def whole_step_statistics(model: ModelConfig, config: Config) -> str | None:
    """What makes a step's backward read statistics of all its micro-batches' forwards, which a step in sweeps
    lacks when its first backward runs (a MoE router's load-balancing loss or z-loss: their gradients divide by
    the step's loads and tokens); None: nothing does."""
    if not model.is_moe:
        return None
    if model.router_aux_loss_coef and model.output_router_logits:
        return "the router's load-balancing loss"
    if config.train.router_z_loss_coef:
        return "train.router_z_loss_coef"
    return None


@dataclass(frozen=True)
class _Counts:
    """A placement in the making: how many stages take each choice, by the planner's rules of which."""

    tokens: int  # per GPU and sweep
    sweeps: int = 1  # forward-backward sweeps a step runs in
    resident: int = 0  # blocks (the first; with the embedding, and the head where tied)
    held: int = 0  # blocks after the resident ones
    offloaded: int = 0  # blocks, the first, whose checkpoints go to host memory
    kept: int = 0  # blocks, the last keepable ones, keeping their products on the GPU
    host_kept: int = 0  # blocks before those, spread evenly, keeping theirs in host memory


class Planner:
    """The cost model of one run: `config`'s model and settings, `rates` and `machine`.

    Memory: `host_bytes`, `persistent_device_bytes` (slots, staging, held weights, resident state) and
    `step_device_bytes` (checkpoints and products kept on the GPU, gradients, a recompute, the head's chunk)
    count what the store and the pipeline allocate. Time, one method per phase: `compute_s`, `copy_passes_s`,
    `optimizer_s`, `disk_s`, `network_s`, `boundary_s`; `phases` overlaps them as the engine does. `place`
    searches a step size's placement; `plan` reports one."""

    def __init__(self, config: Config, model: ModelConfig, rates: Rates, machine: Machine):
        self.config, self.model, self.rates, self.machine = config, model, rates, machine
        engine = config.engine
        self.dtype = resolve_dtype(config.precision.compute_dtype, resolve_device(config.device))
        self.element = torch.finfo(self.dtype).bits // 8
        self.full_grads = config.train.grad_clip > 0
        self.split = engine.shard_across_hosts and machine.hosts > 1
        self.wire_copy = (engine.wire_copy or self.split) and self.dtype != torch.float32
        grpo = config.train.grpo
        self.generating = config.train.objective == "grpo" and grpo.rollouts is None  # (GRPO's rollouts made here)
        self.reference_copy = self.generating and grpo.beta > 0  # (the KL's reference weights, streamed per step)
        self.world = machine.gpus * machine.hosts
        self.micro_tokens = config.train.rows_per_micro_batch * config.data.seq_len
        width = mlp_width_per_token(model) + (model.n_experts_per_tok * model.d_model if model.is_moe else 0)
        # one micro-batch's recompute: q/k/v/attention/outputs/norms ~ 8 x d_model, MLP 3 x its width, in the
        # compute dtype (a MoE layer's width is that of its k experts and shared expert, plus the tokens' copies)
        self.recompute_bytes = self.micro_tokens * (8 * model.d_model + 3 * width) * self.element
        self.experts_per_stage = self._experts_per_stage()
        self.spec = _built(model, self.experts_per_stage)
        self.group_sizes, self.stage_sizes, _ = layout_sizes(model, self.experts_per_stage)
        self.n_stages = len(self.spec.stages)
        self.blocks = range(1, self.n_stages - 1)
        templates = [stage.template for stage in self.spec.stages]
        self.planes = [getattr(t, "checkpoint_planes", 1) if i in self.blocks else 0 for i, t in enumerate(templates)]
        keeps = [callable(getattr(t, "forward_keeping_products", None)) for t in templates]
        self.keepable = next((n for n, i in enumerate(reversed(self.blocks)) if not keeps[i]), len(self.blocks))
        keepers = [templates[i] for i in self.blocks[len(self.blocks) - self.keepable :]]
        self.product_bytes_per_token = max((t.product_bytes_per_token(self.element) for t in keepers), default=0)
        self.extra_bytes_per_token = {
            i: getattr(templates[i], "extra_product_bytes_per_token", lambda _: 0)(self.element) for i in self.blocks
        }
        weightless = {i for i, t in enumerate(templates) if not getattr(t, "backward_reads_weights", True)}
        self.holdable = [i for i in range(1, self.n_stages - 2) if i not in weightless]
        self.table_group = self.spec.stages[0].groups[0]
        # an image-text model's frozen parts: their groups keep weights only (no gradient, no optimizer state)
        self.frozen = self.spec.frozen_groups(config.train.frozen_parts)
        self.frozen_params = sum(self.group_sizes[g] for g in self.frozen)
        self.generation_host_bytes = self._generation_host_bytes()
        self.names = [stage.name for stage in self.spec.stages]

    def _generation_host_bytes(self) -> int:
        """Host bytes GRPO's generation takes beside the store (`megatrain.generate.generation_host_bytes`)."""
        if not self.generating:
            return 0
        from .generate import generation_host_bytes

        grpo = self.config.train.grpo
        stored = file_tensors({p.name: p.shape for group in self.spec.groups for p in group.params})
        length = grpo.max_prompt_length + grpo.max_completion_length
        shapes = {name: shape for name, (shape, _) in stored.items()}
        return generation_host_bytes(
            self.model, shapes, self.dtype, grpo.generation_weights, self.machine.gpu_memory, length
        )

    def _experts_per_stage(self) -> int:
        """engine.experts_per_stage resolved, 0 for whole layers (and dense models). auto: whole layers unless a
        layer's slots, gradients and recompute would take over LAYER_GPU_SHARE of the GPU, then the fewest parts
        (2, 4, 8, ...) that do not, so that the rest stays for activation checkpoints."""
        n, setting, gpu = self.model.n_experts, self.config.engine.experts_per_stage, self.machine.gpu_memory
        if not self.model.is_moe:
            return 0
        if setting != "auto":
            return setting if setting < n else 0

        def layer_bytes(per_stage: int) -> int:
            groups, stages, _ = layout_sizes(self.model, per_stage)
            return 2 * max(stages) * self.element + 2 * max(groups) * 4 + self.recompute_bytes + LOGITS_CHUNK_BYTES

        parts = 1
        while gpu is not None and parts < n and layer_bytes(-(-n // parts)) > LAYER_GPU_SHARE * gpu:
            parts *= 2
        return 0 if parts == 1 else -(-n // min(parts, n))

    # ------------------------------------------------------------------ memory
    def checkpoint_bytes(self, stage: int, tokens: int) -> int:
        return tokens * self.model.d_model * self.element * self.planes[stage]

    def params(self, stages: tuple[int, ...]) -> int:
        """Parameters of the groups these stages bind (each group once)."""
        return sum(self.group_sizes[g] for g in {g for i in stages for g in self.spec.stages[i].groups})

    def resident_state_bytes(self, placement: Placement) -> int:
        """GPU bytes of the resident groups' fp32 masters and moments (and, with clipping, their gradients)."""
        per_param = 4 * (1 + len(STATE_NAMES)) + (4 if self.full_grads else 0)
        return self.params(placement.resident) * per_param

    def persistent_device_bytes(self, placement: Placement) -> int:
        """GPU bytes that outlive a step: the rotating slots, the fp32 staging buffers, held weights, resident state."""
        slots = self.config.engine.n_slots * max(self.stage_sizes) * self.element
        staging = (
            math.prod(staging_buffers(max(self.stage_sizes))) * 4 if self.element < 4 and not self.wire_copy else 0
        )
        held = sum(self.stage_sizes[i] for i in placement.held) * self.element
        return slots + staging + held + self.resident_state_bytes(placement)

    def working_device_bytes(self) -> int:
        """GPU bytes a step works in whatever it keeps: two blocks' fp32 gradients, a micro-batch's recompute,
        the head's chunk and slack."""
        gradients = 2 * max(self.stage_sizes[i] for i in self.blocks) * 4
        recompute = max(self.recompute_bytes, 2 * self.micro_tokens * self.product_bytes_per_token)
        return gradients + recompute + STEP_SLACK_BYTES

    def step_device_bytes(self, placement: Placement) -> int:
        """GPU bytes a step takes beside the persistent ones: checkpoints kept there (and one offloaded stage's
        back a stage ahead of its backward), products kept there (and one host-kept stage's on its way), and
        its working memory."""
        tokens = placement.tokens
        offloaded = placement.offloaded
        checkpoints = sum(self.checkpoint_bytes(i, tokens) for i in self.blocks if i not in offloaded)
        checkpoints += max((self.checkpoint_bytes(i, tokens) for i in offloaded), default=0)
        in_flight = 1 if placement.host_kept else 0
        products = (len(placement.kept) + in_flight) * tokens * self.product_bytes_per_token
        return checkpoints + products + self.sweeps_device_bytes(placement) + self.working_device_bytes()

    def sweeps_device_bytes(self, placement: Placement) -> int:
        """GPU bytes a step in sweeps takes beside one sweep's: the earlier sweeps' gradient sum of a stage, back
        from host memory, and the resident groups' gradients, kept from sweep to sweep (with clipping they are
        held to the step's end anyway: `resident_state_bytes`)."""
        if placement.sweeps == 1:
            return 0
        carried = 0 if self.full_grads else self.params(placement.resident) * 4
        return max(self.stage_sizes) * 4 + carried

    def device_bytes(self, placement: Placement) -> int:
        return RUNTIME_DEVICE_BYTES + self.persistent_device_bytes(placement) + self.step_device_bytes(placement)

    def _device_room(self, placement: Placement) -> float:
        """GPU bytes left beside everything `placement` takes (inf without a GPU: nothing is decided by it)."""
        if self.machine.gpu_memory is None:
            return math.inf
        return self.machine.gpu_memory - self.device_bytes(placement)

    def host_items(self, placement: Placement) -> dict[str, int]:
        """Every host allocation of `placement`, by name, bytes per host: the one place they are counted (the
        store's arenas, the pipeline's pinned rooms, the optimizer's and generation's buffers, the runtime's)."""
        return {name: int(nbytes) for name, nbytes in self._host_allocations(placement) if nbytes > 0}

    def _host_allocations(self, placement: Placement):
        n_params, trainable = self.model.n_params, self.model.n_params - self.frozen_params
        share = 1 / self.machine.hosts if self.split else 1  # a host holds its part of what the hosts split
        yield "master weights", n_params * 4 * share
        yield "optimizer moments", trainable * 4 * len(STATE_NAMES) * share - self.disk_bytes(placement)
        if self.disk_bytes(placement):  # the groups read ahead, being updated and being written behind
            on_disk = sorted(self.group_sizes[placement.first_disk_group :], reverse=True)
            yield "disk tier's page cache", sum(on_disk[:DISK_TIER_GROUPS_IN_MEMORY]) * 4 * len(STATE_NAMES)
        if placement.gradient_pool is None:  # a buffer per group, as the store allocates then
            reason = "for clipping" if self.full_grads else f"across {placement.sweeps} sweeps"
            yield f"gradients held {reason}", trainable * 4 * share
        else:
            yield "gradient pool", placement.gradient_pool * max(self.group_sizes) * 4 * share
        yield "wire copy", n_params * self.element * self.wire_copy
        yield "KL reference copy", n_params * self.element * self.reference_copy
        yield "generation copies", self.generation_host_bytes
        yield (
            "offloaded checkpoints",
            self.machine.gpus * sum(self.checkpoint_bytes(i, placement.tokens) for i in placement.offloaded),
        )
        yield "host-kept products", self.machine.gpus * len(placement.host_kept) * self.stage_products(placement)
        yield "embedding rows buffer", self._rows_buffer_bytes(placement)
        yield "runtime", self._runtime_host_bytes(placement)

    def stage_products(self, placement: Placement) -> int:
        """Bytes one keeping stage's matmul products take for `placement`'s tokens."""
        return placement.tokens * self.product_bytes_per_token

    def _rows_buffer_bytes(self, placement: Placement) -> int:
        """The pinned buffer the embedding's updated rows go to the GPU through (`Trainer._rows_first`): a quarter
        of the table, fp32, rounded up to a power of two by the CUDA host allocator."""
        first = self.spec.stages[0]
        streams_rows = hasattr(first.template, "forward_rows") and len(first.groups) == 1 and self.world == 1
        if not streams_rows or self.wire_copy or 0 in placement.resident or placement.first_disk_group == 0:
            return 0
        nbytes = self.group_sizes[first.groups[0]] // 4 * 4
        return 2 ** math.ceil(math.log2(max(1, nbytes))) if self.machine.gpu_memory is not None else nbytes

    def _runtime_host_bytes(self, placement: Placement) -> int:
        """Host memory a run takes after it is planned beside its buffers: on a GPU, RUNTIME_HOST_BYTES; on the
        CPU, also the compute's own memory (weight slots, checkpoints, a block's work and the head's logits)."""
        if self.machine.gpu_memory is not None:
            return RUNTIME_HOST_BYTES
        # (no CUDA context, kernels or pinned blocks on the CPU: its own allocator's slack instead)
        tokens = placement.tokens
        slots = self.config.engine.n_slots * max(self.stage_sizes) * self.element
        checkpoints = sum(self.checkpoint_bytes(i, tokens) for i in self.blocks)
        products = len(placement.kept) * self.stage_products(placement)
        logits = 3 * min(self.micro_tokens, CHUNK_LOGITS // self.model.vocab_size) * self.model.vocab_size * 4
        work = 2 * max(self.stage_sizes) * 4 + self.recompute_bytes + logits
        # GRPO's generation from resident weights (auto, on the CPU): a copy of the model on the device, the host
        resident = self.generating and self.config.train.grpo.generation_weights != "streamed"
        generation = self.model.n_params * self.element if resident else 0
        return CPU_RUNTIME_HOST_BYTES + slots + checkpoints + products + work + generation

    def disk_bytes(self, placement: Placement) -> int:
        first = len(self.group_sizes) if placement.first_disk_group is None else placement.first_disk_group
        return sum(self.group_sizes[first:]) * 4 * len(STATE_NAMES)

    def host_bytes(self, placement: Placement) -> int:
        return sum(self.host_items(placement).values())

    # ------------------------------------------------------------------- time
    def head_s(self, tokens: int) -> float:
        """The loss head's GPU seconds for `tokens`: its GEMM, the loss and its backward."""
        return 6 * self.model.vocab_size * self.model.d_model * tokens / (self.rates.head_tflops * 1e12)

    def blocks_s(self, tokens: int, kept: int) -> float:
        """The decoder layers' GPU seconds for `tokens`, `kept` of them keeping their products."""
        layer_rate = self.rates.moe_gpu_tflops if self.model.is_moe else self.rates.gpu_tflops
        kept_rate = layer_rate if self.model.is_moe else self.rates.gpu_kept_tflops or layer_rate
        whole, kept_layer = layer_works(self.model, self.config.data.seq_len, tokens)
        return ((self.model.n_layers - kept) * whole / layer_rate + kept * kept_layer / kept_rate) / 1e12

    def layers_s(self, placement: Placement) -> float:
        """The GPU's forward, recompute and backward of every layer and the head, a sweep."""
        kept = len(placement.kept) + len(placement.host_kept)
        skipped = len(self.extras(placement)) * self.recurrence_forward_s(placement.tokens)
        return self.blocks_s(placement.tokens, kept) - skipped + self.head_s(placement.tokens)

    def extras(self, placement: Placement) -> tuple[int, ...]:
        """The stages keeping their products on the GPU that the pipeline will let keep their extra products too,
        by its rule (`extras_that_fit`) on the GPU's room beside `placement` (all of them without a GPU)."""
        extra = {i: placement.tokens * self.extra_bytes_per_token[i] for i in placement.kept}
        return tuple(sorted(extras_that_fit(extra, self._device_room(placement))))

    def recurrence_forward_s(self, tokens: int) -> float:
        """A linear-attention layer's recurrence forward for `tokens`: what keeping its results saves."""
        if not self.model.linear_attention_layers:
            return 0.0
        return linear_attention_flops_per_token(self.model) / 3 * tokens / (self.rates.recurrence_tflops * 1e12)

    def device_update_s(self, placement: Placement) -> float:
        """The resident groups' AdamW and casts, on the compute stream."""
        return self.params(placement.resident) / self.rates.gpu_adam_params_per_s

    def step_layers_s(self, placement: Placement) -> float:
        """Every sweep's layers and head: the GPU's work a step, what the CPU optimizer's is weighed against."""
        return placement.sweeps * self.layers_s(placement)

    def compute_s(self, placement: Placement) -> float:
        """Every sweep's layers, and the resident groups' update once a step."""
        return self.step_layers_s(placement) + self.device_update_s(placement)

    def optimizer_s(self, placement: Placement) -> float:
        """The CPU AdamW of every group not resident (this host's part of them where the hosts split the state)."""
        cpu_params = self.model.n_params - self.frozen_params - self.params(placement.resident)
        return cpu_params / (self.machine.hosts if self.split else 1) / self.rates.cpu_adam_params_per_s

    def _wire(self) -> int:
        """Bytes a weight crosses PCIe in."""
        return self.element if self.wire_copy else 4

    def transfer_s(self, placement: Placement) -> float:
        """The copies alone, each sweep: weights in twice (held ones once, resident ones never), fp32 gradients out
        once (and, after the first sweep, the sum so far back in)."""
        streamed = self.model.n_params - self.params(placement.resident)
        held, sweeps = self.params(placement.held), placement.sweeps
        copies_in = sweeps * (2 * streamed - held) * self._wire() + (sweeps - 1) * 4 * streamed
        return max(copies_in, sweeps * 4 * streamed) / (self.rates.pcie_gbps * 1e9)

    def copy_passes_s(self, placement: Placement) -> tuple[float, float]:
        """(forward, backward) seconds of a sweep, each as long as its compute or its copies, whichever is longer: a pass
        runs no faster than its weights arrive (a MoE forward, a quarter of little active work, often waits for
        them); the backward's weights come in beside its gradients and reloads going out, on a duplex link.
        Resident blocks compute first in the forward and last in the backward with no copy to hide behind
        them (held blocks' forward copies may start meanwhile: their buffers are their own). A sweep after the
        first brings the gradient sums back in beside its weights (here, a sweep's average); the resident groups'
        update, once a step, is `phases`'."""
        pcie, duplex = self.rates.pcie_gbps * 1e9, self.rates.pcie_duplex_gbps * 1e9
        tokens, wire = placement.tokens, self._wire()
        layers_s = self.layers_s(placement)
        resident = self.params(placement.resident)
        streamed, held = self.model.n_params - resident, self.params(placement.held)
        share = resident / self.model.n_params
        activations_out = sum(self.checkpoint_bytes(i, tokens) for i in placement.offloaded)
        activations_out += len(placement.host_kept) * tokens * self.product_bytes_per_token
        forward_compute, backward_compute = FORWARD_SHARE * layers_s, (1 - FORWARD_SHARE) * layers_s
        early_s = min(held * wire / pcie, share * forward_compute)
        forward_s = share * forward_compute + max(
            (1 - share) * forward_compute, streamed * wire / pcie - early_s, activations_out / pcie
        )
        sums_back = (placement.sweeps - 1) / placement.sweeps * streamed * 4
        backward_weights_s = ((streamed - held) * wire + activations_out + sums_back) / duplex
        backward_s = share * backward_compute + max(
            (1 - share) * backward_compute, backward_weights_s, streamed * 4 / duplex
        )
        return forward_s, backward_s

    def boundary_s(self, placement: Placement) -> float:
        """The step boundary's wait where the embedding is not resident: its gradient and the first block's are
        the step's last, their weights the next's first, so the GPU waits for them to go out, be updated on the
        CPU and come back (of the table, the rows the next step's tokens read: the rest is updated beside)."""
        if 0 in placement.resident:
            return 0.0
        rows = min(self.model.vocab_size, placement.step_tokens) * self.model.d_model
        first = rows + self.params((1,))
        return first / self.rates.cpu_adam_params_per_s + first * (self._wire() + 4) / (self.rates.pcie_gbps * 1e9)

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
        return (1 - FORWARD_SHARE) * sweep_s * (1 - resident_share)

    def phases(self, placement: Placement) -> dict[str, float]:
        """What each bound would make the step last (before the step boundary's wait). Updates applied as
        gradients land start after the head and, first layers first, run beside the backward and the next
        forward, which reaches the head once the last is done: with a pool deep enough for what the optimizer has
        left when the backward ends, only the head waits for them, else the whole forward does. With clipping
        they start after the backward, and the next backward waits for the forward they pace. Either way they
        start in the last sweep: a step's earlier sweeps add to what waits for them."""
        forward_s, backward_s = self.copy_passes_s(placement)
        compute_s, optimizer_s = self.compute_s(placement), self.optimizer_s(placement)
        sweeps, sweep_s, update_s = placement.sweeps, self.layers_s(placement), self.device_update_s(placement)
        pool_needed = gradient_pool_size(optimizer_s, self.host_backward_s(placement), self.group_sizes, self.rates)
        if self.full_grads:
            serial_s = (1 - FORWARD_SHARE) * (sweep_s + update_s)
        elif placement.gradient_pool is None or placement.gradient_pool >= pool_needed:
            serial_s = self.head_s(placement.tokens)
        else:
            serial_s = forward_s
        serial_s += (sweeps - 1) * sweep_s
        return {
            "compute": compute_s,
            # = compute where both passes hide their copies (compute wins ties)
            "pcie": sweeps * (forward_s + backward_s) + update_s,
            "cpu_optimizer": max(optimizer_s, self.exchange_s()) + serial_s,
            "disk": self.disk_s(placement),
            "network": sweeps * self.network_s(),
        }

    def reference_tokens_per_s(self, placement: Placement) -> float:
        """DPO's reference pass (forward only, before training): tokens per second, the weights streamed once for
        `reference.PASS_STEPS` steps' rows; 0 where the objective needs no reference."""
        from .reference import PASS_STEPS

        dpo = self.config.train.dpo
        if self.config.train.objective != "dpo" or not dpo.needs_reference:
            return 0.0
        forward_s = FORWARD_SHARE * self.layers_s(placement) * PASS_STEPS
        weights_s = self.model.n_params * self._wire() / (self.rates.pcie_gbps * 1e9)
        return PASS_STEPS * placement.tokens * self.world / max(forward_s, weights_s)

    def step_s(self, placement: Placement) -> float:
        return max(self.phases(placement).values()) + self.boundary_s(placement)

    def compute_bound_tokens(self) -> int:
        """Tokens per step (all GPUs') from which the GPU's work bounds the step, each size placed for itself
        (compute grows with the tokens, the rest nearly does not)."""

        def compute_bound(tokens: int) -> bool:
            return slowest(self.phases(self.place(tokens, explain=False))) == "compute"

        low, high = 0, max(1, self.config.train.rows_per_step * self.config.data.seq_len // self.world)
        while not compute_bound(high) and high < 2**40:
            low, high = high, 2 * high
        while high - low > max(1, high // 1000):  # to 0.1%: a plan per probe
            middle = (low + high) // 2
            low, high = (low, middle) if compute_bound(middle) else (middle, high)
        return high * self.world

    # ------------------------------------------------------------------ search
    def placement_of(self, counts: _Counts, **step) -> Placement:
        """`counts` as stage indices, by the rules: the first blocks resident (with the embedding, and the head
        where tied), then held; the first blocks' checkpoints offloaded; the last keepable blocks keeping their
        products on the GPU, and before those, spread evenly from the first keepable one (the copies out keep
        pace with the forward, and the first layers' backward, last, leaves the copies back the most time), the
        host-kept ones."""
        resident = resident_stages(self.spec, counts.resident)
        holdable = [i for i in self.holdable if i not in resident]
        last_block = self.n_stages - 2
        kept = tuple(range(last_block - counts.kept + 1, last_block + 1))
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
            tokens=counts.tokens,
            sweeps=counts.sweeps,
            wire_copy=self.wire_copy,
            experts_per_stage=self.experts_per_stage,
            **step,
        )
        return replace(placement, device_step_bytes=self.step_device_bytes(placement))

    def place(
        self, tokens: int, first_disk_group: int | None = None, explain: bool = True, sweeps: int | None = None
    ) -> Placement:
        """The placement for steps of `tokens` per GPU (see the module's docstring for the order of the choices).
        `first_disk_group`: the disk tier of a store already allocated (else decided here). With `explain`, the
        placement's `why` says in words what decided each choice. `sweeps`: so many (else engine.sweeps's)."""
        setting = sweeps or self.config.engine.sweeps
        if setting != "auto":
            return self._place_sweeps(tokens, setting, first_disk_group, explain)
        one = self._place_sweeps(tokens, 1, first_disk_group, explain)
        best = one
        for sweeps in self._sweep_counts(one):
            placed = self._place_sweeps(tokens, sweeps, first_disk_group, explain)
            fits = (
                self.machine.host_memory is None
                or self.host_bytes(placed) <= POOL_HOST_SHARE * self.machine.host_memory
            )
            hidden = self.transfer_s(placed) <= SWEEPS_PCIE_SHARE * self.compute_s(placed)
            if fits and hidden and self.step_s(placed) < SWEEPS_GAIN * self.step_s(best):
                best = placed
        if best is not one and explain:
            best.why["sweeps"] = (
                f"the step runs in {best.sweeps} sweeps of {best.tokens:,} tokens: each lets "
                f"{len(best.keeping)} layers keep their products where the whole step would let {len(one.keeping)} "
                f"(predicted {self.step_s(best):.2f} s a step against {self.step_s(one):.2f} s)"
            )
        return best

    def _sweep_counts(self, one: Placement) -> range:
        """The sweeps worth predicting beside one: where no step objective reads all micro-batches first, no
        optimizer state is on disk, the GPU bounds the step, and some layers recompute their products."""
        micro_batches = -(-one.tokens // self.micro_tokens)
        if (
            self.config.train.objective != "sft"
            or whole_step_statistics(self.model, self.config)
            or self.config.engine.optimizer_state_dir
            or self.machine.gpu_memory is None
            or len(one.keeping) >= self.keepable
            or slowest(self.phases(one)) != "compute"
        ):
            return range(0)
        return range(2, min(micro_batches, MOST_SWEEPS) + 1)

    def _place_sweeps(self, tokens: int, sweeps: int, first_disk_group: int | None, explain: bool) -> Placement:
        """The placement for steps of `tokens` per GPU run in `sweeps`, each placed for its micro-batches' tokens."""
        micro_batches = max(1, -(-tokens // self.micro_tokens))
        sweeps = min(sweeps, micro_batches)
        sweep_tokens = min(tokens, -(-micro_batches // sweeps) * self.micro_tokens) if sweeps > 1 else tokens
        why: dict[str, str] = {}
        counts = _Counts(sweep_tokens, sweeps, offloaded=self._offloaded_to_fit(sweep_tokens))
        small = self.step_layers_s(self.placement_of(replace(counts, kept=self._kept(counts)))) < self.optimizer_s(
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
        counts = replace(counts, host_kept=min(counts.host_kept, self.keepable - counts.kept))
        if self.machine.gpu_memory is not None and self.keepable and self.config.engine.kept_layers == "auto":
            which = {0: "no layer keeps its", 1: "the last layer keeps its"}
            what = which.get(counts.kept, f"the last {counts.kept} layers keep their")
            why["kept"] = f"{what} matmul products: as many as the GPU's memory holds"
        return self.placement_of(counts, **step, why=why if explain else {})

    def _room_for_products(self, counts: _Counts) -> float:
        """GPU bytes left for kept products beside everything else `counts` places."""
        return self._device_room(self.placement_of(replace(counts, kept=0)))

    def _kept(self, counts: _Counts) -> int:
        """Layers keeping their products on the GPU: as set, else as many as its memory holds."""
        setting = self.config.engine.kept_layers
        if setting != "auto":
            return min(setting, self.keepable)
        if self.machine.gpu_memory is None or not self.keepable:
            return 0
        stage_products = counts.tokens * self.product_bytes_per_token
        return min(self.keepable, max(0, int(self._room_for_products(counts) // stage_products)))

    def _offloaded_to_fit(self, tokens: int) -> int:
        """First blocks whose checkpoints go to host memory: all or none as set; auto, those that do not fit in
        CHECKPOINT_GPU_SHARE of the GPU's room for a step (the last layers' stay: needed first)."""
        setting = self.config.engine.offload_checkpoints
        if setting != "auto":
            return len(self.blocks) if setting else 0
        if self.machine.gpu_memory is None:
            return 0
        persistent = self.persistent_device_bytes(self.placement_of(_Counts(tokens)))
        room = self.machine.gpu_memory - RUNTIME_DEVICE_BYTES - persistent - self.working_device_bytes()
        room *= CHECKPOINT_GPU_SHARE
        on_gpu = itertools.accumulate(self.checkpoint_bytes(i, tokens) for i in reversed(self.blocks))
        return len(self.blocks) - sum(1 for _ in itertools.takewhile(lambda total: total <= room, on_gpu))

    def _resident(self, counts: _Counts, small: bool, why: dict) -> int:
        """Blocks (the first) resident on the GPU, with the embedding (and the head where tied): as set; none
        with several processes (each updates a shard of every group) or checkpoints that crowd the GPU; in a
        small step the fewest that bring the CPU optimizer (and the head, which waits for it) within the GPU's
        work, in up to GPU_UPDATED_SHARE of it; in a large one the first, where the step boundary's wait costs
        more than the kept products its state displaces."""
        setting, n_blocks = self.config.engine.gpu_updated_layers, len(self.blocks)
        if self.frozen:  # (the first stages are a frozen tower's, whose groups keep no state to update)
            return 0
        if setting != "auto":
            return min(setting, n_blocks)
        if self.machine.gpu_memory is None or counts.offloaded or self.world > 1:
            return 0
        if not small:
            return 1 if self._boundary_pays(counts, why) else 0
        budget = min(GPU_UPDATED_SHARE * self.machine.gpu_memory, self._room_for_products(counts))
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

    def _boundary_pays(self, counts: _Counts, why: dict) -> bool:
        """Whether the embedding's and first block's state on the GPU saves more of the step boundary's wait than
        the recompute of the kept products that memory would have held costs."""
        host = self.placement_of(counts)
        one = self.placement_of(replace(counts, resident=1))
        state = self.resident_state_bytes(one)
        kept = self._kept(counts)
        displaced = state / (counts.tokens * self.product_bytes_per_token) if kept < self.keepable else 0.0
        recompute_saved_s = self.blocks_s(counts.tokens, 0) - self.blocks_s(counts.tokens, 1)
        fits = state <= min(GPU_UPDATED_SHARE * self.machine.gpu_memory, self._room_for_products(counts))
        pays = fits and self.boundary_s(host) > displaced * recompute_saved_s
        if pays:
            why["resident"] = (
                f"the embedding and first block are updated on the GPU: the step boundary would wait "
                f"{self.boundary_s(host):.2f} s for their update on the CPU"
            )
        return pays

    def _held(self, counts: _Counts, small: bool, why: dict) -> int:
        """Blocks after the resident ones whose weights stay on the GPU from forward to backward: as set; in a
        small step as many as fit in HELD_GPU_SHARE of the GPU and the room the step leaves; none otherwise (the
        memory keeps activations instead, which a step the GPU bounds needs)."""
        holdable = [i for i in self.holdable if i not in resident_stages(self.spec, counts.resident)]
        setting = self.config.engine.held_layers
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

    def _offloaded_for_products(self, counts: _Counts, small: bool, why: dict) -> int:
        """In a large step (the GPU the bound, PCIe with time to spare), the fewest first checkpoints sent to host
        memory that let the most layers keep their products, as many as the host holds beside its state."""
        engine = self.config.engine
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

    def _least_pool(self, counts: _Counts) -> float | None:
        """The smallest gradient pool `counts` can have (None: every gradient held, for clipping or sweeps)."""
        return None if self.full_grads or counts.sweeps > 1 else float(GRADIENT_POOL)

    def _gradient_pool(self, counts: _Counts, why: dict) -> float | None:
        """Gradient landing buffers, in largest groups: none with clipping (every gradient is held); as set; else
        deep enough for what the optimizer has left when the backward ends, where the host has the room."""
        if self._least_pool(counts) is None:  # (a step in sweeps holds every gradient until the last)
            return None
        setting = self.config.engine.gradient_pool
        if setting != "auto":
            return float(setting)
        placement = self.placement_of(counts)
        pool = gradient_pool_size(
            self.optimizer_s(placement), self.host_backward_s(placement), self.group_sizes, self.rates
        )
        host = self.machine.host_memory
        deeper = self.host_bytes(replace(placement, gradient_pool=pool))
        if pool > GRADIENT_POOL and host is not None and deeper > POOL_HOST_SHARE * host:
            return float(GRADIENT_POOL)  # the deeper pool is a speed-up, not worth the host memory it lacks
        if pool > GRADIENT_POOL:
            why["gradient_pool"] = f"a gradient pool of {pool:g} largest groups holds what the CPU optimizer has left"
        return pool

    def _first_disk_group(self, placement: Placement, why: dict) -> int:
        """The first group whose moments go to the disk tier (the last groups go): none without
        engine.optimizer_state_dir; with disk_state_fraction auto, as few as bring the plan, its page cache
        included, within DISK_TIER_RAM_SHARE of the host's budget; else that fraction of the parameters."""
        n_groups, fraction = len(self.group_sizes), self.config.engine.disk_state_fraction
        if not self.config.engine.optimizer_state_dir:
            return n_groups
        host, first = self.machine.host_memory, n_groups
        if fraction != "auto":
            to_move = fraction * self.model.n_params
            while first > 0 and to_move > 0:
                first -= 1
                to_move -= self.group_sizes[first]
        else:
            while first > 0 and (
                host is None or self.host_bytes(replace(placement, first_disk_group=first)) > DISK_TIER_RAM_SHARE * host
            ):
                first -= 1
        if first < n_groups:
            reason = "the host cannot hold them" if fraction == "auto" else f"engine.disk_state_fraction {fraction}"
            why["disk"] = f"the moments of groups {first}-{n_groups - 1} live on disk: {reason}"
        return first

    def _host_kept(self, counts: _Counts, small: bool, step: dict, why: dict) -> int:
        """Layers (before those kept on the GPU) keeping their products in pinned host memory: as set; in a large
        step, where the optimizer leaves the host's memory bandwidth to spare and nothing is on disk, as many as
        the host's room allows and the forward's idle copy-out carries while the layers between two of them
        compute."""
        candidates = max(0, self.keepable - self._kept(counts))
        setting = self.config.engine.host_kept_layers
        if setting != "auto":
            return min(setting, candidates)
        placement = self.placement_of(replace(counts, kept=self._kept(counts)), **step)
        machine, stage_products = self.machine, counts.tokens * self.product_bytes_per_token
        layers_s = self.layers_s(placement)
        if (
            machine.gpu_memory is None
            or machine.host_memory is None
            or small
            or self.disk_bytes(placement)
            or not stage_products
            or self.config.engine.kept_layers == 0  # products kept nowhere, as asked
            or self.optimizer_s(placement) > HOST_KEPT_OPTIMIZER_SHARE * self.step_layers_s(placement)
        ):
            return 0
        host_room = HOST_KEPT_RAM_SHARE * machine.host_memory - self.host_bytes(placement)
        # one layer's forward, less its checkpoint's copy out, against one stage's copy out: how far apart they go
        link = HOST_KEPT_PCIE_SHARE * self.rates.pcie_gbps * 1e9
        layer_forward_s = FORWARD_SHARE * layers_s / self.model.n_layers
        layer_forward_s -= self.checkpoint_bytes(1, counts.tokens) / link * counts.offloaded / len(self.blocks)
        spacing = stage_products / link / max(layer_forward_s, 1e-9)
        host_kept = min(
            candidates, int(host_room // (machine.gpus * stage_products)), int(candidates / max(1.0, spacing))
        )
        if host_kept > 0:
            why["host_kept"] = (
                f"{host_kept} more layers keep their products in pinned host memory: the host has the room"
            )
        return max(0, host_kept)

    # ------------------------------------------------------------------ report
    def plan(self, placement: Placement) -> Plan:
        """What `placement` costs and how long its step is predicted to take."""
        model, world, tokens = self.model, self.world, placement.tokens
        phases = self.phases(placement)
        bound = slowest(phases)
        step_s = phases[bound] + self.boundary_s(placement)
        host_items = self.host_items(placement)
        host_bytes = sum(host_items.values())
        global_tokens = placement.step_tokens * world
        stage_products = tokens * self.product_bytes_per_token
        return Plan(
            placement=placement,
            n_params=model.n_params,
            active_params=model.active_params,
            host_bytes=host_bytes,
            host_bytes_per_param=host_bytes / model.n_params,
            host_available=self.machine.host_memory,
            disk_bytes=self.disk_bytes(placement),
            first_disk_group=len(self.group_sizes)
            if placement.first_disk_group is None
            else placement.first_disk_group,
            gpu_bytes=self.device_bytes(placement),
            gpu_available=self.machine.gpu_memory,
            checkpoint_bytes=sum(self.checkpoint_bytes(i, tokens) for i in self.blocks),
            tokens_per_step=global_tokens,
            compute_s=phases["compute"],
            transfer_s=self.transfer_s(placement),
            optimizer_s=self.optimizer_s(placement),
            disk_s=phases["disk"],
            bubble_s=self.boundary_s(placement),
            step_s=step_s,
            tokens_per_s=global_tokens / step_s,
            model_tflops=flops_per_token(model, self.config.data.seq_len) * global_tokens / step_s / 1e12,
            rates=self.rates,
            phases=phases,
            bound=bound,
            compute_bound_tokens=self.compute_bound_tokens() if phases["compute"] else 0,
            gpus=self.machine.gpus,
            hosts=self.machine.hosts,
            network_bytes=self.network_bytes(),
            network_s=phases["network"],
            split_state=self.split,
            checkpoint_stages=sum(self.planes),
            kept_bytes=len(placement.kept) * stage_products,
            extra_kept_layers=len(self.extras(placement)),
            held_bytes=self.params(placement.held) * self.element,
            gpu_updated_bytes=self.resident_state_bytes(placement),
            host_kept_bytes=self.machine.gpus * len(placement.host_kept) * stage_products,
            stage_names=self.names,
            reference_tokens_per_s=self.reference_tokens_per_s(placement),
            frozen_params=self.frozen_params,
            frozen_parts=tuple(sorted({self.spec.group_parts[g] for g in self.frozen} - {"unused"})),
            reference_copy=self.reference_copy,
            generation_host_bytes=self.generation_host_bytes,
            host_items=host_items,
            host_source=self.machine.host_source,
            process_bytes=self.machine.process_bytes,
        )


def make_plan(
    config: Config,
    model: ModelConfig | None = None,
    rates: Rates | None = None,
    gpu_memory: int | None = None,
    gpus: int = 1,
    hosts: int = 1,
    host_memory: int | None = None,
) -> Plan:
    """The plan for `config`'s step on this machine's GPU, or on one with `gpu_memory` bytes, and the host memory
    it has available now, or `host_memory` bytes; with `gpus` per host and `hosts` (data parallel: a replica of the
    state per host, or the state split over them with engine.shard_across_hosts) host bytes are per host, GPU bytes
    per GPU, and the step splits the global batch over every GPU."""
    model = model or model_config_of(config)
    planner = Planner(config, model, rates or load_rates(), Machine.of(config, gpu_memory, host_memory, gpus, hosts))
    tokens = config.train.rows_per_step * config.data.seq_len // (gpus * hosts)
    return planner.plan(planner.place(tokens))


def check_plan(plan: Plan, config: Config, model: ModelConfig) -> None:
    """Refuse, before anything is allocated, a run that cannot work, naming the fix."""
    if config.data.seq_len > model.max_seq_len:
        raise ConfigError(
            f"data.seq_len {config.data.seq_len} is larger than the model allows (max_position_embeddings "
            f"{model.max_seq_len}); lower data.seq_len"
        )
    _check_resident(plan, model)
    _check_sweeps(plan, config, model)
    _check_host(plan, config, model)
    _check_disk(plan, config)
    _check_gpu(plan, config, model)


def _check_resident(plan: Plan, model: ModelConfig) -> None:
    if not plan.gpu_updated_layers:
        return
    if plan.gpus * plan.hosts > 1:
        raise ConfigError(
            f"engine.gpu_updated_layers: {plan.gpu_updated_layers} needs one process holding all of the state; "
            f"with {plan.gpus * plan.hosts} GPUs set engine.gpu_updated_layers: 0 (or auto)"
        )
    on_gpu = gpu_updated_groups(_built(model, plan.experts_per_stage), plan.gpu_updated_layers)
    if max(on_gpu) >= plan.first_disk_group:
        raise ConfigError(
            f"engine.gpu_updated_layers: {plan.gpu_updated_layers} reaches the layers whose optimizer state is on "
            "disk (engine.optimizer_state_dir); set engine.gpu_updated_layers: auto or fewer"
        )


def _check_sweeps(plan: Plan, config: Config, model: ModelConfig) -> None:
    statistics = whole_step_statistics(model, config)
    if plan.placement.sweeps > 1 and statistics:
        raise ConfigError(
            f"engine.sweeps {plan.placement.sweeps}: {statistics} needs the whole step's routing before any "
            "backward; set engine.sweeps to 1 or auto"
        )


# What saves each host item (by the start of its name), for the refusal of a plan the host cannot hold.
HOST_SAVINGS = {
    "master weights": "a host with more memory, or several with engine.shard_across_hosts: true",
    "optimizer moments": "engine.optimizer_state_dir puts them on disk",
    "gradients held for clipping": "train.grad_clip: 0 lands them in a pool of a few layers instead",
    "gradients held across": "engine.sweeps: 1 lands them in a pool of a few layers instead",
    "gradient pool": "engine.gradient_pool: 3",
    "wire copy": "engine.wire_copy: false",
    "KL reference copy": "train.grpo.beta: 0",
    "generation copies": "train.grpo.generation_weights: resident",
    "offloaded checkpoints": "fewer tokens a step (train.batch_size), or a GPU with room for them",
    "host-kept products": "engine.host_kept_layers: 0",
}


def _check_host(plan: Plan, config: Config, model: ModelConfig) -> None:
    """Refuse a plan whose host allocations pass what the run may take, naming its largest item and what saves
    it (a choice that costs host memory first, where dropping it alone would fit)."""
    if plan.host_available is None or plan.host_bytes <= plan.host_available:
        return
    items, gib = plan.host_items, 2**30
    over = plan.host_bytes - plan.host_available
    optional = [name for name in items if name.startswith(("host-kept", "gradients held across"))]
    name = next((n for n in optional if items[n] >= over), max(items, key=items.get))
    saving = next((fix for start, fix in HOST_SAVINGS.items() if name.startswith(start)), "a smaller model")
    largest = plan.host_available / plan.host_bytes_per_param
    raise ConfigError(
        f"host memory: {model.arch} with {_params(plan.n_params)} parameters needs {plan.host_bytes / gib:.1f} GiB "
        f"({plan.host_bytes_per_param:.1f} B/param) but this run may take {plan.host_available / gib:.1f} GiB "
        f"({plan.host_source}); {name} take {items[name] / gib:.1f} GiB: {saving} (about "
        f"{largest / 1e9:.1f}B parameters fit as planned; `megatrain plan` lists every item)"
    )


def _check_disk(plan: Plan, config: Config) -> None:
    if not plan.disk_bytes:
        return
    state_dir = Path(config.engine.optimizer_state_dir)
    existing = next(p for p in (state_dir, *state_dir.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if plan.disk_bytes > free:
        raise ConfigError(
            f"the disk tier needs {plan.disk_bytes / 2**30:.1f} GiB in {state_dir} but its disk has "
            f"{free / 2**30:.1f} GiB free; free space, choose another engine.optimizer_state_dir, or set "
            "engine.disk_state_fraction lower"
        )


def _check_gpu(plan: Plan, config: Config, model: ModelConfig) -> None:
    available = plan.gpu_available
    if available is None or plan.gpu_bytes <= available:
        return
    gib = 2**30
    for setting, count, nbytes, what in (
        ("kept_layers", plan.kept_layers, plan.kept_bytes, "of activations"),
        ("held_layers", plan.held_layers, plan.held_bytes, "of weights"),
        ("gpu_updated_layers", plan.gpu_updated_layers, plan.gpu_updated_bytes, "of weights and moments"),
    ):
        if count and plan.gpu_bytes - nbytes <= available:
            raise ConfigError(
                f"engine.{setting}: {count} keeps {nbytes / gib:.1f} GiB {what} on the GPU, more than its "
                f"{available / gib:.1f} GiB leave beside the rest of the step; set engine.{setting}: auto or fewer"
            )
    per_sequence = plan.checkpoint_bytes // config.train.rows_per_step
    on_gpu = plan.checkpoint_bytes * (plan.checkpoint_stages - plan.offloaded_layers) // max(1, plan.checkpoint_stages)
    fixed = plan.gpu_bytes - on_gpu - plan.kept_bytes - plan.held_bytes - plan.gpu_updated_bytes
    largest_batch = max(0, int((available - fixed) // max(1, per_sequence)))
    if largest_batch < config.train.micro_batch_size:  # not even one micro-batch: the layers themselves
        parts = model.is_moe and plan.experts_per_stage != 1
        raise ConfigError(
            f"the step needs {plan.gpu_bytes / gib:.1f} GiB of GPU memory but the GPU has {available / gib:.1f} GiB: "
            f"the largest layer alone takes {fixed / gib:.1f} GiB (two weight slots, its fp32 gradient and one "
            "micro-batch's recompute); lower train.micro_batch_size"
            + (
                f", stream the experts in smaller parts (engine.experts_per_stage below "
                f"{plan.experts_per_stage or model.n_experts})"
                if parts
                else ""
            )
            + " or use a GPU with more memory"
        )
    raise ConfigError(
        f"the step needs {plan.gpu_bytes / gib:.1f} GiB of GPU memory but the GPU has {available / gib:.1f} GiB; "
        f"set engine.offload_checkpoints: true, lower train.micro_batch_size, or use train.batch_size <= {largest_batch}"
    )


BOUND_NAMES = {
    "compute": "GPU compute",
    "pcie": "PCIe (weights in, gradients out)",
    "cpu_optimizer": "the CPU optimizer",
    "disk": "the disk tier's disk",
    "network": "the network between hosts",
}


def _params(count: int) -> str:
    """A parameter count in words: 7.62B, 85.3M."""
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def _tflops(tflops: float) -> str:
    """Whole TFLOPS, or three digits below ten (a CPU's)."""
    return f"{tflops:.0f}" if tflops >= 10 else f"{tflops:.3g}"


def format_plan(plan: Plan, model_name: str) -> str:
    """`megatrain plan`'s report: memory, the placement as a table of layer ranges, the predicted step."""
    active = f" ({_params(plan.active_params)} active per token)" if plan.active_params != plan.n_params else ""
    lines = [
        f"model            {model_name}: {_params(plan.n_params)} parameters{active}",
        _host_line(plan),
        "  host items     "
        + ", ".join(f"{name} {size / 2**30:.1f}" for name, size in plan.host_items.items())
        + " GiB",
        _device_line(plan),
        f"tokens per step  {plan.tokens_per_step:,}{_ranks_clause(plan)}",
        "",
        plan.placement.table(plan.stage_names, "GPU" if plan.gpu_available else "device"),
        *(f"  - {reason}" for reason in plan.placement.why.values()),
        "",
        *_step_lines(plan),
    ]
    return "\n".join(lines)


def _joined(first: str, clauses: list[tuple[object, str]]) -> str:
    """`first`, then the clauses whose condition holds, in order."""
    return first + "".join(text for holds, text in clauses if holds)


def _host_line(plan: Plan) -> str:
    gib = 2**30
    first = f"host memory      {plan.host_bytes / gib:.1f} GiB ({plan.host_bytes_per_param:.2f} B/param)"
    if plan.host_available:
        first += f" of {plan.host_available / gib:.1f} GiB the run may take ({plan.host_source})"
    frozen = ", ".join(plan.frozen_parts) or "unused"
    return _joined(
        first,
        [
            (plan.disk_bytes, f"; {plan.disk_bytes / gib:.1f} GiB of optimizer state on disk"),
            (plan.gradient_pool, f"; gradient pool of {plan.gradient_pool:g} largest groups"),
            (plan.reference_copy, "; with GRPO's KL reference weights"),
            (plan.frozen_params, f"; {_params(plan.frozen_params)} frozen parameters ({frozen}) hold weights only"),
            (
                plan.generation_host_bytes,
                f"; {plan.generation_host_bytes / gib:.1f} GiB of layer copies for streamed generation",
            ),
        ],
    )


def _device_line(plan: Plan) -> str:
    gib = 2**30
    if plan.gpu_available:
        first = f"GPU memory       {plan.gpu_bytes / gib:.1f} GiB of {plan.gpu_available / gib:.1f} GiB free"
    else:
        first = "compute on       the CPU (no GPU): weight slots and activations live in host memory"
    return _joined(
        first,
        [
            (plan.offloaded_layers, f", {plan.offloaded_layers} stages' activation checkpoints in host memory"),
            (plan.kept_layers, f", {plan.kept_layers} layers keep their matmul products (no GEMM recomputed)"),
            (
                plan.host_kept_layers,
                f", {plan.host_kept_layers} more in host memory ({plan.host_kept_bytes / gib:.1f} GiB)",
            ),
            (plan.held_layers, f", {plan.held_layers} layers' weights held from forward to backward"),
            (
                plan.gpu_updated_layers,
                f", {plan.gpu_updated_layers} layers' weights and moments updated on the GPU "
                f"({plan.gpu_updated_bytes / gib:.1f} GiB)",
            ),
            (plan.experts_per_stage, f"; each MoE layer's experts stream in parts of {plan.experts_per_stage}"),
        ],
    )


def _ranks_clause(plan: Plan) -> str:
    if plan.gpus * plan.hosts == 1:
        return ""
    clause = f" over {plan.gpus} GPU(s) x {plan.hosts} host(s)"
    if plan.split_state:
        clause += " splitting the state"
    clause += "; host memory per host, GPU memory per GPU"
    if plan.hosts > 1:
        clause += f"; {plan.network_bytes / 1e9:.1f} GB per host per step between hosts"
    return clause


def _step_lines(plan: Plan) -> list[str]:
    """The predicted step: its time and parts, what bounds it, its throughput and the rates it came from."""
    compute = "GPU" if plan.gpu_available else "compute"
    parts = f"{compute} {plan.compute_s:.2f} s, copies {plan.transfer_s:.2f} s, CPU AdamW {plan.optimizer_s:.2f} s"
    if plan.disk_s:
        parts += f", disk {plan.disk_s:.2f} s"
    if plan.network_s:
        parts += f", network {plan.network_s:.2f} s"
    bound = plan.bound_name
    if plan.bound != "compute":
        bound += f"; compute-bound from about {plan.compute_bound_tokens:,} tokens per step"
    throughput = f"{plan.tokens_per_s:,.0f} tokens/s, {_tflops(plan.model_tflops)} model TFLOPS"
    if plan.reference_tokens_per_s:
        throughput += (
            f"; DPO's reference pass before training (forward only) {plan.reference_tokens_per_s:,.0f} tokens/s"
        )
    rates = plan.rates
    kept = f" (kept {rates.gpu_kept_tflops})" if rates.gpu_kept_tflops else ""
    return [
        f"step time        {plan.step_s:.2f} s  ({parts} overlapped, step-boundary bubble {plan.bubble_s:.2f} s)",
        f"bound by         {bound}",
        f"throughput       {throughput}",
        f"rates            {'GPU' if plan.gpu_available else 'CPU'} blocks {rates.gpu_tflops}{kept} / head "
        f"{rates.head_tflops} TFLOPS, PCIe {rates.pcie_gbps} GB/s, CPU AdamW {rates.cpu_adam_params_per_s / 1e9:.1f} "
        f"G params/s, disk {rates.disk_gbps} GB/s ({rates.source})",
    ]
