"""The machine's rates the step-time model uses, and where they come from: defaults measured on an H100
machine, `megatrain plan --calibrate` (every rate, this machine), or a run's first plan of a shape on a GPU
(the block's and head's rates at that shape) or on the CPU (all of them), remembered per machine and shape in the
calibration file.
"""

import functools
import hashlib
import json
import math
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from megatrain_optim import adamw_update_, host_kernel
from megatrain_store import MACHINE_CACHE, atomic_write_text
from megatrain_zoo import (
    ModelConfig,
    ModelSpec,
    block_shape,
    build_model,
    generic_stages,
    linear_attention_flops_per_token,
)

from .errors import PlanError

CALIBRATION_FILE = MACHINE_CACHE / "calibration.json"


DEFAULT_RATES_SOURCE = "defaults (calibrated on an H100 machine, 16 cores, 2026-11-24)"


@dataclass(frozen=True)
class Rates:
    """Machine rates the performance model uses."""

    # the defaults are `megatrain plan --calibrate` on a lent H100 machine (16 cores), Qwen2.5-7B, seq 4096 x 4
    gpu_tflops: float = 605.3  # hardware bf16 rate of a decoder block, recompute + backward (7B shape)
    head_tflops: float = 630.8  # the chunked LM head + loss + its backward (Qwen2.5-7B vocabulary)
    pcie_gbps: float = 55.0  # pinned host<->GPU copy, one direction alone
    cpu_adam_params_per_s: float = 4.0e9  # fused AdamW on the host, in a step (beside the GPU's work and copies)
    disk_gbps: float = 1.55  # the disk tier's disk, reading and writing in turn (the H100 machine's virtio disk)
    moe_gpu_tflops: float = 300.0  # a MoE block (grouped expert GEMMs, routing, permutation), same count
    network_gbps: float = 50.0  # between hosts, each way, per host (an assumption: 400 Gb/s; not calibrated)
    pcie_duplex_gbps: float = 48.3  # each direction while the other copies too (the backward)
    # GPU-updated layers: their fused AdamW on the GPU plus the casts of their masters into the slots, a step
    gpu_adam_params_per_s: float = 66.6e9
    source: str = DEFAULT_RATES_SOURCE
    # what ran the host's AdamW when `cpu_adam_params_per_s` was measured (`host_kernel.kernel_name`): a machine's
    # rates measured with another kernel are measured again (megatrain's ran 16% faster than torch's in a step)
    cpu_adam_kernel: str = host_kernel.TORCH_FUSED
    # a layer keeping its matmul products (no GEMM recomputed), counted as `block_work` counts it; None: the
    # block's rate (at small shapes the GEMMs a kept layer skips are a smaller share of its time than of its work)
    gpu_kept_tflops: float | None = None
    # a MoE layer keeping its products, likewise (None: `moe_gpu_tflops`): its kept pass runs slower than its
    # recomputing one, whose extra forward is GEMMs (OLMoE-1B-7B at 4 x 4096 on an H200: 408 against 436)
    moe_gpu_kept_tflops: float | None = None
    # the chunked delta rule's forward kernels (`linear_attention_flops_per_token`'s forward third), what a layer
    # keeping its recurrence's results skips in its backward's recompute: 1.28 ms at Qwen3.5-0.8B's shape on an
    # H200 (23.5), 4.03 ms at the 27B's on an H100 (22.4), 16k tokens; not calibrated
    recurrence_tflops: float = 23.0
    # a packed base's values dequantized on the GPU a second, counted as the GPU time they take from the GEMMs
    # running beside them: one compiled kernel a weight, a dense-120b layer on an H200 (2026-11-29,
    # `benchmarks/dequantize.py`: 6.16 ms and 8.45 ms of 1.54G values); not calibrated by `megatrain plan`
    nf4_dequantize_values_per_s: float = 249e9
    int8_dequantize_values_per_s: float = 182e9


def block_rates(rates: Rates, moe: bool) -> tuple[float, float]:
    """A decoder layer's rates in TFLOPS (recomputing, keeping its products): a MoE model's or a dense one's."""
    if moe:
        return rates.moe_gpu_tflops, rates.moe_gpu_kept_tflops or rates.moe_gpu_tflops
    return rates.gpu_tflops, rates.gpu_kept_tflops or rates.gpu_tflops


@functools.cache
def templates_digest() -> str:
    """A digest of megatrain_templates' source files: the kernels a layer runs, which set its rate as torch's do (the
    fused elementwise kernels made a Qwen2.5-7B layer 4% faster with torch unchanged)."""
    import megatrain_templates

    digest = hashlib.sha1()
    for path in sorted(Path(megatrain_templates.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:8]


def calibration_key(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    device: torch.device = torch.device("cuda"),
    dtype=torch.bfloat16,
    spec: ModelSpec | None = None,
) -> str:
    """What a calibration is of: this machine's GPU (or, for a run on the CPU, its processor) and CPUs, its torch (whose
    kernels and compiler set the rates and which kinds of layer compile) and the templates' code (`templates_digest`),
    the dtype computed in, and a run's model and micro-batch shape (the rates depend on the shape: a Qwen2.5-0.5B block
    runs at half a 7B block's rate on an H100), and how the run builds its layers (`spec`: `_as_built`)."""
    digest = hashlib.sha1(repr(model).encode()).hexdigest()[:8]
    processor = (
        torch.cuda.get_device_name() if device.type == "cuda" else f"CPU {platform.processor() or platform.machine()}"
    )
    return (
        f"{processor}, {os.cpu_count()} CPUs, torch {torch.__version__}, templates {templates_digest()}, "
        f"host AdamW {host_kernel.kernel_name()}, {dtype}: "
        f"{model.arch} d_model {model.d_model}, {model.n_layers} layers, seq {seq_len} x {micro_batch} ({digest})"
        f"{_as_built(spec)}"
    )


def _as_built(spec: ModelSpec | None) -> str:
    """What of a run's build of its model (`build_model`'s) sets its layers' rate beside the model: a MoE layer's
    experts streamed in parts, LoRA's adapters over a frozen base; "" for neither (or no `spec`: whole layers, every
    weight trained)."""
    if spec is None:
        return ""
    built = f", experts in parts of {spec.experts_per_stage}" if spec.experts_per_stage else ""
    if spec.adapter is not None:
        built += f", LoRA r {spec.adapter.r} ({hashlib.sha1(repr(spec.adapter).encode()).hexdigest()[:8]})"
    return built


def _calibrations() -> dict:
    """The calibration file: {"machine": the newest `calibrate` here, "shapes": {key: rates}, "eager_kinds": {key:
    the kinds of generic layer Inductor failed to compile there (`generic_stages.eager_kinds`)}} (older files hold
    one rates object: the machine's; or no eager kinds)."""
    saved = json.loads(CALIBRATION_FILE.read_text()) if CALIBRATION_FILE.exists() else {"machine": None, "shapes": {}}
    return {"eager_kinds": {}} | (saved if "shapes" in saved else {"machine": saved, "shapes": {}})


def load_rates(key: str | None = None, saved: dict | None = None) -> Rates:
    """The rates measured for `key` (`calibration_key`) on this machine; else the newest calibration here;
    else the defaults. `saved`: the calibration file already read."""
    saved = saved or _calibrations()
    chosen = saved["shapes"].get(key) or saved["machine"]
    return Rates(**chosen) if chosen else Rates()


def save_rates(key: str, rates: Rates, machine: bool) -> None:
    """Remember `rates` for `key`, and with `machine` (all of them measured) as this machine's too; with them the
    kinds of generic layer that run eagerly (`generic_stages.KINDS_RUN_EAGERLY`: those the measurement found
    Inductor fails on)."""
    saved = _calibrations()
    saved["shapes"][key] = asdict(rates)
    saved["eager_kinds"][key] = generic_stages.eager_kinds()
    if machine:
        saved["machine"] = asdict(rates)
    CALIBRATION_FILE.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(CALIBRATION_FILE, json.dumps(saved, indent=2))


def run_rates(
    model: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    seq_len: int,
    micro_batch: int,
    measure: bool = True,
    spec: ModelSpec | None = None,
) -> Rates:
    """The rates to plan a run with: this machine's (`load_rates`), with the GPU's block and head rates at
    the run's own shape, measured the first time (seconds, most of them the kernels' compilation, which the
    run's warm-up then reuses; remembered) where `measure` allows and the run computes in bf16 on a CUDA GPU
    (the rates are bf16's); on the CPU, `cpu_rates`. PCIe and AdamW rates do not depend on the shape: the first
    shape measured on a machine measures them too (`_machine_rates`; a host whose AdamW moved 80-98 GB/s, against
    108-130 GB/s on another H200, ran a Qwen2.5-7B step 11.5% longer than the defaults predicted), and `megatrain
    plan --calibrate` again. Measuring beside other processes would time them too, so a launch of several leaves it
    to `megatrain plan`; without `measure` (engine.measure_rates: false, as the tests run: plans from remembered or
    default rates, the same on every machine) nothing is measured. `seq_len` and `micro_batch` (rows): the run's
    micro-batch shape; `spec`: the model as the run builds it (its experts in parts, its LoRA adapters: the layers
    measured are the run's), None: whole layers, every weight trained."""
    if not measure or (device.type == "cuda" and dtype != torch.bfloat16):
        return load_rates()
    if device.type == "cpu":
        return cpu_rates(model, dtype, seq_len, micro_batch, spec)
    with torch.cuda.device(device):
        key = calibration_key(model, seq_len, micro_batch, spec=spec)
        saved = _calibrations()
        if key in saved["shapes"]:
            generic_stages.run_eagerly(saved["eager_kinds"].get(key, []))  # (planned as eager, as measured)
            return load_rates(key, saved)
        machine_kernel = (saved["machine"] or {}).get("cpu_adam_kernel", host_kernel.TORCH_FUSED)
        # nothing of this machine's measured yet, or its AdamW with another kernel: its copies and AdamWs too
        first = saved["machine"] is None or machine_kernel != host_kernel.kernel_name()
        also = ", and its copies and AdamWs" if first else ""
        print(f"megatrain: measuring this GPU's block and head at the run's shape ({key}){also}, once", file=sys.stderr)
        machine = load_rates(key, saved)
        try:
            rates, took = _measure_run_shape(model, seq_len, micro_batch, device, machine, first, spec)
        except torch.OutOfMemoryError:  # a layer the GPU cannot time at this shape: this machine's rates will do
            return machine
        finally:
            torch.cuda.empty_cache()  # the plan counts the GPU's free memory
        print(f"megatrain: measured in {took}, kept for this shape", file=sys.stderr)
        if first:  # the machine's too, for other shapes: named by what of them is the machine's
            measured = f"PCIe and AdamWs measured {time.strftime('%Y-%m-%d')} with a run's first shape"
            save_rates(key, replace(rates, source=f"{measured}; the rest {machine.source}"), machine=True)
        save_rates(key, rates, machine=False)
        return rates


def _measure_run_shape(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    device: torch.device,
    machine: Rates,
    first: bool,
    spec: ModelSpec | None,
) -> tuple[Rates, str]:
    """`machine` with the GPU's block and head rates at a run's shape, and where this is the `first` shape the
    machine measures its PCIe and AdamW rates, measured now (its source says what was measured); how long it took."""
    start = time.perf_counter()
    FIRST_CALLS.seconds = 0.0
    with torch.random.fork_rng(devices=[device]):  # the run's random numbers stay its own
        layer_tflops, kept_tflops, head_tflops, layer_pass = measure_block_rates(model, seq_len, micro_batch, spec=spec)
        rates = _with_gpu_rates(machine, model, layer_tflops, kept_tflops, head_tflops)
        if first:
            rates = replace(rates, **_machine_rates(layer_pass), cpu_adam_kernel=host_kernel.kernel_name())
    took = f"{time.perf_counter() - start:.0f} s ({FIRST_CALLS.seconds:.0f} s of it compiling the run's kernels)"
    rest = "PCIe and both AdamWs with them" if first else f"the rest {machine.source}"
    source = f"GPU block and head measured {time.strftime('%Y-%m-%d')} at this shape in {took}; {rest}"
    return replace(rates, source=source), took


# A layer whose pass would take longer than this at the CPU's matrix-product rate is not timed (a 0.5B model's layer
# over 16k tokens: minutes): at that size its matrix products are its time, and their rate stands for its passes'.
CPU_PASS_LIMIT_S = 0.1


def cpu_rates(
    model: ModelConfig, dtype: torch.dtype, seq_len: int, micro_batch: int, spec: ModelSpec | None = None
) -> Rates:
    """The rates of a run whose device is this machine's CPU, measured here the first time (a second or two;
    remembered per processor, dtype and shape): its layers' and loss head's passes at the run's shape in `dtype` as
    the "GPU" rates (a small model's layer runs far below a large matrix product's rate: its many small operations
    take the time), or the matrix product's rate where a pass would be long (`CPU_PASS_LIMIT_S`); its memory copies
    as the "PCIe" ones (a slot is a host buffer), and its AdamW as both the host's and the "GPU's" optimizer; `spec`:
    `run_rates`'."""
    cpu = torch.device("cpu")
    key = calibration_key(model, seq_len, micro_batch, cpu, dtype, spec)
    saved = _calibrations()
    if key in saved["shapes"]:
        return Rates(**saved["shapes"][key])
    print(f"megatrain: measuring this CPU's layers, head and AdamW at the run's shape ({key}), once", file=sys.stderr)
    a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    matmul_tflops = _rounded(2 * 1024**3 / _host_seconds(lambda: a @ b) / 1e12)
    layer_tflops = kept_tflops = head_tflops = matmul_tflops
    frozen = spec is not None and spec.adapter is not None
    if layer_works(model, seq_len, micro_batch * seq_len, frozen)[0] / (matmul_tflops * 1e12) < CPU_PASS_LIMIT_S:
        with torch.random.fork_rng(devices=[]):
            layer_tflops, kept_tflops, head_tflops, _ = measure_block_rates(
                model, seq_len, micro_batch, cpu, dtype, spec
            )
    numel = _streamed_numel(model)
    source, target = torch.empty(numel), torch.empty(numel)
    copy_gbps = _rounded(source.numel() * 4 / _host_seconds(lambda: target.copy_(source)) / 1e9)
    adam = _rounded(_host_adam_params_per_s(numel))
    rates = Rates(
        gpu_tflops=layer_tflops,
        gpu_kept_tflops=kept_tflops,
        moe_gpu_tflops=layer_tflops,
        moe_gpu_kept_tflops=kept_tflops,
        head_tflops=head_tflops,
        pcie_gbps=copy_gbps,
        pcie_duplex_gbps=_rounded(copy_gbps / 2),
        cpu_adam_params_per_s=adam,
        gpu_adam_params_per_s=adam,
        cpu_adam_kernel=host_kernel.kernel_name(),
        source=f"this machine's CPU, measured {time.strftime('%Y-%m-%d')} at this shape ({key})",
    )
    save_rates(key, rates, machine=False)
    return rates


# A step this many times longer or shorter than its plan predicted shows rates that are not this machine's now, unless
# it is off by less than PREDICTION_OFF_MIN_S: a tiny run's steps (0.07 s against 0.03 predicted) vary that much alone.
PREDICTION_OFF, PREDICTION_OFF_MIN_S = 2.0, 0.1


def stale_rates_note(
    predicted_s: float,
    step_s: float,
    model: ModelConfig,
    device: torch.device,
    dtype,
    seq_len: int,
    micro_batch: int,
    spec: ModelSpec | None = None,
) -> str | None:
    """Where a run's step (`step_s`, past its warm-up) is PREDICTION_OFF times off the plan's `predicted_s` (and by
    PREDICTION_OFF_MIN_S or more), the rates measured for its shape (`run_rates`) are dropped, so that the next run of
    that shape measures them again (a measurement beside other work, say, is otherwise kept for good); what to say of
    it, or None. `spec`: the model as the run built it (`run_rates`')."""
    if 1 / PREDICTION_OFF <= step_s / predicted_s <= PREDICTION_OFF or abs(step_s - predicted_s) < PREDICTION_OFF_MIN_S:
        return None
    on_cpu = device.type == "cpu"
    key = calibration_key(
        model, seq_len, micro_batch, torch.device(device.type), dtype if on_cpu else torch.bfloat16, spec
    )
    saved = _calibrations()
    if saved["shapes"].pop(key, None) is None:
        return None  # (planned on rates of another shape or the defaults: nothing of this run's to drop)
    saved["eager_kinds"].pop(key, None)
    atomic_write_text(CALIBRATION_FILE, json.dumps(saved, indent=2))
    return (
        f"steps take {step_s:.2f} s where the plan predicted {predicted_s:.2f} s: the rates measured for this shape "
        "are off (measured beside other work?) and are dropped; the next run of this shape measures them again"
    )


def _streamed_numel(model: ModelConfig) -> int:
    """The elements a CPU's copy and AdamW rates are measured over: the model's largest layer's parameters (within
    2**16 to 2**25), whose copies and update stream through memory as the run's do. A fixed 16M-element buffer sat in
    a 2-core machine's 300 MiB cache: a 0.5B model's copies were planned at 42 GB/s and its AdamW at 2.6 G params/s
    where its layers' ran at a fraction of that."""
    largest = max(model.layer_params(layer) for layer in range(model.n_layers))
    return min(max(largest, 2**16), 2**25)


def _host_adam_params_per_s(n: int) -> float:
    """The fused AdamW's parameters a second on this machine's CPU."""
    p, g, m, v = (torch.full((n,), value) for value in (0.02, 1e-3, 1e-4, 1e-6))
    step = torch.tensor(1.0)
    return n / _host_seconds(lambda: _adamw([p], [g], [m], [v], step))


def _host_seconds(run: Callable[[], object], timed_s: float = 0.2) -> float:
    """Seconds a call of `run` takes on the CPU: the mean over about `timed_s` after one untimed call."""
    run()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < timed_s:
        run()
        calls += 1
    return (time.perf_counter() - start) / calls


def block_work(model: ModelConfig, seq_len: int, tokens: int, kept_layers: int = 0, frozen: bool = False) -> float:
    """FLOPs the GPU runs in the decoder layers per step: forward, recompute and backward (8 x
    parameters a token multiplies with, plus attention 8/6 of the counted), less the MLP's down projections
    (a dense layer's, a MoE layer's experts'), which the recompute skips (but where a dense layer's output is
    normed: Gemma, OLMo 2; where gpt-oss' down bias is scaled by the routing weight; and in a generic model's
    layers, which recompute all), and less the recompute's GEMMs in `kept_layers` (layers whose forward's
    matmul products are kept). Routers and experts count their active part; linear-attention layers their
    delta rule instead of attention. A `frozen` base (LoRA's) makes no weight gradient: 6 x parameters, not 8 (its
    adapters' few FLOPs aside)."""
    attention = 4 * _attention_forward(model, seq_len, tokens)
    matmul_layers = model.matmul_params - model.vocab_size * model.d_model
    moe_layers = sum(model.layer_is_moe(layer) for layer in range(model.n_layers))
    native = model.implementation == "native"  # (a generic layer skips none)
    dense_down = model.d_ff * model.d_model if native and model.norm_placement == "pre" else 0
    moe_down = model.n_experts_per_tok * model.moe_d_ff * model.d_model if native and model.arch != "gpt_oss" else 0
    skipped_down = 2 * ((model.n_layers - moe_layers) * dense_down + moe_layers * moe_down)
    # a layer's recompute GEMMs: 2 x its matmul parameters but the down projection (where skipped), on average
    recomputed_matmuls = (2 * matmul_layers - skipped_down) / model.n_layers * tokens
    per_param = 6 if frozen else 8
    return (per_param * matmul_layers - skipped_down) * tokens + attention - kept_layers * recomputed_matmuls


def _attention_forward(model: ModelConfig, seq_len: int, tokens: int) -> float:
    """FLOPs of the layers' attention forward (2 of the 8 a step counts: forward, recompute, backward), or their
    delta rule's."""
    n_linear = len(model.linear_attention_layers)
    attention = 2 * (model.n_layers - n_linear) * seq_len * model.n_heads * model.head_dim * tokens
    return attention + 2 / 6 * n_linear * linear_attention_flops_per_token(model) * tokens


def forward_work(model: ModelConfig, seq_len: int, tokens: int) -> float:
    """FLOPs of one decoder layer's forward, on average (`block_work`'s conventions): 2 x the parameters a token
    multiplies with, and attention's forward."""
    matmul_layers = model.matmul_params - model.vocab_size * model.d_model
    return (2 * matmul_layers * tokens + _attention_forward(model, seq_len, tokens)) / model.n_layers


def layer_works(model: ModelConfig, seq_len: int, tokens: int, frozen: bool = False) -> tuple[float, float]:
    """`block_work` of one dense layer recomputing, and of one keeping its products (of a `frozen` base's)."""
    all_layers = block_work(model, seq_len, tokens, frozen=frozen)
    whole = all_layers / model.n_layers
    return whole, whole - (all_layers - block_work(model, seq_len, tokens, 1, frozen))


def measure_disk_gbps(directory: Path, size: int = 2**30) -> float:
    """Bytes per second the disk under `directory` moves writing then reading a file, past the page cache."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "megatrain-disk-probe.bin"
    block = os.urandom(2**24)
    try:
        start = time.perf_counter()
        with open(path, "wb") as file:
            for _ in range(size // len(block)):
                file.write(block)
            file.flush()
            os.fsync(file.fileno())
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with open(path, "rb") as file:
            while file.read(2**24):
                pass
        return 2 * size / (time.perf_counter() - start) / 1e9
    finally:
        path.unlink(missing_ok=True)


def calibrate(model: ModelConfig, seq_len: int, micro_batch: int, state_dir: str | None = None) -> Rates:
    """Measure the rates on this machine (GPU block rate at the run's micro-batch shape, pinned
    PCIe bandwidth, CPU AdamW, and the disk tier's disk if `state_dir` is set) and save them."""
    if not torch.cuda.is_available():
        raise PlanError("megatrain plan --calibrate needs a CUDA GPU to measure")
    key = calibration_key(model, seq_len, micro_batch)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        rates = _measure_rates(model, seq_len, micro_batch, state_dir, load_rates(key))
    torch.cuda.empty_cache()  # a plan made next counts the GPU's free memory
    save_rates(key, rates, machine=True)
    return rates


def _with_gpu_rates(
    rates: Rates, model: ModelConfig, layer_tflops: float, kept_tflops: float | None, head_tflops: float
) -> Rates:
    """`rates` with `measure_block_rates`' results for `model`: a MoE model's layer rate is the MoE one, and
    the dense rates stay as they were (and the other way round)."""
    return replace(
        rates,
        gpu_tflops=rates.gpu_tflops if model.is_moe else layer_tflops,
        gpu_kept_tflops=rates.gpu_kept_tflops if model.is_moe else kept_tflops,
        moe_gpu_tflops=layer_tflops if model.is_moe else rates.moe_gpu_tflops,
        moe_gpu_kept_tflops=kept_tflops if model.is_moe else rates.moe_gpu_kept_tflops,
        head_tflops=head_tflops,
    )


def _rounded(rate: float) -> float:
    """Four significant digits (a tiny test model's block runs at hundredths of a TFLOPS)."""
    return float(f"{rate:.4g}")


# The seconds the measurements' first calls took: compiling the kernels (Inductor's, Triton's), which the run's own
# first steps then find compiled; the rest of a measurement is timing.
FIRST_CALLS = SimpleNamespace(seconds=0.0)


# A pass's measurement by device type: (wait for its work, seconds of warm-up calls, seconds of timed calls). A GPU
# just out of idle runs faster for a while: the best of three 250 ms windows put a Qwen2.5-7B block on an H100 at
# 632 TFLOPS, ten calls right after them at 593, which a 128k step's compute matches. A CPU's pass runs at its rate
# from the second call on, and a run on a CPU is small: shorter windows.
_TIMING = {"cuda": (torch.cuda.synchronize, 0.5, 1.0), "cpu": (lambda: None, 0.05, 0.2)}


def _sustained_seconds(run: Callable[[], None], device_type: str = "cuda") -> float:
    """Seconds a call of `run` takes on a device kept busy, as in a step: the mean of the calls of a timed window
    after a warm-up one (`_TIMING`); the first call's seconds count as compiling (`FIRST_CALLS`)."""
    synchronize, warm_s, timed_s = _TIMING[device_type]
    start = time.perf_counter()
    run()
    synchronize()
    FIRST_CALLS.seconds += time.perf_counter() - start
    start = time.perf_counter()
    run()
    synchronize()
    once = max(time.perf_counter() - start, 1e-6)
    for _ in range(math.ceil(warm_s / once)):
        run()
    calls = max(3, math.ceil(timed_s / once))
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    synchronize()
    return (time.perf_counter() - start) / calls


def measure_block_rates(
    model: ModelConfig,
    seq_len: int,
    micro_batch: int,
    device: torch.device = torch.device("cuda"),
    dtype: torch.dtype = torch.bfloat16,
    spec: ModelSpec | None = None,
) -> tuple[float, float | None, float, Callable[[], None]]:
    """The device's rates at a run's micro-batch shape computing in `dtype` (a GPU's in bf16), in TFLOPS as
    `block_work` counts them: its layers' forward, recompute and backward (one layer of each kind timed, weighted
    by how many layers it stands for: Qwen3.5's linear-attention layers run at a rate of their own beside its
    softmax ones, a model's first dense layers beside its MoE ones, a generic model's layers by their module and
    layer type), its dense layers' keeping their products likewise (None where the largest layer always
    recomputes: a generic one, or a MoE layer streamed in parts), and the loss head's (6 FLOPs per weight and
    token); and the largest layer's recomputing pass, to run beside other measurements. The layers are `spec`'s, as
    the run builds them (`build_model(model)` where None): a MoE layer in parts is timed as its stages run, a LoRA
    layer with its base frozen (its work counted without the base's weight gradient): at a whole full-training
    layer's rate, OLMoE's LoRA in four parts of its experts was planned at 0.69 s a step and ran 1.08 s (an H100)."""
    spec = spec or build_model(model)
    largest = max(range(model.n_layers), key=model.layer_params)
    kinds = _layer_kinds(model, spec)
    keepable = [_keeps_products(spec, layer) for layer in range(model.n_layers)]
    if spec.router_load is not None:  # the balance losses' statistics of one layer's pass, not a step's layers
        spec.router_load.n_layers = 1
    x = torch.randn(micro_batch, seq_len, model.d_model, device=device, dtype=dtype)
    tokens = micro_batch * seq_len
    whole, kept_layer = layer_works(model, seq_len, tokens, frozen=spec.adapter is not None)
    largest_passes = _layer_passes(spec, largest, x)

    def seconds_of(layers: list[int], keeping: bool) -> float:
        """All of one kind's `layers`, from one of them timed (the largest, where it is among them)."""
        chosen = largest_passes if largest in layers else _layer_passes(spec, layers[0], x)
        return len(layers) * _sustained_seconds(chosen[keeping], device.type)

    layer_tflops = _rounded(whole * model.n_layers / sum(seconds_of(layers, False) for layers in kinds.values()) / 1e12)
    kept_tflops = None
    if keepable[largest]:
        keeping_kinds = [layers for layers in kinds.values() if keepable[layers[0]]]
        kept_seconds = sum(seconds_of(layers, True) for layers in keeping_kinds)
        kept_tflops = _rounded(kept_layer * sum(map(len, keeping_kinds)) / kept_seconds / 1e12)
    grad_dtype = torch.promote_types(dtype, torch.float32)  # (the gradient buffers' as the engine's: fp32 or fp64)
    return layer_tflops, kept_tflops, _head_tflops(model, spec, x, grad_dtype), largest_passes[0]


def _keeps_products(spec: ModelSpec, layer: int) -> bool:
    """Whether decoder layer `layer` can keep its matmul products: one stage, whose template keeps them."""
    stages = spec.layer_stages(layer)
    return len(stages) == 1 and spec.stages[stages[0]].template.forward_keeping_products is not None


def _layer_passes(spec: ModelSpec, layer: int, x: Tensor) -> tuple[Callable[[], None], Callable[[], None] | None]:
    """Decoder layer `layer`'s forward and backward over the micro-batch `x` as the pipeline runs its stages (each
    prepared, then its forward; the backwards in reverse from its checkpoint): recomputing, and keeping its products
    (None where it cannot: `_keeps_products`). On one set of random weights, with a gradient buffer for each group the
    run trains (none for a frozen base); a layer's parts of its experts of one size share theirs: a pass's time reads
    no values."""
    frozen = spec.frozen_groups(set())
    grad_dtype = torch.promote_types(x.dtype, torch.float32)  # (the gradient buffers' as the engine's: fp32 or fp64)
    buffers: dict[tuple, tuple[list[Tensor], list[Tensor | None]]] = {}
    stages = []
    for index in spec.layer_stages(layer):
        stage = spec.stages[index]
        sizes = tuple(sum(p.numel for p in params) for params in stage.template.groups)
        trained = tuple(g not in frozen for g in stage.groups)
        if (sizes, trained) not in buffers:
            weights = [torch.randn(n, device=x.device, dtype=x.dtype) * 0.02 for n in sizes]
            grads = [torch.zeros(n, device=x.device, dtype=grad_dtype) if t else None for n, t in zip(sizes, trained)]
            buffers[sizes, trained] = weights, grads
        stages.append((stage.template, *buffers[sizes, trained]))

    def run(keeping: bool) -> None:
        _new_pass(spec)
        saved, h = [], x
        for template, weights, _ in stages:
            kwargs = {} if template.prepare is None else {"prepared": template.prepare(weights, h)}
            saved.append((template.checkpoint(h), kwargs))
            if keeping:  # (a layer of one stage)
                h, kwargs["products"] = template.forward_keeping_products(weights, h)
            else:
                h = template.forward(weights, h, **kwargs)
        grad = x
        for (template, weights, grads), (checkpoint, kwargs) in zip(reversed(stages), reversed(saved)):
            grad = template.backward(weights, checkpoint, grad, grads, **kwargs)

    kept = functools.partial(run, True) if _keeps_products(spec, layer) else None
    return functools.partial(run, False), kept


def _new_pass(spec) -> None:
    """Forget the router statistics of the pass before (as a step does)."""
    if spec.router_load is not None:
        spec.router_load.reset()


def _layer_kinds(model: ModelConfig, spec) -> dict[tuple, list[int]]:
    """The model's layers grouped by what fixes their speed: their template's `kind` (a generic model's module and
    layer type), else their block shape and whether they are MoE."""
    kinds: dict[tuple, list[int]] = {}
    for layer in range(model.n_layers):
        template = spec.stages[spec.layer_stages(layer)[0]].template
        kind = template.kind or (block_shape(model, layer), model.layer_is_moe(layer))
        kinds.setdefault(kind, []).append(layer)
    return kinds


def _head_tflops(model: ModelConfig, spec, x: Tensor, grad_dtype: torch.dtype) -> float:
    """The loss head's rate on the micro-batch `x` [batch, seq, d_model]: its GEMM, loss and backward, 6 FLOPs per
    weight and token."""
    head = spec.stages[-1].template  # the model's own (tied or not, Gemma's norm and soft-capping)
    head_weights = [
        torch.randn(sum(p.numel for p in group), device=x.device, dtype=x.dtype) * 0.02 for group in head.groups
    ]
    head_grads = [torch.zeros_like(weights, dtype=grad_dtype) for weights in head_weights]
    labels = torch.randint(0, model.vocab_size, x.shape[:2], device=x.device)
    head_s = _sustained_seconds(lambda: head.loss(head_weights, x, labels, 1.0, head_grads), x.device.type)
    return _rounded(6 * model.vocab_size * model.d_model * x.shape[0] * x.shape[1] / head_s / 1e12)


class _Copies:
    """256 MiB each way between pinned host memory and the GPU, on two streams."""

    def __init__(self):
        self.host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
        self.device = torch.empty_like(self.host, device="cuda")
        self.returned = torch.empty_like(self.host, pin_memory=True)
        self.outgoing = torch.empty_like(self.device)
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def queue(self, both_ways: bool) -> None:
        with torch.cuda.stream(self.streams[0]):
            self.device.copy_(self.host, non_blocking=True)
        if both_ways:  # as in the backward (weights in beside gradients out): each slower than alone
            with torch.cuda.stream(self.streams[1]):
                self.returned.copy_(self.outgoing, non_blocking=True)

    def gbps(self, both_ways: bool) -> float:
        """The best of three bursts (a remembered rate should not be one burst's hiccup: two calibrations
        on H100 machines of one session timed 31 and 55 GB/s)."""
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                self.queue(both_ways)
            torch.cuda.synchronize()
            rates.append(5 * self.host.numel() / (time.perf_counter() - start) / 1e9)
        return max(rates)


def _adamw(params, grads, exp_avgs, exp_avg_sqs, step) -> None:
    adamw_update_(
        params, grads, exp_avgs, exp_avg_sqs, step, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1
    )


def _device_adam_params_per_s() -> float:
    """A resident layer's share of a step: its fused AdamW on the GPU and its master cast into a slot twice."""
    n = 64 * 2**20
    master, grad, exp_avg, exp_avg_sq = (torch.rand(n, device="cuda") for _ in range(4))
    slot = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    step = torch.ones((), device="cuda")

    def update() -> None:
        _adamw([master], [grad], [exp_avg], [exp_avg_sq], step)
        slot.copy_(master)
        slot.copy_(master)

    update()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        update()
    torch.cuda.synchronize()
    return 5 * n / (time.perf_counter() - start)


def _cpu_adam_params_per_s(copies: _Copies, layer_pass: Callable[[], None]) -> float:
    """AdamW as in a step: on another thread, over groups far larger than the caches, while this thread launches
    a layer's forward and backward and weights stream in and gradients out. (Timed beside weight copies alone, it
    ran ~25% faster than in the steps; beside saturated copies both ways, ~25% slower.) One untimed update first
    starts the threads."""
    n = 256 * 2**20
    p, g, m, v = (torch.full((n,), value) for value in (0.02, 1e-3, 1e-4, 1e-6))  # randn: seconds of its own
    step = torch.tensor(1.0)

    def update(times: int) -> None:
        for _ in range(times):
            _adamw([p], [g], [m], [v], step)

    update(1)
    optimizer = threading.Thread(target=update, args=(8,))  # a second or so: a layer pass is 50 ms of it
    start = time.perf_counter()
    optimizer.start()
    while optimizer.is_alive():
        copies.queue(both_ways=True)
        layer_pass()
        torch.cuda.synchronize()
    return 8 * n / (time.perf_counter() - start)


def _machine_rates(layer_pass: Callable[[], None]) -> dict[str, float]:
    """The rates of this machine that no model's shape changes: PCIe's (one way, both ways), the GPU's AdamW of a
    resident layer, and the host's AdamW beside a layer's passes (`layer_pass`) and copies both ways, as in a step.
    A second or two."""
    copies = _Copies()
    copies.gbps(True)  # the first copies set up the streams and the host mappings
    pcie, pcie_duplex = copies.gbps(False), copies.gbps(True)
    rates = {
        "pcie_gbps": _rounded(pcie),
        "pcie_duplex_gbps": _rounded(pcie_duplex),
        "gpu_adam_params_per_s": _rounded(_device_adam_params_per_s()),
        "cpu_adam_params_per_s": _rounded(_cpu_adam_params_per_s(copies, layer_pass)),
    }
    del copies
    _empty_host_cache()
    return rates


def _empty_host_cache() -> None:
    """Give the pinned host memory freed here back to the system: torch's caching host allocator keeps freed pinned
    blocks for reuse (the copies' half a GiB, which the run's plan of host memory does not count)."""
    empty = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def _measure_rates(model: ModelConfig, seq_len: int, micro_batch: int, state_dir: str | None, previous: Rates) -> Rates:
    layer_tflops, kept_tflops, head_tflops, layer_pass = measure_block_rates(model, seq_len, micro_batch)
    return replace(
        _with_gpu_rates(previous, model, layer_tflops, kept_tflops, head_tflops),
        **_machine_rates(layer_pass),
        disk_gbps=_rounded(measure_disk_gbps(Path(state_dir))) if state_dir else previous.disk_gbps,
        source=f"calibrated {time.strftime('%Y-%m-%d')}: {calibration_key(model, seq_len, micro_batch)}",
    )
