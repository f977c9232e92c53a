"""`megatrain plan`'s report: a placement with what it costs (`Plan`), as a run writes it (`placement.json`),
benchmark rows record it and `format_plan` prints it."""

from dataclasses import asdict, dataclass, field

from megatrain_sched import Placement

from .rates import DEFAULT_RATES_SOURCE, Rates, block_rates


@dataclass
class Plan:
    """A placement with what it costs: memory (host bytes per host, GPU bytes per GPU) and the predicted step."""

    placement: Placement
    n_params: int
    active_params: int
    moe: bool  # a mixture of experts: its layers run at the rates' MoE ones
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
    compute_bound_tokens: int = 0  # tokens per step from which the GPU's work is the longest part; 0: not searched
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
    copied_bytes: int = 0  # GPU memory the resident blocks' compute-dtype copies take
    parked_bytes: int = 0  # the parked stages' moments, out of the GPU from their update to the next backward
    gpu_updated_bytes: int = 0  # GPU memory the resident state takes (and, with clipping, their gradients)
    host_kept_bytes: int = 0  # host memory the host-kept products take (in host_bytes)
    stage_names: list[str] = field(default_factory=list)
    reference_tokens_per_s: float = 0.0  # DPO's reference pass, forward only (0: none)
    reference_copy: bool = False  # the store keeps the reference weights GRPO's KL streams (in host_bytes)
    generation_host_bytes: int = 0  # host copies GRPO's streamed generation keeps (in host_bytes)
    frozen_params: int = 0  # an image-text model's frozen parts' parameters: weights only, no gradient or moments
    frozen_parts: tuple[str, ...] = ()  # which (train.freeze_*)
    host_items: dict = field(default_factory=dict)  # every host allocation by name, bytes per host
    largest_params: dict = field(default_factory=dict)  # mode -> the parameters the host's budget holds in it
    host_source: str = ""  # where host_available came from, in words
    process_bytes: int = 0  # the process's resident memory when planned (outside host_bytes)
    packed_cache_bytes: int = 0  # a packed base's bytes, also kept on disk beside the run (output_dir/cache)
    dequantize_s: float = 0.0  # of compute_s: the GPU time a packed base's dequantization takes a step
    shares_cores: bool = False  # the device is the host's CPU: the step's parts take turns (`Machine.shares_cores`)

    @property
    def experts_per_stage(self) -> int:
        """Experts per streamed part of a MoE layer (0: whole layers), as the placement says."""
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

    @property
    def copied_layers(self) -> int:
        """Of those, the blocks whose compute-dtype copy stays on the GPU (never cast)."""
        return len(self.placement.copied)

    @property
    def parked_layers(self) -> int:
        """Resident stages whose moments wait in host memory from their update to the next backward."""
        return len(self.placement.parked)

    def as_dict(self) -> dict:
        """Every field (the placement as its own dict) and the placement's counts, as plain values."""
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
                (self.copied_layers, "of them kept in the compute dtype too"),
                (self.parked_layers, "stages parking their moments in host memory"),
                (self.held_layers, "holding their weights"),
                (self.offloaded_layers, "with checkpoints in host memory"),
                (self.kept_layers, "keeping their products on the GPU"),
                (self.extra_kept_layers, "of them their attention's results too"),
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
            + (f"; predicted {self.step_s:.2f} s a step, bound by {self.bound_name}" if self.predicts_step else "")
        )

    @property
    def predicts_step(self) -> bool:
        """Whether the plan's rates are this machine's: on the CPU (`shares_cores`) the default rates are an H100
        machine's GPU and host, whose step says nothing of a CPU's (unmeasured: engine.measure_rates false, or
        several processes)."""
        return not (self.shares_cores and self.rates.source == DEFAULT_RATES_SOURCE)

    @property
    def bound_name(self) -> str:
        """What bounds the step, in words."""
        return (
            "the CPU's compute (no GPU)"
            if self.bound == "compute" and not self.gpu_available
            else BOUND_NAMES[self.bound]
        )


_COUNTS = ("experts_per_stage", "gradient_pool", "offloaded_layers", "kept_layers", "host_kept_layers")
_COUNTS += ("held_layers", "gpu_updated_layers", "copied_layers", "parked_layers")


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


def format_plan(plan: Plan, model_name: str, refused: bool = False) -> str:
    """`megatrain plan`'s report: memory, the placement as a table of layer ranges, the predicted step (none where
    the checks refuse the plan: it was not timed at this machine's rates, which are measured only for a run that
    can go ahead)."""
    active = f" ({_params(plan.active_params)} active per token)" if plan.active_params != plan.n_params else ""
    lines = [
        f"model            {model_name}: {_params(plan.n_params)} parameters{active}",
        _host_line(plan),
        "  host items     "
        + ", ".join(f"{name} {size / 2**30:.1f}" for name, size in plan.host_items.items())
        + " GiB",
        *_largest_line(plan),
        _device_line(plan),
        f"tokens per step  {plan.tokens_per_step:,}{_ranks_clause(plan)}",
        "",
        plan.placement.table(plan.stage_names, "GPU" if plan.gpu_available else "device"),
        *(f"  - {reason}" for reason in plan.placement.why.values()),
        "",
        *(
            ["step time        not predicted: this machine cannot run the plan (why below)"]
            if refused
            else _step_lines(plan)
            if plan.predicts_step
            else ["step time        not predicted: this CPU's rates are not measured (engine.measure_rates: true)"]
        ),
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
            (
                plan.packed_cache_bytes,
                f"; a run from a checkpoint also keeps the packed base on disk ({plan.packed_cache_bytes / gib:.1f} "
                "GiB in output_dir/cache, where the disk has twice that free)",
            ),
        ],
    )


def _largest_line(plan: Plan) -> list[str]:
    """What the host would train in each mode at this step's size (none where its budget is unknown)."""
    if not plan.largest_params:
        return []
    modes = ", ".join(f"{_params(params)} with {mode}" for mode, params in plan.largest_params.items())
    return [f"  largest model  this host's budget holds about {modes}"]


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
            (
                plan.copied_layers,
                f", {plan.copied_layers} of them kept in the compute dtype too ({plan.copied_bytes / gib:.1f} GiB)",
            ),
            (
                plan.parked_layers,
                f", {plan.parked_layers} stages' moments parked in host memory between update and backward "
                f"({plan.parked_bytes / gib:.1f} GiB)",
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
    dequantizing = f", {plan.dequantize_s:.2f} s of it dequantizing the base" if plan.dequantize_s else ""
    parts = (
        f"{compute} {plan.compute_s:.2f} s{dequantizing}, copies {plan.transfer_s:.2f} s, "
        f"CPU AdamW {plan.optimizer_s:.2f} s"
    )
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
    layer_rate, kept_rate = block_rates(rates, plan.moe)
    kept = f" (kept {kept_rate})" if kept_rate != layer_rate else ""
    blocks = ("GPU" if plan.gpu_available else "CPU") + (" MoE" if plan.moe else "")
    return [
        f"step time        {plan.step_s:.2f} s  ({parts} {'in turn' if plan.shares_cores else 'overlapped'}, "
        f"step-boundary bubble {plan.bubble_s:.2f} s)",
        f"bound by         {bound}",
        f"throughput       {throughput}",
        f"rates            {blocks} blocks {layer_rate}{kept} / head "
        f"{rates.head_tflops} TFLOPS, PCIe {rates.pcie_gbps} GB/s, CPU AdamW {rates.cpu_adam_params_per_s / 1e9:.1f} "
        f"G params/s, disk {rates.disk_gbps} GB/s ({rates.source})",
    ]
