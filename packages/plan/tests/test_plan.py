"""The planner on its own inputs (no config): a preset built once, a step's shape, the engine's settings, a machine
given or simulated, and the rates."""

import math
import shutil
from dataclasses import replace

import pytest
import torch

from megatrain_plan import (
    CPU_OPTIMIZER_MARGIN,
    DISK_TIER_RAM_SHARE,
    GRADIENT_POOL,
    RUNTIME_HOST_BYTES,
    SWEEPS_PCIE_SHARE,
    EngineChoices,
    Machine,
    ObjectiveMemory,
    Plan,
    PlanError,
    Planner,
    Rates,
    StepShape,
    block_work,
    check_plan,
    experts_per_stage,
    format_plan,
    gpu_updated_groups,
    host_memory,
    kept_bytes_per_token,
    layout_sizes,
    measure_disk_gbps,
)
from megatrain_plan.costs import (
    GPU_ADAM_BESIDE_SHARE,
    POOL_HOST_SHARE,
    RESIDENT_GAIN,
    STEP_TURNAROUND_S,
)
from megatrain_plan.counts import Counts
from megatrain_plan.search import parkable_stages
from megatrain_sched import EXTRAS_MARGIN, RESIDENT, RESIDENT_COPY
from megatrain_store import GroupLayout, PackedLayout, StoreError
from megatrain_templates import Lora
from megatrain_templates.chunked_recurrence import KeptRecurrence
from megatrain_templates.kernel_attention import KeptAttention
from megatrain_zoo import build_model, linear_attention_flops_per_token, preset


@pytest.fixture(autouse=True)
def host_side_of_a_gpu_run(monkeypatch):
    """These tests plan a GPU run's host side on this CPU machine (no GPU memory given stands for 'no GPU
    decides'): its runtime item is a GPU run's, not the CPU compute's memory a run on this CPU would take
    (a run on the CPU counts its compute's memory there: `CostModel._runtime_host_bytes`)."""
    monkeypatch.setattr(Planner, "_runtime_host_bytes", lambda self, placement: RUNTIME_HOST_BYTES)


def simulate_host(monkeypatch, gib: float) -> None:
    """Plan as on a host whose operating system gives the run `gib` GiB (less the stated margin)."""
    monkeypatch.setattr(host_memory, "os_room", lambda: (int(gib * 2**30), "a simulated host"))


def planner_for(
    name: str,
    tokens: int,
    *,
    rates: Rates | None = None,
    gpu_memory: int | None = None,
    host_memory: int | None = None,
    gpus: int = 1,
    hosts: int = 1,
    seq_len: int = 2048,
    micro_batch: int = 8,
    clipping: bool = False,
    router_z_loss: bool = False,
    objective: ObjectiveMemory = ObjectiveMemory(),
    adapter: Lora | None = None,
    **engine,
) -> Planner:
    """The planner of preset `name`'s steps of `tokens` (all GPUs') in micro-batches of `micro_batch` sequences of
    `seq_len`, bf16, on a machine with `gpu_memory` (None: no GPU) and this host's (simulated) memory or
    `host_memory`; `engine`: `EngineChoices` fields; `adapter`: LoRA over the frozen model."""
    model = preset(name)
    shape = StepShape(
        seq_len, tokens // seq_len, micro_batch, torch.bfloat16, clipping=clipping, router_z_loss=router_z_loss
    )
    machine = Machine.of(torch.device("cpu"), None, gpu_memory, host_memory, gpus, hosts)
    choices = EngineChoices(**engine)
    parts = experts_per_stage(model, choices.experts_per_stage, shape, machine.gpu_memory, adapter)
    spec = build_model(model, parts, adapter)
    return Planner(spec, rates or Rates(), machine, shape, choices, objective)


def planned(planner: Planner) -> Plan:
    """`planner`'s plan of its configured step."""
    return planner.plan(planner.place(planner.step_tokens))


def plan_for(name: str, tokens: int, **settings) -> Plan:
    """The plan of `planner_for(name, tokens, **settings)`'s step."""
    return planned(planner_for(name, tokens, **settings))


def test_memory_matches_the_store_and_measured_run():
    # measured on the H100 machine with a bf16 wire copy (benchmarks/results/throughput-h100.json):
    # 105.4 GiB host, 36.1 GiB GPU peak
    plan = plan_for("qwen2.5-7b", 131072, wire_copy=True)
    store = plan.host_bytes - plan.host_items["runtime"]
    assert store / 2**30 == pytest.approx(105.4, abs=0.2)
    assert store / plan.n_params == pytest.approx(14.86, abs=0.02)
    assert plan.gpu_bytes / 2**30 == pytest.approx(36.1, rel=0.15)
    # the default sends the fp32 master and casts on the GPU: 2 B/param less
    plan = plan_for("qwen2.5-7b", 131072)
    store = plan.host_bytes - plan.host_items["runtime"] - plan.host_items["embedding rows buffer"]
    assert store / plan.n_params == pytest.approx(12.86, abs=0.02)


def test_disk_tier_takes_only_what_does_not_fit(monkeypatch, tmp_path):
    simulate_host(monkeypatch, 64)
    # a disk with room (the test machine's had 27 GiB free and the plan's 37 GiB disk tier was refused)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**41, 0, 2**41))
    model = preset("qwen2.5-7b")
    planner = planner_for("qwen2.5-7b", 65536, optimizer_state_dir=str(tmp_path))
    plan = planned(planner)
    check_plan(plan, planner)
    assert 0 < plan.first_disk_group < model.n_layers + 2
    assert plan.host_bytes <= DISK_TIER_RAM_SHARE * plan.host_available
    assert plan.host_items["disk tier's page cache"] > 0  # (the groups read ahead and written behind)
    # one group fewer on disk would not fit that share
    assert plan.host_bytes + model.block_params * 8 > DISK_TIER_RAM_SHARE * plan.host_available
    assert plan.disk_bytes == 8 * sum(layout_sizes(planner.spec)[0][plan.first_disk_group :])
    assert plan.disk_s == pytest.approx(2 * plan.disk_bytes / (plan.rates.disk_gbps * 1e9))
    assert plan.step_s >= plan.disk_s  # the disk moves every byte of its state in and out each step
    last = len(layout_sizes(planner.spec)[0]) - 1
    assert plan.placement.why["disk"] == (
        f"the moments of groups {plan.first_disk_group}-{last} live on disk: the host cannot hold them"
    )
    whole_state = planner_for("qwen2.5-7b", 65536, optimizer_state_dir=str(tmp_path), disk_state_fraction=1.0)
    everything = planned(whole_state)
    assert everything.first_disk_group == 0 and everything.disk_bytes == 8 * model.n_params
    assert everything.placement.why["disk"].endswith(f"0-{last} live on disk: engine.disk_state_fraction 1.0")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**40, 2**40 - 2**30, 2**30))
    with pytest.raises(PlanError, match=r"disk tier needs .* GiB .* has 1.00 GiB free"):
        check_plan(everything, whole_state)
    (tmp_path / "afile").write_text("")  # (a directory that cannot be written: said so, not as a full disk)
    unwritable = planner_for("qwen2.5-7b", 65536, optimizer_state_dir=str(tmp_path / "afile" / "state"))
    with pytest.raises(StoreError, match=r"optimizer_state_dir .*afile/state is not writable \(.*afile is a file\)"):
        check_plan(planned(unwritable), unwritable)


def test_step_time_model_is_overlap_aware(monkeypatch):
    simulate_host(monkeypatch, 100)  # no room for a deeper gradient pool
    rates = Rates(gpu_tflops=500, head_tflops=400, pcie_gbps=50, cpu_adam_params_per_s=3.4e9)
    plan = plan_for("qwen2.5-7b", 131072, rates=rates)
    assert plan.disk_s == 0
    # updates as gradients land (no clipping) overlap all but the forward, a quarter of the GPU's work
    optimizer_bound = plan.optimizer_s + 0.25 * plan.compute_s
    assert plan.step_s == pytest.approx(max(plan.compute_s, plan.transfer_s, optimizer_bound) + plan.bubble_s)
    slow_cpu = plan_for("qwen2.5-7b", 131072, rates=Rates(500, 400, 50, 0.2e9))
    assert slow_cpu.step_s > 2 * plan.step_s and slow_cpu.bound == "cpu_optimizer"
    # the GPU's share grows with the tokens: from compute_bound_tokens on, the optimizer hides behind it
    tokens = -(-slow_cpu.compute_bound_tokens // (8 * 2048)) * 8 * 2048  # whole micro-batches of 8 sequences
    at_crossover = plan_for("qwen2.5-7b", tokens, rates=Rates(500, 400, 50, 0.2e9))
    assert at_crossover.bound == "compute"
    below = plan_for("qwen2.5-7b", tokens - 8 * 2048, rates=Rates(500, 400, 50, 0.2e9))
    assert below.bound == "cpu_optimizer"


def test_small_steps_get_a_gradient_pool_deep_enough_for_the_optimizer(monkeypatch):
    """16k tokens of a 7B model: the CPU optimizer takes longer than the backward. With the room, the pool
    holds what it has left when the backward ends, and only the head waits for it (its work goes first
    layers first, beside the next forward); without, the pool stays small and the forward waits."""
    rates = Rates(570, 385, 50, 4.3e9)
    simulate_host(monkeypatch, 126)
    small = plan_for("qwen2.5-7b", 16384, rates=rates)
    backward_s = 0.75 * small.compute_s
    left = (small.optimizer_s - backward_s) * rates.cpu_adam_params_per_s
    largest = max(layout_sizes(build_model(preset("qwen2.5-7b")))[0])  # the head: its matrix and the final norm
    assert small.gradient_pool == math.ceil(2 + left / largest) > GRADIENT_POOL
    assert small.bound == "cpu_optimizer"
    head_s = 6 * preset("qwen2.5-7b").vocab_size * 3584 * 16384 / 385e12
    assert small.step_s == pytest.approx(small.optimizer_s + head_s + small.bubble_s)
    large = plan_for("qwen2.5-7b", 131072, rates=rates)
    assert large.gradient_pool == GRADIENT_POOL and large.bound == "compute"
    assert small.host_bytes - large.host_bytes == pytest.approx((small.gradient_pool - GRADIENT_POOL) * largest * 4)
    simulate_host(monkeypatch, 100)  # the deeper pool would not fit: the forward waits
    tight = plan_for("qwen2.5-7b", 16384, rates=rates)
    assert tight.gradient_pool == GRADIENT_POOL and tight.host_bytes == pytest.approx(large.host_bytes)
    assert tight.step_s > small.step_s


def test_a_moe_forward_waits_for_its_weights(monkeypatch):
    """OLMoE at 64k tokens: the forward (a quarter of little active work) is shorter than one pass
    of all 6.9B weights over PCIe, so the next step waits for the weights and the optimizer, not
    for the GPU's work."""
    simulate_host(monkeypatch, 90)  # no room for a deeper gradient pool
    rates = Rates(500, 400, 50, 3.6e9, moe_gpu_tflops=410)
    plan = plan_for("olmoe-1b-7b", 65536, rates=rates)
    weight_pass = plan.n_params * 4 / 50e9
    assert 0.25 * plan.compute_s < weight_pass
    assert plan.bound == "cpu_optimizer"
    assert plan.step_s == pytest.approx(plan.optimizer_s + weight_pass + plan.bubble_s)


def test_refuses_what_cannot_fit_and_names_the_largest(monkeypatch):
    simulate_host(monkeypatch, 64)
    planner = planner_for("qwen2.5-7b", 65536)
    message = r"needs 92.7 GiB .* may take 61.4 GiB .*; optimizer moments take 56.7 GiB: engine.optimizer_state_dir"
    with pytest.raises(PlanError, match=message):
        check_plan(planned(planner), planner)


def test_disk_probe_measures_and_cleans_up(tmp_path):
    assert measure_disk_gbps(tmp_path / "probe", size=2**25) > 0
    assert list((tmp_path / "probe").iterdir()) == []


def test_checkpoints_that_do_not_fit_the_gpu_go_to_host_layer_by_layer(monkeypatch):
    simulate_host(monkeypatch, 2000)
    model = preset("dense-120b")
    h200 = 140 * 2**30
    # (no layer keeps its products: the checkpoints' own rule alone)
    recompute_all = {"micro_batch": 4, "kept_layers": 0}
    plan = plan_for("dense-120b", 65536, **recompute_all, gpu_memory=h200)
    per_layer = plan.checkpoint_bytes // model.n_layers
    assert 0 < plan.offloaded_layers < model.n_layers  # some stay on the GPU, the rest go to host
    kept = model.n_layers - plan.offloaded_layers
    # slots, gradient buffers, recompute, logits, and one offloaded layer's checkpoints back ahead of its backward
    fixed = plan.gpu_bytes - kept * per_layer - per_layer
    assert kept == int(0.5 * (h200 - fixed) // per_layer)  # half of the rest
    assert plan.host_bytes >= 12 * model.n_params + plan.offloaded_layers * per_layer
    assert f"{plan.offloaded_layers} stages' activation checkpoints in host memory" in format_plan(plan, "dense")


def test_checkpoints_make_way_for_kept_products_in_large_steps(monkeypatch):
    """Where the GPU is the bound and products are short of room, the first layers' checkpoints go to host memory:
    the fewest that let the most layers keep their products; not for small steps, nor past the host's room."""
    simulate_host(monkeypatch, 1000)
    h200, model = 140 * 2**30, preset("llama2-7b")
    # (the rule alone, in one sweep)
    host_updates = {"gpu_updated_layers": 0, "host_kept_layers": 0, "sweeps": 1}
    large = dict(name="llama2-7b", tokens=131072, **host_updates)
    plan = plan_for(**large, gpu_memory=h200)
    checkpoints_there = {"offload_checkpoints": False} | host_updates
    on_gpu = plan_for("llama2-7b", 131072, **checkpoints_there, gpu_memory=h200)
    per_layer = plan.checkpoint_bytes // model.n_layers
    assert 0 < plan.offloaded_layers <= model.n_layers and plan.kept_layers > on_gpu.kept_layers
    # the fewest: a GPU with two checkpoints' room less keeps as many products with two more offloaded
    fewer = plan_for(**large, gpu_memory=h200 - per_layer * 2)
    assert (fewer.kept_layers, fewer.offloaded_layers) == (plan.kept_layers, plan.offloaded_layers + 2)
    assert plan.compute_s < on_gpu.compute_s and plan.gpu_bytes <= h200
    assert plan.host_bytes == pytest.approx(on_gpu.host_bytes + plan.offloaded_layers * per_layer)
    small = plan_for("llama2-7b", 16384, gpu_memory=80 * 2**30)  # the CPU optimizer's step
    assert small.kept_layers < model.n_layers and small.offloaded_layers == 0
    simulate_host(monkeypatch, 100)  # 12 B a parameter fits, all the checkpoints beside not
    tight = plan_for(**large, gpu_memory=h200)
    assert tight.offloaded_layers < plan.offloaded_layers and tight.host_bytes <= 0.85 * 100 * 2**30


def test_large_steps_update_the_embedding_and_first_block_on_the_gpu(monkeypatch):
    """Where the GPU is the bound, the step boundary (the embedding's and first block's gradients out, their CPU
    update, their weights back in) is worth their state on the GPU, which takes less of the kept products' room
    than that wait costs; where the head binds the table (tied) the head's norm goes with it."""
    simulate_host(monkeypatch, 1000)
    h200 = 139 * 2**30
    auto = plan_for("llama2-7b", 131072, gpu_memory=h200)
    host = plan_for("llama2-7b", 131072, gpu_updated_layers=0, gpu_memory=h200)
    # (the bubble left is the host's turnaround between steps, which every placement has)
    assert (auto.gpu_updated_layers, auto.bubble_s, auto.held_layers) == (1, STEP_TURNAROUND_S, 0)
    assert host.bubble_s > STEP_TURNAROUND_S and auto.step_s < host.step_s and auto.gpu_bytes <= h200
    model = preset("llama2-7b")  # (untied: embedding, head, blocks, final norm)
    table = model.vocab_size * model.d_model
    block = (model.n_params - 2 * table - model.d_model) // model.n_layers
    assert auto.gpu_updated_bytes == 12 * (table + block)  # fp32 master and two moments
    tied = plan_for("llama3.2-3b", 131072, gpu_memory=h200)
    tied_host = plan_for("llama3.2-3b", 131072, gpu_updated_layers=0, gpu_memory=h200)
    assert (tied.gpu_updated_layers, tied.bubble_s) == (1, STEP_TURNAROUND_S)
    assert tied_host.bubble_s > STEP_TURNAROUND_S
    model = preset("llama3.2-3b")  # (tied: the embedding is the head's weight; the head's group is its norm)
    table = model.vocab_size * model.d_model
    block = (model.n_params - table - model.d_model) // model.n_layers
    assert tied.gpu_updated_bytes == 12 * (table + block + model.d_model)


def test_data_parallel_plan_splits_the_batch_not_the_host_memory():
    rates = Rates()
    one = plan_for("qwen2.5-7b", 131072, rates=rates)
    many = plan_for("qwen2.5-7b", 131072 * 8, rates=rates, gpus=4, hosts=2)
    # a replica per host, shared by its GPUs (one process sends the embedding's updated rows first)
    assert many.host_bytes == one.host_bytes - one.host_items["embedding rows buffer"]
    assert many.compute_s == pytest.approx(one.compute_s)  # each GPU runs the same tokens as before
    assert many.network_bytes == int(2 * 0.5 * 4 * one.n_params)  # ring all-reduce of fp32 gradients
    assert many.tokens_per_s > 7 * one.tokens_per_s
    assert plan_for("qwen2.5-7b", 131072, rates=rates).network_bytes == 0


def test_moe_plan_moves_all_parameters_and_computes_the_active_ones():
    """All experts cross PCIe and are updated every step; only the active ones compute: with few
    tokens the CPU optimizer bounds the step, and from compute_bound_tokens on the GPU does."""
    rates = Rates()
    small = plan_for("olmoe-1b-7b", 32768, rates=rates)
    model = preset("olmoe-1b-7b")
    assert small.active_params == model.active_params < model.n_params == small.n_params
    assert small.transfer_s == pytest.approx(model.n_params * 8 / (rates.pcie_gbps * 1e9))
    assert small.bound == "cpu_optimizer" and small.compute_bound_tokens > 32768
    tokens = -(-small.compute_bound_tokens // (8 * 2048)) * 8 * 2048
    assert plan_for("olmoe-1b-7b", tokens, rates=rates).bound == "compute"
    dense = plan_for("qwen2.5-7b", 32768, rates=rates)
    # 7.6B active against 1.3B, at the same rate (a MoE block's is lower)
    assert dense.compute_s * rates.gpu_tflops > 3 * small.compute_s * rates.moe_gpu_tflops


def test_a_layer_too_large_for_the_gpu_streams_its_experts_in_parts(monkeypatch):
    """gpt-oss-120b on a 24 GiB GPU: two slots of a 3.2B-parameter layer and its fp32 gradients alone
    exceed it, whatever the batch. Kept whole, the error says so (instead of suggesting a batch size
    of zero) and names the fix; auto streams each layer's experts in the fewest parts that leave half
    the GPU for activation checkpoints; where whole layers fit, they stay whole."""
    simulate_host(monkeypatch, 2000)
    model = preset("gpt-oss-120b")
    whole = planner_for("gpt-oss-120b", 16 * 2048, micro_batch=1, experts_per_stage=128, gpu_memory=24 * 2**30)
    plan = planned(whole)
    assert plan.experts_per_stage == 0 and plan.offloaded_layers == plan.checkpoint_stages == model.n_layers
    with pytest.raises(PlanError, match=r"the largest layer alone takes .*engine\.experts_per_stage below 128"):
        check_plan(plan, whole)

    auto = planner_for("gpt-oss-120b", 16 * 2048, micro_batch=1, gpu_memory=24 * 2**30)
    plan = planned(auto)
    assert plan.experts_per_stage == 16  # 8 parts: 4 would leave under half of the GPU
    groups, stages, planes = layout_sizes(auto.spec)
    assert max(stages[1:-1]) < 0.4e9 and planes == 2 * model.n_layers  # a layer keeps its input and one `a`
    assert plan.checkpoint_stages == planes and plan.gpu_bytes < 0.95 * 24 * 2**30
    check_plan(plan, auto)
    assert "each MoE layer's experts stream in parts of 16" in format_plan(plan, "gpt-oss-120b")

    h100 = plan_for("gpt-oss-120b", 16 * 2048, micro_batch=1, gpu_memory=80 * 2**30)
    assert h100.experts_per_stage == 0  # an H100 holds whole layers
    assert plan_for("qwen2.5-7b", 16 * 2048, experts_per_stage=4).experts_per_stage == 0


def test_lora_streams_a_moe_layer_whole_where_its_slots_fit_and_in_parts_where_not(monkeypatch):
    """QLoRA (nf4) on an H100's 79 GiB: a frozen layer sends no gradient, so the GPU holds two of its slots and its
    adapters' gradients, not its fp32 gradient too. Mixtral-8x22B's layers at micro-batches of 8 x 4096 stream whole
    (full training's bytes would split them in two); DeepSeek-V3's 11.3B-parameter layers, whose two bf16 slots alone
    take more than half the GPU, in parts, each binding the layer's adapter group; both plans pass the checks."""
    simulate_host(monkeypatch, 2000)
    nf4, h100 = Lora(16, 32.0, ("all-linear",), base_format="nf4"), 79 * 2**30
    mixtral = planner_for("mixtral-8x22b", 65536, micro_batch=8, seq_len=4096, gpu_memory=h100, adapter=nf4)
    assert mixtral.experts_per_stage == 0
    assert planner_for("mixtral-8x22b", 65536, micro_batch=8, seq_len=4096, gpu_memory=h100).experts_per_stage == 4
    check_plan(planned(mixtral), mixtral)
    assert max(mixtral.trained_sizes) < 0.01 * max(mixtral.stage_sizes)  # (a layer's gradients: its adapters')

    deepseek = planner_for("deepseek-v3", 65536, micro_batch=1, seq_len=4096, gpu_memory=h100, adapter=nf4)
    assert deepseek.experts_per_stage == 128  # (two parts of its 256 experts)
    spec = deepseek.spec
    parts = [stage for stage in spec.stages if ".experts" in stage.name]
    assert parts and all(spec.groups[stage.groups[-1]].name.endswith(".lora") for stage in parts)
    check_plan(planned(deepseek), deepseek)


def test_layers_that_fit_the_gpu_keep_their_activations_and_skip_the_recompute(monkeypatch):
    simulate_host(monkeypatch, 1000)
    h100 = 79 * 2**30
    gpu_only = {"host_kept_layers": 0}
    plans = {
        kept: plan_for("qwen2.5-7b", 32768, kept_layers=kept, **gpu_only, gpu_memory=h100) for kept in ("auto", 0, 28)
    }
    auto = plans["auto"]
    assert 0 < auto.kept_layers < 28  # some fit beside the checkpoints, not all
    assert plans[0].kept_layers == 0 and plans[28].kept_layers == 28
    assert auto.gpu_bytes <= h100 < plans[28].gpu_bytes  # auto fits, keeping every layer would not
    assert plans[28].compute_s < auto.compute_s < plans[0].compute_s
    # the recompute's GEMMs skipped: a fifth of a dense 7B layer's GPU work (no down GEMM; attention recomputed)
    saved = (plans[0].compute_s - plans[28].compute_s) / plans[0].compute_s
    assert 0.15 < saved < 0.25
    # the more tokens, the fewer layers fit
    assert plan_for("qwen2.5-7b", 131072, **gpu_only, gpu_memory=h100).kept_layers < auto.kept_layers
    # a MoE model's layers keep theirs as well: at 128k tokens some of OLMoE's 16, not all
    assert 0 < plan_for("olmoe-1b-7b", 131072, **gpu_only, gpu_memory=h100).kept_layers < 16


def test_large_steps_keep_more_products_in_host_memory(monkeypatch):
    """With auto, where the GPU is the bound, layers before those kept on the GPU keep their products in
    pinned host memory: as many as the host's room and the forward's copy-out time allow, a stage of them
    reserved on the GPU; none for small steps, nor where the optimizer is over half the GPU's work; an
    explicit count beyond the host is refused."""
    h100, model = 79 * 2**30, preset("qwen2.5-7b")
    simulate_host(monkeypatch, 1000)
    one = {"sweeps": 1}  # (the rule in one sweep: test_large_steps_run_in_sweeps_where_they_keep_more_products)
    default = plan_for("qwen2.5-7b", 131072, **one, gpu_memory=h100)
    assert default.offloaded_layers > 0 and default.host_kept_layers > 0  # both by default where the host has room
    # (checkpoints kept on the GPU: offloaded, they would take the smaller host's room first, see below)
    checkpoints_there = {"offload_checkpoints": False} | one
    auto = {"host_kept_layers": "auto"} | checkpoints_there
    large = plan_for("qwen2.5-7b", 131072, **auto, gpu_memory=h100)
    gpu_only = plan_for("qwen2.5-7b", 131072, host_kept_layers=0, **checkpoints_there, gpu_memory=h100)
    stage = 131072 * kept_bytes_per_token(build_model(model), 2)
    assert large.host_kept_layers > 0 and large.host_kept_bytes == large.host_kept_layers * stage
    assert large.host_bytes == pytest.approx(gpu_only.host_bytes + large.host_kept_bytes)
    assert large.kept_layers + large.host_kept_layers <= model.n_layers
    assert gpu_only.kept_layers - 1 <= large.kept_layers <= gpu_only.kept_layers  # one stage in flight reserved
    assert large.compute_s < gpu_only.compute_s and large.step_s < gpu_only.step_s and large.gpu_bytes <= h100
    # the forward's idle copy-out carries them: no more than its time (a quarter of the GPU's work) allows
    assert large.host_kept_bytes <= 0.8 * 0.25 * gpu_only.compute_s * large.rates.pcie_gbps * 1e9
    simulate_host(monkeypatch, 140)  # a host with room for fewer
    smaller_host = plan_for("qwen2.5-7b", 131072, **auto, gpu_memory=h100)
    assert 0 < smaller_host.host_kept_layers < large.host_kept_layers
    # checkpoints offloaded first: each of their bytes in host memory makes room for as many products on the GPU
    # as a byte of host-kept products keeps, at half the copies (out and back of a layer's input, not its products)
    both = plan_for("qwen2.5-7b", 131072, host_kept_layers="auto", **one, gpu_memory=h100)
    assert both.offloaded_layers > 0 and both.host_kept_layers < smaller_host.host_kept_layers
    assert plan_for("qwen2.5-7b", 16384, **auto, gpu_memory=h100).host_kept_layers == 0  # a small step
    # nor where the CPU optimizer, bound by the host memory their copies go through, takes over half the GPU's work
    at_32k, at_64k = (plan_for("qwen2.5-7b", t, **auto, gpu_memory=h100) for t in (32768, 65536))
    assert at_32k.host_kept_layers == 0 and at_64k.host_kept_layers > 0
    too_many = planner_for("qwen2.5-7b", 131072, host_kept_layers=20, gpu_memory=h100)
    with pytest.raises(PlanError, match="host-kept products take 225.3 GiB: engine.host_kept_layers: 0"):
        check_plan(planned(too_many), too_many)


def test_more_kept_layers_than_the_gpu_holds_are_refused_naming_the_setting(monkeypatch):
    simulate_host(monkeypatch, 1000)
    planner = planner_for("qwen2.5-7b", 32768, kept_layers=28, gpu_memory=79 * 2**30)
    with pytest.raises(PlanError, match="engine.kept_layers: 28 keeps .* set engine.kept_layers: auto"):
        check_plan(planned(planner), planner)


def test_small_steps_hold_the_blocks_weights_from_forward_to_backward(monkeypatch):
    """Where the CPU optimizer is slower than the GPU's work, every block but the last keeps its weights on
    the GPU until its backward (a quarter of the GPU at most); kept layers get the rest."""
    simulate_host(monkeypatch, 1000)
    h100 = 79 * 2**30
    host_updates = {"gpu_updated_layers": 0}  # (auto would take the optimizer's load off instead)
    small = plan_for("qwen2.5-7b", 16384, **host_updates, gpu_memory=h100)
    none = plan_for("qwen2.5-7b", 16384, held_layers=0, **host_updates, gpu_memory=h100)
    _, stages, _ = layout_sizes(build_model(preset("qwen2.5-7b")))
    assert small.held_layers == 27 and small.held_bytes == 2 * sum(stages[1:-2])
    assert small.transfer_s < none.transfer_s and small.kept_layers <= none.kept_layers
    assert small.gpu_bytes <= h100
    # a large step is the GPU's: its memory keeps activations instead
    assert plan_for("qwen2.5-7b", 131072, gpu_memory=h100).held_layers == 0
    # a 14B model's blocks take more than a quarter of the GPU: as many as fit there
    larger = plan_for("qwen2.5-14b", 16384, **host_updates, gpu_memory=h100)
    assert 0 < larger.held_layers < preset("qwen2.5-14b").n_layers - 1 and larger.held_bytes <= h100 / 4
    planner = planner_for("qwen2.5-7b", 65536, held_layers=27, kept_layers=24, gpu_memory=h100)
    with pytest.raises(PlanError, match="engine.kept_layers: 24 keeps"):
        check_plan(planned(planner), planner)


def test_small_steps_update_the_first_blocks_on_the_gpu(monkeypatch):
    """Where the CPU optimizer is slower than the GPU's work, the first blocks' masters and moments move to
    the GPU, as few as bring the optimizer within the GPU's work; not for large steps, several processes,
    or more than the GPU holds."""
    simulate_host(monkeypatch, 1000)
    h100 = 79 * 2**30
    model = preset("qwen2.5-7b")
    auto = plan_for("qwen2.5-7b", 16384, gpu_memory=h100)
    host = plan_for("qwen2.5-7b", 16384, gpu_updated_layers=0, gpu_memory=h100)
    _, stages, _ = layout_sizes(build_model(model))
    on_gpu = sum(stages[: 1 + auto.gpu_updated_layers])  # the embedding (untied) and the first blocks
    assert gpu_updated_groups(build_model(model), auto.gpu_updated_layers) == list(range(1 + auto.gpu_updated_layers))
    assert 0 < auto.gpu_updated_layers < model.n_layers and auto.gpu_updated_bytes == 12 * on_gpu
    assert auto.optimizer_s == pytest.approx(host.optimizer_s * (1 - on_gpu / model.n_params))
    assert auto.optimizer_s + 0.2 < host.optimizer_s and auto.step_s < host.step_s and auto.gpu_bytes <= h100
    head_s = 6 * model.vocab_size * model.d_model * 16384 / (auto.rates.head_tflops * 1e12)
    assert auto.optimizer_s + head_s <= CPU_OPTIMIZER_MARGIN * auto.compute_s  # within the GPU's work, with a margin
    assert auto.bound != "cpu_optimizer" and host.bound == "cpu_optimizer"
    assert plan_for("qwen2.5-7b", 131072, gpu_memory=h100).gpu_updated_layers == 1  # see below
    assert plan_for("qwen2.5-7b", 16384, gpu_memory=h100, gpus=2).gpu_updated_layers == 0
    clipped = plan_for("qwen2.5-7b", 16384, clipping=True, gpu_memory=h100)
    assert clipped.gpu_updated_bytes == 12 * sum(stages[: 1 + clipped.gpu_updated_layers])  # (gradients: the step's)
    tied = preset("qwen2.5-0.5b")  # its table is the head's weight too: the head's norm group goes with it
    assert gpu_updated_groups(build_model(tied), 2) == [0, 1, 2, tied.n_layers + 1]
    several = planner_for("qwen2.5-7b", 16384, gpu_updated_layers=2, gpu_memory=h100, gpus=2)
    with pytest.raises(PlanError, match="engine.gpu_updated_layers: 2 needs one process"):
        check_plan(planned(several), several)
    too_many = planner_for("qwen2.5-7b", 16384, gpu_updated_layers=28, kept_layers=0, gpu_memory=h100)
    with pytest.raises(PlanError, match="engine.gpu_updated_layers: 28 keeps .* GiB"):
        check_plan(planned(too_many), too_many)
    copied = planner_for("qwen2.5-7b", 16384, gpu_updated_layers=2, copied_layers=3, gpu_memory=h100)
    with pytest.raises(PlanError, match="engine.copied_layers 3: this run has 2 blocks updated on the GPU"):
        check_plan(planned(copied), copied)
    copied = planner_for(
        "qwen2.5-7b", 16384, gpu_updated_layers=19, copied_layers=19, held_layers=0, kept_layers=0, gpu_memory=h100
    )
    with pytest.raises(PlanError, match="engine.copied_layers: 19 keeps .* GiB of weights in the compute dtype"):
        check_plan(planned(copied), copied)


def test_with_clipping_the_first_blocks_on_the_gpu_are_as_many_as_give_the_fastest_step(monkeypatch):
    """With clipping the CPU's AdamW starts once the norm is known and runs beside the next forward alone, a quarter
    of the GPU's work: a 7B step of 32k tokens that would wait for it (the plan that updated only the embedding and
    first block there predicted 3.6 s, bound by the CPU) updates as many first blocks on the GPU as give the
    fastest predicted step, each displacing kept products. (Each count is weighed before the held weights are
    chosen: another count, with its own held and kept layers, may be predicted up to 2% faster.)"""
    simulate_host(monkeypatch, 1000)
    h200 = 139 * 2**30
    settings = {"clipping": True, "seq_len": 4096, "micro_batch": 4, "gpu_memory": h200}
    auto = plan_for("qwen2.5-7b", 32768, **settings)
    alone = {n: plan_for("qwen2.5-7b", 32768, gpu_updated_layers=n, **settings) for n in (0, 1, 4, 8, 12, 16, 20, 24)}
    fitting = {n: plan.step_s for n, plan in alone.items() if plan.gpu_bytes <= h200}
    assert alone[1].bound == "cpu_optimizer" and 1 < auto.gpu_updated_layers < 28
    assert auto.step_s <= min(fitting.values()) * 1.02 and auto.step_s < 0.8 * alone[1].step_s
    assert auto.gpu_bytes <= h200 and auto.gpu_updated_bytes == 12 * sum(
        layout_sizes(build_model(preset("qwen2.5-7b")))[1][: 1 + auto.gpu_updated_layers]
    )  # fp32 master and two moments (the gradients held for the norm: the step's, below)
    unclipped = {key: value for key, value in settings.items() if key != "clipping"}
    assert plan_for("qwen2.5-7b", 131072, **unclipped).gpu_updated_layers == 1  # (large steps: as before)


def test_with_clipping_a_resident_block_that_displaces_no_products_is_taken_where_faster(monkeypatch):
    """The margin that takes the fewest first blocks within RESIDENT_GAIN of the fastest step is for the kept products
    each displaces; where every layer keeps its products whatever the count (Qwen2.5-1.5B at 32k on an H200), the
    fastest count is taken: 16 blocks were predicted 0.1% slower than 17, the CPU's AdamW bounding the step."""
    simulate_host(monkeypatch, 1000)
    settings = {"clipping": True, "seq_len": 4096, "micro_batch": 4, "gpu_memory": 139 * 2**30}
    auto = plan_for("qwen2.5-1.5b", 32768, **settings)
    alone = {n: plan_for("qwen2.5-1.5b", 32768, gpu_updated_layers=n, **settings) for n in range(14, 20)}
    assert all(plan.kept_layers == 28 for plan in [auto, *alone.values()])
    fastest = min(alone, key=lambda n: alone[n].step_s)
    assert alone[fastest - 1].step_s <= alone[fastest].step_s / RESIDENT_GAIN  # (the margin's choice: one fewer)
    assert auto.gpu_updated_layers == fastest and auto.step_s == pytest.approx(alone[fastest].step_s)


def test_with_clipping_the_resident_gradients_take_the_room_the_last_products_leave():
    """With clipping a resident group's fp32 gradient is held from its backward to the step's end, while the
    backward frees each stage's checkpoint and kept products as it goes: the step's device bytes count the most
    both hold at once (Qwen2.5-7B at 32k with 18 resident blocks and 15 kept layers peaked at 113.8 GiB of an H200
    where their sum counted 136 GiB), and the room that leaves keeps more products."""
    h200 = 139 * 2**30
    settings = {"seq_len": 4096, "micro_batch": 4, "gpu_memory": h200, "gpu_updated_layers": 18}
    clipped, unclipped = (planner_for("qwen2.5-7b", 32768, clipping=c, **settings) for c in (True, False))
    sizes = layout_sizes(clipped.spec)[0]
    gradients = 4 * sum(sizes[: 1 + 18])  # the embedding's and the first 18 blocks'
    layer_products = 32768 * clipped.product_bytes_per_token
    checkpoints = sum(clipped.checkpoint_bytes(i, 32768) for i in clipped.blocks)
    bytes_of = {}
    for kept in (0, 22):
        placement = clipped.placement_of(Counts(32768, resident=18, kept=kept))
        bytes_of[kept] = clipped.step_device_bytes(placement), unclipped.step_device_bytes(placement)
    # no products: the most is at the backward's end, every held gradient and no activation
    assert bytes_of[0][0] == bytes_of[0][1] - checkpoints + gradients
    # the last 22 layers' products: those of layers 19-28, freed before the first held gradient, hold more
    assert 10 * layer_products > gradients and bytes_of[22][0] == bytes_of[22][1]
    # in sweeps every resident gradient is carried from the first sweep's backward: all of them, at once
    swept = clipped.placement_of(Counts(16384, sweeps=2, resident=18, kept=6))
    one = replace(swept, sweeps=1)
    assert clipped.sweeps_device_bytes(swept) == 4 * max(clipped.stage_sizes) + gradients
    assert clipped.backward_peak(one) > clipped.backward_peak(swept)  # (which counts them no more)
    # the room left keeps 22 layers' products where counting both whole kept 15 (the run above)
    assert planned(planner_for("qwen2.5-7b", 32768, clipping=True, **settings)).kept_layers >= 20


def test_resident_blocks_keep_their_compute_copy_in_the_room_products_and_extras_leave(monkeypatch):
    """Qwen2.5-1.5B at 32k with clipping: on an H200 every resident block keeps its bf16 copy beside its products
    and their extras (no cast slot left); on a GPU with room for the step without copies, the extras,
    `EXTRAS_MARGIN` and k blocks' copies, the first k blocks are copied, every other choice as it was. Only a block
    binding one group of its own is copied."""
    simulate_host(monkeypatch, 1000)
    settings = {"clipping": True, "seq_len": 4096, "micro_batch": 4}
    roomy = planner_for("qwen2.5-1.5b", 32768, gpu_memory=139 * 2**30, **settings)
    placement = roomy.place(32768)
    blocks = [i for i in placement.resident if i in roomy.blocks]
    assert len(blocks) > 4 and placement.copied == tuple(blocks) and roomy.extras(placement) == placement.kept

    def uncopied(placement):
        return tuple(replace(s, weights=RESIDENT) if s.weights == RESIDENT_COPY else s for s in placement.stages)

    uncopied_placement = replace(placement, stages=uncopied(placement))
    block_bytes = roomy.stage_sizes[blocks[0]] * 2
    assert roomy.device_bytes(placement) == roomy.device_bytes(uncopied_placement) + (len(blocks) - 1) * block_bytes
    extras = sum(32768 * roomy.extra_bytes_per_token[i] for i in placement.kept)
    for k in (1, 3):
        gpu = roomy.device_bytes(uncopied_placement) + extras + EXTRAS_MARGIN + k * block_bytes + block_bytes // 2
        tight = planner_for("qwen2.5-1.5b", 32768, gpu_memory=gpu, **settings).place(32768)
        assert tight.copied == tuple(blocks[:k]) and tight.stages[blocks[-1]].weights == RESIDENT
        assert uncopied(tight) == uncopied(placement) and replace(tight, stages=()) == replace(placement, stages=())
    # a MoE layer in parts: its stages bind the layer's shared group each, so they are cast, not copied
    split = planner_for("tiny-llama4", 4096, seq_len=512, gpu_memory=2**37, gpu_updated_layers=2, experts_per_stage=3)
    placement = split.place(4096)
    assert placement.resident == (0, 1, 2, 3, 4) and placement.copied == (1,)


def test_parked_moments_give_their_room_to_products_at_the_peak(monkeypatch):
    """Qwen2.5-7B at 32k with clipping on an H200 and a 125 GiB host: the GPU-updated stages' state displaces kept
    products, so the first ones (the table first) park their moments from their update to the backward: every
    layer keeps its products where 21 did, predicted faster, resident and held blocks as they were. Their moments
    leave the persistent bytes and count in the backward's from the block after whose backward they come back; the
    j-th parked stage comes before that block; the head's gradient buffer joins the persistent bytes. A tied table
    (bound by the head too) is not parked."""
    simulate_host(monkeypatch, 125)
    settings = {"clipping": True, "seq_len": 4096, "micro_batch": 4, "gpu_memory": int(139.8 * 2**30)}
    auto, none = (planner_for("qwen2.5-7b", 32768, parked_layers=p, **settings) for p in ("auto", 0))
    parked, unparked = auto.place(32768), none.place(32768)
    assert len(unparked.kept) < len(parked.kept) == auto.keepable
    assert (
        parked.resident == unparked.resident
        and parked.held == unparked.held
        and auto.step_s(parked) < none.step_s(unparked)
    )
    assert parked.parked == parkable_stages(auto.spec, parked.resident)[: len(parked.parked)] and parked.parked[0] == 0
    assert all(parked_stage < back for parked_stage, back in parked.moments_back_after.items())
    moments = auto.parked_moment_bytes(parked)
    assert moments == 8 * auto.params(parked.parked)
    kept_all = replace(parked, parked=())
    head_gradient = 4 * auto.params((auto.n_stages - 1,))  # (kept from step to step where stages park)
    assert parked.persistent_gradients == (auto.n_stages - 1,) and kept_all.persistent_gradients == ()
    assert auto.persistent_device_bytes(parked) == auto.persistent_device_bytes(kept_all) - moments + head_gradient
    assert parked.why["parked"].endswith("the head's gradient stays on the GPU from step to step (2.0 GiB)")
    assert 0 <= auto.backward_peak(parked) - auto.backward_peak(kept_all) <= moments
    forward_s, backward_s = auto.copy_passes_s(parked)
    assert forward_s >= moments / (auto.rates.pcie_gbps * 1e9) and backward_s >= moments / (
        auto.rates.pcie_duplex_gbps * 1e9
    )
    tied = planner_for("qwen2.5-1.5b", 32768, gpu_updated_layers=4, parked_layers=2, **settings)
    assert tied.spec.stages[0].groups[0] in tied.spec.stages[-1].groups
    assert tied.place(32768).parked == (1, 2)


def test_with_clipping_the_resident_updates_run_beside_the_forward():
    """Without clipping a resident group's update runs on the compute stream after its backward: all of it adds to
    the GPU's work. With clipping it runs beside the next forward (`DeviceAdamW.update_beside`) at
    GPU_ADAM_BESIDE_SHARE of its rate: the first resident stage's update, which the forward waits for, adds, and what
    of the rest the forward's resident stages do not cover: nothing at 32k tokens, where a Qwen2.5-7B block's forward
    takes 26 ms, some at 8k, where it takes 7 ms and its update beside it 8.2 ms on an H200."""
    settings = {"seq_len": 4096, "gpu_memory": 139 * 2**30}
    clipped, unclipped = (planner_for("qwen2.5-7b", 8192, micro_batch=2, clipping=c, **settings) for c in (True, False))
    placement = clipped.placement_of(Counts(8192, resident=27, kept=28))
    rate = clipped.rates.gpu_adam_params_per_s
    sizes = layout_sizes(clipped.spec)[0]
    assert unclipped.device_update_s(placement) == pytest.approx(sum(sizes[:28]) / rate)
    forward_s = clipped.forward_share(placement) * clipped.layers_s(placement)
    left = sum(sizes[1:28]) / (GPU_ADAM_BESIDE_SHARE * rate) - forward_s * 27 / 30
    assert left > 0 and clipped.device_update_s(placement) == pytest.approx(sizes[0] / rate + left)
    for planner in (clipped, unclipped):
        assert planner.compute_s(placement) == pytest.approx(
            planner.layers_s(placement) + planner.device_update_s(placement)
        )
    large = planner_for("qwen2.5-7b", 32768, micro_batch=4, clipping=True, **settings)
    placement = large.placement_of(Counts(32768, resident=19, kept=21))
    forward_s = large.forward_share(placement) * large.layers_s(placement)
    assert forward_s * 19 / 30 > sum(sizes[1:20]) / (GPU_ADAM_BESIDE_SHARE * rate)
    assert large.device_update_s(placement) == pytest.approx(sizes[0] / rate)  # the embedding's


def test_a_layers_forward_is_its_share_of_the_work():
    """The forward's share of the GPU's work, by FLOPs (forward, recompute, backward 2, 2 and 4 a weight and token;
    the recompute skips the down projection): over a quarter of a recomputing layer's, about a third of one keeping
    its products (which still recomputes attention); with LoRA's frozen base, which makes no weight gradient, over a
    third and about a half. A Qwen2.5-7B block's forward at 8k tokens comes out at the 7.0 ms an H200's trace shows
    (results/device-clip-h200.json). What resident stages' updates run beside, and what of the backward lands
    gradients in host memory, are reckoned from it."""
    lora = Lora(16, 32.0, ("all-linear",))
    for adapter, recomputing, keeping in ((None, (0.25, 0.3), (0.32, 1 / 3)), (lora, (1 / 3, 0.4), (0.45, 0.5))):
        planner = planner_for("qwen2.5-7b", 8192, micro_batch=2, seq_len=4096, gpu_memory=139 * 2**30, adapter=adapter)
        for kept, (low, high) in ((0, recomputing), (28, keeping)):
            assert low < planner.forward_share(planner.placement_of(Counts(8192, kept=kept))) <= high + 1e-3
    block_forward_s = planner.blocks_s(8192, 28, forward_only=True) / 28
    assert block_forward_s == pytest.approx(7.0e-3, rel=0.1)


def test_a_set_gradient_pool_is_planned_as_set(monkeypatch):
    simulate_host(monkeypatch, 1000)
    auto = plan_for("qwen2.5-7b", 16384)
    assert auto.gradient_pool > GRADIENT_POOL  # the optimizer lags the backward at 16k tokens: deepened
    deeper = plan_for("qwen2.5-7b", 16384, gradient_pool=auto.gradient_pool + 2)
    largest = max(layout_sizes(build_model(preset("qwen2.5-7b")))[0])
    assert deeper.gradient_pool == auto.gradient_pool + 2
    assert deeper.host_bytes == auto.host_bytes + 2 * largest * 4
    clipped = plan_for("qwen2.5-7b", 16384, gradient_pool=12, clipping=True)
    assert clipped.gradient_pool == 0  # clipping holds every gradient: no pool


def test_kept_layers_are_planned_at_their_own_rate():
    """A kept layer's time is its work (no recomputed GEMMs) at the kept rate where one was measured; the
    block's rate for it otherwise, which is the block work less the skipped GEMMs at the block's rate."""
    model = preset("qwen2.5-0.5b")
    h100 = int(79.2 * 2**30)
    same = plan_for("qwen2.5-0.5b", 131072, rates=Rates(gpu_tflops=400.0), gpu_memory=h100)
    explicit = plan_for("qwen2.5-0.5b", 131072, rates=Rates(gpu_tflops=400.0, gpu_kept_tflops=400.0), gpu_memory=h100)
    assert (explicit.compute_s, explicit.step_s) == pytest.approx((same.compute_s, same.step_s), rel=1e-12)
    slower = plan_for("qwen2.5-0.5b", 131072, rates=Rates(gpu_tflops=400.0, gpu_kept_tflops=300.0), gpu_memory=h100)
    assert slower.kept_layers == same.kept_layers > 0
    tokens, seq = 131072, 2048
    kept_work = block_work(model, seq, tokens) / model.n_layers - (
        block_work(model, seq, tokens) - block_work(model, seq, tokens, 1)
    )
    expected = same.kept_layers * kept_work * (1 / 300.0 - 1 / 400.0) / 1e12
    assert slower.compute_s - same.compute_s == pytest.approx(expected, rel=1e-9)


def test_moe_layers_kept_are_planned_at_the_moe_kept_rate_and_the_report_names_it():
    """A MoE model's kept layers run at its MoE kept rate where one was measured (`measure_block_rates` times the
    kept pass; OLMoE's ran slower than its recomputing pass), its MoE block rate otherwise; the dense kept rate is
    not a MoE layer's, and the plan's rates line names the MoE ones."""
    h100 = int(79.2 * 2**30)
    tokens, seq = 131072, 2048
    fixed = {"gpu_memory": h100, "parked_layers": 0}  # (parking pays at the faster kept rate alone: 9 layers, not 8)
    same = plan_for("olmoe-1b-7b", tokens, rates=Rates(moe_gpu_tflops=430.0, gpu_kept_tflops=900.0), **fixed)
    slower = plan_for("olmoe-1b-7b", tokens, rates=Rates(moe_gpu_tflops=430.0, moe_gpu_kept_tflops=400.0), **fixed)
    assert slower.kept_layers == same.kept_layers > 0
    model = preset("olmoe-1b-7b")
    kept_work = block_work(model, seq, tokens) / model.n_layers - (
        block_work(model, seq, tokens) - block_work(model, seq, tokens, 1)
    )
    expected = same.kept_layers * kept_work * (1 / 400.0 - 1 / 430.0) / 1e12
    assert slower.compute_s - same.compute_s == pytest.approx(expected, rel=1e-9)
    assert "GPU MoE blocks 430.0 (kept 400.0) / head" in format_plan(slower, "olmoe-1b-7b")
    assert "GPU MoE blocks 430.0 / head" in format_plan(same, "olmoe-1b-7b")
    dense = plan_for("qwen2.5-0.5b", tokens, rates=Rates(gpu_tflops=400.0, gpu_kept_tflops=380.0), gpu_memory=h100)
    assert "GPU blocks 400.0 (kept 380.0) / head" in format_plan(dense, "qwen2.5-0.5b")


def test_layers_keep_their_attention_results_as_the_gpu_has_room():
    """Qwen3.5-0.8B at 64k tokens: its layers keeping their products keep their attention kernel's results too
    (the 18 linear-attention layers their recurrence's, the 6 others their causal attention's output and
    log-sum-exp) where the GPU has room beyond the placement and `EXTRAS_MARGIN` (as the pipeline grants them),
    all on an H200, fewer on an H100, none where the room is short; each saves its kernel's forward (the
    recurrence's at `Rates.recurrence_tflops`, attention's at the block's rate) and costs no other choice."""
    rates = Rates(recurrence_tflops=20.0, gpu_tflops=500.0)
    qwen35 = dict(seq_len=4096, micro_batch=4, rates=rates, host_memory=2**40)
    plans = [plan_for("qwen3.5-0.8b", 65536, **qwen35, gpu_memory=int(gib * 2**30)) for gib in (139, 79, 64)]
    h200, h100, short = plans
    assert h200.kept_layers == h100.kept_layers == short.kept_layers == 24
    assert h200.placement.resident == h100.placement.resident == short.placement.resident
    assert h200.extra_kept_layers == 24 and 0 < h100.extra_kept_layers < 24 and short.extra_kept_layers == 0
    assert h200.compute_s < h100.compute_s < short.compute_s
    model = preset("qwen3.5-0.8b")
    recurrence_s = linear_attention_flops_per_token(model) / 3 * 65536 / 20e12
    attention_s = model.n_heads * sum(model.attention_widths) * 4096 * 65536 / 500e12  # (the forward third)
    assert short.compute_s - h200.compute_s == pytest.approx(18 * recurrence_s + 6 * attention_s, rel=1e-9)
    room = 79 * 2**30 - h100.gpu_bytes - EXTRAS_MARGIN
    recurrence_bytes = 65536 * KeptRecurrence.bytes_per_token(16, 128, 128, 64, True, 2)
    attention_bytes = 65536 * KeptAttention.bytes_per_token(model.n_heads, model.head_dim, 2)
    assert min(recurrence_bytes, attention_bytes) < room < 18 * recurrence_bytes + 6 * attention_bytes
    dense = [plan_for("qwen2.5-0.5b", 65536, gpu_memory=gib * 2**30, rates=rates) for gib in (139, 24)]
    assert dense[0].extra_kept_layers == dense[0].kept_layers == 24 and dense[1].extra_kept_layers == 0


def test_large_steps_run_in_sweeps_where_they_keep_more_products(monkeypatch):
    """Where the GPU bounds a large step and its layers recompute products, the planner predicts it in sweeps (each
    placed as a step of its micro-batches' tokens) and takes the fastest, by a margin, whose copies leave PCIe
    room: Gemma-3-4B at 128k tokens a step on an H100 runs as 4 sweeps of 32k, each keeping what a 32k step keeps,
    every gradient held to the last sweep (no pool); Qwen2.5-7B's 4 sweeps, predicted faster too, would keep PCIe
    too busy (measured slower). Not a step the GPU does not bound, nor DPO's or a MoE router loss's (they read the
    whole step first); engine.sweeps sets the count."""
    simulate_host(monkeypatch, 1000)
    h100 = 79 * 2**30
    large = plan_for("gemma-3-4b", 131072, gpu_memory=h100)
    one = plan_for("gemma-3-4b", 131072, sweeps=1, gpu_memory=h100)
    at_32k = plan_for("gemma-3-4b", 32768, gpu_memory=h100)
    assert large.placement.sweeps == 4 and large.placement.tokens == 32768 and large.tokens_per_step == 131072
    assert large.kept_layers + large.host_kept_layers > one.kept_layers + one.host_kept_layers
    # nearly what a 32k step keeps (the embedding's gradient, carried from sweep to sweep, takes two layers' room)
    assert at_32k.kept_layers - 3 <= large.kept_layers + large.host_kept_layers < at_32k.kept_layers
    assert large.step_s < 0.97 * one.step_s and large.compute_s < one.compute_s
    assert large.gradient_pool == 0 and one.gradient_pool > 0
    assert "4 sweeps of 32,768 tokens" in large.placement.why["sweeps"] and "in 4 sweeps of 32,768" in large.summary()
    # the weights stream once a sweep, the gradient sums go out each sweep and come back after the first
    streamed = large.n_params - large.gpu_updated_bytes // 12  # (fp32 weights cross; none held in a large step)
    copies_in = 4 * 2 * streamed * 4 + 3 * 4 * streamed
    assert large.transfer_s == pytest.approx(copies_in / (large.rates.pcie_gbps * 1e9))
    assert large.transfer_s <= SWEEPS_PCIE_SHARE * large.compute_s
    qwen = {"sweeps": 4}
    busy = plan_for("qwen2.5-7b", 131072, **qwen, gpu_memory=h100)
    assert busy.transfer_s > SWEEPS_PCIE_SHARE * busy.compute_s
    assert plan_for("qwen2.5-7b", 131072, gpu_memory=h100).placement.sweeps == 1
    assert at_32k.placement.sweeps == 1 and plan_for("gemma-3-4b", 16384, gpu_memory=h100).placement.sweeps == 1
    dpo = plan_for("gemma-3-4b", 131072, objective=ObjectiveMemory(sweepable=False), gpu_memory=h100)
    z_loss = plan_for("olmoe-1b-7b", 131072, router_z_loss=True, gpu_memory=h100)
    assert dpo.placement.sweeps == 1 and z_loss.placement.sweeps == 1
    three = plan_for("qwen2.5-7b", 131072, sweeps=3, gpu_memory=h100)
    assert three.placement.sweeps == 3 and three.placement.tokens == 3 * 16384  # 8 micro-batches: 3, 3 and 2


def test_a_nearly_full_host_still_runs_a_large_step_in_the_sweeps_that_are_faster():
    """Qwen2.5-7B at 128k tokens with clipping on an H200's 125 GiB host: 97% of the budget in one sweep or in 8.
    Held to POOL_HOST_SHARE of it, the step ran in one sweep keeping 8 layers' products (497 model TFLOPS, where 8
    sweeps ran 540: sweeps-qwen2.5-7b-h200.json); within the budget itself the faster sweeps are taken."""
    gpu, host = int(139.8 * 2**30), int(117.7 * 2**30)
    planner = planner_for(
        "qwen2.5-7b", 131072, seq_len=4096, micro_batch=4, clipping=True, gpu_memory=gpu, host_memory=host
    )
    one, chosen = planner.place(131072, sweeps=1), planner.place(131072)
    assert POOL_HOST_SHARE * host < planner.host_bytes(one) == planner.host_bytes(chosen) <= host
    assert chosen.sweeps > 1 and len(chosen.keeping) > len(one.keeping) and planner.step_s(chosen) < planner.step_s(one)
    assert "sweeps" in chosen.why and "host" not in chosen.why["sweeps"]  # (taken as faster, not as lighter)


def test_a_step_the_host_cannot_hold_in_one_sweep_runs_in_the_sweeps_that_it_holds():
    """Smaller sweeps offload smaller checkpoints: where one sweep's plan passes the host's budget and more sweeps'
    plan does not, the planner takes the sweeps, even where they are predicted slower (QLoRA's 405B on a 256 GiB
    host: each sweep dequantizes the whole base again)."""
    nf4, gpu = Lora(16, 32.0, ("all-linear",), base_format="nf4"), int(139.8 * 2**30)
    planner = planner_for(
        "llama3.1-405b", 32768, micro_batch=1, seq_len=4096, gpu_memory=gpu, host_memory=256 * 2**30, adapter=nf4
    )
    one, chosen = planner.place(32768, sweeps=1), planner.place(32768)
    budget = POOL_HOST_SHARE * 256 * 2**30
    assert planner.host_bytes(one) > budget >= planner.host_bytes(chosen) and chosen.sweeps > 1
    assert planner.step_s(chosen) > planner.step_s(one)
    assert "which the host does not hold" in chosen.why["sweeps"]


def test_lora_holds_the_base_once_in_the_compute_dtype_and_trains_its_adapters_alone():
    """LoRA over Qwen2.5-7B: the base at 2 B/param (bf16) and no master, moments or gradients but the adapters'; the
    backward makes no weight gradient of the base (6 FLOPs a parameter with its recompute, not 8) and sends none back;
    the report says what the host holds each way."""
    lora = Lora(16, 32.0, ("all-linear",))
    host, gpu = 125 * 2**30, int(139.8 * 2**30)
    full = planner_for("qwen2.5-7b", 32768, clipping=True, gpu_memory=gpu, host_memory=host)
    tuned = planner_for("qwen2.5-7b", 32768, clipping=True, gpu_memory=gpu, host_memory=host, adapter=lora)
    plan, adapters = planned(tuned), tuned.spec.adapter_params
    assert 40e6 < adapters < 41e6  # r 16 on q, k, v, o, gate, up, down of 28 layers
    items = plan.host_items
    assert items["frozen base weights"] == 2 * tuned.frozen_params == 2 * plan.n_params
    assert items["master weights"] == 4 * adapters and items["optimizer moments"] == 8 * adapters
    assert items["gradients held for clipping"] == 4 * adapters
    # the base crosses PCIe in bf16 (the fp32 masters cast on arrival: 4 bytes), and no gradient of it comes back
    assert full._wire() == 4 and tuned._wire() == pytest.approx(2, rel=0.02) and tuned.grad_share < 0.01
    assert tuned.blocks_s(32768, 0) == pytest.approx(full.blocks_s(32768, 0) * 0.75, rel=0.05)
    # between steps the first stages wait for their adapters' update alone (a frozen table comes in beside, the
    # first block's base once its adapters are updated)
    on_host = {"clipping": True, "gpu_memory": gpu, "host_memory": host, "gpu_updated_layers": 0}
    full_on_host = planner_for("qwen2.5-7b", 32768, **on_host)
    tuned_on_host = planner_for("qwen2.5-7b", 32768, adapter=lora, **on_host)
    first_adapters = tuned_on_host.trained_sizes[1]
    assert 0 < first_adapters < 2e6 and tuned_on_host.trained_sizes[0] == 0  # (layer 0's adapters; a frozen table)
    first_block_in = tuned_on_host.params((1,)) * tuned_on_host._wire()
    expected = STEP_TURNAROUND_S + first_adapters / Rates().cpu_adam_params_per_s
    expected += (4 * first_adapters + first_block_in) / (Rates().pcie_gbps * 1e9)
    assert planned(tuned_on_host).bubble_s == pytest.approx(expected, rel=1e-6)
    assert planned(full_on_host).bubble_s - STEP_TURNAROUND_S > 0.1 > 5 * (expected - STEP_TURNAROUND_S)
    largest = plan.largest_params
    modes = ["full training", "LoRA over a base in bf16", "LoRA over an int8 base", "LoRA over an nf4 base"]
    assert list(largest) == modes
    assert largest["LoRA over a base in bf16"] == pytest.approx(8 * largest["full training"], rel=1e-9)
    assert largest["LoRA over an nf4 base"] == pytest.approx(largest["LoRA over a base in bf16"] * 2 / 0.516, rel=1e-3)
    assert largest["LoRA over an nf4 base"] / largest["LoRA over an int8 base"] == pytest.approx(1.94, rel=0.01)
    assert "frozen parameters (base model under LoRA adapters)" in format_plan(plan, "qwen2.5-7b")


def test_a_packed_base_is_planned_at_the_bytes_the_store_holds_it_in():
    """QLoRA (nf4 or int8 layers): the host item is the bytes `HostStore` allocates for the base (packed layers,
    embedding and head in bf16); the base crosses PCIe at that size; the GPU holds two byte buffers of the largest
    packed layer and spends the dequantization's time a sweep; a model the host does not hold is refused naming the
    mode that would hold it."""
    for format, per_param in (("nf4", 0.5159), ("int8", 1.0)):  # (and the norms' and biases' bf16)
        lora = Lora(16, 32.0, ("all-linear",), base_format=format)
        tuned = planner_for("qwen2.5-7b", 32768, clipping=True, gpu_memory=int(139.8 * 2**30), adapter=lora)
        layouts = [GroupLayout.from_specs((p.name, p.shape, True) for p in g.params) for g in tuned.spec.groups]
        frozen = tuned.spec.frozen_groups(set())
        packed = tuned.spec.packed_groups
        store_bytes = sum(PackedLayout.of(layouts[g], format, torch.bfloat16).nbytes for g in packed)
        store_bytes += 2 * sum(layouts[g].numel for g in frozen - packed)
        plan = planned(tuned)
        assert plan.host_items["frozen base weights"] == store_bytes
        # (and, while the checkpoint loads, one layer unpacked before it is packed: `PackedGroups.writing`)
        assert plan.host_items["packing buffer"] == 2 * max(layouts[g].numel for g in packed)
        layers = sum(layouts[g].numel for g in packed)
        assert per_param < (store_bytes - 2 * (plan.n_params - layers)) / layers < per_param * 1.005
        crossing = store_bytes + 4 * tuned.spec.adapter_params  # (the adapters as fp32 masters, cast on arrival)
        assert tuned._wire() == pytest.approx(crossing / tuned.stored_params, rel=1e-9)
        # each packed matrix is dequantized on the GPU twice a sweep, at the GPU time it takes from the layers
        packed_layouts = [PackedLayout.of(layouts[g], format, torch.bfloat16) for g in packed]
        values = sum(p.entry.numel for layout in packed_layouts for p in layout.entries if p.format)
        assert tuned.dequantize_s() == 2 * values / getattr(tuned.rates, f"{format}_dequantize_values_per_s")
    bf16 = planner_for(
        "qwen2.5-7b", 32768, clipping=True, gpu_memory=int(139.8 * 2**30), adapter=Lora(16, 32.0, ("all-linear",))
    )
    ring = 2 * max(PackedLayout.of(layouts[g], "int8", torch.bfloat16).nbytes for g in packed)
    placement = tuned.place(32768)
    assert tuned.persistent_device_bytes(placement) - bf16.persistent_device_bytes(placement) == ring
    assert bf16.dequantize_s() == 0
    assert tuned.layers_s(placement) - bf16.layers_s(placement) == pytest.approx(tuned.dequantize_s(), rel=1e-9)
    # `megatrain plan` says both: the packed base's file beside a run, the dequantization's share of the GPU's time
    report = format_plan(tuned.plan(placement), "qwen2.5-7b")
    assert f"keeps the packed base on disk ({sum(tuned.packed.values()) / 2**30:.1f} GiB in output_dir/cache" in report
    assert f", {placement.sweeps * tuned.dequantize_s():.2f} s of it dequantizing the base," in report
    plain = format_plan(bf16.plan(placement), "qwen2.5-7b")
    assert "packed base" not in plain and "dequantizing" not in plain
    lora = Lora(16, 32.0, ("all-linear",))
    with pytest.raises(
        PlanError, match=r"it fits with LoRA over an nf4 base \(model.adapter: \{type: lora, base_dtype: nf4\}\)"
    ):
        too_large = planner_for("dense-120b", 32768, clipping=True, host_memory=100 * 2**30, adapter=lora)
        check_plan(planned(too_large), too_large)


def test_lora_dropout_plans_a_layers_masks():
    """With dropout, each adapted member's keep-mask and dropped input ([tokens, its input width] each, one member at
    a time) are a layer's working memory on top of its recompute."""
    plain = planner_for("qwen2.5-7b", 32768, micro_batch=4, seq_len=4096, adapter=Lora(16, 32.0, ("all-linear",)))
    dropped = planner_for(
        "qwen2.5-7b", 32768, micro_batch=4, seq_len=4096, adapter=Lora(16, 32.0, ("all-linear",), dropout=0.05)
    )
    widest = preset("qwen2.5-7b").d_ff  # (the down projection's input)
    assert dropped.recompute_bytes - plain.recompute_bytes == 2 * 4 * 4096 * widest * 2


def test_on_the_hosts_own_cpu_the_steps_parts_take_turns(monkeypatch):
    """Where the device is the host's CPU (`Machine.shares_cores`), compute, copies and updates share its cores: the
    step is their sum, where a GPU's overlap them (the longest bounds it); the report says which."""
    simulate_host(monkeypatch, 64)
    gpu = planner_for("qwen2.5-0.5b", 8192)
    measured = replace(gpu.rates, source="measured on this CPU")  # (a CPU's step on the default rates is not predicted)
    cpu = Planner(gpu.spec, measured, replace(gpu.machine, shares_cores=True), gpu.shape, gpu.engine, gpu.objective)
    placement = gpu.place(gpu.step_tokens)
    overlapped, in_turn = gpu.plan(placement, False), cpu.plan(placement, False)
    parts = in_turn.compute_s + in_turn.transfer_s + in_turn.optimizer_s + gpu.device_update_s(placement)
    assert in_turn.step_s == pytest.approx(parts + in_turn.bubble_s, rel=1e-9)
    assert overlapped.step_s < in_turn.step_s and in_turn.bound == "compute"
    assert " in turn, " in format_plan(in_turn, "qwen2.5-0.5b") and " overlapped, " in format_plan(overlapped, "x")


def test_a_host_refusal_names_another_saving_that_fits_alone():
    """Llama-3.1-70B with clipping on a 1 TiB host: the moments (the largest item) are named with the disk tier, and
    the gradients held for clipping too, whose saving alone fits (it named the largest item's alone)."""
    planner = planner_for(
        "llama3.1-70b", 32768, seq_len=4096, micro_batch=4, clipping=True, gpu_memory=141 * 2**30, host_memory=2**40
    )
    message = r"optimizer moments take .* engine.optimizer_state_dir .*; or train.grad_clip: 0 .* \(gradients held for"
    with pytest.raises(PlanError, match=message):
        check_plan(planned(planner), planner)
