"""A config as the planner's inputs (`megatrain_plan`): the machine, the rates, the step's shape, the engine's
settings and what the objective holds, with the model built once for the planner and the run. What `megatrain
plan`, the Trainer and the run call; the planner's refusals are config errors here."""

import os
from contextlib import contextmanager
from dataclasses import replace

import torch

from megatrain_optim.launch import launch_shape
from megatrain_plan import (
    EngineChoices,
    Machine,
    ObjectiveMemory,
    Plan,
    PlanError,
    Planner,
    Rates,
    StepShape,
    experts_per_stage,
    load_rates,
    run_rates,
)
from megatrain_plan import check_plan as check_planned
from megatrain_templates import file_tensors, lora_names
from megatrain_zoo import ModelConfig, ModelSpec, build_model
from megatrain_zoo.generate import generation_host_bytes

from .config import OBJECTIVES, Config, ConfigError, adapter_of, model_config_of, resolve_device, resolve_dtype
from .objectives import check_model_settings, user_objective_class
from .reference import PASS_STEPS


def step_shape(config: Config, on_gpu: bool = False) -> StepShape:
    """One step of `config` as the planner sees it (`on_gpu`: for a GPU, whatever this machine has: auto is bf16)."""
    train = config.train
    device = torch.device("cuda") if on_gpu else resolve_device(config.device)
    return StepShape(
        seq_len=config.data.seq_len,
        rows_per_step=train.rows_per_step,
        rows_per_micro_batch=train.rows_per_micro_batch,
        dtype=resolve_dtype(config.precision.compute_dtype, device),
        micro_batch_size=train.micro_batch_size,
        clipping=train.grad_clip > 0,
        router_z_loss=bool(train.router_z_loss_coef),
        frozen_parts=frozenset(train.frozen_parts),
    )


def engine_choices(config: Config) -> EngineChoices:
    """The `engine.*` settings the planner reads, as the config sets them."""
    return EngineChoices(**{name: getattr(config.engine, name) for name in EngineChoices.__dataclass_fields__})


def objective_memory(config: Config, spec: ModelSpec, machine: Machine, dtype: torch.dtype) -> ObjectiveMemory:
    """What `config`'s objective holds beside the model's state: GRPO's reference weights and generation copies
    (`megatrain_zoo.generate.generation_host_bytes`, in the compute `dtype`), DPO's reference pass
    (`reference.PASS_STEPS` steps' rows a pass)."""
    train, grpo = config.train, config.train.grpo
    generating = train.objective == "grpo" and grpo.rollouts is None  # (GRPO's rollouts made here)
    generation_bytes = 0
    if generating:
        stored = file_tensors({p.name: p.shape for group in spec.groups for p in group.params})
        shapes = {name: shape for name, (shape, _) in stored.items()}
        length = grpo.max_prompt_length + grpo.max_completion_length
        generation_bytes = generation_host_bytes(
            spec.config, shapes, dtype, grpo.generation_weights, machine.gpu_memory, length
        ) + _merged_bytes(spec, dtype)
    return ObjectiveMemory(
        reference_copy=generating and grpo.beta > 0,
        generation_host_bytes=generation_bytes,
        generation_device_copy=generating and grpo.generation_weights != "streamed",
        reference_pass_steps=PASS_STEPS if train.objective == "dpo" and train.dpo.needs_reference else 0,
        sweepable=train.objective == "sft",
    )


def _merged_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Host bytes a LoRA run's generation takes to merge its adapters (`megatrain_zoo.peft.with_adapters_merged`): a
    copy of each adapted matrix, and every packed layer unpacked first."""
    if spec.adapter is None:
        return 0
    adapters = {p.name for g in spec.adapter_groups for p in spec.groups[g].params}
    base = [p for g in spec.frozen_groups(set()) for p in spec.groups[g].params]
    adapted = [p for p in base if lora_names(p.name)[0] in adapters]
    unpacked = [p for g in spec.packed_groups for p in spec.groups[g].params]
    return torch.empty((), dtype=dtype).element_size() * sum(p.numel for p in adapted + unpacked)


@contextmanager
def planner_refusals_as_config_errors():
    """The planner's refusals (`PlanError`) inside, as the config errors they are here: one line naming the fix."""
    try:
        yield
    except PlanError as error:
        raise ConfigError(str(error)) from None


def machine_of(config: Config, gpu_memory=None, host_memory=None, gpus: int = 1, hosts: int = 1) -> Machine:
    """This machine for `config`'s device, or one with `gpu_memory` / `host_memory` bytes free (`Machine.of`)."""
    with planner_refusals_as_config_errors():
        device = resolve_device(config.device)
        machine = Machine.of(device, config.engine.host_memory_gib, gpu_memory, host_memory, gpus, hosts)
        return replace(machine, shares_cores=device.type == "cpu" and gpu_memory is None)


def measuring_allowed(config: Config) -> bool:
    """Whether `config`'s run may measure its rates: engine.measure_rates, or MEGATRAIN_MEASURE_RATES (0 or 1) where
    set."""
    setting = os.environ.get("MEGATRAIN_MEASURE_RATES")
    return config.engine.measure_rates if setting is None else setting != "0"


def rates_of(config: Config, model: ModelConfig, measure: bool = True, spec: ModelSpec | None = None) -> Rates:
    """The rates to plan `config`'s run with (`run_rates`), measured at its shape, on its layers as `spec` builds
    them, where `measure` and `measuring_allowed` allow."""
    shape = step_shape(config)
    device = resolve_device(config.device)
    measuring = measure and measuring_allowed(config)
    return run_rates(model, device, shape.dtype, shape.seq_len, config.train.micro_batch_size, measuring, spec=spec)


def make_planner(
    config: Config,
    model: ModelConfig | None = None,
    rates: Rates | None = None,
    gpu_memory: int | None = None,
    gpus: int = 1,
    hosts: int = 1,
    host_memory: int | None = None,
) -> Planner:
    """The planner of `config`'s run on this machine's GPU, or on one with `gpu_memory` bytes, and the host memory
    it has available now, or `host_memory` bytes; with `gpus` per host and `hosts` (data parallel: a replica of the
    state per host, or the state split over them with engine.shard_across_hosts) host bytes are per host, GPU bytes
    per GPU, and the step splits the global batch over every GPU. Its `spec` is the model, built once here."""
    model = model or model_config_of(config)
    machine = machine_of(config, gpu_memory, host_memory, gpus, hosts)
    shape, engine = step_shape(config, on_gpu=not machine.shares_cores), engine_choices(config)
    adapter = adapter_of(config)
    experts = experts_per_stage(model, engine.experts_per_stage, shape, machine.gpu_memory, adapter)
    spec = build_model(model, experts, adapter)
    objective = objective_memory(config, spec, machine, shape.dtype)
    return Planner(spec, rates or load_rates(), machine, shape, engine, objective)


def run_planner(config: Config, model: ModelConfig, measure: bool = True, **machine) -> Planner:
    """`make_planner(config, model, **machine)` at the rates measured at the run's shape where `measure` allows
    (`rates_of`), once a plan from the remembered rates passes the checks: what the machine cannot run (a model its
    host cannot hold, a data.seq_len the model does not reach) is refused by the caller's check without the seconds
    of measuring first (half a minute on a GPU). No refusal hangs on the rates: the planner's choices fit the
    machine, and what is configured is the same at any rates. Measured on its layers as built; the machine read anew."""
    planner = make_planner(config, model, **machine)
    early = measure and measuring_allowed(config) and planner.plan(planner.place(planner.step_tokens), False)
    if early and passes_checks(early, planner):
        planner = make_planner(config, model, rates_of(config, model, spec=planner.spec), **machine)
    return planner


def passes_checks(plan: Plan, planner: Planner) -> bool:
    """Whether `check_plan` lets `plan` go ahead (its refusal, where not, is the caller's to raise)."""
    try:
        check_planned(plan, planner)
    except PlanError:
        return False
    return True


def make_plan(config: Config, **machine) -> Plan:
    """The plan of `config`'s step as configured, by `make_planner(config, **machine)`."""
    planner = make_planner(config, **machine)
    return planner.plan(planner.place(planner.step_tokens))


def check_runnable(config: Config, model: ModelConfig) -> None:
    """Refuse, before the data is read (a large corpus's tokenizing came first), what the model or this machine
    cannot run: options the model lacks, and what `check_plan` refuses in a plan from the remembered rates (a
    data.seq_len beyond the model's positions, a model the host cannot hold). The trainer checks again as it is made."""
    check_model_settings(config, model)
    if config.train.objective not in OBJECTIVES:  # (a user's class that does not import: said now)
        user_objective_class(config.train.objective)
    gpus, hosts = launch_shape()
    planner = make_planner(config, model, gpus=gpus, hosts=hosts)
    check_plan(planner.plan(planner.place(planner.step_tokens), False), planner)


def check_plan(plan: Plan, planner: Planner) -> None:
    """Refuse, before anything is allocated, a run that cannot work (`megatrain_plan.check_plan`), naming the fix."""
    with planner_refusals_as_config_errors():
        check_planned(plan, planner)
