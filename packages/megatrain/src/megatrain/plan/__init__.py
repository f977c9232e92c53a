"""`megatrain plan`: where each layer's weights and activations go, whether a run fits, and how fast it runs.

`costs` is the cost model (memory and time of a placement), `search` the planner that places a step size by its
rules, `checks` the refusals of what cannot run, `report` the plan as written and printed."""

from megatrain_zoo import ModelConfig

from ..config import Config, model_config_of
from ..rates import Rates, load_rates
from .checks import check_plan
from .costs import (
    CPU_OPTIMIZER_MARGIN,
    CPU_RUNTIME_HOST_BYTES,
    DISK_TIER_RAM_SHARE,
    GRADIENT_POOL,
    HOST_KEPT_RAM_SHARE,
    RUNTIME_HOST_BYTES,
    SWEEPS_PCIE_SHARE,
    CostModel,
    Machine,
    gpu_updated_groups,
    kept_bytes_per_token,
    layout_sizes,
    resident_stages,
    slowest,
)
from .report import Plan, format_plan
from .search import Planner

__all__ = [
    "CPU_OPTIMIZER_MARGIN",
    "CPU_RUNTIME_HOST_BYTES",
    "DISK_TIER_RAM_SHARE",
    "GRADIENT_POOL",
    "HOST_KEPT_RAM_SHARE",
    "RUNTIME_HOST_BYTES",
    "SWEEPS_PCIE_SHARE",
    "CostModel",
    "Machine",
    "Plan",
    "Planner",
    "Rates",
    "check_plan",
    "format_plan",
    "gpu_updated_groups",
    "kept_bytes_per_token",
    "layout_sizes",
    "make_plan",
    "resident_stages",
    "slowest",
]


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
