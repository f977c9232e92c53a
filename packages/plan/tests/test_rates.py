"""The rates: remembered per machine and run shape, measured once per shape on a GPU."""

import contextlib
import json
import time
from dataclasses import asdict

import pytest
import torch

from megatrain_plan import Rates
from megatrain_plan import rates as calibration
from megatrain_zoo import generic_stages, preset


def test_calibrations_are_remembered_per_machine_and_run_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "CALIBRATION_FILE", tmp_path / "calibration.json")
    monkeypatch.setattr(calibration.host_kernel, "kernel_name", lambda: Rates().cpu_adam_kernel)  # the rates' own
    assert calibration.load_rates("H100: a 7B") == Rates()  # nothing calibrated here: the defaults
    seven, half = Rates(gpu_tflops=627.5, source="7B"), Rates(gpu_tflops=314.5, source="0.5B")
    calibration.save_rates("H100: a 7B", seven, machine=True)  # `megatrain plan --calibrate`: every rate
    calibration.save_rates("H100: a 0.5B", half, machine=False)  # a run's GPU rates at its shape
    assert calibration.load_rates("H100: a 7B") == seven and calibration.load_rates("H100: a 0.5B") == half
    assert calibration.load_rates("H100: a 3B") == seven  # not measured: the machine's calibration
    (tmp_path / "calibration.json").write_text(json.dumps(asdict(half)))  # one rates object: an older file
    assert calibration.load_rates("H100: a 7B") == half

    # a bf16 run on a CUDA GPU measures its shape's block and head once; fp32 runs and runs told not to
    # measure (a launch of several processes, engine.measure_rates: false) do not
    measured = []

    def gpu_rates(model, seq_len, micro_batch, spec=None):
        measured.append((seq_len, micro_batch))
        calibration.FIRST_CALLS.seconds += 7.0  # the first calls' compiling, as `_sustained_seconds` counts it
        return 300.0, 280.0, 500.0, None

    measuring_on_a_gpu(monkeypatch, gpu_rates)
    model, cuda, bf16 = preset("qwen2.5-0.5b"), torch.device("cuda"), torch.bfloat16
    rates = calibration.run_rates(model, cuda, bf16, 2048, 8)
    assert (rates.gpu_tflops, rates.gpu_kept_tflops, rates.head_tflops) == (300.0, 280.0, 500.0)
    assert rates.pcie_gbps == half.pcie_gbps
    assert "measured" in rates.source and measured == [(2048, 8)]
    assert "(7 s of it compiling the run's kernels)" in rates.source  # counted afresh for each measurement
    assert calibration.run_rates(model, cuda, bf16, 2048, 8) == rates and measured == [(2048, 8)]  # remembered
    assert calibration.run_rates(model, cuda, bf16, 2048, 4, measure=False) == half  # the machine's
    assert calibration.run_rates(model, cuda, torch.float32, 2048, 4) == half and len(measured) == 1
    assert calibration.run_rates(model, cuda, bf16, 2048, 4).gpu_tflops == 300.0
    assert measured == [(2048, 8), (2048, 4)]
    assert calibration.load_rates("another shape") == half  # what a run measures is not the machine's calibration
    moe = calibration.run_rates(preset("olmoe-1b-7b"), cuda, bf16, 2048, 2)  # a MoE model's are its MoE rates
    assert (moe.moe_gpu_tflops, moe.moe_gpu_kept_tflops) == (300.0, 280.0)
    assert (moe.gpu_tflops, moe.gpu_kept_tflops) == (half.gpu_tflops, half.gpu_kept_tflops)


def test_rates_are_remembered_per_templates_code(tmp_path, monkeypatch):
    """A layer's rate is its kernels': rates measured before the templates' code changed (an upgrade, a new fused
    kernel) are not the new code's, so the calibration's key names a digest of that code."""
    import megatrain_templates

    package = tmp_path / "megatrain_templates"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "ops.py").write_text("def swiglu(x): return x\n")
    monkeypatch.setattr(megatrain_templates, "__file__", str(package / "__init__.py"))
    model, keys = preset("qwen2.5-0.5b"), []
    for source in ("def swiglu(x): return x\n", "def swiglu(x): return x\n", "def swiglu(x): return 2 * x\n"):
        (package / "ops.py").write_text(source)
        calibration.templates_digest.cache_clear()
        keys.append(calibration.calibration_key(model, 2048, 8, torch.device("cpu"), torch.float32))
    calibration.templates_digest.cache_clear()
    assert keys[0] == keys[1] != keys[2]
    # so does the host AdamW kernel's name: its rate is in every shape's rates
    monkeypatch.setattr(calibration.host_kernel, "kernel_name", lambda: "megatrain 0123abcd")
    assert calibration.calibration_key(model, 2048, 8, torch.device("cpu"), torch.float32) != keys[2]


def test_a_machines_first_shape_measures_its_copies_and_adamws_too(tmp_path, monkeypatch):
    """PCIe's and both AdamWs' rates are the machine's, whatever the shape: a run on a machine that measured nothing
    yet measures them with its shape's block (beside that block's pass, as in a step) and keeps them as the
    machine's, which a later shape, or a run told not to measure, plans with; then they are not measured again."""
    monkeypatch.setattr(calibration, "CALIBRATION_FILE", tmp_path / "calibration.json")
    machine_measured = []
    measuring_on_a_gpu(monkeypatch, lambda *shape, spec=None: (300.0, 280.0, 500.0, "the block's pass"))
    monkeypatch.setattr(
        calibration,
        "_machine_rates",
        lambda layer_pass: machine_measured.append(layer_pass) or {"pcie_gbps": 41.0, "cpu_adam_params_per_s": 3.1e9},
    )
    model, cuda, bf16 = preset("qwen2.5-0.5b"), torch.device("cuda"), torch.bfloat16
    first = calibration.run_rates(model, cuda, bf16, 2048, 8)
    assert (first.pcie_gbps, first.cpu_adam_params_per_s, first.gpu_tflops) == (41.0, 3.1e9, 300.0)
    assert machine_measured == ["the block's pass"] and "PCIe and both AdamWs with them" in first.source
    second = calibration.run_rates(model, cuda, bf16, 2048, 4)
    assert second.cpu_adam_params_per_s == 3.1e9 and "the rest PCIe and AdamWs measured" in second.source
    assert calibration.run_rates(model, cuda, bf16, 1024, 4, measure=False).pcie_gbps == 41.0
    assert machine_measured == ["the block's pass"]  # once

    # an upgrade that changes what runs the host's AdamW: the machine's rates are that kernel's no more
    monkeypatch.setattr(calibration.host_kernel, "kernel_name", lambda: "megatrain 0123abcd")
    upgraded = calibration.run_rates(model, cuda, bf16, 1024, 2)
    assert machine_measured == ["the block's pass"] * 2 and upgraded.cpu_adam_kernel == "megatrain 0123abcd"
    assert calibration.load_rates().cpu_adam_kernel == "megatrain 0123abcd"  # now the machine's


def measuring_on_a_gpu(monkeypatch, gpu_rates) -> None:
    """`run_rates` as on a GPU, measuring with `gpu_rates` (`measure_block_rates`' arguments and results), a shape's
    calibration key its micro-batch shape."""
    monkeypatch.setattr(calibration, "measure_block_rates", gpu_rates)
    monkeypatch.setattr(calibration, "_machine_rates", lambda layer_pass: {})
    monkeypatch.setattr(
        calibration,
        "calibration_key",
        lambda model, seq_len, micro_batch, spec=None: f"seq {seq_len} x {micro_batch}{calibration._as_built(spec)}",
    )
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_kinds_of_layer_inductor_failed_on_are_remembered_with_the_rates(tmp_path, monkeypatch):
    """A kind of generic layer that the measurement found Inductor fails on is remembered beside the rates: a later
    run, a new process that finds the rates remembered, plans it as eager too instead of meeting the failure at its
    first step with compiled products planned."""
    monkeypatch.setattr(calibration, "CALIBRATION_FILE", tmp_path / "calibration.json")
    monkeypatch.setattr(generic_stages, "KINDS_RUN_EAGERLY", set())
    failing = ("FalconH1DecoderLayer", "hybrid", (torch.Size([64, 32]), torch.Size([32])))

    def gpu_rates(model, seq_len, micro_batch, spec=None):
        generic_stages.KINDS_RUN_EAGERLY.add(failing)  # as `GenericLayer._call` does on a failed compile
        return 300.0, None, 500.0, None

    measuring_on_a_gpu(monkeypatch, gpu_rates)
    model, cuda, bf16 = preset("qwen2.5-0.5b"), torch.device("cuda"), torch.bfloat16
    measured = calibration.run_rates(model, cuda, bf16, 2048, 8)
    generic_stages.KINDS_RUN_EAGERLY.clear()  # a new process
    monkeypatch.setattr(calibration, "measure_block_rates", None)  # (remembered: nothing measured)
    assert calibration.run_rates(model, cuda, bf16, 2048, 8) == measured
    assert generic_stages.KINDS_RUN_EAGERLY == {failing}


def test_a_measured_pass_counts_its_first_call_apart(monkeypatch):
    """A pass's first call compiles its kernels (which the run then reuses): its seconds are counted apart
    (`FIRST_CALLS`) and stay out of the rate, which is the mean of the calls after the warm-up."""
    calls = []

    def layer_pass():
        calls.append(None)
        time.sleep(0.3 if len(calls) == 1 else 0.002)

    monkeypatch.setattr(calibration.FIRST_CALLS, "seconds", 0.0)
    monkeypatch.setitem(calibration._TIMING, "cpu", (lambda: None, 0.01, 0.02))
    seconds = calibration._sustained_seconds(layer_pass, "cpu")
    assert calibration.FIRST_CALLS.seconds >= 0.3 and seconds < 0.1 and len(calls) > 3


def test_the_layer_rate_weighs_each_kind_of_layer_by_its_count(monkeypatch):
    """Qwen3.5's layers are of two kinds (linear attention on three of four): the measured layer rates
    (recomputing, keeping products) are the layers' work over one timed layer of each kind, weighted by how many
    layers it stands for (kinds in layer order: layer 0 is linear); then the head's."""
    model, timed = preset("tiny-qwen3.5"), []

    def sustained_seconds(run, device_type):
        run()
        timed.append(0.01 * (len(timed) + 1))  # (a time of each pass's own, to tell which weighs what)
        return timed[-1]

    monkeypatch.setattr(calibration, "_sustained_seconds", sustained_seconds)
    layer_tflops, kept_tflops, head_tflops, _ = calibration.measure_block_rates(
        model, 64, 2, torch.device("cpu"), torch.float32
    )
    n_linear = len(model.linear_attention_layers)
    assert 0 < n_linear < model.n_layers and len(timed) == 5  # two kinds, recomputing and keeping; the head
    whole, kept = calibration.layer_works(model, 64, 128)
    for rate, work, (linear_s, softmax_s) in [(layer_tflops, whole, timed[:2]), (kept_tflops, kept, timed[2:4])]:
        expected = work * model.n_layers / (n_linear * linear_s + (model.n_layers - n_linear) * softmax_s) / 1e12
        assert rate == pytest.approx(expected, rel=1e-3)
    assert head_tflops == pytest.approx(6 * model.vocab_size * model.d_model * 128 / timed[4] / 1e12, rel=1e-3)


def test_a_run_on_the_cpu_plans_with_its_layers_rates_at_its_shape(tmp_path, monkeypatch):
    """On the CPU the "GPU" rates are the run's own layers' and head's at its shape and dtype (a small model's
    layer runs far below a large matrix product's rate), its AdamW this CPU's: measured once per shape and dtype,
    remembered; a large layer's are its matrix products' rate."""
    monkeypatch.setattr(calibration, "CALIBRATION_FILE", tmp_path / "calibration.json")
    monkeypatch.setitem(calibration._TIMING, "cpu", (lambda: None, 0.0, 0.0))
    model, cpu = preset("tiny-llama"), torch.device("cpu")
    rates = calibration.run_rates(model, cpu, torch.float32, 32, 2)
    assert min(rates.gpu_tflops, rates.gpu_kept_tflops, rates.head_tflops, rates.cpu_adam_params_per_s) > 0
    assert rates.cpu_adam_params_per_s != Rates().cpu_adam_params_per_s and "at this shape" in rates.source
    monkeypatch.setattr(calibration, "measure_block_rates", None)  # (nothing measured: remembered, or not allowed)
    assert calibration.run_rates(model, cpu, torch.float32, 32, 2) == rates
    assert calibration.run_rates(model, cpu, torch.float32, 64, 2, measure=False) == Rates()
    # a layer whose pass would take long runs at its matrix products' rate: no pass is timed
    large = calibration.run_rates(preset("qwen2.5-0.5b"), cpu, torch.float32, 4096, 4)
    assert large.gpu_tflops == large.gpu_kept_tflops == large.head_tflops > 0
    shapes = json.loads((tmp_path / "calibration.json").read_text())["shapes"]
    assert [key.split(": ")[0].split(", ")[-1] for key in shapes] == ["torch.float32"] * 2


def test_a_mixture_of_experts_with_its_balance_loss_on_measures_one_layer_at_a_time(monkeypatch):
    """A layer's pass alone is not a step: its router statistics are one layer's, forgotten after each pass (with
    the balance loss on, a backward reads them; a step's count of layers would refuse one layer's records)."""
    monkeypatch.setitem(calibration._TIMING, "cpu", (lambda: None, 0.0, 0.0))
    model = preset("tiny-mixtral")
    assert model.output_router_logits and model.router_aux_loss_coef > 0
    rates = calibration.measure_block_rates(model, 16, 2, torch.device("cpu"), torch.float32)[:3]
    assert min(rate for rate in rates if rate is not None) > 0


def test_a_run_measures_its_layers_as_it_builds_them(tmp_path, monkeypatch):
    """A MoE layer whose experts stream in parts is timed as the pipeline runs it: its attention stage, then each
    part prepared and run forward, then the backwards in reverse, each given what its forward was (no products
    kept: no kept rate); a LoRA layer with no gradient buffer for its frozen base, its work counted without the base's
    weight gradient. Each build is a calibration of its own, measured once."""
    from megatrain_templates import Lora, MoeAttention, MoeExperts
    from megatrain_zoo import build_model

    monkeypatch.setattr(calibration, "CALIBRATION_FILE", tmp_path / "calibration.json")
    monkeypatch.setitem(calibration._TIMING, "cpu", (lambda: None, 0.0, 0.0))
    calls = []

    def recorded(cls, method):
        original = getattr(cls, method)

        def call(self, weights, x, *args, **kwargs):
            stage = "attention" if cls is MoeAttention else f"experts {self.first}"
            grads = args[1] if method == "backward" else None
            trained = None if grads is None else [g is not None for g in grads]
            calls.append((stage, method, sorted(kwargs), trained))
            return original(self, weights, x, *args, **kwargs)

        monkeypatch.setattr(cls, method, call)

    for cls, method in [(MoeAttention, "forward"), (MoeAttention, "backward")] + [
        (MoeExperts, m) for m in ("prepare", "forward", "backward")
    ]:
        recorded(cls, method)
    model, cpu = preset("tiny-olmoe"), torch.device("cpu")
    adapter = Lora(4, 8, ("all-linear",))
    parts = build_model(model, 3, adapter)
    parts.router_load.n_layers = 1  # (one layer's pass: `measure_block_rates` counts it so)
    x = torch.randn(2, 16, model.d_model)
    calibration._layer_passes(parts, 0, x)[0]()
    assert model.n_experts == 8 and [call[:2] for call in calls] == [
        ("attention", "forward"),
        *[(part, step) for part in ("experts 0", "experts 3", "experts 6") for step in ("prepare", "forward")],
        *[(part, "backward") for part in ("experts 6", "experts 3", "experts 0")],
        ("attention", "backward"),
    ]
    parts_forward = [kwargs for stage, method, kwargs, _ in calls if method == "forward" and stage != "attention"]
    assert parts_forward == [["prepared"]] * 3
    # trained: the adapters' group alone (the attention stage's trunk and router, a part's router and experts frozen)
    assert {stage: trained for stage, method, _, trained in calls if method == "backward"} == {
        "attention": [False, False, True],
        **{f"experts {first}": [False, False, True] for first in (0, 3, 6)},
    }

    seconds = []
    monkeypatch.setattr(calibration, "_sustained_seconds", lambda run, device: seconds.append(run) or 0.5)
    layer_tflops, kept_tflops, _, _ = calibration.measure_block_rates(model, 16, 2, cpu, torch.float32, parts)
    frozen_work = calibration.layer_works(model, 16, 32, frozen=True)[0]
    assert kept_tflops is None and layer_tflops == pytest.approx(frozen_work / 0.5 / 1e12, rel=1e-3)
    assert frozen_work < calibration.layer_works(model, 16, 32)[0]

    keys = {
        calibration.calibration_key(model, 16, 2, cpu, torch.float32, spec)
        for spec in (None, build_model(model), build_model(model, 3), build_model(model, 0, adapter), parts)
    }
    assert len(keys) == 4  # (None and the whole build are one calibration)
    monkeypatch.setattr(calibration, "measure_block_rates", lambda *shape: (1.0, None, 2.0, None))
    rates = calibration.run_rates(model, cpu, torch.float32, 16, 2, spec=parts)
    monkeypatch.setattr(calibration, "measure_block_rates", None)  # (remembered: nothing measured again)
    assert calibration.run_rates(model, cpu, torch.float32, 16, 2, spec=parts) == rates
    assert rates.moe_gpu_tflops == 1.0 and rates.moe_gpu_kept_tflops is None
