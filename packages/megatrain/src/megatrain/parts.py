"""The Trainer's parts, each made from the config and the model by one function: the host store, the host
optimizer with its update policy, the layer pipeline, the embedding's rows-first update and the MoE routers' step
statistics. The Trainer (`trainer.py`) composes them and runs the steps."""

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from megatrain_optim import (
    STATE_NAMES,
    AdamWConfig,
    EmbeddingRowsFirst,
    HostAdamW,
    HostUpdates,
    Ranks,
    RankSharing,
    RankSync,
    Sharing,
    UpdatesAfterClipping,
    UpdatesAsGradientsLand,
)
from megatrain_sched import Hooks, LayerPipeline, Placement, Stage, Timeline
from megatrain_store import HostStore
from megatrain_templates import Objective
from megatrain_zoo import ModelSpec

from .config import Config, ConfigError, resolve_device, resolve_dtype
from .distributed import shared_arenas


def new_store(
    spec: ModelSpec,
    config: Config,
    placement: Placement,
    plan,  # the planner's costing of `placement`: the first group on disk, whether a reference copy is kept
    frozen: frozenset,
    device: torch.device,
    ranks: Ranks | None,
    training: bool,
) -> HostStore:
    """Host memory for `spec`'s weights in the compute dtype and, `training`, their gradients and optimizer state
    (but for the `frozen` groups'), as placed and planned; shared by the ranks of a host where there are several. A
    packed base (QLoRA) is quantized on `device` where it is a GPU: seconds for a 120B model, not the CPU's minutes."""
    return HostStore(
        [group.layout() for group in spec.groups],
        resolve_dtype(config.precision.compute_dtype, device),
        STATE_NAMES if training else (),
        grad_pool=placement.gradient_pool if training else 1,  # (evaluation lands none)
        state_dir=config.engine.optimizer_state_dir if training else None,
        first_disk_group=plan.first_disk_group,
        wire_copy=config.engine.wire_copy,
        reference_copy=plan.reference_copy,
        # (evaluation keeps no state to leave out, but LoRA's base is still held once in the compute dtype)
        frozen=frozen if training or spec.adapter is not None else frozenset(),
        frozen_in_compute_dtype=spec.adapter is not None,
        packed=spec.packed_groups,
        packed_format=spec.adapter.base_format if spec.adapter is not None else None,
        pack_on=device if device.type == "cuda" else None,
        shared=None if ranks is None else shared_arenas(ranks, config.engine.shared_dir),
        **_shards(ranks),
    )


def _shards(ranks: Ranks | None) -> dict:
    """The store's `shard` (the slice of each group this rank updates) and `owned` (the slices
    its host holds the state of): its host's 1/L, or with split hosts its own 1/N of N ranks."""
    if ranks is None:
        return {}
    if ranks.split_state:
        return {
            "shard": (ranks.rank, ranks.world_size),
            "owned": (ranks.node * ranks.local_world_size, ranks.local_world_size),
        }
    return {"shard": (ranks.local_rank, ranks.local_world_size)}


@dataclass
class Updates:
    """The host optimizer, the worker that runs its updates, and the policy that decides when."""

    optimizer: HostAdamW
    updates: HostUpdates
    policy: UpdatesAfterClipping | UpdatesAsGradientsLand


def new_updates(
    spec: ModelSpec,
    store: HostStore,
    config: Config,
    sync: RankSync | None,
    timeline: Timeline,
    device_span: Callable[[str], AbstractContextManager],
) -> Updates:
    """The updates of `store`'s groups as train configures them; `device_span(name)` times a resident group's
    update on the GPU."""
    train = config.train
    adamw = AdamWConfig(train.lr, train.betas, train.eps, train.weight_decay)
    optimizer = HostAdamW(store, adamw, train.router_bias_update_rate)
    forward_order: dict[int, int] = {}  # where each group is first needed in a forward
    for index, stage in enumerate(spec.stages):
        for group in stage.groups:
            forward_order.setdefault(group, index)
    names = [group.name for group in spec.groups]
    host_groups = [g for g in range(store.n_groups) if g not in store.frozen]
    # (split hosts swap updated weights in one order on every rank: the order each policy updates in, roughly)
    exchange_order = host_groups if train.grad_clip > 0 else host_groups[::-1]
    sharing = Sharing() if sync is None else RankSharing(sync, exchange_order)
    span = lambda name: timeline.host_span(name, "optimizer")  # noqa: E731
    updates = HostUpdates(optimizer, forward_order, names, sharing, span, resolve_device(config.device).type == "cpu")
    if train.grad_clip > 0:
        return Updates(optimizer, updates, UpdatesAfterClipping(updates, train.grad_clip, device_span=device_span))
    return Updates(optimizer, updates, UpdatesAsGradientsLand(updates, device_span=device_span))


def new_pipeline(
    spec: ModelSpec,
    store: HostStore,
    device: torch.device,
    config: Config,
    timeline: Timeline,
    sync: RankSync | None,
    objective: Objective | None,
    updates: Updates | None,
) -> LayerPipeline:
    """The pipeline that streams `spec`'s stages from `store`; training (`updates` given), its gradients land for
    the update policy."""
    hooks = None
    if updates is not None:
        hooks = Hooks(
            before_fetch=updates.updates.wait,
            updates_done=updates.updates.done,
            first_rows=updates.updates.first_rows,
            on_grads_landed=updates.policy.grads_landed,
            on_device_grads=updates.policy.device_grads_made,
            before_cast=updates.policy.before_cast,
            bring_back=updates.policy.bring_back,
            let_go_parked=updates.policy.let_go_parked,
            held_device_bytes=updates.policy.held_device_bytes,
        )
    if config.train.objective == "grpo":  # (its completions' tokens scored at the sampling temperature, as TRL does)
        tempered(spec.stages[-1].template, config.train.grpo.temperature)
    return LayerPipeline(
        [Stage(s.template, s.groups, s.name) for s in spec.stages],
        store,
        device,
        n_slots=config.engine.n_slots,
        timeline=timeline,
        reduce_grad=None if sync is None else sync.reduce_grad,
        objective=objective,
        hooks=hooks,
    )


def tempered(head, temperature: float) -> None:
    """The head's logits divided by `temperature` before their softmax; refused where a soft cap comes first."""
    if temperature != 1.0 and getattr(head, "logit_softcap", None) is not None:
        raise ConfigError(
            f"train.grpo.temperature {temperature} on soft-capped logits (Gemma 2's) is not built; set 1.0"
        )
    head.temperature = temperature


def rows_first(
    spec: ModelSpec,
    store: HostStore,
    placement: Placement,
    updates: HostUpdates,
    ranks: Ranks | None,
    device: torch.device,
) -> EmbeddingRowsFirst | None:
    """The embedding's rows updated and sent first, where its table streams from this process's store
    (not with ranks: each updates a slice of every row; nor a wire copy, or the table's state on disk; nor a frozen
    table, which is never updated)."""
    first = spec.stages[0]
    eligible = (
        first.template.forward_rows is not None
        and len(first.groups) == 1
        and first.groups[0] not in store.frozen
        and ranks is None
        and "wire" not in store.arenas
        and first.groups[0] < store.first_disk_group
        and 0 not in placement.resident
    )
    if not eligible:
        return None
    if updates.rows_first is not None:
        return updates.rows_first
    d_model = first.template.d_model
    # pinned: the updated rows on their way to the GPU, up to a quarter of the table (beyond, it would not pay)
    rows_out = torch.empty(
        (store.layouts[first.groups[0]].numel // 4 // d_model, d_model),
        dtype=store.master_dtype,
        pin_memory=device.type == "cuda",
    )
    return EmbeddingRowsFirst(updates, first.groups[0], rows_out)


def route_statistics(router_load, config: Config, sync: RankSync | None) -> None:
    """The MoE routers' step-level statistics: their loss weights, the global batch, every rank's routing."""
    train = config.train
    router_load.seq_coef = train.router_seq_aux_loss_coef
    router_load.z_coef = train.router_z_loss_coef
    router_load.sequences = train.batch_size  # over all ranks
    if sync is not None:
        router_load.reduce = sync.all_reduce  # routing statistics of the global batch


def with_router_terms(loss: float, router_load) -> tuple[float, tuple]:
    """A step's `loss` with the routers' terms added, and their (aux loss, max violation, sequence aux loss,
    z-loss); None each where the model routes nothing (no `router_load`)."""
    if router_load is None:
        return loss, (None,) * 4
    aux = router_load.loss().item()
    loss += router_load.coef * aux
    violation = router_load.max_violation().item()
    sequence_aux = z = None
    if router_load.seq_coef:
        sequence_aux = router_load.sequence_loss().item()
        loss += router_load.seq_coef * sequence_aux
    if router_load.z_coef:
        z = router_load.z_loss().item()
        loss += router_load.z_coef * z
    return loss, (aux, violation, sequence_aux, z)
