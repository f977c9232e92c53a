"""The Trainer: the planner, store, optimizer, update policy and pipeline of one model, composed.

A step: the planner's `Placement` for the step's size (planned again when the size changes) says where each
layer's weights and activations live; the pipeline runs forward and backward layer-major as it says and lands
each group's fp32 gradient in host memory (or hands a resident group's over on the GPU); the update policy
(`megatrain_optim`) updates each group as its gradient lands (clipping off) or once the clip coefficient is
known (clipping on). Either way the step equals a synchronous AdamW step; a non-finite loss or gradient norm
skips the step (a non-finite group, its update).

The class reads as: build (its parts made in `parts.py`), place, step (`StepBatch`, the rows each rank runs in
`step.py`, the objective told what it needs by its own `start_step`), evaluate, state (`state_dict` /
`load_state_dict`, which `checkpoint.py` writes and reads), export, close.
"""

import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatrain_data import PairWindows, sequence_lengths, sequence_of_tokens
from megatrain_optim import DeviceAdamW, Ranks, RankSync, lr_at
from megatrain_optim.launch import launch_shape, leave_ranks
from megatrain_plan import read_placement
from megatrain_sched import Placement, StepResult, Timeline
from megatrain_store import Pending, set_fused_dequantize
from megatrain_templates import Media, Sequences, set_compile
from megatrain_zoo import ModelConfig, flops_per_token, init_param_
from megatrain_zoo.hf_weights import (
    WholeGroups,
    all_finite,
    check_hf_weights,
    check_same_weights,
    load_groups,
    load_hf_weights,
    named_masters,
    named_wire,
)
from megatrain_zoo.peft import check_peft_weights, is_peft_directory, load_peft_adapter

from .checkpoint import OPTIMIZER_FILE, WEIGHTS_FILE, NonFiniteError, TrainerState, check_same_model
from .config import Config, ConfigError, model_config_of, resolve_device, resolve_dtype
from .distributed import check_data_parallel, init_ranks
from .export import export_hf
from .objectives import check_model_settings, make_objective
from .parts import new_pipeline, new_store, new_updates, route_statistics, rows_first, with_router_terms
from .planning import check_plan, run_planner
from .step import RowShares, StepBatch, dropout_key
from .warmup import warm_up_pipeline

SMALLER_STEP_KEEPS_PLACEMENT = 0.75  # (a step down to this share of the planned tokens runs as placed)


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
    objective: dict | None = None  # a step-level objective's metrics (DPO: TRL's rewards/*, logps/*)

    def as_dict(self) -> dict:
        """metrics.jsonl's record: floats to 8 significant digits (six decimals logged 2.74217e-05 as 2.7e-05)."""
        values = {k: v for k, v in self.__dict__.items() if v is not None and k != "objective"}
        values |= self.objective or {}
        return {k: (float(f"{v:.8g}") if isinstance(v, float) else v) for k, v in values.items()}


def compile_on_cuda(enabled: bool) -> None:
    """engine.compile: torch.compile on CUDA (or eager) for the templates' elementwise work and a packed base's
    dequantization."""
    set_compile(enabled)
    set_fused_dequantize(enabled)


class Trainer:
    """Owns the host store, optimizer, update policy and pipeline of one model, placed by its planner.

    `training=False` keeps only the weights in host memory (no gradients, no optimizer state): `evaluate` alone."""

    def __init__(
        self,
        config: Config,
        model_config: ModelConfig | None = None,
        training: bool = True,
        ranks: Ranks | None = None,
    ):
        self.config, self.training = config, training
        self.device = resolve_device(config.device)
        self.compute_dtype = resolve_dtype(config.precision.compute_dtype, self.device)
        self.model_config = model_config or model_config_of(config)
        check_model_settings(config, self.model_config)
        compile_on_cuda(config.engine.compile)  # before planning, whose rate measurement runs the templates
        self._plan_placement()
        self._join_ranks(ranks)
        self._fill_store()
        train = config.train
        self.schedule = train.lr_schedule
        self.timeline = Timeline(enabled=config.engine.trace)
        self.optimizer = self.updates = self.policy = self.device_optimizer = parts = None
        if training:
            parts = new_updates(self.spec, self.store, config, self.sync, self.timeline, self._device_span)
            self.optimizer, self.updates, self.policy = parts.optimizer, parts.updates, parts.policy
        self.objective = make_objective(config)
        self.extra_state: dict[str, dict[str, torch.Tensor]] = {}  # checkpoint file -> tensors (GRPO's rollout)
        self.rows = RowShares(self.ranks, train.rows_per_example, train.rows_per_micro_batch, self.model_config)
        self.pipeline = new_pipeline(
            self.spec, self.store, self.device, config, self.timeline, self.sync, self.objective, parts
        )
        self._device_state_loaded = False  # loaded from the store by the first step (after any write to it)
        self._place(self.placement)
        if self.spec.router_load is not None:
            route_statistics(self.spec.router_load, config, self.sync)
        self.step_index = self.bad_steps = 0
        # torch.compile's kernels are built here, in setup, not in the first step (tens of seconds longer otherwise)
        self.warm_up_s = self.warm_up() if training and self.device.type == "cuda" else 0.0

    def warm_up(self) -> float:
        """Seconds of the setup's warm-up step (`warmup.py`): nothing it does reaches the weights or optimizer."""
        return warm_up_pipeline(self)

    # ------------------------------------------------------------------ setup
    def _plan_placement(self) -> None:
        """The planner for this machine, its placement of the configured step and the plan it costs; a training
        plan that cannot run stops here, before any memory is taken."""
        config = self.config
        gpus, hosts = launch_shape()
        measure = self.training and gpus * hosts == 1
        self.planner = run_planner(config, self.model_config, measure, gpus=gpus, hosts=hosts)
        self.placement = self._configured_placement()  # each GPU: its share of the batch
        self.plan = self.planner.plan(self.placement, compute_bound=False)  # (`megatrain plan`'s report has it)
        if self.training:
            check_plan(self.plan, self.planner)
        self.spec = self.planner.spec  # the model, built once for the planner and the run
        if config.model.hf_dir is not None:
            check_hf_weights(self.spec, Path(config.model.hf_dir))
        if config.model.adapter.path is not None:
            check_peft_weights(self.spec, Path(config.model.adapter.path))

    def _join_ranks(self, ranks: Ranks | None) -> None:
        """The process group, where the caller has not joined it already (to read the data first), and this
        rank's GPU."""
        self.ranks = ranks or init_ranks(self.device.type, self.config.engine)
        if self.ranks is not None:
            check_data_parallel(self.config, self.ranks.world_size)
            if self.device.type == "cuda":
                self.device = torch.device("cuda", self.ranks.local_rank)
                torch.cuda.set_device(self.device)

    def _fill_store(self) -> None:
        """The host store, with the initial weights written once per host and seen by every rank."""
        planner, training = self.planner, self.training
        self.store = new_store(
            self.spec, self.config, self.placement, self.plan, planner.frozen, self.device, self.ranks, training
        )
        self.sync = None if self.ranks is None else RankSync(self.ranks, self.store, self.device)
        if self.ranks is None or self.ranks.is_local_main:  # one copy of the weights per host
            self._init_weights()
        if self.ranks is not None:
            self.sync.barrier()  # every rank has mapped the shared arenas and sees the weights
            if self.ranks.is_local_main:
                self.store.shared.unlink()

    def _configured_placement(self) -> Placement:
        """The planner's placement for the configured step (evaluation: every layer streamed, nothing resident),
        or the one engine.placement's file holds."""
        planner, engine = self.planner, self.config.engine
        tokens = planner.step_tokens
        if not self.training:
            return Placement.build(planner.n_stages, tokens=tokens, experts_per_stage=planner.experts_per_stage)
        if engine.placement == "auto":
            return planner.place(tokens)
        return read_placement(Path(engine.placement), planner)

    def load_weights(self, model_dir: Path | None) -> None:
        """Put a Hugging Face directory's weights (a PEFT directory's: its adapters) into the store (None: the run's
        initial weights again), on every rank of the host (a reference model's pass, say); optimizer state untouched."""
        self.finish_updates()
        if self.ranks is None or self.ranks.is_local_main:
            if model_dir is None:
                self._init_weights()
            elif is_peft_directory(model_dir):  # (a LoRA run's final/)
                load_peft_adapter(self.store, self.spec, Path(model_dir))
            else:
                check_hf_weights(self.spec, model_dir)
                load_hf_weights(self.store, self.spec, model_dir)
        self.sync_weights()

    def keep_reference(self, model_dir: Path | None = None) -> None:
        """Keep the initial weights (or a Hugging Face directory's, which replace them meanwhile) in the store's
        reference copy, which `token_logps(reference=True)` streams: before training, on every rank of the host."""
        if model_dir is not None:
            self.load_weights(model_dir)
        if self.ranks is None or self.ranks.is_local_main:
            self.store.keep_reference()
            for group in self.spec.adapter_groups:  # LoRA's reference is the base, its adapters off (as TRL's)
                self.store.reference(group).zero_()
        if model_dir is not None:
            self.load_weights(None)
        elif self.sync is not None:
            self.sync.barrier()

    def sync_weights(self) -> None:
        """Every rank of the host sees the store's weights; resident groups take them at their next use."""
        if self.sync is not None:
            self.sync.barrier()
        self._device_state_loaded = False

    def _init_weights(self) -> None:
        """The run's initial weights: the Hugging Face directory's (or drawn as transformers starts them), and the
        adapters drawn as PEFT starts them (or read from model.adapter.path)."""
        drawn = range(self.store.n_groups)  # every host draws every group: the same weights as one process
        if (model := self.config.model).hf_dir is not None:  # (its cache: a packed base's bytes)
            load_hf_weights(self.store, self.spec, Path(model.hf_dir), Path(self.config.output_dir) / "cache")
            drawn = sorted(self.spec.adapter_groups)
        for group in drawn:
            with self.store.writing(group) as views:
                for name, view in views.items():
                    init_param_(name, view, self.model_config, self.config.train.seed)
        if model.adapter.path is not None:
            load_peft_adapter(self.store, self.spec, Path(model.adapter.path))

    def _device_span(self, name: str):
        return self.timeline.current_stream_span(name, self.pipeline.streams)

    # -------------------------------------------------------------- placement
    def _place(self, placement: Placement) -> None:
        """Run the next steps as `placement` says: the resident groups' state moved to (or from) the GPU, the
        gradient pool resized, the embedding's rows-first update where the table streams, the pipeline told."""
        resident = self.spec.groups_of(placement.resident)
        if self.device_optimizer is not None and self.device_optimizer.groups != resident:
            self.finish_updates()
            self.device_optimizer.to_host()  # the store holds the current state of the groups leaving the GPU
            self.device_optimizer = None
        if self.device_optimizer is None and resident:
            self.finish_updates()
            self.device_optimizer = DeviceAdamW(self.optimizer, resident, self.device)
            self._device_state_loaded = False
        if self.policy is not None:
            self.policy.device = self.device_optimizer
            if placement.gradient_pool is not None:
                self.finish_updates()
                self.store.resize_grad_pool(placement.gradient_pool)
            self.updates.rows_first = rows_first(
                self.spec, self.store, placement, self.updates, self.ranks, self.device
            )
        if (device := self.device_optimizer) is not None:
            device.keep_copies(self.spec.groups_of(placement.copied))
            device.park(self.spec.groups_of(placement.parked))
        self.pipeline.place(placement, *((None, None) if device is None else (device.masters, device.copies)))
        self.placement, self._planned_tokens = placement, placement.step_tokens * self.planner.world

    def _follow_step_size(self, tokens: int) -> None:
        """Place again for a step of another size than the placement's (engine.placement auto): a larger one needs
        the memory, and a placement made for a large step loses a much smaller one a third of its speed. Steps a
        little smaller (packed preference pairs vary by a row or two) keep it: the pipeline fits it to them."""
        planned = self._planned_tokens
        if self.config.engine.placement != "auto" or planned * SMALLER_STEP_KEEPS_PLACEMENT <= tokens <= planned:
            return
        # (a store made with a gradient pool cannot hold every gradient until a last sweep)
        sweeps = 1 if self.store.grad_pool is not None else None
        placement = self.planner.place(tokens // self.planner.world, self.placement.first_disk_group, sweeps=sweeps)
        if placement.gradient_pool is not None and self.placement.gradient_pool is not None:
            # (a pool no smaller than the one allocated: shrinking it would give nothing back worth the re-pinning)
            placement = replace(placement, gradient_pool=max(placement.gradient_pool, self.placement.gradient_pool))
        print(f"megatrain: placed again for steps of {tokens:,} tokens", file=sys.stderr)
        self._place(placement)
        self.plan = self.planner.plan(placement, compute_bound=False)

    # ------------------------------------------------------------------- step
    def pair_windows(self, tokens, batch_size: int = 1, shuffle: bool = False, seed: int = 0) -> PairWindows:
        """Preference pairs batched as this trainer runs them: packed where data.pack says, a share per rank."""
        world = 1 if self.ranks is None else self.ranks.world_size
        return PairWindows(tokens, batch_size, shuffle, seed, pack=self.config.data.pack, shares=world)

    def train_step(self, batch: StepBatch) -> StepMetrics:
        """One optimizer step on `batch` (its rows, and what the objective needs of them: `StepBatch`).

        With several ranks every rank is given the same global batch and runs its own rows of it:
        the step's result does not depend on the number of ranks."""
        start = time.perf_counter()
        n_targets = batch.n_targets
        if n_targets == 0:
            raise ConfigError("a batch has no target tokens (every label is -100); check the data and loss mask")
        self._follow_step_size(batch.input_ids.numel())
        self._load_device_state()
        micro = self.rows.micro_batches(batch, dropout_key(self.spec.adapter, self.config.train.seed, self.step_index))
        if self.updates.rows_first is not None:
            self.updates.rows_first.tokens = sum(mb.input_ids.numel() for mb in micro)
        if self.objective is not None:
            share = self.rows.rank_share(batch, micro)
            self.objective.start_step(share.sequence_of, batch.extras, share.mine, share.lengths)
            n_targets = 1  # (the objective's loss is the step's loss)
        lr = lr_at(self.step_index, self.schedule)
        self.policy.begin_step(self.step_index, lr)
        if self.spec.router_load is not None:
            self.spec.router_load.reset(sweeps=[len(part) for part in self.pipeline.sweeps_of(micro)])
        loss, grad_norm, router = self._step_values(self.pipeline.run(micro, loss_scale=1.0 / n_targets), n_targets)
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        self.policy.end_step(skipped)
        self.step_index += 1
        elapsed = time.perf_counter() - start
        tokens = batch.input_ids.numel()
        flops = flops_per_token(self.model_config, batch.input_ids.shape[1], self.spec.active_adapter_params) * tokens
        metrics = None if self.objective is None else self._objective_metrics()
        return StepMetrics(
            self.step_index, loss, lr, grad_norm, tokens, elapsed, tokens / elapsed, flops / elapsed / 1e12, skipped,
            *router, metrics,
        )  # fmt: skip

    def _objective_metrics(self) -> dict[str, float]:
        """The objective's metrics of the step: this rank's, or with several the mean of every rank's, each weighted
        by what it is a mean over (its sequences or tokens)."""
        metrics, weight = self.objective.metrics, self.objective.metrics_weight
        if self.sync is None or not metrics:
            return metrics
        names = sorted(metrics)
        sums = [weight] + [metrics[name] * weight if weight else 0.0 for name in names]
        sums = self.sync.all_reduce(torch.tensor(sums, dtype=torch.float64, device=self.device)).tolist()
        return {name: value / sums[0] if sums[0] else math.nan for name, value in zip(names, sums[1:])}

    def _step_values(self, result: StepResult, n_targets: int) -> tuple[float, float, tuple]:
        """(loss, global gradient norm, the routers' (aux loss, max violation, sequence aux loss, z-loss)) of a
        step, over every rank: the loss as transformers reports it, the routers' terms included."""
        loss_sum, sq_norms = result.loss_sum, result.group_sq_norms
        if self.sync is not None:
            loss_sum = self.sync.all_reduce(loss_sum)
            sq_norms = self.sync.sum_over_shards(sq_norms)
        sq_norm_sum = sq_norms.sum()
        self.policy.gradients_complete(loss_sum, sq_norm_sum)  # (on the device, before the host waits for them)
        loss = loss_sum.item() / n_targets  # (an objective's loss is the step's already: n_targets 1)
        loss, router = with_router_terms(loss, self.spec.router_load)
        return loss, math.sqrt(sq_norm_sum.item()), router

    @torch.no_grad()
    def evaluate(self, batch: StepBatch) -> tuple[float, int]:
        """(summed token loss, number of target tokens) of the current weights on a batch, forward only,
        streaming the layers once for all its rows; every rank takes a share of the rows."""
        self.finish_updates()
        self._load_device_state()
        micro = self.rows.micro_batches(batch)
        loss_sum = torch.zeros((), dtype=self.store.master_dtype, device=self.device)
        if micro:
            loss_sum = self.pipeline.evaluate(micro)
        if self.spec.router_load is not None:
            self.spec.router_load.reset()  # evaluation's routing is not part of any step's load-balancing loss
        if self.sync is not None:
            loss_sum = self.sync.all_reduce(loss_sum)
        return loss_sum.item(), batch.n_targets

    @torch.no_grad()
    def token_logps(self, batch: StepBatch, reference: bool = False) -> torch.Tensor:
        """Every row's log-probability of each trained token ([rows, seq] float64 on the host, 0 where the label is
        -100), forward only, the weights streamed once for all rows (a reference model's pass, the policy's that
        sampled a rollout); every rank runs its share of the rows. `reference`: under the weights `keep_reference`
        took instead of the current ones."""
        self.finish_updates()
        self._load_device_state()
        micro = self.rows.micro_batches(batch)
        logps = [t.double().cpu() for t in (self.pipeline.token_logps(micro, reference) if micro else [])]
        if self.spec.router_load is not None:
            self.spec.router_load.reset()  # (a forward's routing is no step's load-balancing statistic)
        logps = torch.cat(logps) if logps else torch.zeros(0, batch.labels.shape[1], dtype=torch.float64)
        return self.sync.gather_rows(logps) if self.sync is not None else logps

    def sequence_logps(self, batch: StepBatch) -> Sequences:
        """Every sequence's summed log-probability of its trained tokens and their count ([sequences] each, float64
        on the host; a sequence a row, or as `sequences` numbers packed pairs), as `token_logps`."""
        logps = self.token_logps(batch)
        owner = sequence_of_tokens(batch.labels, batch.sequences)
        lengths = sequence_lengths(batch.labels, batch.sequences)
        sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, owner[owner >= 0], logps[owner >= 0])
        return Sequences(sums, lengths)

    # ------------------------------------------------------------------ state
    def finish_updates(self) -> None:
        """Wait until every queued optimizer update has been applied (re-raising worker errors),
        on every rank of this host. The store then holds the current state, except for the resident
        groups' (their updates run in the GPU's stream order): `sync_store` brings those too."""
        if self.updates is not None:
            self.updates.wait_all()

    def _load_device_state(self) -> None:
        """Give the resident groups the store's state, where it changed since they last took it (a new
        trainer whose weights may still be written, a checkpoint loaded)."""
        if self.device_optimizer is not None and not self._device_state_loaded:
            self.device_optimizer.to_device()
            self._device_state_loaded = True

    def sync_store(self) -> None:
        """Finish the updates and copy the resident groups' masters and moments into the store, so that
        it holds the whole current state (for checkpoints, export and anything else that reads it)."""
        self.finish_updates()
        if self.device_optimizer is not None:
            self.device_optimizer.to_host()

    def state_dict(self) -> TrainerState:
        """The state a checkpoint holds (`checkpoint.save_checkpoint`), up to date: the store's tensors as entries
        loaded as they are written (gathered a group at a time where hosts split the state), then `extra_state`'s."""
        self.sync_store()
        whole = self._whole_groups()
        optimizer = [
            entry for state in self.store.state_names for entry in whole.entries(f"state.{state}", f"{state}.")
        ]
        # a LoRA run's frozen base is its initial weights again at resume: its checkpoints hold the adapters alone
        tensors = {WEIGHTS_FILE: whole.entries("master", trained_only=self.spec.adapter is not None)}
        tensors[OPTIMIZER_FILE] = optimizer
        for filename, extra in self.extra_state.items():  # (GRPO's rollout in use)
            tensors[filename] = [(name, Pending(tuple(t.shape), t.dtype, lambda t=t: t)) for name, t in extra.items()]
        return TrainerState(
            self.step_index, self.optimizer.step_count, self.bad_steps, self.model_config.as_dict(),
            self.config.as_dict(), tensors, writes=self.is_main,
            sends_part=not self.is_main and self.store_is_split and self.ranks.is_local_main,
        )  # fmt: skip

    def load_state_dict(self, state: TrainerState) -> None:
        """Continue from `state` (a checkpoint's, `checkpoint.Resume.state`), on every rank: the weights and moments
        (where this trainer holds them) read from its files into the store, and the step it holds (the resident
        groups take the store's state at the next step). A checkpoint of another model is refused."""
        check_same_model(state.source, state.model, self.model_config)
        check_same_weights(self.config.model.hf_dir, state.base_fingerprint, state.source)
        self.finish_updates()
        if self.ranks is None or self.ranks.is_local_main:  # one copy of the state (or of its part) per host
            load_groups(self.store, [state.files[WEIGHTS_FILE]], trained_only=self.spec.adapter is not None)
            for name in self.store.state_names:  # a trainer made for evaluation holds none
                load_groups(self.store, [state.files[OPTIMIZER_FILE]], f"state.{name}", f"{name}.")
        if self.sync is not None:
            self.sync.barrier()
        self.step_index, self.bad_steps = state.step, state.bad_steps
        if self.updates is not None:
            self.updates.steps = state.step
            for group in range(self.store.n_groups):
                self.updates.sharing.mark(group, state.step)
        if self.optimizer is not None:
            self.optimizer.step_count = state.optimizer_step
        self._device_state_loaded = False

    def host_bytes(self) -> int:
        """Host memory of this host's copy of the training state: the shared arenas once, and the
        gradient landing buffers of every rank on it (each holds its shard's)."""
        report = self.store.memory_report()
        if self.ranks is None:
            return report.total_bytes
        return report.total_bytes + (self.ranks.local_world_size - 1) * report.arenas["grad"]

    @property
    def store_is_split(self) -> bool:
        """The hosts split the master weights and optimizer state (each holds its part)."""
        return self.ranks is not None and self.ranks.split_state

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

    def streamed_weights(self) -> dict[str, torch.Tensor]:
        """What the device copies, by Hugging Face name, up to date: views of the store's pinned wire copy, or of
        the fp32 masters where it keeps none."""
        self.sync_store()
        return named_wire(self.store)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, media: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
        """Full-precision logits [batch, seq, vocab] of the current weights, stage by stage
        (for evaluation and interop checks on small inputs; training never builds them). `media`: an image-text
        model's rows' images (`StepBatch.media`)."""
        self.sync_store()
        x = input_ids.to(self.device)
        kwargs = {}
        if self.model_config.image_text:
            kwargs["media"] = Media.of_rows(x, media or []).to(self.device)
        *body, head = self.spec.stages
        for stage in body:
            x = stage.template.forward(self._device_weights(stage.groups), x, **kwargs)
        return head.template.logits(self._device_weights(head.groups), x)

    def _device_weights(self, groups: tuple[int, ...]) -> list[torch.Tensor]:
        return [self.store.weights(g).to(self.device, self.compute_dtype) for g in groups]

    def export(self, out_dir: Path, tokenizer: Path | None = None, **options) -> Path:
        """Write the current weights as a Hugging Face model directory (see `export_hf`; a LoRA run's adapters as a
        PEFT adapter directory over model.hf_dir); with several ranks, call it on every rank: rank 0 writes
        (gathering whole groups where hosts split the state). A state holding NaN or Inf is refused, naming the group,
        before anything is written."""
        self.sync_store()
        adapters = self.spec.adapter is not None  # (a LoRA run writes its adapters alone)
        written = [g for g in range(self.store.n_groups) if not (adapters and g in self.store.frozen)]
        broken = [self.spec.groups[g].name for g in written if not all_finite(self.store.master(g))]
        if broken:
            raise NonFiniteError(
                f"the weights of {', '.join(broken)} hold NaN or Inf; nothing exported. Resume from the last "
                "checkpoint (checkpoints hold finite states only) with a lower train.lr or train.grad_clip on"
            )
        if not self.is_main:
            if self.store_is_split and self.ranks.is_local_main:
                WholeGroups.replay(self._whole_groups().entries("master", trained_only=adapters))
            return Path(out_dir)
        gather, base = self._whole_groups().gather, self.config.model.hf_dir
        return export_hf(self.store, self.spec, out_dir, tokenizer, gather=gather, base_model=base, **options)

    def _whole_groups(self) -> WholeGroups:
        """The store's state as whole groups to write (gathered to rank 0 where the hosts split it)."""
        return WholeGroups(self.store, self.sync.gather_whole if self.store_is_split else None)

    def close(self, abandon: bool = False) -> None:
        """Finish the queued optimizer updates, stop their worker and leave the ranks. `abandon` (a run that
        failed): drop the updates instead of waiting for them, since they may wait on a rank that died or hung,
        for engine.rank_wait_s again after the wait that failed."""
        if not abandon:
            self.finish_updates()
        if self.updates is not None:
            self.updates.close()
        if self.ranks is not None:
            leave_ranks()
