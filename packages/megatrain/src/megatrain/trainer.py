"""The Trainer: a thin loop that composes store, optimizer, scheduler, templates and zoo.

One step: the pipeline runs forward + backward layer-major and lands each group's fp32
gradient in host memory. Two update policies, both equal to a synchronous AdamW step:

- clipping on (train.grad_clip > 0): every gradient is kept until the global norm is
  known after the last layer; the clip coefficient is then fixed and group updates are
  queued in layer order, overlapping the next step's forward (which waits for each
  layer's update just before copying it in). A non-finite norm or loss skips the step.
- clipping off: each group is updated by the optimizer worker as soon as its gradient
  lands, overlapping the rest of the backward, and gradients land in a small pool of
  buffers instead of a full fp32 copy of the model (4 bytes per parameter less). A
  group whose gradient is non-finite is not updated and the step is reported skipped.
  Where the optimizer is slower than the backward (small steps), the worker takes the
  landed gradient the next forward needs first, so that forward starts while it still
  updates the last layers (the planner deepens the pool to hold what waits).

Where small steps leave the CPU optimizer slower than the GPU, the first blocks' masters and
moments live on the GPU (`engine.gpu_updated_layers`, `DeviceAdamW`) and are updated there under
the same policy: as their gradient is made, or once the clip coefficient is known.
"""

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain_optim import (
    STATE_NAMES,
    AdamWConfig,
    BackgroundStepper,
    DeviceAdamW,
    HostAdamW,
    Schedule,
    clip_coefficient,
    lr_at,
)
from megatrain_sched import LayerPipeline, MicroBatch, Stage, Timeline, synchronize
from megatrain_store import GroupLayout, HostStore
from megatrain_templates import Documents
from megatrain_zoo import CORRECTION_BIASED, ModelConfig, build_model, flops_per_token, init_param_

from .config import Config, ConfigError, model_config_of, resolve_device, resolve_dtype
from .distributed import Ranks, RankSync, check_data_parallel, init_ranks, launch_shape, leave_ranks, shared_arenas
from .hf_io import WholeGroups, check_hf_weights, export_hf, load_hf_weights, named_masters
from .plan import check_plan, gpu_updated_groups, make_plan, run_rates

# Groups whose disk-tier optimizer state is read ahead of the update that needs it: two keep
# the disk busy while one group's read would otherwise wait for the previous update.
DISK_READ_AHEAD = 2


def _finite(sq_norm: torch.Tensor | None) -> bool:
    """Whether a landed gradient may be applied: its squared norm is finite (None: not checked per group)."""
    return sq_norm is None or math.isfinite(float(sq_norm))


class NonFiniteError(RuntimeError):
    """Training produced non-finite losses or gradients several steps in a row."""


@dataclass
class StepMetrics:
    step: int
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    step_time_s: float
    tokens_per_s: float
    tflops: float
    skipped: bool
    router_aux_loss: float | None = None  # MoE: the load-balancing loss (in `loss` only when the model adds it)
    # MoE: the worst layer's max expert load / mean load - 1 (DeepSeek-V3's MaxVio; 0: perfectly even)
    router_max_violation: float | None = None
    router_seq_aux_loss: float | None = None  # MoE: the sequence-wise balance loss, where on (in `loss`)
    router_z_loss: float | None = None  # MoE: the router z-loss, where on (in `loss`)

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items() if v is not None}


class Trainer:
    """Owns the host store, optimizer, background stepper and pipeline for one model.

    `training=False` keeps only the weights in host memory (no gradients to hold, no optimizer
    state): for `evaluate` alone."""

    def __init__(
        self,
        config: Config,
        model_config: ModelConfig | None = None,
        training: bool = True,
        ranks: Ranks | None = None,
    ):
        self.config = config
        self.device = resolve_device(config.device)
        self.compute_dtype = resolve_dtype(config.precision.compute_dtype, self.device)
        self.model_config = model_config or model_config_of(config)
        if config.train.router_bias_update_rate and not self.model_config.router_bias:
            raise ConfigError(
                f"train.router_bias_update_rate moves a router's correction bias, which only some families' routers "
                f"have ({', '.join(CORRECTION_BIASED)}); this {self.model_config.arch} model has none: set it "
                f"to 0 (its balance comes from the load-balancing loss, router_aux_loss_coef)"
            )
        for name in ("router_seq_aux_loss_coef", "router_z_loss_coef"):
            if getattr(config.train, name) and not self.model_config.is_moe:
                raise ConfigError(
                    f"train.{name} acts on a mixture of experts' routers; this {self.model_config.arch} model has "
                    "none: set it to 0"
                )
        gpus, hosts = launch_shape()
        # (what the engine uses of it: kept, held and GPU-updated layers, the gradient pool, the disk tier)
        rates = run_rates(config, self.model_config, measure=training and gpus * hosts == 1)
        self.plan = plan = make_plan(config, self.model_config, rates, gpus=gpus, hosts=hosts)  # each GPU: its share
        if training:
            check_plan(plan, config, self.model_config)
        self.spec = build_model(self.model_config, plan.experts_per_stage)
        if config.model.hf_dir is not None:
            check_hf_weights(self.spec, Path(config.model.hf_dir))
        layouts = [
            GroupLayout.from_specs((p.name, p.shape, p.weight_decay, p.update) for p in g.params)
            for g in self.spec.groups
        ]
        self.eager_updates = config.train.grad_clip == 0
        pool = (plan.gradient_pool if self.eager_updates else None) if training else 1  # evaluation lands none
        # the process group, where the caller has not joined it already (to read the data first)
        self.ranks = ranks or init_ranks(self.device.type, config.engine.shard_across_hosts)
        if self.ranks is not None:
            check_data_parallel(config, self.ranks)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.ranks.local_rank)
                torch.cuda.set_device(self.device)
        self.store = HostStore(
            layouts,
            self.compute_dtype,
            STATE_NAMES if training else (),
            grad_pool=pool,
            state_dir=config.engine.optimizer_state_dir if training else None,
            first_disk_group=plan.first_disk_group,
            wire_copy=config.engine.wire_copy,
            shared=None if self.ranks is None else shared_arenas(self.ranks),
            **self._shards(),
        )
        self.sync = None if self.ranks is None else RankSync(self.ranks, self.store, self.device)
        if self.ranks is None or self.ranks.is_local_main:  # one copy of the weights per host
            self._init_weights()
        if self.ranks is not None:
            self.sync.barrier()  # every rank has mapped the shared arenas and sees the weights
            if self.ranks.is_local_main:
                self.store.shared.unlink()
        train = config.train
        adamw = AdamWConfig(train.lr, train.betas, train.eps, train.weight_decay)
        self.optimizer = HostAdamW(self.store, adamw, train.router_bias_update_rate) if training else None
        # the first blocks' (and the embedding's, tied or not) masters and moments on the GPU, updated there
        on_device = gpu_updated_groups(self.spec, plan.gpu_updated_layers)
        self.device_optimizer = DeviceAdamW(self.optimizer, on_device, self.device) if training and on_device else None
        self._device_state_loaded = False  # loaded from the store by the first step (after any write to it)
        self.schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
        self.stepper = BackgroundStepper()
        # split state: updated weights go to the other hosts from a thread of their own, in update order,
        # so the optimizer moves on to the next group while the network carries the last one
        self.exchanger = BackgroundStepper(enabled=self.store_is_split)
        self.timeline = Timeline(enabled=config.engine.trace)
        self.pipeline = LayerPipeline(
            [Stage(s.template, s.groups, s.name) for s in self.spec.stages],
            self.store,
            self.device,
            n_slots=config.engine.n_slots,
            offload_checkpoints=None
            if config.engine.offload_checkpoints == "auto"
            else config.engine.offload_checkpoints,
            # as many as the plan does at most: it knows the host's room, and that a small step's PCIe has none
            offload_for_products=plan.offloaded_layers,
            kept_layers=None if config.engine.kept_layers == "auto" else config.engine.kept_layers,
            host_kept_layers=plan.host_kept_layers if training else 0,
            held_layers=plan.held_layers if training else 0,
            device_masters=None if self.device_optimizer is None else self.device_optimizer.masters,
            on_device_grads=self._device_grads_made,
            before_fetch=self._wait_for_updates,
            updates_done=self._updates_done,
            first_rows=self._first_rows,
            on_grads_landed=self._grads_landed,
            timeline=self.timeline,
            reduce_grad=None if self.sync is None else self.sync.reduce_grad,
        )
        if self.spec.router_load is not None:
            self.spec.router_load.seq_coef = train.router_seq_aux_loss_coef
            self.spec.router_load.z_coef = train.router_z_loss_coef
            self.spec.router_load.sequences = train.batch_size  # over all ranks
            if self.sync is not None:
                self.spec.router_load.reduce = self.sync.all_reduce  # routing statistics of the global batch
        # where each group is first needed in a forward: the optimizer worker's order when it lags behind
        self._forward_order = {}
        for index, stage in enumerate(self.spec.stages):
            for group in stage.groups:
                self._forward_order.setdefault(group, index)
        # The first stage's table (the embedding) is the last gradient of a step and the first weights of the
        # next: its update waits here until the next step says which rows it reads, which are then updated,
        # and sent, first (`_first_rows`). Not with ranks (each updates a slice of every row), a wire copy or
        # the table's state on disk.
        first = self.spec.stages[0]
        eligible = (
            training
            and hasattr(first.template, "forward_rows")
            and len(first.groups) == 1
            and self.ranks is None
            and "wire" not in self.store.arenas
            and first.groups[0] < self.store.first_disk_group
            and self.device_optimizer is None
        )
        self._row_group = first.groups[0] if eligible else None
        self._deferred: dict[int, tuple] = {}  # group -> its update's arguments, held for `_first_rows`
        # pinned: the updated rows on their way to the GPU, up to a quarter of the table (beyond that, updating
        # them first would not pay); updates are held only where a step's tokens cannot read more
        self._rows_out = None
        if eligible:
            d_model = first.template.d_model
            self._rows_out = torch.empty(
                (self.store.layouts[first.groups[0]].numel // 4 // d_model, d_model),
                dtype=self.store.master_dtype,
                pin_memory=self.device.type == "cuda",
            )
        self._tokens_per_step = 0  # this rank's, of the last step: the next is expected to be alike
        self.step_index = 0
        self.bad_steps = 0
        self._landed: dict[int, object] = {}
        self._lr = 0.0
        # torch.compile's kernels are built here (setup) rather than inside the first step, which would
        # otherwise take tens of seconds longer than the rest
        self.warm_up_s = self.warm_up() if training and self.device.type == "cuda" else 0.0

    def _shards(self) -> dict:
        """The store's `shard` (the slice of each group this rank updates) and `owned` (the slices
        its host holds the state of): its host's 1/L, or with split hosts its own 1/N of N ranks."""
        ranks = self.ranks
        if ranks is None:
            return {}
        if ranks.split_state:
            return {
                "shard": (ranks.rank, ranks.world_size),
                "owned": (ranks.node * ranks.local_world_size, ranks.local_world_size),
            }
        return {"shard": (ranks.local_rank, ranks.local_world_size)}

    @property
    def store_is_split(self) -> bool:
        """The hosts split the master weights and optimizer state (each holds its part)."""
        return self.ranks is not None and self.ranks.split_state

    def _init_weights(self) -> None:
        if self.config.model.hf_dir is not None:
            load_hf_weights(self.store, self.spec, Path(self.config.model.hf_dir))
            return
        for group in range(self.store.n_groups):  # every host draws every group: the same weights as one process
            with self.store.writing(group) as views:
                for name, view in views.items():
                    init_param_(name, view, self.model_config, self.config.train.seed)

    # ------------------------------------------------------------ engine hooks
    def _wait_for_updates(self, groups: tuple[int, ...]) -> None:
        for group in groups:
            self._submit_deferred(group)
            self.stepper.wait(group)
            self.exchanger.wait(group)
        if self.sync is not None:  # and for the other ranks of this host, which update other shards
            self.sync.wait_applied(groups, self.step_index)

    def _updates_done(self, groups: tuple[int, ...]) -> bool:
        """Whether `_wait_for_updates(groups)` would return at once."""
        if any(g in self._deferred or self.stepper.busy(g) or self.exchanger.busy(g) for g in groups):
            return False
        return self.sync is None or self.sync.applied(groups, self.step_index)

    def _grads_landed(self, group: int, event, sq_norm: torch.Tensor) -> None:
        if self.eager_updates:  # (the next step may begin before this update runs: its lr and count are kept)
            self._queue_update(group, self._lr, 1.0, event, self.optimizer.step_tensor, self.step_index + 1, sq_norm)
        else:
            self._landed[group] = event

    def _device_grads_made(self, group: int, grad: torch.Tensor, sq_norm: torch.Tensor) -> None:
        """A GPU-updated group's gradient (on the device): updated now, on the compute stream, or with
        clipping kept there until the coefficient is known."""
        if self.eager_updates:
            with self.timeline.device_span(
                f"adamw {self.spec.groups[group].name}", "compute", self.pipeline.streams, self.pipeline.streams.compute
            ):
                self.device_optimizer.update(group, grad, self._lr, 1.0, self.optimizer.step_tensor, sq_norm)
        else:
            self._landed[group] = grad

    def _queue_update(
        self, group: int, lr: float, clip: float, landed, step, applied: int, sq_norm=None, hold: bool = True
    ) -> None:
        """Give the optimizer worker `group`'s update, or hold it for `_first_rows` (the first stage's table)."""
        if hold and group == self._row_group and self._tokens_per_step <= len(self._rows_out):
            self._deferred[group] = (lr, clip, landed, step, applied, sq_norm)
            return
        self.stepper.submit(
            group,
            lambda: self._update(group, lr, clip, landed, step, applied, sq_norm),
            priority=(applied, self._forward_order[group]),  # what the next forward needs first
            ready=None if landed is None else landed.query,
        )

    def _submit_deferred(self, group: int) -> None:
        """A held update, queued as it is (whole), where something needs it before the next step's rows."""
        if group in self._deferred:
            self._queue_update(group, *self._deferred.pop(group), hold=False)

    def _first_rows(self, group: int, rows: torch.Tensor) -> torch.Tensor | None:
        """The first stage's table's `rows` (sorted unique indices) as this step's forward reads them, updated
        before the rest of the table (whose update then runs beside the forward), in pinned memory: a
        [len(rows), row] tensor, valid until the next step. None where no update is held (or too many rows
        for it to pay): the pipeline copies the whole table."""
        if group not in self._deferred or len(rows) > len(self._rows_out):
            return None
        lr, clip, landed, step, applied, sq_norm = self._deferred.pop(group)
        out = self._rows_out[: len(rows)]

        def rows_first():
            synchronize(landed)
            with self.timeline.host_span(f"adamw {self.spec.groups[group].name} rows", "optimizer"):
                if _finite(sq_norm):
                    self.optimizer.update_rows(group, rows, out, lr, clip, step)
                else:  # not updated, as `_update` will not update the rest
                    torch.index_select(self.store.master(group).view(-1, out.shape[1]), 0, rows, out=out)

        def the_rest():
            self._update(group, lr, clip, None, step, applied, sq_norm)
            if _finite(sq_norm):
                self.optimizer.write_rows(group, rows, out)

        # the rows before anything else; the rest after the updates this step's forward waits for and before
        # those of its own gradients (the tied head of the forward, or the table's backward, waits for it)
        rows_done = self.stepper.submit(group, rows_first, priority=(applied, -1))
        self.stepper.submit(group, the_rest, priority=(applied, len(self.spec.stages)))
        rows_done.result()
        return out

    def _update(
        self,
        group: int,
        lr: float,
        clip: float,
        landed,
        step: torch.Tensor,
        applied: int,
        sq_norm: torch.Tensor | None = None,
    ) -> None:
        """Runs on the optimizer worker: wait for the gradient to land, update, free the buffer."""
        synchronize(landed)
        self._read_ahead(group, 1)
        if _finite(sq_norm):
            with self.timeline.host_span(f"adamw {self.spec.groups[group].name}", "optimizer"):
                self.optimizer.update_group(group, lr, clip, step)
        self.store.write_behind_state(group)
        self.store.release_grad(group)
        self._share_update(group, applied)

    def _share_update(self, group: int, applied: int) -> None:
        """Mark `group` as holding `applied` optimizer steps in this rank's shard; where the hosts split
        the state, once the other hosts' updated slices have arrived (skipped or not, every host's rank
        takes part in each exchange)."""
        if not self.store_is_split:
            self._mark_applied(group, applied)
            return

        def exchange():
            self.sync.exchange_updated_weights(group)
            self._mark_applied(group, applied)

        self.exchanger.submit(group, exchange)

    def _read_ahead(self, group: int, first: int) -> None:
        """Start reading the disk-tier state of the groups updated `first` .. DISK_READ_AHEAD after `group`
        (updates run backward with eager updates, forward otherwise)."""
        direction = -1 if self.eager_updates else 1
        for ahead in range(first, DISK_READ_AHEAD + 1):
            if 0 <= group + direction * ahead < self.store.n_groups:
                self.store.prefetch_state(group + direction * ahead)

    def warm_up(self) -> float:
        """Seconds to run a step's forward and backward once on random tokens, each micro-batch shape of a
        configured batch once, gradients dropped, and the step's pinned host memory taken (`LayerPipeline.warm_up`);
        the weights are only read.
        Fine-tuning rows come as the data will bring them (padding marked, packed documents' positions
        restarting), so the attention kernels they take are built too."""
        start = time.perf_counter()
        train, data = self.config.train, self.config.data
        tokens = torch.randint(
            0, self.model_config.vocab_size, (train.batch_size, data.seq_len), generator=torch.Generator()
        )
        valid = positions = None
        if data.dataset is not None:
            valid = torch.ones_like(tokens, dtype=torch.bool)
            if data.pack:  # two documents a row
                positions = (torch.arange(data.seq_len) % max(1, data.seq_len // 2)).expand_as(tokens).contiguous()
        step = self._micro_batches(tokens, tokens, positions, valid, self._my_rows(train.batch_size))
        shapes = {}
        for micro in step:
            shapes.setdefault(micro.input_ids.shape, micro)
        if shapes:
            self.pipeline.warm_up(list(shapes.values()), step)
        return time.perf_counter() - start

    # ------------------------------------------------------------------- step
    def _micro_batches(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        valid: torch.Tensor | None,
        rows: slice,
    ) -> list[MicroBatch]:
        """This rank's `rows` of a batch in micro-batches of train.micro_batch_size rows (the last may be short)."""
        size = self.config.train.micro_batch_size
        micro = []
        for start in range(rows.start, rows.stop, size):
            part = slice(start, min(start + size, rows.stop))
            documents = None
            if position_ids is not None or valid is not None:
                documents = Documents(*(None if t is None else t[part] for t in (position_ids, valid)))
            micro.append(MicroBatch(input_ids[part], labels[part], documents))
        return micro

    def _my_rows(self, n_rows: int) -> slice:
        """The rows of a batch this rank runs: all of them, or its contiguous share with several ranks."""
        if self.ranks is None:
            return slice(0, n_rows)
        bounds = [n_rows * r // self.ranks.world_size for r in range(self.ranks.world_size + 1)]
        return slice(bounds[self.ranks.rank], bounds[self.ranks.rank + 1])

    def train_step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> StepMetrics:
        """One optimizer step on a batch ([batch, seq] int64 each; labels -100 = no loss; position ids
        restarting at 0 where each packed document begins, or None for one sequence per row; `valid`
        False for padding tokens, which MoE routing statistics leave out, or None).

        With several ranks every rank is given the same global batch and runs its own rows of it:
        the step's result does not depend on the number of ranks."""
        start = time.perf_counter()
        self._load_device_state()
        n_targets = int((labels != -100).sum())
        if n_targets == 0:
            raise ConfigError("a batch has no target tokens (every label is -100); check the data and loss mask")
        tokens = input_ids.numel()
        seq_len = input_ids.shape[1]
        micro = self._micro_batches(input_ids, labels, position_ids, valid, self._my_rows(input_ids.shape[0]))
        self._tokens_per_step = sum(mb.input_ids.numel() for mb in micro)
        train = self.config.train
        lr = self._lr = lr_at(self.step_index, self.schedule)
        if self.eager_updates:
            self.optimizer.begin_step()
            self._read_ahead(self.store.n_groups - 1, 0)  # the head updates first, after the forward
        router_load = self.spec.router_load
        if router_load is not None:
            router_load.reset()
        result = self.pipeline.run(micro, loss_scale=1.0 / n_targets)
        loss_sum, sq_norms = result.loss_sum, result.group_sq_norms
        if self.sync is not None:
            loss_sum = self.sync.all_reduce(loss_sum)
            sq_norms = self.sync.sum_over_shards(sq_norms)
        loss = loss_sum.item() / n_targets
        aux = violation = sequence_aux = z = None
        if router_load is not None:
            aux = router_load.loss().item()
            loss += router_load.coef * aux  # what transformers reports as the loss, aux term included
            violation = router_load.max_violation().item()
            if router_load.seq_coef:
                sequence_aux = router_load.sequence_loss().item()
                loss += router_load.seq_coef * sequence_aux
            if router_load.z_coef:
                z = router_load.z_loss().item()
                loss += router_load.z_coef * z
        grad_norm = math.sqrt(sq_norms.sum().item())
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if not self.eager_updates:
            applied = self.step_index + 1
            landed, self._landed = self._landed, {}
            if skipped:
                for group in range(self.store.n_groups):
                    self._mark_applied(group, applied)  # (no update, so nothing to exchange, on every rank)
            else:
                clip = clip_coefficient(grad_norm, train.grad_clip)
                self.optimizer.begin_step()
                self._read_ahead(0, 0)
                step = self.optimizer.step_tensor
                for group in range(self.store.n_groups):  # layer order: the next forward needs layer 0 first
                    if self.device_optimizer is not None and group in self.device_optimizer.masters:
                        self.device_optimizer.update(group, landed[group], lr, clip, step)
                    else:
                        self._queue_update(group, lr, clip, landed[group], step, applied)
        self.step_index += 1
        elapsed = time.perf_counter() - start
        flops = flops_per_token(self.model_config, seq_len) * tokens
        return StepMetrics(
            self.step_index,
            loss,
            lr,
            grad_norm,
            tokens,
            elapsed,
            tokens / elapsed,
            flops / elapsed / 1e12,
            skipped,
            aux,
            violation,
            sequence_aux,
            z,
        )

    @torch.no_grad()
    def evaluate(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> tuple[float, int]:
        """(summed token loss, number of target tokens) of the current weights on a batch, forward only,
        streaming the layers once for all its rows; every rank takes a share of the rows."""
        self.finish_updates()
        self._load_device_state()
        mine = self._my_rows(input_ids.shape[0])
        loss_sum = torch.zeros((), dtype=self.store.master_dtype, device=self.device)
        if mine.stop > mine.start:
            loss_sum = self.pipeline.evaluate(self._micro_batches(input_ids, labels, position_ids, valid, mine))
        if self.spec.router_load is not None:
            self.spec.router_load.reset()  # evaluation's routing is not part of any step's load-balancing loss
        if self.sync is not None:
            loss_sum = self.sync.all_reduce(loss_sum)
        return loss_sum.item(), int((labels != -100).sum())

    def _mark_applied(self, group: int, applied: int) -> None:
        if self.sync is not None:
            self.sync.mark_applied(group, applied)

    def finish_updates(self) -> None:
        """Wait until every queued optimizer update has been applied (re-raising worker errors),
        on every rank of this host. The store then holds the current state, except for the GPU-updated
        layers' (their updates run in the GPU's stream order): `sync_store` brings those too."""
        for group in list(self._deferred):
            self._submit_deferred(group)
        self.stepper.wait_all()
        self.exchanger.wait_all()
        if self.sync is not None:
            self.sync.wait_applied(range(self.store.n_groups), self.step_index)

    def _load_device_state(self) -> None:
        """Give the GPU-updated layers the store's state, where it changed since they last took it (a new
        trainer whose weights may still be written, a checkpoint loaded)."""
        if self.device_optimizer is not None and not self._device_state_loaded:
            self.device_optimizer.to_device()
            self._device_state_loaded = True

    def sync_store(self) -> None:
        """Finish the updates and copy the GPU-updated layers' masters and moments into the store, so that
        it holds the whole current state (for checkpoints, export and anything else that reads it)."""
        self.finish_updates()
        if self.device_optimizer is not None:
            self.device_optimizer.to_host()

    def restore_step(self, step_index: int) -> None:
        """After loading a checkpoint into the store: the weights hold `step_index` optimizer steps, on every
        rank (the GPU-updated layers take the store's state at the next step)."""
        self.step_index = step_index
        for group in range(self.store.n_groups):
            self._mark_applied(group, step_index)
        self._device_state_loaded = False

    def host_bytes(self) -> int:
        """Host memory of this host's copy of the training state: the shared arenas once, and the
        gradient landing buffers of every rank on it (each holds its shard's)."""
        report = self.store.memory_report()
        if self.ranks is None:
            return report.total_bytes
        return report.total_bytes + (self.ranks.local_world_size - 1) * report.arenas["grad"]

    @property
    def is_main(self) -> bool:
        """The process that writes metrics, checkpoints and the final model."""
        return self.ranks is None or self.ranks.is_main

    def named_weights(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by Hugging Face name, up to date (views into host memory)."""
        if self.store_is_split:
            raise ConfigError(
                "the hosts split the master weights (engine.shard_across_hosts): no process holds them all; "
                "export() or a checkpoint gathers them to rank 0"
            )
        self.sync_store()
        return named_masters(self.store)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-precision logits [batch, seq, vocab] of the current weights, stage by stage
        (for evaluation and interop checks on small inputs; training never builds them)."""
        self.sync_store()
        x = input_ids.to(self.device)
        *body, head = self.spec.stages
        for stage in body:
            x = stage.template.forward(self._device_weights(stage.groups), x)
        return head.template.logits(self._device_weights(head.groups), x)

    def _device_weights(self, groups: tuple[int, ...]) -> list[torch.Tensor]:
        return [self.store.wire(g).to(self.device, self.compute_dtype) for g in groups]

    def export(self, out_dir: Path, tokenizer: Path | None = None, **options) -> Path:
        """Write the current weights as a Hugging Face model directory (see `export_hf`); with several
        ranks, call it on every rank: rank 0 writes (gathering whole groups where hosts split the state)."""
        self.sync_store()
        if not self.is_main:
            if self.store_is_split and self.ranks.is_local_main:
                WholeGroups.replay(self.whole_groups().entries("master"))
            return Path(out_dir)
        return export_hf(self.store, self.spec, out_dir, tokenizer, gather=self.whole_groups().gather, **options)

    def whole_groups(self) -> WholeGroups:
        """The store's state as whole groups to write (gathered to rank 0 where the hosts split it)."""
        return WholeGroups(self.store, self.sync.gather_whole if self.store_is_split else None)

    def close(self) -> None:
        self.finish_updates()
        self.stepper.close()
        self.exchanger.close()
        if self.ranks is not None:
            leave_ranks()
