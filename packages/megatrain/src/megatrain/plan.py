"""`megatrain plan`: will a configuration fit, and how fast will it run?

Memory is counted from the same numbers the store and scheduler allocate. Step time
comes from a small performance model: GPU work at a measured rate, host<->GPU copies at
a measured PCIe bandwidth, the CPU optimizer at a measured rate, each overlapped the way
the engine overlaps them, plus the step-boundary bubble (the embedding's update). The
rates default to the H100 machine's measurements; `megatrain plan --calibrate` measures
them on the current machine and saves them.
"""

import functools
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from megatrain_optim import STATE_NAMES
from megatrain_store import atomic_write_text, bytes_per_param
from megatrain_zoo import ModelConfig, build_model, flops_per_token, linear_attention_flops_per_token

from .config import Config, ConfigError, model_config_of, resolve_device, resolve_dtype

CALIBRATION_FILE = Path(os.environ.get("MEGATRAIN_CACHE", Path.home() / ".cache" / "megatrain")) / "calibration.json"
# the forward's share of a step's GPU work (forward 2, recompute 2, backward 4 FLOPs per weight and token)
FORWARD_SHARE = 0.25
LOGITS_CHUNK_BYTES = 3 * 2**30  # the head's fp32 logits chunk plus its bf16 copies
# With engine.experts_per_stage auto, a MoE layer streams in parts once its two slots, two gradients
# and recompute would take more than this share of the GPU: the rest is for activation checkpoints.
LAYER_GPU_SHARE = 0.5
# Landing buffers when updates run as gradients arrive, in largest groups (the embedding's room
# holds several layers'): at least enough for the optimizer to lag the backward by a few layers;
# more where it is slower than the backward (small steps), see `gradient_pool_size`.
GRADIENT_POOL = 3
# With engine.disk_state_fraction auto, moments go to disk until the plan fits this share of
# host memory: the rest is page cache for the disk tier's read-ahead and write-behind.
DISK_TIER_RAM_SHARE = 0.85
# GPU memory the scheduler leaves free beside kept layers' products, past what fixed_gpu counts: the CUDA
# context and allocator slack
KEPT_RESERVE_BYTES = 3 * 2**30
# With engine.held_layers auto, the blocks' weights stay on the GPU from forward to backward, in at most
# this share of its memory, where the CPU optimizer takes longer than the GPU's work (small steps): the
# second copy in of every weight then no longer competes with the optimizer for host memory bandwidth.
HELD_GPU_SHARE = 0.25
# With engine.gpu_updated_layers auto, the first blocks' masters and moments live and are updated on the GPU,
# in at most this share of its memory, where the CPU optimizer is slower than the GPU's work (small steps)...
GPU_UPDATED_SHARE = 0.75
# ... until the CPU optimizer's time (and the head's, which waits for it) is within this share of the GPU's
# work: its rate varies by 20% between machines and in a step, and a step it holds back loses more than
# the kept layers that memory would have held save.
CPU_OPTIMIZER_MARGIN = 0.8
# With engine.host_kept_layers auto (large steps), kept products also go to pinned host memory, up to this
# share of it with the rest of the plan, and only as many as the forward's idle copy-out carries at
# HOST_KEPT_PCIE_SHARE of the link while the layers between two of them compute (each waits for the one
# before to be out; the backward, three times longer, brings them back beside the weights).
HOST_KEPT_RAM_SHARE = 0.85
HOST_KEPT_PCIE_SHARE = 0.8
# ... and only where the CPU optimizer takes under this share of the GPU's work: their copies go through the
# host memory the optimizer's updates are bound by (Qwen2.5-7B at 32k on an H100, optimizer 1.6-1.9 s of a
# 2.8 s step: 2 such layers 2.80-2.82 s against 2.80 with none; 7B at 128k, 1-1.6 of 7.7 s: +0.7%)
HOST_KEPT_OPTIMIZER_SHARE = 0.5


def available_host_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    source: str = "defaults (calibrated on an H100 machine, 16 cores, 2026-11-24)"
    # a layer keeping its matmul products (no GEMM recomputed), counted as `block_work` counts it; None: the
    # block's rate (at small shapes the GEMMs a kept layer skips are a smaller share of its time than of its work)
    gpu_kept_tflops: float | None = None


@dataclass
class Plan:
    n_params: int
    active_params: int
    host_bytes: int
    host_bytes_per_param: float
    host_available: int | None
    disk_bytes: int  # optimizer state in the disk tier's files
    first_disk_group: int  # groups from here on keep their optimizer state on disk
    gpu_bytes: int
    gpu_available: int | None
    offloaded_layers: int  # layers whose activation checkpoints go to pinned host memory
    checkpoint_bytes: int  # all layers' checkpoints
    tokens_per_step: int
    compute_s: float
    transfer_s: float
    optimizer_s: float
    disk_s: float
    bubble_s: float
    step_s: float
    tokens_per_s: float
    model_tflops: float
    rates: Rates
    bound: str = "compute"  # what sets the step time: compute, pcie, cpu_optimizer, disk or network
    compute_bound_tokens: int = 0  # tokens per step from which the GPU's work is the longest part
    gpus: int = 1  # per host
    hosts: int = 1
    network_bytes: int = 0  # sent by each host per step (gradients, and weights where hosts split the state)
    network_s: float = 0.0
    split_state: bool = False  # the hosts split the master weights and moments (engine.shard_across_hosts)
    experts_per_stage: int = 0  # a MoE layer's experts streamed in parts of this many (0: whole layers)
    # [tokens, d_model] activation checkpoints a micro-batch keeps (offloaded_layers of them offloaded)
    checkpoint_stages: int = 0
    # gradient landing pool, in largest groups' gradients (store.grad_pool); 0: one buffer per group
    gradient_pool: float = 0.0
    kept_layers: int = 0  # layers whose forward keeps its matmul products for the backward (no GEMM recomputed)
    kept_bytes: int = 0  # GPU memory their products hold
    held_layers: int = 0  # block stages (the first) whose weights stay on the GPU from forward to backward
    held_bytes: int = 0  # GPU memory those weights take
    gpu_updated_layers: int = 0  # block stages (the first) whose masters and moments live and update on the GPU
    gpu_updated_bytes: int = 0  # GPU memory their state takes (and, with clipping, their gradients)
    host_kept_layers: int = 0  # kept layers (before those on the GPU) whose products wait in pinned host memory
    host_kept_bytes: int = 0  # host memory those products take (in host_bytes)

    def as_dict(self) -> dict:
        return asdict(self)


def calibration_key(model: ModelConfig, seq_len: int, micro_batch: int) -> str:
    """What a calibration is of: this machine's GPU and CPUs, and a run's model and micro-batch shape (the
    GPU's rates depend on the shape: a Qwen2.5-0.5B block runs at half a 7B block's rate on an H100)."""
    digest = hashlib.sha1(repr(model).encode()).hexdigest()[:8]
    return (
        f"{torch.cuda.get_device_name()}, {os.cpu_count()} CPUs: {model.arch} d_model {model.d_model}, "
        f"{model.n_layers} layers, seq {seq_len} x {micro_batch} ({digest})"
    )


def _calibrations() -> dict:
    """The calibration file: {"machine": the newest `calibrate` here, "shapes": {key: rates}} (older files
    hold one rates object: the machine's)."""
    if not CALIBRATION_FILE.exists():
        return {"machine": None, "shapes": {}}
    saved = json.loads(CALIBRATION_FILE.read_text())
    return saved if "shapes" in saved else {"machine": saved, "shapes": {}}


def load_rates(key: str | None = None, saved: dict | None = None) -> Rates:
    """The rates measured for `key` (`calibration_key`) on this machine; else the newest calibration here;
    else the defaults. `saved`: the calibration file already read."""
    saved = saved or _calibrations()
    chosen = saved["shapes"].get(key) or saved["machine"]
    return Rates(**chosen) if chosen else Rates()


def save_rates(key: str, rates: Rates, machine: bool) -> None:
    """Remember `rates` for `key`, and with `machine` (all of them measured) as this machine's too."""
    saved = _calibrations()
    saved["shapes"][key] = asdict(rates)
    if machine:
        saved["machine"] = asdict(rates)
    CALIBRATION_FILE.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(CALIBRATION_FILE, json.dumps(saved, indent=2))


def run_rates(config: Config, model: ModelConfig, measure: bool = True) -> Rates:
    """The rates to plan a run with: this machine's (`load_rates`), with the GPU's block and head rates at
    the run's own shape, measured the first time (seconds, most of them the kernels' compilation, which the
    run's warm-up then reuses; remembered) where `measure` allows and the run computes in bf16 on a CUDA GPU
    (the rates are bf16's). PCIe and CPU rates do not depend on the shape and vary from one burst to the
    next: `megatrain plan --calibrate` measures them. Measuring beside other processes would time them too,
    so a launch of several leaves it to `megatrain plan`; MEGATRAIN_MEASURE_RATES=0 turns it off (the tests:
    plans from remembered or default rates, the same on every machine)."""
    device = resolve_device(config.device)
    measure = measure and os.environ.get("MEGATRAIN_MEASURE_RATES", "1") != "0"
    if not measure or device.type != "cuda" or resolve_dtype(config.precision.compute_dtype, device) != torch.bfloat16:
        return load_rates()
    seq_len, micro_batch = config.data.seq_len, config.train.micro_batch_size
    with torch.cuda.device(device):
        key = calibration_key(model, seq_len, micro_batch)
        saved = _calibrations()
        machine = load_rates(key, saved)
        if key in saved["shapes"]:
            return machine
        print(f"megatrain: measuring this GPU's block and head at the run's shape ({key}), once", file=sys.stderr)
        try:
            with torch.random.fork_rng(devices=[device]):  # the run's random numbers stay its own
                layer_tflops, kept_tflops, head_tflops, _ = measure_gpu_rates(model, seq_len, micro_batch)
        except torch.OutOfMemoryError:  # a layer that fits the GPU only in parts: this machine's rates will do
            return machine
        finally:
            torch.cuda.empty_cache()  # the plan counts the GPU's free memory
        rates = replace(
            _with_gpu_rates(machine, model, layer_tflops, kept_tflops, head_tflops),
            source=f"GPU block and head measured {time.strftime('%Y-%m-%d')} at this shape; the rest {machine.source}",
        )
        save_rates(key, rates, machine=False)
        return rates


@functools.cache  # a plan asks for the same model's stages several times (layout, kept layers)
def _built(model: ModelConfig, experts_per_stage: int):
    return build_model(model, experts_per_stage)


def layout_sizes(model: ModelConfig, experts_per_stage: int = 0) -> tuple[list[int], list[int], int]:
    """(parameters per store group in store order, parameters each stage binds, how many [tokens,
    d_model] activation checkpoints a micro-batch keeps), as megatrain_zoo builds the model."""
    spec = _built(model, experts_per_stage)
    groups = [sum(p.numel for p in group.params) for group in spec.groups]
    stages = [sum(groups[g] for g in stage.groups) for stage in spec.stages]
    planes = sum(getattr(stage.template, "checkpoint_planes", 1) for stage in spec.stages[1:-1])
    return groups, stages, planes


def gpu_updated_groups(spec, layers: int) -> list[int]:
    """The groups (of a built model `spec`) whose masters and moments live on the GPU for
    engine.gpu_updated_layers = `layers`: the first `layers` blocks', and with any, the embedding table's:
    it is the last gradient of a step and the first weight of the next, so the step boundary then waits
    for no copy out, CPU update or copy in. Tied, the head's other groups (its norm) with it: a stage binds
    groups updated on the GPU only, or none."""
    if not layers:
        return []
    groups = {g for stage in spec.stages[1 : 1 + layers] for g in stage.groups}
    table = set(spec.stages[0].groups)
    groups |= table
    groups.update(g for stage in spec.stages[1:] if table & set(stage.groups) for g in stage.groups)
    return sorted(groups)


def mlp_width_per_token(model: ModelConfig) -> int:
    """The widest MLP hidden state one token makes in any layer (k experts + shared expert, or d_ff)."""
    moe = model.n_experts_per_tok * model.moe_d_ff + model.shared_expert_d_ff
    return max(moe if model.layer_is_moe(layer) else model.d_ff for layer in range(model.n_layers))


def block_work(model: ModelConfig, seq_len: int, tokens: int, kept_layers: int = 0) -> float:
    """FLOPs the GPU runs in the decoder layers per step: forward, recompute and backward (8 x
    parameters a token multiplies with, plus attention 8/6 of the counted), less the dense MLP's
    down projection, which the dense recompute skips (but where its output is normed: Gemma, OLMo 2), and less
    the recompute's GEMMs in `kept_layers` (dense layers whose forward's matmul products are kept).
    Routers and experts count their active part; linear-attention layers their delta rule instead of attention."""
    n_linear = len(model.linear_attention_layers)
    attention = 8 * (model.n_layers - n_linear) * seq_len * model.n_heads * model.head_dim * tokens
    attention += 8 / 6 * n_linear * linear_attention_flops_per_token(model) * tokens
    matmul_layers = model.matmul_params - model.vocab_size * model.d_model
    dense_layers = sum(not model.layer_is_moe(layer) for layer in range(model.n_layers))
    down = 0 if model.norm_placement != "pre" else model.d_ff * model.d_model
    skipped_down = 2 * dense_layers * down
    # a dense layer's recompute GEMMs: 2 x its matmul parameters but the down projection (where skipped)
    recomputed_matmuls = 2 * (matmul_layers / model.n_layers - down) * tokens
    return (8 * matmul_layers - skipped_down) * tokens + attention - kept_layers * recomputed_matmuls


def layer_works(model: ModelConfig, seq_len: int, tokens: int) -> tuple[float, float]:
    """`block_work` of one dense layer recomputing, and of one keeping its products."""
    all_layers = block_work(model, seq_len, tokens)
    whole = all_layers / model.n_layers
    return whole, whole - (all_layers - block_work(model, seq_len, tokens, 1))


def kept_bytes_per_token(model: ModelConfig, element_size: int) -> int:
    """GPU bytes per token that one kept layer's matmul products hold; 0 where the layers always recompute."""
    template = _built(model, 0).stages[-2].template
    keeps = callable(getattr(template, "forward_keeping_products", None))
    return template.product_bytes_per_token(element_size) if keeps else 0


def first_disk_group(
    config: Config, model: ModelConfig, sizes: list[int], ram_bytes: int, host_available: int | None
) -> int:
    """The first group (of `sizes`, parameters per group) whose optimizer state goes to the disk tier
    (the last groups go): with disk_state_fraction auto, as few as bring `ram_bytes` within the
    host's share for the run."""
    if not config.engine.optimizer_state_dir:
        return len(sizes)
    fraction = config.engine.disk_state_fraction
    state_per_param = 4 * len(STATE_NAMES)
    if fraction != "auto":
        to_move = fraction * model.n_params
    elif host_available is None:
        to_move = model.n_params
    else:
        to_move = (ram_bytes - DISK_TIER_RAM_SHARE * host_available) / state_per_param
    first = len(sizes)
    while first > 0 and to_move > 0:
        first -= 1
        to_move -= sizes[first]
    return first


def slowest(parts: dict[str, float]) -> str:
    """The phase that bounds a step; the first of those within rounding of it (compute wins ties: a pass
    whose copies are hidden sums to the same seconds by another path)."""
    longest = max(parts.values())
    return next(name for name, seconds in parts.items() if seconds >= longest * (1 - 1e-9))


def host_memory_limit() -> int | None:
    """Host memory the run may use: MEGATRAIN_HOST_MEMORY_GIB if set (machines whose
    MemAvailable grows as memory is touched), else MemAvailable."""
    override = os.environ.get("MEGATRAIN_HOST_MEMORY_GIB")
    return int(float(override) * 2**30) if override else available_host_bytes()


def make_plan(
    config: Config,
    model: ModelConfig | None = None,
    rates: Rates | None = None,
    gpu_memory: int | None = None,
    gpus: int = 1,
    hosts: int = 1,
    host_memory: int | None = None,
) -> Plan:
    """The plan for `config` on this machine's GPU, or on one with `gpu_memory` bytes, and the host memory
    it has available now, or `host_memory` bytes (a run's own, asked after it has allocated); with `gpus`
    per host and `hosts` (data parallel: a replica of the state per host, or the state split over
    them with engine.shard_across_hosts) host bytes are per host, GPU bytes per GPU, and the step
    splits the global batch over every GPU."""
    model = model or model_config_of(config)
    rates = rates or load_rates()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.precision.compute_dtype, device)
    element = torch.finfo(dtype).bits // 8
    full_grads = config.train.grad_clip > 0
    split = config.engine.shard_across_hosts and hosts > 1
    wire_copy = (config.engine.wire_copy or split) and dtype != torch.float32
    per_param = bytes_per_param(dtype, len(STATE_NAMES), full_grads, wire_copy)
    tokens = config.train.batch_size * config.data.seq_len
    gpu_tokens = tokens // (gpus * hosts)  # each GPU runs its share of the global batch
    micro_tokens = config.train.micro_batch_size * config.data.seq_len
    layer_checkpoint = gpu_tokens * model.d_model * element
    # one micro-batch's recompute: q/k/v/attention/outputs/norms ~ 8 x d_model, MLP 3 x its width, in the
    # compute dtype (a MoE layer's width is that of its k experts and shared expert, plus the tokens' copies)
    width = mlp_width_per_token(model) + (model.n_experts_per_tok * model.d_model if model.is_moe else 0)
    recompute = micro_tokens * (8 * model.d_model + 3 * width) * element
    gpu_available = gpu_memory
    if gpu_available is None and device.type == "cuda":
        gpu_available = torch.cuda.get_device_properties(device).total_memory

    @functools.cache  # asked again for the parts chosen
    def layout(experts_per_stage: int):
        """(group sizes, stage sizes, checkpoints per micro-batch, GPU bytes of two slots, two gradients and a
        recompute)"""
        groups, stages, planes = layout_sizes(model, experts_per_stage)
        fixed = 2 * max(stages) * element + 2 * max(groups) * 4 + recompute + LOGITS_CHUNK_BYTES
        return groups, stages, planes, fixed

    experts_per_stage = choose_experts_per_stage(config, model, gpu_available, lambda e: layout(e)[3])
    sizes, stage_sizes, n_checkpoints, fixed_gpu = layout(experts_per_stage)
    largest_group = max(sizes)
    holdable = stage_sizes[1:-2]  # the blocks but the last (its backward finds its rotating slot still full)

    checkpoints = layer_checkpoint * n_checkpoints
    offload = config.engine.offload_checkpoints
    if offload == "auto":  # as the scheduler decides: what does not fit in half the free GPU memory
        fit = (
            n_checkpoints
            if gpu_available is None
            else max(0, int(0.5 * (gpu_available - fixed_gpu) // layer_checkpoint))
        )
        offloaded = max(0, n_checkpoints - fit)
    else:
        offloaded = n_checkpoints if offload else 0
    # layers whose forward keeps its matmul products: as the scheduler decides, the last ones, as many as the GPU
    # holds beside the checkpoints and a reserve (the head's chunk, two gradients and a recompute in
    # fixed_gpu, plus what the scheduler keeps free)
    per_token_kept = kept_bytes_per_token(model, element) if not experts_per_stage else 0
    trailing_dense = next(
        (count for count, layer in enumerate(reversed(range(model.n_layers))) if model.layer_is_moe(layer)),
        model.n_layers,
    )
    keepable = max(0, min(trailing_dense, model.n_layers)) if per_token_kept else 0
    stage_products = gpu_tokens * per_token_kept  # one kept layer's products, the step's

    def room_at(tokens_per_gpu: int, offloaded_there: int | None = None) -> float:
        """GPU bytes left beside the step's fixed needs and checkpoints (all but `offloaded_there`, by default
        the plan's, with one of those back ahead of its backward), for kept products and held weights."""
        offloaded_there = offloaded if offloaded_there is None else offloaded_there
        there = n_checkpoints - offloaded_there + (1 if offloaded_there else 0)
        checkpoints_there = there * tokens_per_gpu * model.d_model * element
        return min(gpu_available - KEPT_RESERVE_BYTES, 0.9 * gpu_available) - fixed_gpu - checkpoints_there

    host_kept = 0  # kept layers whose products wait in host memory, decided with the host's room below

    def kept_at(tokens_per_gpu: int, offloaded_there: int | None = None) -> int:
        if config.engine.kept_layers != "auto":
            return min(config.engine.kept_layers, keepable)
        if gpu_available is None or not keepable:
            return 0
        room = room_at(tokens_per_gpu, offloaded_there) - reserved_bytes
        return min(keepable, max(0, int(room // (tokens_per_gpu * per_token_kept))))

    # performance model, first what sizes the gradient pool
    counted = flops_per_token(model, config.data.seq_len) * tokens
    layer_rate = rates.moe_gpu_tflops if model.is_moe else rates.gpu_tflops
    kept_rate = layer_rate if model.is_moe else rates.gpu_kept_tflops or layer_rate

    def head_seconds(tokens_per_gpu: int) -> float:
        return 6 * model.vocab_size * model.d_model * tokens_per_gpu / (rates.head_tflops * 1e12)

    def blocks_seconds(tokens_per_gpu: int, kept: int) -> float:
        """The decoder layers' GPU time, `kept` of them keeping their products."""
        whole, kept_layer = layer_works(model, config.data.seq_len, tokens_per_gpu)
        return ((model.n_layers - kept) * whole / layer_rate + kept * kept_layer / kept_rate) / 1e12

    def gpu_seconds(tokens_per_gpu: int) -> float:
        return blocks_seconds(tokens_per_gpu, kept_at(tokens_per_gpu) + host_kept) + head_seconds(tokens_per_gpu)

    def optimizer_seconds(cpu_params: int) -> float:
        return cpu_params / (hosts if split else 1) / rates.cpu_adam_params_per_s

    # GPU-updated blocks (the first, and the embedding with the head's norm where tied): 12 B/param of masters
    # and moments, and with clipping their gradients kept there until the norm is known; one process per machine
    # only
    device_state_per_param = 4 * (1 + len(STATE_NAMES)) + (4 if full_grads else 0)
    n_blocks = len(stage_sizes) - 2
    spec = _built(model, experts_per_stage)

    def gpu_updated_params_of(layers: int) -> int:
        return sum(sizes[g] for g in gpu_updated_groups(spec, layers))

    reserved_bytes = 0  # held weights and GPU-updated state: what kept_at leaves room for
    wire = element if wire_copy else 4  # bytes a weight crosses PCIe in
    pcie, pcie_duplex = rates.pcie_gbps * 1e9, rates.pcie_duplex_gbps * 1e9
    # The step boundary, where the CPU updates the embedding and the first block: their gradients are the step's
    # last, their weights the next's first, so the GPU waits for them to go out, be updated and come back (of
    # the table, the rows the next step's tokens read: the rest is updated beside its forward)
    table_group = spec.stages[0].groups[0]
    first_rows = min(model.vocab_size, gpu_tokens) * model.d_model
    first_params = first_rows + sum(sizes[g] for g in spec.stages[1].groups)
    boundary_s = first_params / rates.cpu_adam_params_per_s + first_params * (wire + 4) / pcie
    # what a layer keeping its products saves of the GPU's work
    recompute_saved_s = blocks_seconds(gpu_tokens, 0) - blocks_seconds(gpu_tokens, 1)
    optimizer_s = optimizer_seconds(model.n_params)
    # a small step: the CPU optimizer would take longer than the GPU's work, so GPU memory is worth more
    # holding weights and updating the first blocks than keeping activations
    small_step = gpu_seconds(gpu_tokens) < optimizer_s
    if config.engine.gpu_updated_layers != "auto":
        gpu_updated = min(config.engine.gpu_updated_layers, n_blocks)
    elif gpu_available is None or offloaded or gpus * hosts > 1:
        gpu_updated = 0
    elif not small_step:  # the GPU is the bound: only the step boundary's wait is worth the memory
        reserved_bytes = gpu_updated_params_of(1) * device_state_per_param
        # (the kept layers' products whose room its state takes: none where every layer keeps them anyway)
        displaced = reserved_bytes / stage_products if kept_at(gpu_tokens) < keepable else 0.0
        displaced_s = displaced * recompute_saved_s
        first_on_gpu = table_group in gpu_updated_groups(spec, 1)
        fits = reserved_bytes <= min(GPU_UPDATED_SHARE * gpu_available, room_at(gpu_tokens))
        gpu_updated = 1 if first_on_gpu and fits and boundary_s > displaced_s else 0
    else:  # the fewest that bring the CPU optimizer (and the head, which waits for it) within the GPU's work
        budget = min(GPU_UPDATED_SHARE * gpu_available, room_at(gpu_tokens))
        gpu_updated = 0
        while gpu_updated < n_blocks:
            on_gpu = gpu_updated_params_of(gpu_updated)
            reserved_bytes = on_gpu * device_state_per_param
            cpu_s = optimizer_seconds(model.n_params - on_gpu) + head_seconds(gpu_tokens)
            if cpu_s <= CPU_OPTIMIZER_MARGIN * gpu_seconds(gpu_tokens):
                break
            if gpu_updated_params_of(gpu_updated + 1) * device_state_per_param > budget:
                break
            gpu_updated += 1
    gpu_updated_params = gpu_updated_params_of(gpu_updated)
    gpu_updated_bytes = gpu_updated_params * device_state_per_param
    reserved_bytes = gpu_updated_bytes
    optimizer_s = optimizer_seconds(model.n_params - gpu_updated_params)
    holdable = holdable[gpu_updated:]  # (those updated on the GPU need no held copy)
    if config.engine.held_layers != "auto":
        held_layers = min(config.engine.held_layers, len(holdable))
    elif gpu_available is None or offloaded or not small_step:
        held_layers = 0
    else:
        budget = min(HELD_GPU_SHARE * gpu_available, room_at(gpu_tokens) - reserved_bytes)
        held_so_far = itertools.accumulate(size * element for size in holdable)
        held_layers = sum(1 for _ in itertools.takewhile(lambda held: held <= budget, held_so_far))
    held_params = sum(holdable[:held_layers])
    held_bytes = held_params * element
    reserved_bytes += held_bytes
    host_available = host_memory if host_memory is not None else host_memory_limit()
    if offload == "auto" and config.engine.kept_layers == "auto" and keepable and not small_step:
        # as the scheduler decides: the fewest first checkpoints offloaded that let the most layers keep their
        # products (large steps, whose GPU is the bound: the copies ride on time PCIe has to spare), as many
        # as the host holds beside the rest of the plan
        limit = n_checkpoints
        if host_available is not None:
            around = model.n_params * per_param + GRADIENT_POOL * largest_group * 4
            room = HOST_KEPT_RAM_SHARE * host_available - around
            limit = max(offloaded, min(n_checkpoints, int(room // (gpus * layer_checkpoint))))
        most = kept_at(gpu_tokens, limit)
        while offloaded < limit and kept_at(gpu_tokens, offloaded) < most:
            offloaded += 1
    gpu_bytes = fixed_gpu + (n_checkpoints - offloaded) * layer_checkpoint
    kept_layers = kept_at(gpu_tokens)

    def host_backward_s(compute_s: float) -> float:
        """The part of the backward that lands gradients in host memory: all but the GPU-updated blocks',
        which come last."""
        return (1 - FORWARD_SHARE) * compute_s * (1 - gpu_updated_params / model.n_params)

    if full_grads:
        gradient_pool = 0.0
    elif config.engine.gradient_pool != "auto":
        gradient_pool = float(config.engine.gradient_pool)
    else:
        gradient_pool = gradient_pool_size(optimizer_s, host_backward_s(gpu_seconds(gpu_tokens)), sizes, rates)
    pool = gradient_pool * largest_group * 4
    if split:  # a host holds its 1/H of masters, moments and gradients, and a whole copy to stream
        per_param = element + (per_param - (element if wire_copy else 0)) / hosts
        pool /= hosts
    host_bytes = model.n_params * per_param + pool + gpus * offloaded * layer_checkpoint
    deeper_pool = config.engine.gradient_pool == "auto" and gradient_pool > GRADIENT_POOL
    if host_available is not None and deeper_pool and host_bytes > 0.9 * host_available:
        host_bytes -= (gradient_pool - GRADIENT_POOL) * largest_group * 4 / (hosts if split else 1)
        gradient_pool = float(GRADIENT_POOL)  # the deeper pool is a speed-up, not worth the host memory it lacks
    first_disk = first_disk_group(config, model, sizes, host_bytes, host_available)
    disk_bytes = sum(sizes[first_disk:]) * 4 * len(STATE_NAMES)
    host_bytes -= disk_bytes

    # kept layers' products in pinned host memory, the layers before those kept on the GPU: where the step
    # is the GPU's (not small), as many as the host's room and the forward's idle copy-out time allow
    candidates = max(0, keepable - kept_layers)
    if config.engine.host_kept_layers != "auto":
        host_kept = min(config.engine.host_kept_layers, candidates)
    elif (
        gpu_available is None
        or host_available is None
        or small_step
        or disk_bytes
        or not stage_products
        or config.engine.kept_layers == 0  # products kept nowhere, as asked
        or optimizer_s > HOST_KEPT_OPTIMIZER_SHARE * gpu_seconds(gpu_tokens)
    ):
        host_kept = 0
    else:
        host_room = HOST_KEPT_RAM_SHARE * host_available - host_bytes
        # one layer's forward, less its checkpoint's copy out, against one stage's copy out: how many layers
        # apart they must be
        link = HOST_KEPT_PCIE_SHARE * rates.pcie_gbps * 1e9
        layer_forward_s = FORWARD_SHARE * gpu_seconds(gpu_tokens) / model.n_layers
        layer_forward_s -= (layer_checkpoint / link) * offloaded / n_checkpoints
        spacing = stage_products / link / max(layer_forward_s, 1e-9)
        host_kept = max(
            0, min(candidates, int(host_room // (gpus * stage_products)), int(candidates / max(1.0, spacing)))
        )
    if host_kept:  # a stage of them on the GPU on its way out or back: the kept layers make room
        reserved_bytes += stage_products
        kept_layers = kept_at(gpu_tokens)
        host_kept = min(host_kept, keepable - kept_layers)
    host_kept_bytes = gpus * host_kept * stage_products
    host_bytes += host_kept_bytes
    kept_bytes = kept_layers * stage_products
    gpu_bytes += kept_bytes + reserved_bytes

    # weights go in twice a step (forward, backward) and fp32 gradients out once, on a duplex link;
    # a MoE model moves every expert, used or not
    # (held layers' weights go in once, GPU-updated layers' not at all, nor do their gradients go out)
    streamed = model.n_params - gpu_updated_params
    transfer_s = max((2 * streamed - held_params) * wire, 4 * streamed) / pcie
    # neither pass runs faster than its weights arrive (the backward's gradients leave meanwhile, on
    # the link's other direction): a MoE forward, a quarter of little active work, often waits for them
    weight_pass_s = streamed * wire / pcie
    # (and the kept products and offloaded checkpoints, back in the backward; out in the forward, on the
    # otherwise idle copy-out)
    activations_out = host_kept * stage_products + offloaded * layer_checkpoint
    backward_weights_s = ((streamed - held_params) * wire + activations_out) / pcie_duplex
    activations_out_s = activations_out / pcie
    # each GPU's link carries every weight in; gradients out and the optimizer's work are split over
    # the GPUs of a host (and its cores over their processes), so the host's total stays the same
    # a replica per host: each host sends and receives its gradient shards' share of a ring all-reduce;
    # split: the other hosts' parts of its gradient sum (a reduce-scatter), then its updated part of
    # the weights to each of them
    fraction = (hosts - 1) / hosts
    network_bytes = int(fraction * (4 + element) * model.n_params if split else 2 * fraction * 4 * model.n_params)
    network_s = network_bytes / (rates.network_gbps * 1e9)
    # split: a host's updated part goes out group by group as the optimizer finishes each (beside it)
    exchange_s = fraction * element * model.n_params / (rates.network_gbps * 1e9) if split else 0.0
    bubble_s = 0.0 if table_group in gpu_updated_groups(spec, gpu_updated) else boundary_s
    disk_s = 2 * disk_bytes / (rates.disk_gbps * 1e9)  # every step reads and writes the state on disk

    # GPU-updated blocks compute with no copy to wait for, first in the forward and last in the backward:
    # only the other blocks' work hides the copies (the held blocks' forward copies may start while the
    # GPU-updated blocks compute: their buffers are their own)
    on_gpu_share = gpu_updated_params / model.n_params
    held_copy_s = held_params * wire / pcie

    # the GPU-updated layers' AdamW and casts run on the compute stream, no copy to hide behind them
    device_update_s = gpu_updated_params / rates.gpu_adam_params_per_s

    def phases(tokens_per_gpu: int) -> dict[str, float]:
        """What each bound would make a step of `tokens_per_gpu` last."""
        layers_s = gpu_seconds(tokens_per_gpu)
        compute_s = layers_s + device_update_s
        forward_compute_s, backward_compute_s = FORWARD_SHARE * layers_s, (1 - FORWARD_SHARE) * layers_s
        early_s = min(held_copy_s, on_gpu_share * forward_compute_s)
        forward_s = on_gpu_share * forward_compute_s + max(
            (1 - on_gpu_share) * forward_compute_s, weight_pass_s - early_s, activations_out_s
        )
        backward_s = (
            on_gpu_share * backward_compute_s
            + device_update_s
            + max((1 - on_gpu_share) * backward_compute_s, backward_weights_s, streamed * 4 / pcie_duplex)
        )
        # Updates applied as gradients land start after the head and, first layers first, run beside the
        # backward and the next forward, which reaches the head once the last is done: with a pool deep
        # enough for what the optimizer has left when the backward ends, only the head waits for them, else
        # the whole forward does. With clipping they start after the backward, and the next backward
        # waits for the forward they pace.
        if full_grads:
            serial_s = (1 - FORWARD_SHARE) * compute_s
        elif gradient_pool >= gradient_pool_size(optimizer_s, host_backward_s(compute_s), sizes, rates):
            serial_s = head_seconds(tokens_per_gpu)
        else:
            serial_s = forward_s
        return {
            "compute": compute_s,
            "pcie": forward_s + backward_s,  # = compute where both passes hide their copies (compute wins ties)
            "cpu_optimizer": max(optimizer_s, exchange_s) + serial_s,
            "disk": disk_s,
            "network": network_s,
        }

    parts = phases(gpu_tokens)
    compute_s = parts["compute"]
    bound = slowest(parts)
    step_s = parts[bound] + bubble_s

    def compute_bound(tokens_per_gpu: int) -> bool:
        bounds = phases(tokens_per_gpu)
        return slowest(bounds) == "compute"

    # compute grows with the tokens, the rest (nearly) does not: the step is compute-bound from here on
    low, high = 0, max(1, gpu_tokens)
    while not compute_bound(high) and high < 2**40:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if compute_bound(middle) else (middle, high)
    compute_bound_tokens = high * gpus * hosts if compute_s else 0
    return Plan(
        model.n_params,
        model.active_params,
        host_bytes,
        host_bytes / model.n_params,
        host_available,
        disk_bytes,
        first_disk,
        gpu_bytes,
        gpu_available,
        offloaded,
        checkpoints,
        tokens,
        compute_s,
        transfer_s,
        optimizer_s,
        disk_s,
        bubble_s,
        step_s,
        tokens / step_s,
        counted / step_s / 1e12,
        rates,
        bound,
        compute_bound_tokens,
        gpus,
        hosts,
        network_bytes,
        network_s,
        split,
        experts_per_stage,
        n_checkpoints,
        gradient_pool,
        kept_layers,
        kept_bytes,
        held_layers,
        held_bytes,
        gpu_updated,
        gpu_updated_bytes,
        host_kept,
        host_kept_bytes,
    )


def gradient_pool_size(optimizer_s: float, backward_s: float, sizes: list[int], rates: Rates) -> float:
    """The gradient pool, in largest groups (`sizes`: parameters per group): GRADIENT_POOL, or where the
    optimizer takes longer than the part of the backward that lands its gradients (`backward_s`), room for
    the gradients it has not taken when that part ends plus two of the largest (the embedding's, which
    lands last, and room for first-fit's gaps), so that the backward never waits for it (one did at a pool
    one smaller, on a machine whose optimizer ran below its rate: a 16k-token 7B step waited 0.2 s for
    room for the embedding's gradient)."""
    left = max(0.0, optimizer_s - backward_s) * rates.cpu_adam_params_per_s
    return max(float(GRADIENT_POOL), math.ceil(2 + left / max(sizes)))


def choose_experts_per_stage(config: Config, model: ModelConfig, gpu_available: int | None, fixed_gpu) -> int:
    """engine.experts_per_stage resolved, 0 for whole layers (and dense models). auto: whole layers
    unless a layer's slots, gradients and recompute (`fixed_gpu(experts_per_stage)`, bytes) would take
    over LAYER_GPU_SHARE of the GPU, then the fewest parts (2, 4, 8, ...) that do not, so that the
    rest stays for activation checkpoints."""
    n = model.n_experts
    setting = config.engine.experts_per_stage
    if not model.is_moe:
        return 0
    if setting != "auto":
        return setting if setting < n else 0
    parts = 1
    while gpu_available is not None and parts < n and fixed_gpu(-(-n // parts)) > LAYER_GPU_SHARE * gpu_available:
        parts *= 2
    return 0 if parts == 1 else -(-n // min(parts, n))


def check_plan(plan: Plan, config: Config, model: ModelConfig) -> None:
    """Refuse, before anything is allocated, a run that cannot work, naming the fix."""
    if config.data.seq_len > model.max_seq_len:
        raise ConfigError(
            f"data.seq_len {config.data.seq_len} is larger than the model allows (max_position_embeddings "
            f"{model.max_seq_len}); lower data.seq_len"
        )
    if plan.gpu_updated_layers:
        if plan.gpus * plan.hosts > 1:
            raise ConfigError(
                f"engine.gpu_updated_layers: {plan.gpu_updated_layers} needs one process holding all of the state; "
                f"with {plan.gpus * plan.hosts} GPUs set engine.gpu_updated_layers: 0 (or auto)"
            )
        on_gpu = gpu_updated_groups(_built(model, plan.experts_per_stage), plan.gpu_updated_layers)
        if max(on_gpu) >= plan.first_disk_group:
            raise ConfigError(
                f"engine.gpu_updated_layers: {plan.gpu_updated_layers} reaches the layers whose optimizer state is on "
                "disk (engine.optimizer_state_dir); set engine.gpu_updated_layers: auto or fewer"
            )
    if plan.host_available is not None and plan.host_bytes > 0.95 * plan.host_available:
        if plan.host_kept_layers and plan.host_bytes - plan.host_kept_bytes <= 0.95 * plan.host_available:
            raise ConfigError(
                f"engine.host_kept_layers: {plan.host_kept_layers} keeps {plan.host_kept_bytes / 2**30:.1f} GiB of "
                f"matmul products in host memory, which with the rest of the run "
                f"({(plan.host_bytes - plan.host_kept_bytes) / 2**30:.1f} GiB) passes the "
                f"{plan.host_available / 2**30:.1f} GiB available; set engine.host_kept_layers: auto or fewer"
            )
        largest = 0.95 * plan.host_available / plan.host_bytes_per_param
        raise ConfigError(
            f"{model.arch} with {plan.n_params / 1e9:.2f}B parameters needs {plan.host_bytes / 2**30:.1f} GiB of host "
            f"memory ({plan.host_bytes_per_param:.1f} B/param) but {plan.host_available / 2**30:.1f} GiB is available; "
            f"the largest model that fits has about {largest / 1e9:.1f}B parameters"
            + ("; train.grad_clip: 0 saves 4 B/param" if config.train.grad_clip > 0 else "")
            + (
                f"; engine.shard_across_hosts: true splits the state over the {plan.hosts} hosts"
                if plan.hosts > 1 and not plan.split_state
                else ""
            )
            + (
                ""
                if config.engine.optimizer_state_dir
                else "; engine.optimizer_state_dir moves optimizer state to disk"
            )
        )
    if plan.disk_bytes:
        state_dir = Path(config.engine.optimizer_state_dir)
        existing = next(p for p in (state_dir, *state_dir.parents) if p.exists())
        free = shutil.disk_usage(existing).free
        if plan.disk_bytes > free:
            raise ConfigError(
                f"the disk tier needs {plan.disk_bytes / 2**30:.1f} GiB in {state_dir} but its disk has "
                f"{free / 2**30:.1f} GiB free; free space, choose another engine.optimizer_state_dir, or set "
                "engine.disk_state_fraction lower"
            )
    if plan.gpu_available is not None and plan.gpu_bytes > 0.95 * plan.gpu_available:
        if plan.gpu_bytes - plan.kept_bytes <= 0.95 * plan.gpu_available:
            raise ConfigError(
                f"engine.kept_layers: {plan.kept_layers} keeps {plan.kept_bytes / 2**30:.1f} GiB of activations "
                f"on the GPU, more than its {plan.gpu_available / 2**30:.1f} GiB leave beside the rest of the "
                "step; set engine.kept_layers: auto (as many as fit) or fewer"
            )
        if plan.held_layers and plan.gpu_bytes - plan.held_bytes <= 0.95 * plan.gpu_available:
            raise ConfigError(
                f"engine.held_layers: {plan.held_layers} holds {plan.held_bytes / 2**30:.1f} GiB of weights on the "
                f"GPU, more than its {plan.gpu_available / 2**30:.1f} GiB leave beside the rest of the step; set "
                "engine.held_layers: auto or fewer"
            )
        if plan.gpu_updated_layers and plan.gpu_bytes - plan.gpu_updated_bytes <= 0.95 * plan.gpu_available:
            raise ConfigError(
                f"engine.gpu_updated_layers: {plan.gpu_updated_layers} keeps {plan.gpu_updated_bytes / 2**30:.1f} GiB "
                f"of weights and moments on the GPU, more than its {plan.gpu_available / 2**30:.1f} GiB leave beside "
                "the rest of the step; set engine.gpu_updated_layers: auto or fewer"
            )
        per_sequence = plan.checkpoint_bytes // config.train.batch_size
        kept = plan.checkpoint_bytes * (plan.checkpoint_stages - plan.offloaded_layers) // plan.checkpoint_stages
        fixed = plan.gpu_bytes - kept - plan.kept_bytes - plan.held_bytes - plan.gpu_updated_bytes
        largest_batch = max(0, int((0.95 * plan.gpu_available - fixed) // per_sequence))
        if largest_batch < config.train.micro_batch_size:  # not even one micro-batch: the layers themselves
            raise ConfigError(
                f"the step needs {plan.gpu_bytes / 2**30:.1f} GiB of GPU memory but the GPU has "
                f"{plan.gpu_available / 2**30:.1f} GiB: the largest layer alone takes {fixed / 2**30:.1f} GiB (two "
                "weight slots, its fp32 gradient and one micro-batch's recompute); lower train.micro_batch_size"
                + (
                    ", stream the experts in smaller parts (engine.experts_per_stage below "
                    f"{plan.experts_per_stage or model.n_experts})"
                    if model.is_moe and plan.experts_per_stage != 1
                    else ""
                )
                + " or use a GPU with more memory"
            )
        raise ConfigError(
            f"the step needs {plan.gpu_bytes / 2**30:.1f} GiB of GPU memory but the GPU has "
            f"{plan.gpu_available / 2**30:.1f} GiB; set engine.offload_checkpoints: true, lower "
            f"train.micro_batch_size, or use train.batch_size <= {largest_batch}"
        )


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
        raise ConfigError("megatrain plan --calibrate needs a CUDA GPU to measure")
    key = calibration_key(model, seq_len, micro_batch)
    with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
        rates = _measure_rates(model, seq_len, micro_batch, state_dir, load_rates(key))
    torch.cuda.empty_cache()  # a plan made next counts the GPU's free memory
    save_rates(key, rates, machine=True)
    return rates


def _with_gpu_rates(
    rates: Rates, model: ModelConfig, layer_tflops: float, kept_tflops: float | None, head_tflops: float
) -> Rates:
    """`rates` with `measure_gpu_rates`' results for `model`: a MoE model's layer rate is the MoE one, and
    the dense rates stay as they were (and the other way round)."""
    return replace(
        rates,
        gpu_tflops=rates.gpu_tflops if model.is_moe else layer_tflops,
        gpu_kept_tflops=rates.gpu_kept_tflops if model.is_moe else kept_tflops,
        moe_gpu_tflops=layer_tflops if model.is_moe else rates.moe_gpu_tflops,
        head_tflops=head_tflops,
    )


def _rounded(rate: float) -> float:
    """Four significant digits (a tiny test model's block runs at hundredths of a TFLOPS)."""
    return float(f"{rate:.4g}")


def _sustained_seconds(run: Callable[[], None], warm_s: float = 0.5, timed_s: float = 1.0) -> float:
    """Seconds a call of `run` takes on a GPU kept busy, as in a step: the mean over `timed_s` of calls after
    `warm_s` of them. (A GPU just out of idle runs faster for a while: the best of three 250 ms windows put
    a Qwen2.5-7B block on an H100 at 632 TFLOPS, ten calls right after them at 593, which a 128k step's
    compute matches.)"""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - start, 1e-6)
    for _ in range(math.ceil(warm_s / once)):
        run()
    calls = max(3, math.ceil(timed_s / once))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def measure_gpu_rates(
    model: ModelConfig, seq_len: int, micro_batch: int
) -> tuple[float, float | None, float, Callable[[], None]]:
    """This GPU's rates at a run's micro-batch shape, in TFLOPS as `block_work` counts them: its layers'
    forward, recompute and backward (one layer of each kind timed, weighted by how many layers it stands for:
    Qwen3.5's linear-attention layers run at a rate of their own beside its softmax ones, a model's first dense
    layers beside its MoE ones), its dense layers' keeping their products likewise (None where the largest layer
    is a MoE layer, which always recomputes), and the loss head's (6 FLOPs per weight and token); and the largest
    layer's recomputing pass, to run beside other measurements."""
    from megatrain_zoo import build_model
    from megatrain_zoo.model import block_shape

    spec = build_model(model)
    largest = max(range(model.n_layers), key=model.layer_params)
    kinds: dict[tuple, list[int]] = {}
    for layer in range(model.n_layers):
        kinds.setdefault((block_shape(model, layer), model.layer_is_moe(layer)), []).append(layer)
    x = torch.randn(micro_batch, seq_len, model.d_model, device="cuda", dtype=torch.bfloat16)

    def passes(layer: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """Layer `layer`'s recomputing pass and its pass keeping its products."""
        block = spec.stages[layer + 1].template
        weights = [torch.randn(block.numel, device="cuda", dtype=torch.bfloat16) * 0.02]
        grads = [torch.zeros(block.numel, device="cuda")]

        def layer_pass() -> None:
            block.forward(weights, x)
            block.backward(weights, x, x, grads)

        def kept_layer_pass() -> None:
            _, products = block.forward_keeping_products(weights, x)
            block.backward(weights, x, x, grads, products=products)

        return layer_pass, kept_layer_pass

    tokens = micro_batch * seq_len
    whole, kept_layer = layer_works(model, seq_len, tokens)
    largest_passes = passes(largest)

    def seconds_of(layers: list[int], keeping: bool) -> float:
        """All of one kind's `layers`, from one of them timed (the largest, where it is among them)."""
        return len(layers) * _sustained_seconds((largest_passes if largest in layers else passes(layers[0]))[keeping])

    layer_tflops = _rounded(whole * model.n_layers / sum(seconds_of(layers, False) for layers in kinds.values()) / 1e12)
    kept_tflops = None
    if not model.layer_is_moe(largest):
        dense_kinds = [layers for (_, moe), layers in kinds.items() if not moe]
        kept_seconds = sum(seconds_of(layers, True) for layers in dense_kinds)
        kept_tflops = _rounded(kept_layer * sum(map(len, dense_kinds)) / kept_seconds / 1e12)
    head = spec.stages[-1].template  # the model's own (tied or not, Gemma's norm and soft-capping)
    head_weights = [
        torch.randn(sum(p.numel for p in group), device="cuda", dtype=torch.bfloat16) * 0.02 for group in head.groups
    ]
    head_grads = [torch.zeros_like(weights, dtype=torch.float32) for weights in head_weights]
    labels = torch.randint(0, model.vocab_size, (micro_batch, seq_len), device="cuda")
    head_s = _sustained_seconds(lambda: head.loss(head_weights, x, labels, 1.0, head_grads))
    head_tflops = _rounded(6 * model.vocab_size * model.d_model * tokens / head_s / 1e12)
    return layer_tflops, kept_tflops, head_tflops, largest_passes[0]


def _measure_rates(model: ModelConfig, seq_len: int, micro_batch: int, state_dir: str | None, previous: Rates) -> Rates:
    from megatrain_optim import adamw_update_

    layer_tflops, kept_tflops, head_tflops, layer_pass = measure_gpu_rates(model, seq_len, micro_batch)
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    returned = torch.empty_like(host, pin_memory=True)
    outgoing = torch.empty_like(device)
    copies = [torch.cuda.Stream(), torch.cuda.Stream()]

    def copy_gbps(both_ways: bool) -> float:
        """The best of three bursts (a remembered rate should not be one burst's hiccup: two calibrations
        on H100 machines of one session timed 31 and 55 GB/s)."""
        rates = []
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                with torch.cuda.stream(copies[0]):
                    device.copy_(host, non_blocking=True)
                if both_ways:  # as in the backward (weights in beside gradients out): each slower than alone
                    with torch.cuda.stream(copies[1]):
                        returned.copy_(outgoing, non_blocking=True)
            torch.cuda.synchronize()
            rates.append(5 * host.numel() / (time.perf_counter() - start) / 1e9)
        return max(rates)

    copy_gbps(True)  # the first copies set up the streams and the host mappings
    pcie, pcie_duplex = copy_gbps(False), copy_gbps(True)

    # a GPU-updated layer's share of a step: its fused AdamW on the GPU, its master cast into a slot twice
    n_device = 64 * 2**20
    masters, device_grads, exp_avgs, exp_avg_sqs = (torch.rand(n_device, device="cuda") for _ in range(4))
    slot = torch.empty(n_device, device="cuda", dtype=torch.bfloat16)
    device_step = torch.ones((), device="cuda")

    def device_update() -> None:
        adamw_update_(
            [masters],
            [device_grads],
            [exp_avgs],
            [exp_avg_sqs],
            device_step,
            lr=1e-4,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
        )
        slot.copy_(masters)
        slot.copy_(masters)

    device_update()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        device_update()
    torch.cuda.synchronize()
    gpu_adam = 5 * n_device / (time.perf_counter() - start)

    # AdamW as in a step: on another thread, over groups far larger than the caches, while this thread
    # launches the layer's forward and backward and weights stream in and gradients out. (Timed beside
    # weight copies alone, it ran ~25% faster than in the steps; beside saturated copies both ways, ~25%
    # slower.) One untimed update first starts the threads.
    n = 256 * 2**20
    p, g, m, v = (torch.full((n,), value) for value in (0.02, 1e-3, 1e-4, 1e-6))  # randn: seconds of its own
    step = torch.tensor(1.0)

    def update(times: int) -> None:
        for _ in range(times):
            adamw_update_([p], [g], [m], [v], step, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    update(1)
    optimizer = threading.Thread(target=update, args=(8,))  # a second or so: a layer pass is 50 ms of it
    start = time.perf_counter()
    optimizer.start()
    while optimizer.is_alive():
        with torch.cuda.stream(copies[0]):
            device.copy_(host, non_blocking=True)
        with torch.cuda.stream(copies[1]):
            returned.copy_(device, non_blocking=True)
        layer_pass()
        torch.cuda.synchronize()
    cpu = 8 * n / (time.perf_counter() - start)
    return replace(
        _with_gpu_rates(previous, model, layer_tflops, kept_tflops, head_tflops),
        pcie_gbps=_rounded(pcie),
        pcie_duplex_gbps=_rounded(pcie_duplex),
        cpu_adam_params_per_s=_rounded(cpu),
        gpu_adam_params_per_s=_rounded(gpu_adam),
        disk_gbps=_rounded(measure_disk_gbps(Path(state_dir))) if state_dir else previous.disk_gbps,
        source=f"calibrated {time.strftime('%Y-%m-%d')}: {calibration_key(model, seq_len, micro_batch)}",
    )


BOUND_NAMES = {
    "compute": "GPU compute",
    "pcie": "PCIe (weights in, gradients out)",
    "cpu_optimizer": "the CPU optimizer",
    "disk": "the disk tier's disk",
    "network": "the network between hosts",
}


def format_plan(plan: Plan, model_name: str) -> str:
    gib = 2**30
    lines = [
        f"model            {model_name}: {plan.n_params / 1e9:.2f}B parameters"
        + (f" ({plan.active_params / 1e9:.2f}B active per token)" if plan.active_params != plan.n_params else ""),
        f"host memory      {plan.host_bytes / gib:.1f} GiB ({plan.host_bytes_per_param:.2f} B/param)"
        + (f" of {plan.host_available / gib:.1f} GiB available" if plan.host_available else "")
        + (f"; {plan.disk_bytes / gib:.1f} GiB of optimizer state on disk" if plan.disk_bytes else "")
        + (
            f"; gradient pool of {plan.gradient_pool:g} largest groups, for the updates the CPU optimizer has left "
            "when the backward ends"
            if plan.gradient_pool > GRADIENT_POOL
            else ""
        ),
        f"GPU memory       {plan.gpu_bytes / gib:.1f} GiB"
        + (f" of {plan.gpu_available / gib:.1f} GiB" if plan.gpu_available else " (no GPU here)")
        + (f", {plan.offloaded_layers} stages' activation checkpoints in host memory" if plan.offloaded_layers else "")
        + (f", {plan.kept_layers} layers keep their matmul products (no GEMM recomputed)" if plan.kept_layers else "")
        + (
            f", {plan.host_kept_layers} more in host memory ({plan.host_kept_bytes / 2**30:.1f} GiB)"
            if plan.host_kept_layers
            else ""
        )
        + (f", {plan.held_layers} layers' weights held from forward to backward" if plan.held_layers else "")
        + (
            f", {plan.gpu_updated_layers} layers' weights and moments updated on the GPU "
            f"({plan.gpu_updated_bytes / gib:.1f} GiB)"
            if plan.gpu_updated_layers
            else ""
        )
        + (f"; each MoE layer's experts stream in parts of {plan.experts_per_stage}" if plan.experts_per_stage else ""),
        f"tokens per step  {plan.tokens_per_step:,}"
        + (
            f" over {plan.gpus} GPU(s) x {plan.hosts} host(s)"
            + (" splitting the state" if plan.split_state else "")
            + "; host memory per host, GPU memory per GPU"
            + (f"; {plan.network_bytes / 1e9:.1f} GB per host per step between hosts" if plan.hosts > 1 else "")
            if plan.gpus * plan.hosts > 1
            else ""
        ),
        f"step time        {plan.step_s:.2f} s  (GPU {plan.compute_s:.2f} s, copies {plan.transfer_s:.2f} s, "
        f"CPU AdamW {plan.optimizer_s:.2f} s"
        + (f", disk {plan.disk_s:.2f} s" if plan.disk_s else "")
        + (f", network {plan.network_s:.2f} s" if plan.network_s else "")
        + f" overlapped, step-boundary bubble {plan.bubble_s:.2f} s)",
        f"bound by         {BOUND_NAMES[plan.bound]}"
        + (
            ""
            if plan.bound == "compute"
            else f"; compute-bound from about {plan.compute_bound_tokens:,} tokens per step"
        ),
        f"throughput       {plan.tokens_per_s:,.0f} tokens/s, {plan.model_tflops:.0f} model TFLOPS",
        f"rates            GPU blocks {plan.rates.gpu_tflops}"
        + (f" (kept {plan.rates.gpu_kept_tflops})" if plan.rates.gpu_kept_tflops else "")
        + f" / head {plan.rates.head_tflops} TFLOPS, "
        f"PCIe {plan.rates.pcie_gbps} GB/s, "
        f"CPU AdamW {plan.rates.cpu_adam_params_per_s / 1e9:.1f} G params/s, disk {plan.rates.disk_gbps} GB/s "
        f"({plan.rates.source})",
    ]
    return "\n".join(lines)
