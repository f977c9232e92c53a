"""The checks a training plan passes before anything is allocated, each refusal one line naming the fix."""

import shutil
from pathlib import Path

from megatrain_store.progress import size_text
from megatrain_store.rundir import check_state_dir
from megatrain_zoo import ModelConfig, ModelSpec

from .costs import gpu_updated_groups, whole_step_statistics
from .errors import PlanError
from .host_items import PER_PARAMETER_ITEMS
from .report import Plan, _params
from .search import Planner, parkable_stages


def check_plan(plan: Plan, planner: Planner) -> None:
    """Refuse, before anything is allocated, a run that `planner` planned (`plan`) and that cannot work, naming
    the fix (`PlanError`)."""
    _check_engine_counts(plan, planner)
    _check_seq_len(planner.model, planner.shape.seq_len)
    _check_resident(plan, planner.spec)
    _check_sweeps(plan, planner)
    _check_host(plan, planner.model, planner.spec.adapter)
    _check_disk(plan, planner.engine.optimizer_state_dir)
    _check_gpu(plan, planner)


def _check_engine_counts(plan: Plan, planner: Planner) -> None:
    """Refuse an `engine.*` count beyond what the model or the step has (the planner would take fewer without a
    word), and a gradient pool where every gradient is held to the step's end."""
    engine = planner.engine
    limits = {
        "kept_layers": (planner.keepable, "layers that can keep their matmul products"),
        "host_kept_layers": (planner.keepable, "layers that can keep their matmul products"),
        "held_layers": (len(planner.holdable), "blocks that can hold their weights"),
        "gpu_updated_layers": (len(planner.blocks), "blocks"),
        "copied_layers": (plan.gpu_updated_layers, "blocks updated on the GPU"),
        "parked_layers": (len(parkable_stages(planner.spec, plan.placement.resident)), "stages that can park moments"),
        "sweeps": (
            planner.shape.micro_batches(planner.step_tokens),
            "micro-batches a step (train.batch_size / train.micro_batch_size)",
        ),
        "n_slots": (planner.n_stages, "stages to stream"),
    }
    for name, (most, what) in limits.items():
        setting = getattr(engine, name)
        if setting != "auto" and setting > most:
            auto = "" if name == "n_slots" else ", or auto"  # (the one count the planner does not choose)
            raise PlanError(f"engine.{name} {setting}: this run has {most} {what}; set at most {most}{auto}")
    if engine.gradient_pool != "auto" and plan.placement.gradient_pool is None:
        raise PlanError(
            f"engine.gradient_pool {engine.gradient_pool}: with clipping (train.grad_clip) or a step in sweeps every "
            "gradient is held to the step's end, so there is no landing pool to size; leave it auto"
        )


def _check_seq_len(model: ModelConfig, seq_len: int) -> None:
    if seq_len > model.max_seq_len:
        raise PlanError(
            f"data.seq_len {seq_len} is larger than the model allows (max_position_embeddings "
            f"{model.max_seq_len}); lower data.seq_len"
        )


def _check_resident(plan: Plan, spec: ModelSpec) -> None:
    if not plan.gpu_updated_layers:
        return
    if plan.gpus * plan.hosts > 1:
        raise PlanError(
            f"engine.gpu_updated_layers: {plan.gpu_updated_layers} needs one process holding all of the state; "
            f"with {plan.gpus * plan.hosts} GPUs set engine.gpu_updated_layers: 0 (or auto)"
        )
    on_gpu = gpu_updated_groups(spec, plan.gpu_updated_layers)
    if max(on_gpu) >= plan.first_disk_group:
        raise PlanError(
            f"engine.gpu_updated_layers: {plan.gpu_updated_layers} reaches the layers whose optimizer state is on "
            "disk (engine.optimizer_state_dir); set engine.gpu_updated_layers: auto or fewer"
        )


def _check_sweeps(plan: Plan, planner: Planner) -> None:
    statistics = whole_step_statistics(planner.model, planner.shape)
    if plan.placement.sweeps > 1 and statistics:
        raise PlanError(
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
    "offloaded checkpoints": "fewer tokens a step (train.batch_size, data.seq_len), or a GPU with room for them",
    "host-kept products": "engine.host_kept_layers: 0",
    "runtime": "fewer tokens a micro-batch or a step (train.micro_batch_size, train.batch_size)",
}


# Host items no setting of this run's saves alone (their savings name another machine or a smaller step).
UNSAVED = ("master weights", "runtime", "offloaded checkpoints")


# What several hosts split with engine.shard_across_hosts (each holds its part).
SPLIT_BY_HOSTS = ("master weights", "optimizer moments", "gradients held for clipping")


# what sets each mode of `Plan.largest_params` (its name up to " base")
MODE_SETTINGS = {
    "full training": "no model.adapter",
    "LoRA over a": "model.adapter: {type: lora}",
    "LoRA over an int8": "model.adapter: {type: lora, base_dtype: int8}",
    "LoRA over an nf4": "model.adapter: {type: lora, base_dtype: nf4}",
}


# a LoRA base's formats (`Lora.base_format`) in the order of `Plan.largest_params`' LoRA modes, after full training
BASE_MODES = (None, "int8", "nf4")


def _check_host(plan: Plan, model: ModelConfig, adapter) -> None:
    """Refuse a plan whose host allocations pass what the run may take, naming its largest item and what saves
    it (a choice that costs host memory first, where dropping it alone would fit); or, where the step's own items
    alone pass it, saying that no saving of the model's state helps."""
    if plan.host_available is None or plan.host_bytes <= plan.host_available:
        return
    items, gib = plan.host_items, 2**30
    needs = f"host memory: {model.arch} with {_params(plan.n_params)} parameters needs {plan.host_bytes / gib:.1f} GiB"
    may_take = f"this run may take {plan.host_available / gib:.1f} GiB ({plan.host_source})"
    if adapter is not None and adapter.r > model.d_model:  # (no other saving is near enough)
        raise PlanError(
            f"{needs} but {may_take}; LoRA's rank r={adapter.r} is past the model's hidden size {model.d_model}, "
            f"and its adapters' master weights alone take {items.get('master weights', 0) / gib:.1f} GiB: a smaller "
            "model.adapter.r (`megatrain plan` lists every item)"
        )
    optional = [name for name in items if name.startswith(("host-kept", "gradients held across"))]
    required = {name: nbytes for name, nbytes in _step_own(items).items() if name not in optional}
    if sum(required.values()) >= plan.host_available:
        # (on the CPU the step's activations are host memory: the runtime item grows with the step's tokens)
        step = "a smaller train.batch_size or data.seq_len, " if plan.gpu_available is None else ""
        raise PlanError(
            f"{needs} but {may_take}, and its step's own items ({', '.join(required)}) alone take "
            f"{sum(required.values()) / gib:.1f} GiB: {step}a smaller model or a host with more memory (`megatrain "
            "plan` lists every item)"
        )
    over = plan.host_bytes - plan.host_available
    name = next((n for n in optional if items[n] >= over), max(items, key=items.get))
    saving = next((fix for start, fix in HOST_SAVINGS.items() if name.startswith(start)), "a smaller model")
    if plan.hosts > 1 and not plan.split_state and name in SPLIT_BY_HOSTS:
        saving = f"engine.shard_across_hosts: true splits the state over the {plan.hosts} hosts"
    # (the modes that hold less than the configured one: `largest_params` lists them from the most bytes down)
    configured = 0 if adapter is None else 1 + BASE_MODES.index(adapter.base_format)
    lighter = list(plan.largest_params.items())[configured + 1 :]
    fits = next((mode for mode, params in lighter if params >= plan.n_params), None)
    take = "take" if name.endswith("s") else "takes"  # (moments take, the runtime takes)
    # another item whose saving alone would fit (70B on 1 TiB: the moments named, the held gradients enough too)
    others = [n for n in sorted(items, key=items.get, reverse=True) if n not in (name, *UNSAVED) and items[n] >= over]
    other = others[0] if others else None
    also = next((fix for start, fix in HOST_SAVINGS.items() if other and other.startswith(start)), None)
    raise PlanError(
        f"{needs} ({plan.host_bytes_per_param:.1f} B/param) but {may_take}; {name} {take} {items[name] / gib:.1f} GiB: "
        f"{saving} ({_what_fits(plan, name if name in optional else None)}; `megatrain plan` lists every item)"
        + (f"; or {also} ({other}, {items[other] / gib:.1f} GiB)" if also else "")
        + (f"; it fits with {fits} ({MODE_SETTINGS[fits.split(' base')[0]]})" if fits else "")
    )


def _what_fits(plan: Plan, dropped: str | None = None) -> str:
    """How many parameters the run's budget holds as planned: beside the step's own host items (the runtime's, the
    buffers'), at the plan's bytes a parameter, as the report's "largest model" line counts them; without the
    `dropped` item where the refusal's fix is to drop it (host-kept products beside which no model fits)."""
    items = {name: nbytes for name, nbytes in plan.host_items.items() if name != dropped}
    step_own = sum(_step_own(items).values())
    per_parameter = sum(items.values()) - step_own
    fitting = (plan.host_available - step_own) / (per_parameter / plan.n_params)
    return f"about {_params(fitting)} parameters fit " + ("without them" if dropped else "as planned")


def _step_own(items: dict[str, int]) -> dict[str, int]:
    """The host items that do not grow with the model's parameters (`host_items.PER_PARAMETER_ITEMS`)."""
    return {name: nbytes for name, nbytes in items.items() if not name.startswith(PER_PARAMETER_ITEMS)}


def _check_disk(plan: Plan, optimizer_state_dir: str | None) -> None:
    if not plan.disk_bytes:
        return
    state_dir = Path(optimizer_state_dir)
    check_state_dir(state_dir)  # (one that cannot be written has no free space either: say which it is)
    free = shutil.disk_usage(state_dir).free
    if plan.disk_bytes > free:
        raise PlanError(
            f"the disk tier needs {size_text(plan.disk_bytes)} in {state_dir} but its disk has "
            f"{size_text(free)} free; free space, choose another engine.optimizer_state_dir, or set "
            "engine.disk_state_fraction lower"
        )


def _check_gpu(plan: Plan, planner: Planner) -> None:
    model, shape = planner.model, planner.shape
    available = plan.gpu_available
    if available is None or plan.gpu_bytes <= available:
        return
    gib = 2**30
    for setting, count, nbytes, what in (
        ("kept_layers", plan.kept_layers, plan.kept_bytes, "of activations"),
        ("held_layers", plan.held_layers, plan.held_bytes, "of weights"),
        ("copied_layers", plan.copied_layers, plan.copied_bytes, "of weights in the compute dtype"),
        ("gpu_updated_layers", plan.gpu_updated_layers, plan.gpu_updated_bytes, "of weights and moments"),
    ):
        if count and plan.gpu_bytes - nbytes <= available:
            raise PlanError(
                f"engine.{setting}: {count} keeps {nbytes / gib:.1f} GiB {what} on the GPU, more than its "
                f"{available / gib:.1f} GiB leave beside the rest of the step; set engine.{setting}: auto or fewer"
            )
    per_sequence = plan.checkpoint_bytes // shape.rows_per_step
    on_gpu = plan.checkpoint_bytes * (plan.checkpoint_stages - plan.offloaded_layers) // max(1, plan.checkpoint_stages)
    fixed = plan.gpu_bytes - on_gpu - plan.kept_bytes - plan.held_bytes - plan.gpu_updated_bytes
    largest_batch = max(0, int((available - fixed) // max(1, per_sequence)))
    if largest_batch < shape.micro_batch:  # not even one micro-batch: the layers themselves
        parts = model.is_moe and plan.experts_per_stage != 1
        gradient = "its adapters' fp32 gradient" if planner.adapter else "its fp32 gradient"
        raise PlanError(
            f"the step needs {plan.gpu_bytes / gib:.1f} GiB of GPU memory but the GPU has {available / gib:.1f} GiB: "
            f"the largest layer alone takes {fixed / gib:.1f} GiB (two weight slots, {gradient} and one "
            "micro-batch's recompute); lower train.micro_batch_size"
            + (
                f", stream the experts in smaller parts (engine.experts_per_stage below "
                f"{plan.experts_per_stage or model.n_experts})"
                if parts
                else ""
            )
            + " or use a GPU with more memory"
        )
    raise PlanError(
        f"the step needs {plan.gpu_bytes / gib:.1f} GiB of GPU memory but the GPU has {available / gib:.1f} GiB; "
        f"set engine.offload_checkpoints: true, lower train.micro_batch_size, or use train.batch_size <= {largest_batch}"
    )
