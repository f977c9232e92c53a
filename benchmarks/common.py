"""Helpers shared by the benchmark scripts: machine facts, fast weight fill, JSON output in the one
results schema (`results_schema.py`), tables."""

import functools
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results_schema import check_results, normalize  # noqa: E402

from megatrain.config import ConfigError, load_config  # noqa: E402
from megatrain.planning import check_plan, make_planner  # noqa: E402
from megatrain_zoo import flops_per_token  # noqa: E402


def machine() -> dict:
    """This machine as results files record it: device, GPU and host memory in GiB, cores, torch, date."""
    info = {"torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M")}
    info |= {"device": "cpu", "gpu_memory_gib": None, "host_memory_gib": None, "cpu_cores": None}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    try:
        info["host_memory_gib"] = round(int(Path("/proc/meminfo").read_text().split()[1]) / 2**20, 1)
        info["cpu_cores"] = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip())
    except (OSError, ValueError):
        pass
    return info


def base_row(system, name, model, seq_len, n_seqs, micro_seqs, step_s) -> dict:
    """The fields every system reports for one measured point."""
    tokens = n_seqs * seq_len
    return {
        "system": system,
        "model": name,
        "params_b": round(model.n_params / 1e9, 3),
        "active_params_b": round(model.active_params / 1e9, 3),
        "seq_len": seq_len,
        "tokens_per_step": tokens,
        "micro_batch_seqs": micro_seqs,
        "step_time_s": round(step_s, 3),
        "tokens_per_s": round(tokens / step_s),
        "model_tflops": round(flops_per_token(model, seq_len) * tokens / step_s / 1e12, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
    }


def scope_row(name: str, model, seq_len: int, micro_seqs: int, scope: str) -> dict:
    """The fields of a row that times a part of a run (`scope`), not whole steps: its step fields null."""
    return {
        "system": "megatrain",
        "model": name,
        "scope": scope,
        "params_b": round(model.n_params / 1e9, 3),
        "seq_len": seq_len,
        "micro_batch_seqs": micro_seqs,
        "tokens_per_step": None,
        "step_time_s": None,
        "tokens_per_s": None,
        "model_tflops": None,
    }


def fill_random_(flat: torch.Tensor, std: float, block: int = 1 << 24) -> None:
    """Fill a large host buffer with N(0, std) values quickly: one random block, tiled (drawn once per dtype, std
    and block: a 120B model's 530 tensors each drew 16M values, 0.28 s a draw on 2 cores).

    Benchmarks need realistic values (zeros run faster on some kernels), not independent ones."""
    pattern = _random_block(block, flat.dtype, std)
    for start in range(0, flat.numel(), pattern.numel()):
        chunk = flat[start : start + pattern.numel()]
        chunk.copy_(pattern[: chunk.numel()])


@functools.cache
def _random_block(numel: int, dtype: torch.dtype, std: float) -> torch.Tensor:
    return torch.randn(numel, dtype=dtype) * std


ADAMW_BYTES_PER_PARAM = 28  # the fused CPU AdamW reads the fp32 weight, gradient and two moments, writes three back


def timed(run, steps: int) -> float:
    """Mean seconds of `steps` calls of `run`, the GPU's queued work finished before and after (where there is one)."""
    synchronize = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        run()
    synchronize()
    return (time.perf_counter() - start) / steps


# what a row timed by `steady_steps` records as its `timing` (rows without one drained the last step's updates)
STEADY_STATE = (
    "steady state: the window runs from the warm-up step's end to the last timed step's end, the step before's "
    "updates in flight at both ends (benchmarks/throughput.py since 2026-11-30)"
)


def steady_steps(trainer, next_batch, steps: int, warmup: int) -> dict:
    """`warmup` training steps on `next_batch()`, then `steps` timed ones, in a run's steady state: seconds a step,
    the warm-up's seconds, the timed steps' losses and global gradient norms, and where the window starts
    (`perf_counter`).

    The window runs from the end of the last warm-up step to the end of the last timed one, and at both ends the
    step before's updates (the CPU's, after clipping) are still running beside what comes next, as between any two
    steps of a run. Draining them inside the window would charge one step's whole CPU update to a few steps
    (Qwen2.5-7B at 32k with clipping: 0.67 s over 3 steps, 7%); they are drained after it."""
    warm0 = time.perf_counter()
    for _ in range(warmup):
        trainer.train_step(next_batch())
    wall0 = time.perf_counter()
    with HostStalls() as stalls:
        metrics = [trainer.train_step(next_batch()) for _ in range(steps)]
    step_s = (time.perf_counter() - wall0) / steps
    trainer.finish_updates()
    torch.cuda.synchronize()
    stalls = stalls.per_step(steps)
    return {
        "step_s": step_s,
        "warmup_s": wall0 - warm0,
        "losses": [m.loss for m in metrics],
        "grad_norms": [m.grad_norm for m in metrics],
        "window_start": wall0,
        "stalls": stalls,
    }


class HostStalls:
    """What stops the host thread mid-step, counted over a window, where a trace shows only a longer span: the
    CUDA caching allocator's retries (an allocation that finds the device full frees the cache, which waits for
    every stream first), its device-wide waits, and Python's garbage collections (seconds, by generation)."""

    ALLOCATOR = {"alloc_retries": "num_alloc_retries", "device_waits": "num_sync_all_streams"}

    def __enter__(self) -> "HostStalls":
        self.allocator = self._allocator_counts()
        self.gc_s, self._gc_start = [0.0, 0.0, 0.0], 0.0
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)
        self.allocator = {name: n - self.allocator[name] for name, n in self._allocator_counts().items()}

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_s[info["generation"]] += time.perf_counter() - self._gc_start

    def _allocator_counts(self) -> dict:
        stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        return {name: stats.get(key, 0) for name, key in self.ALLOCATOR.items()}

    def per_step(self, steps: int) -> dict:
        """Each count a step, and the collector's seconds a step by generation."""
        return {name: round(n / steps, 2) for name, n in self.allocator.items()} | {
            f"gc_gen{generation}_s": round(s / steps, 4) for generation, s in enumerate(self.gc_s)
        }


def write_results(path: Path, payload: dict) -> None:
    """Write a script's payload as a results file in the one schema (its rows dated, its command line recorded).
    A payload that fails the schema's check goes to PATH.rejected.json instead, so no measurement is lost,
    and ValueError names every problem."""
    payload = normalize(payload)
    problems = check_results(payload)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path.with_name(path.stem + ".rejected.json") if problems else path
    target.write_text(json.dumps(payload, indent=2) + "\n")
    if problems:
        raise ValueError(f"{target}: does not fit benchmarks/results_schema.py: " + "; ".join(problems))


def table(rows: list[dict], columns: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = ["  ".join(c.rjust(widths[c]) for c in columns)]
    lines += ["  ".join(str(r.get(c, "")).rjust(widths[c]) for c in columns) for r in rows]
    return "\n".join(lines)


H200_MEMORY = int(139.8 * 2**30)  # an H200's memory as torch reports it, for plans of one


def planned_row(overrides: list[str], rates, host_gib: int) -> dict:
    """The planned step of the config `overrides` make, on one H200 and a host of `host_gib` GiB with `rates`, as a
    results row ("megatrain plan"), and whether the host holds it (refusal: the planner's words where it does not)."""
    config = load_config(None, overrides)
    planner = make_planner(config, rates=rates, gpu_memory=H200_MEMORY, host_memory=host_gib * 2**30)
    plan = planner.plan(planner.place(planner.step_tokens))
    try:
        check_plan(plan, planner)
        refusal = None
    except ConfigError as error:
        refusal = str(error)
    return {
        "system": "megatrain plan",
        "model": config.model.preset,
        "host_size_gib": host_gib,
        "params_b": round(plan.n_params / 1e9, 1),
        "host_memory_gib": round(plan.host_bytes / 2**30, 1),
        "host_bytes_per_param": round(plan.host_bytes_per_param, 2),
        "host_holds_it": refusal is None,
        "tokens_per_step": plan.tokens_per_step,
        "seq_len": config.data.seq_len,
        "step_time_s": round(plan.step_s, 2),
        "predicted_step_s": round(plan.step_s, 2),
        "tokens_per_s": round(plan.tokens_per_s),
        "model_tflops": round(plan.model_tflops, 1),
        "bound": plan.bound,
        "optimizer_s": round(plan.optimizer_s, 2),
        **({"refusal": refusal} if refusal else {}),
    }
