"""The planner: where each layer's weights and activations go, whether a run fits, and how fast it runs.

`costs` is the cost model (memory and time of a placement; `host_items` its host memory), `search` the planner that
places a step size by its rules (`host_rules` those where the host's memory decides, on `counts`), `checks` the
refusals of what cannot run, `report` the plan as written and printed, `host_memory` the host's budget, `rates` the
machine's measured rates. The planner takes a built model (`megatrain_zoo.ModelSpec`) and small values (`inputs`):
the machine, the step's shape, the engine's settings and what the objective holds."""

from .checks import check_plan
from .costs import (
    CPU_OPTIMIZER_MARGIN,
    DISK_TIER_RAM_SHARE,
    GRADIENT_POOL,
    HOST_KEPT_RAM_SHARE,
    SWEEPS_PCIE_SHARE,
    CostModel,
    experts_per_stage,
    gpu_updated_groups,
    kept_bytes_per_token,
    layout_sizes,
    resident_stages,
    slowest,
)
from .errors import PlanError
from .host_items import CPU_RUNTIME_HOST_BYTES, RUNTIME_HOST_BYTES
from .host_memory import HOST_MARGIN_MIN, HostBudget, host_budget, process_bytes
from .inputs import EngineChoices, Machine, ObjectiveMemory, StepShape
from .rates import (
    Rates,
    block_work,
    calibrate,
    layer_works,
    load_rates,
    measure_disk_gbps,
    run_rates,
    save_rates,
    stale_rates_note,
)
from .report import Plan, format_plan
from .search import Planner, read_placement

__all__ = [
    "CPU_OPTIMIZER_MARGIN",
    "CPU_RUNTIME_HOST_BYTES",
    "DISK_TIER_RAM_SHARE",
    "GRADIENT_POOL",
    "HOST_KEPT_RAM_SHARE",
    "HOST_MARGIN_MIN",
    "RUNTIME_HOST_BYTES",
    "SWEEPS_PCIE_SHARE",
    "CostModel",
    "EngineChoices",
    "HostBudget",
    "Machine",
    "ObjectiveMemory",
    "Plan",
    "PlanError",
    "Planner",
    "Rates",
    "StepShape",
    "block_work",
    "calibrate",
    "check_plan",
    "experts_per_stage",
    "format_plan",
    "gpu_updated_groups",
    "host_budget",
    "kept_bytes_per_token",
    "layer_works",
    "layout_sizes",
    "load_rates",
    "measure_disk_gbps",
    "process_bytes",
    "read_placement",
    "resident_stages",
    "run_rates",
    "save_rates",
    "stale_rates_note",
    "slowest",
]
