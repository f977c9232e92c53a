"""The one schema of `benchmarks/results/*.json`: what a results file holds, a check of it, and the
conversion of what each benchmark script measures into it. `common.write_results` normalizes and checks
every file it writes; `python benchmarks/results_schema.py` checks every committed file (no torch needed).
"""

import json
import re
import shlex
import sys
import time
from pathlib import Path

RESULTS_DIR = Path(__file__).parent / "results"

TOP_LEVEL = ("benchmark", "machine", "commands", "notes", "results")
OPTIONAL_TOP_LEVEL = ("configs",)  # settings the commands used (a DeepSpeed config, planner rates, script arguments)
MACHINE_FIELDS = ("device", "gpu_memory_gib", "host_memory_gib", "cpu_cores", "torch", "date")
REQUIRED_ROW_FIELDS = ("system", "model", "tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops", "date")
SYSTEMS = (
    "megatrain",
    "megatrain plan",  # the planner's prediction: step_time_s is predicted_step_s
    "pytorch-gpu",  # transformers' model fully on the GPU: fp32 masters and AdamW there, bf16 autocast
    "deepspeed-zero3-offload",
    "fsdp2-offload",
    "published-layer-streaming",  # figures the published layer-streaming system reports; not measured here
)
# A row whose process's peak resident memory passes its plan by more than this share is flagged: the plan is a
# promise the planner keeps (`megatrain_plan.CostModel.host_items`).
RSS_OVER_PLAN = 0.03
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}( \d{2}:\d{2})?$")

NUMBER, INTEGER, TEXT, FLAG, MAPPING, NOTHING = (int, float), (int,), (str,), (bool,), (dict,), (type(None),)
REQUIRED_ROW_TYPES = {"tokens_per_step": INTEGER + NOTHING} | dict.fromkeys(
    ("step_time_s", "tokens_per_s", "model_tflops"), NUMBER + NOTHING
)  # null where a row measured no whole step (a part of a model, a failure, a quoted figure)
# The types of the optional fields that tables and plots read; any other field a row carries is kept as written.
OPTIONAL_ROW_TYPES = {
    "seq_len": INTEGER,
    "micro_batch_seqs": INTEGER,
    "params_b": NUMBER,
    "active_params_b": NUMBER,
    "n_layers": INTEGER,
    "gpus": INTEGER,
    "doc_len": INTEGER,
    "predicted_step_s": NUMBER + NOTHING,
    "prediction_error": NUMBER + NOTHING,
    "peak_gpu_gib": NUMBER + NOTHING,
    "host_gib": NUMBER + NOTHING,
    "host_bytes_per_param": NUMBER + NOTHING,
    # the plan's host bytes with what the process held when planned, and the process's peak resident memory
    "planned_host_gib": NUMBER + NOTHING,
    "peak_rss_gib": NUMBER + NOTHING,
    "kept_layers": INTEGER + NOTHING,
    "extra_kept_layers": INTEGER + NOTHING,
    "placement": MAPPING + NOTHING,  # where each layer's state and work live, as the engine placed them
    "engine": TEXT,  # which engine version or setting ran, where rows of one file differ in it
    "scope": TEXT,  # what part of a model was timed, where a row does not time whole training steps
    "command": TEXT,  # the command line of this row, where the file's commands hold several
    "machine": MAPPING,  # this row's machine, where it differs from the file's
    "note": TEXT,
    "fits": FLAG,
    "error": TEXT,
}


def _is(value, types) -> bool:
    return isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


def check_machine(machine, where: str, required: bool = True) -> list[str]:
    """Problems with a machine record (the file's, or a row's partial override)."""
    if not isinstance(machine, dict):
        return [f"{where}: must be an object with {', '.join(MACHINE_FIELDS)}"]
    problems = [f"{where}: missing '{key}'" for key in MACHINE_FIELDS if required and key not in machine]
    if "device" in machine and not (isinstance(machine["device"], str) and machine["device"]):
        problems.append(f"{where}.device: must name the device, got {machine['device']!r}")
    if "date" in machine and not (isinstance(machine["date"], str) and DATE.match(machine["date"])):
        problems.append(f"{where}.date: must read YYYY-MM-DD or YYYY-MM-DD HH:MM, got {machine['date']!r}")
    for key in ("gpu_memory_gib", "host_memory_gib", "cpu_cores"):
        if key in machine and not _is(machine[key], NUMBER + NOTHING):
            problems.append(f"{where}.{key}: must be a number or null, got {machine[key]!r}")
    return problems


def check_row(row, where: str) -> list[str]:
    """Problems with one result row: its required fields, their types, and what its system implies."""
    if not isinstance(row, dict):
        return [f"{where}: must be an object"]
    problems = [f"{where}: missing '{key}'" for key in REQUIRED_ROW_FIELDS if key not in row]
    if row.get("system") not in SYSTEMS:
        problems.append(f"{where}.system: {row.get('system')!r} is not one of {', '.join(SYSTEMS)} (add it to SYSTEMS)")
    for key in ("model", "date"):
        if key in row and not (isinstance(row[key], str) and row[key]):
            problems.append(f"{where}.{key}: must be a non-empty string, got {row[key]!r}")
    if isinstance(row.get("date"), str) and not DATE.match(row["date"]):
        problems.append(f"{where}.date: must read YYYY-MM-DD or YYYY-MM-DD HH:MM, got {row['date']!r}")
    for key, types in (REQUIRED_ROW_TYPES | OPTIONAL_ROW_TYPES).items():
        if key in row and not _is(row[key], types):
            problems.append(
                f"{where}.{key}: has type {type(row[key]).__name__}, expected {'/'.join(t.__name__ for t in types)}"
            )
    if "machine" in row:
        problems += check_machine(row["machine"], f"{where}.machine", required=False)
    return problems + _check_row_kind(row, where) + _check_host_memory(row, where)


def _check_host_memory(row: dict, where: str) -> list[str]:
    """A measured row's peak RSS within RSS_OVER_PLAN of its planned host memory."""
    planned, peak = row.get("planned_host_gib"), row.get("peak_rss_gib")
    if not (_is(planned, NUMBER) and _is(peak, NUMBER)) or peak <= (1 + RSS_OVER_PLAN) * planned:
        return []
    return [
        f"{where}: peak RSS {peak} GiB passes the planned {planned} GiB by more than {RSS_OVER_PLAN:.0%}: a host "
        "allocation the planner does not count (megatrain_plan.CostModel.host_items)"
    ]


def _check_row_kind(row: dict, where: str) -> list[str]:
    """A whole measured step has its tokens and time; a plan its prediction as its step time; a failure its error."""
    if row.get("fits") is False:
        return [] if isinstance(row.get("error"), str) else [f"{where}: a row with fits: false says why in 'error'"]
    if row.get("system") == "megatrain plan":
        if not _is(row.get("predicted_step_s"), NUMBER) or row.get("step_time_s") != row["predicted_step_s"]:
            return [f"{where}: a plan row has predicted_step_s, and step_time_s equal to it"]
        return []
    if "scope" in row or row.get("system") == "published-layer-streaming":
        return []
    missing = [key for key in ("tokens_per_step", "step_time_s") if not _is(row.get(key), NUMBER)]
    return (
        [f"{where}: a measured step needs {' and '.join(missing)} (or a 'scope' saying what else was timed)"]
        if missing
        else []
    )


def check_results(payload) -> list[str]:
    """Every problem with one results file's content, as readable lines; empty when it is valid."""
    if not isinstance(payload, dict):
        return ["the file must hold one JSON object"]
    problems = [f"missing top-level '{key}'" for key in TOP_LEVEL if key not in payload]
    problems += [
        f"unknown top-level '{key}' (allowed: {', '.join(TOP_LEVEL + OPTIONAL_TOP_LEVEL)}; put it in notes, configs or rows)"
        for key in payload
        if key not in TOP_LEVEL + OPTIONAL_TOP_LEVEL
    ]
    benchmark = payload.get("benchmark")
    if "benchmark" in payload and not (isinstance(benchmark, str) and benchmark.strip() and "\n" not in benchmark):
        problems.append("benchmark: must be one line saying the question the file answers")
    if "machine" in payload:
        problems += check_machine(payload["machine"], "machine")
    for key in ("commands", "notes"):
        values = payload.get(key, [])
        if not isinstance(values, list) or not all(isinstance(v, str) and v for v in values):
            problems.append(f"{key}: must be a list of non-empty strings")
    if "commands" in payload and not payload["commands"]:
        problems.append("commands: name at least one command that produced the rows")
    if "configs" in payload and not isinstance(payload["configs"], dict):
        problems.append("configs: must be an object")
    rows = payload.get("results", [])
    if not isinstance(rows, list) or not rows:
        return problems + ["results: must be a non-empty list of rows"]
    for index, row in enumerate(rows):
        problems += check_row(row, f"results[{index}]")
    return problems


def check_file(path: Path) -> list[str]:
    """Problems with one committed results file, each prefixed with the file's name."""
    try:
        payload = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        return [f"{Path(path).name}: cannot be read as JSON: {error}"]
    return [f"{Path(path).name}: {problem}" for problem in check_results(payload)]


def load_rows(results_dir: Path = RESULTS_DIR) -> list[dict]:
    """Every row of every results file, in file order, each with its file's name (`file`), machine
    (`file_machine`) and commands (`file_commands`), and its place among all rows (`order`)."""
    rows = []
    for path in sorted(Path(results_dir).glob("*.json")):
        payload = json.loads(path.read_text())
        for row in payload["results"]:
            context = {"file": path.name, "file_machine": payload["machine"], "file_commands": payload["commands"]}
            rows.append(row | context | {"order": len(rows)})
    return rows


def main(argv: list[str] | None = None) -> int:
    """Check the named results files (default: all of benchmarks/results); exit 1 naming each problem."""
    paths = [Path(p) for p in (argv if argv is not None else sys.argv[1:])] or sorted(RESULTS_DIR.glob("*.json"))
    problems = [problem for path in paths for problem in check_file(path)]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(paths)} results files, {len(problems)} problems")
    return 1 if problems else 0


# What each benchmark script measures, put in the schema (common.write_results calls normalize).

QUESTIONS = {  # a script's own "benchmark" name -> the question its rows answer
    "throughput": "megatrain's training throughput per model and tokens per step (and plain PyTorch's where it fits)",
    "deepspeed-zero3-offload": "DeepSpeed ZeRO-3 with parameter and optimizer offload: throughput per model and tokens per step",
    "megatrain vs baselines": "megatrain against its baselines at the same model and tokens per step",
    "block_shapes": "a decoder block's and the head's GPU rates at each run's shape (what megatrain plan measures)",
    "linear_attention": "one Gated DeltaNet layer's mixer on the GPU: the delta rule, the mixer, its GEMMs, causal SDPA",
    "delta_kernels": "the chunked delta rule's Triton kernels alone: each one's share, and with --sweep its time per launch",
    "kernel_table": "GPU time per kernel kind in one profiled training step",
    "block": "one decoder block's forward and recompute + backward per SDPA backend: the per-layer ceiling",
    "moe-block": "one MoE layer's forward + recompute + backward rate on the GPU",
    "host_plans": "the largest model several hosts would train: a replica per host against the state split over them",
}


def normalize(payload: dict, command: str | None = None) -> dict:
    """A script's payload in the schema: its measurements as rows, its settings in configs, its command and date
    filled in. Files already in the schema pass through unchanged."""
    payload = dict(payload)
    machine = {key: None for key in MACHINE_FIELDS} | (payload.pop("machine", None) or {})
    machine["device"] = machine["device"] or "not recorded"  # plans made without a device, merged files without one
    machine["date"] = machine["date"] or time.strftime("%Y-%m-%d %H:%M")
    name = payload.pop("benchmark", None) or _script_name(payload)
    rows = _rows(payload, machine)
    configs = dict(payload.pop("configs", {}))
    for key in ("args", "config", "rates", "calibration", "candidates"):
        if key in payload:
            configs[key] = payload.pop(key)
    commands = payload.pop("commands", None) or [payload.pop("command", None) or command or _command_line()]
    notes = payload.pop("notes", None) or []
    notes = [notes] if isinstance(notes, str) else list(notes)
    if payload.get("note"):
        notes.append(payload.pop("note"))
    leftover = {key: value for key, value in payload.items() if key not in ("results", "note")}
    notes += [f"{key}: {json.dumps(value)}" for key, value in leftover.items()]
    normalized = {"benchmark": QUESTIONS.get(name, name), "machine": machine, "commands": commands, "notes": notes}
    return normalized | ({"configs": configs} if configs else {}) | {"results": rows}


def _command_line() -> str:
    return shlex.join(["python", *sys.argv])


def _script_name(payload: dict) -> str:
    if "variants" in payload:
        return "block"
    if "forward_recompute_backward_ms" in payload:
        return "moe-block"
    if "plans" in payload:
        return "host_plans"
    return "benchmark"


def _rows(payload: dict, machine: dict) -> list[dict]:
    """The payload's measurements as schema rows (taken out of the payload), each dated by the machine's clock."""
    if "variants" in payload:  # block.py
        rows = _block_rows(payload)
    elif "forward_recompute_backward_ms" in payload:  # moe_block.py
        rows = [_layer_row(payload)]
    elif "kinds" in payload:  # kernel_table.py
        rows = [_kernel_row(payload)]
    elif "plans" in payload:  # host_plans.py
        rows = [_host_plan_row(plan) for plan in payload.pop("plans")]
    else:  # throughput.py, the baselines, compare.py, block_shapes.py, linear_attention.py
        model = payload.get("args", {}).get("model", "-")
        rows = [_result_row(row, model) for row in payload.pop("results", [])]
    return [row if row.get("date") else row | {"date": machine.get("date")} for row in rows]


def _result_row(row: dict, model: str) -> dict:
    """A row that already names its system, or a part of `model` timed alone (block_shapes.py, linear_attention.py)."""
    row = dict(row)
    if "system" not in row:
        row = {"system": "megatrain", "model": row.pop("model", model)} | row
        row.setdefault("scope", row.get("what") or "one block and the head at the run's shape")
        timed_ms = row.get("ms", row.get("block_ms"))
        row.setdefault("step_time_s", None if timed_ms is None else round(timed_ms / 1e3, 6))
    for key in ("tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops"):
        row.setdefault(key, None)  # a "does not fit" row measured none of them
    return row


def _block_rows(payload: dict) -> list[dict]:
    """block.py: one row per SDPA backend; the timed call is the forward plus the recompute + backward."""
    model, tokens, seq_len = payload.pop("model"), payload.pop("tokens"), payload.pop("seq_len")
    backward = "bwd from kept products" if payload.pop("kept_products", False) else "recompute+bwd"
    rows = []
    for backend, measured in payload.pop("variants").items():
        row = {
            "system": "megatrain",
            "model": model,
            "scope": f"one decoder block, fwd + {backward}, SDPA {backend}",
        }
        row |= {"tokens_per_step": tokens, "seq_len": seq_len, "tokens_per_s": None}
        if "error" in measured:
            rows.append(row | {"step_time_s": None, "model_tflops": None, "fits": False, "error": measured["error"]})
            continue
        step_s = (measured["forward_ms"] + measured["recompute_backward_ms"]) / 1e3
        rows.append(
            row | {"step_time_s": round(step_s, 6), "model_tflops": measured["model_tflops_ceiling"]} | measured
        )
    return rows


MOE_LAYER = "one MoE layer, fwd + recompute+bwd"
MOE_LAYER_KEPT = "one MoE layer, fwd + bwd from kept products"


def _layer_row(payload: dict) -> dict:
    """moe_block.py: one layer's fwd + recompute + bwd as the timed call (taken out of the payload)."""
    measured = {
        key: payload.pop(key) for key in list(payload) if key not in ("args", "commands", "command", "note", "notes")
    }
    return {
        "system": "megatrain",
        "model": measured.pop("model"),
        "scope": MOE_LAYER_KEPT if measured.get("kept_products") else MOE_LAYER,
        "tokens_per_step": measured.pop("tokens"),
        "seq_len": measured.pop("seq_len"),
        "step_time_s": round(measured["forward_recompute_backward_ms"] / 1e3, 6),
        "tokens_per_s": None,
        "model_tflops": measured.pop("model_tflops_ceiling", None),
    } | measured


def _kernel_row(payload: dict) -> dict:
    """kernel_table.py: one profiled step, its kernel time by kind."""
    args = payload.get("args", {})
    return {
        "system": "megatrain",
        "model": args.get("model", "-"),
        "scope": f"one profiled step, kernel time by kind ({payload.pop('timed')})",
        "seq_len": args.get("seq_len"),
        "tokens_per_step": args.get("tokens"),
        "micro_batch_seqs": args.get("micro_batch"),
        "step_time_s": payload.pop("profiled_step_s"),  # with the profiler's overhead: compare kinds, not this
        "tokens_per_s": None,
        "model_tflops": None,
        "kinds": payload.pop("kinds"),
        "largest_kernels": payload.pop("largest_kernels"),
    }


def _host_plan_row(plan: dict) -> dict:
    """host_plans.py: one plan of several hosts as a planner row."""
    plan = dict(plan)
    step_s = plan.pop("step_s")
    return {
        "system": "megatrain plan",
        "model": plan.pop("model"),
        "tokens_per_step": plan.pop("tokens_per_step"),
        "step_time_s": step_s,
        "predicted_step_s": step_s,
        "tokens_per_s": plan.pop("tokens_per_s"),
        "model_tflops": plan.pop("model_tflops"),
        "host_size_gib": plan.pop("host_gib"),  # the host's memory; host_memory_gib is what the plan takes of it
    } | plan


if __name__ == "__main__":
    sys.exit(main())
