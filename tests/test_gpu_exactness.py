"""The CUDA engine (three streams, pinned memory, slots, offloaded checkpoints) against plain
PyTorch on the same GPU. CPU twins: test_exactness.py."""

from dataclasses import replace

import pytest
import torch
from test_exactness import (
    check_embedding_rows_first,
    check_steps_match_plain_pytorch,
    check_wire_copy_changes_nothing,
    random_batch,
    tiny_llama_config,
)

import megatrain_sched.weights
from megatrain.config import EngineSection
from megatrain.step import StepBatch
from megatrain.trainer import Trainer
from megatrain_optim import DeviceAdamW
from megatrain_templates import set_compile
from megatrain_zoo import preset


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("preset_name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
@pytest.mark.parametrize("grad_clip", [0.0, 0.3])
@pytest.mark.parametrize("kept_layers", [0, "auto"], ids=["recomputed-held", "kept-gpu-updated"])
def test_gpu_steps_match_plain_pytorch(dtype, preset_name, grad_clip, kept_layers, tmp_path):
    # auto keeps every layer's graph of these tiny models (the GPU has the room), the first block's
    # master and moments living and updated on the GPU; 0 recomputes them all, the first block from
    # weights held since its forward (cast on arrival into a buffer of its own)
    n_layers = preset(preset_name).n_layers
    check_steps_match_plain_pytorch(
        dtype,
        preset_name,
        grad_clip,
        "cuda",
        tmp_path,
        expect_kept=n_layers if kept_layers == "auto" else 0,
        kept_layers=kept_layers,
        held_layers=1 if kept_layers == 0 else 0,
        gpu_updated_layers=0 if kept_layers == 0 else 1,
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "engine",
    [
        {"n_slots": 3},
        {"offload_checkpoints": True},
        {"n_slots": 4, "offload_checkpoints": True},
        {"gpu_updated_layers": 2, "kept_layers": 0, "copied_layers": 0},  # every block cast from GPU masters
        {"gpu_updated_layers": 2, "kept_layers": 0, "copied_layers": 1},  # the first bound to its bf16 copy
        {"gpu_updated_layers": 2, "kept_layers": 0, "parked_layers": 1},  # the first's moments parked in the store
        {"kept_layers": 1, "host_kept_layers": 1},  # a block's products through pinned host memory and back
        # every checkpoint through host memory, the kept layers' too
        {"offload_checkpoints": True, "kept_layers": 1, "host_kept_layers": 1},
    ],
)
def test_gpu_engine_options_stay_exact(engine, tmp_path):
    # float64: a race between streams would show up as a difference far above 1e-10
    check_steps_match_plain_pytorch("float64", "tiny-qwen2", 0.3, "cuda", tmp_path, **engine)


@pytest.mark.gpu
@pytest.mark.parametrize("copied_layers,parked_layers", [(0, 0), (2, 0), (0, 1)])
def test_gpu_clipped_updates_beside_the_forward_are_waited_for(copied_layers, parked_layers, tmp_path, monkeypatch):
    # with clipping, resident groups' updates run on the GPU optimizer's stream beside the next forward; each held
    # back there ~25 ms, a cast (or a read of the copy the update refreshes) that did not wait for its groups' update
    # would read the old weights, and a gradient let go too early would be overwritten under it; parked moments go
    # out and come back on a stream of their own, held back there too: an update that did not wait for them, or
    # memory reused before they left, would read or write the wrong moments (float64: any shows far above 1e-10)
    update, park, bring_back = DeviceAdamW.update, DeviceAdamW._park, DeviceAdamW.bring_back

    def late_update(self, *args, **kwargs):
        if self.stream is not None and torch.cuda.current_stream(self.device) == self.stream:
            torch.cuda._sleep(50_000_000)  # clock cycles
        update(self, *args, **kwargs)

    def late(method):
        def late_on_the_moment_stream(self, *args):
            with torch.cuda.stream(self.moment_stream):
                torch.cuda._sleep(50_000_000)
            method(self, *args)

        return late_on_the_moment_stream

    monkeypatch.setattr(DeviceAdamW, "update", late_update)
    monkeypatch.setattr(DeviceAdamW, "_park", late(park))
    monkeypatch.setattr(DeviceAdamW, "bring_back", late(bring_back))
    check_steps_match_plain_pytorch(
        "float64",
        "tiny-qwen2",
        0.3,
        "cuda",
        tmp_path,
        gpu_updated_layers=2,
        kept_layers="auto",
        copied_layers=copied_layers,
        parked_layers=parked_layers,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("grad_clip", [0.0, 0.3])
@pytest.mark.parametrize(
    "engine",
    [
        {"sweeps": 3, "offload_checkpoints": True},
        {"sweeps": 2, "kept_layers": 1, "host_kept_layers": 1, "gpu_updated_layers": 1},
    ],
    ids=["a-micro-batch-each-offloaded", "uneven-beside-kept-and-gpu-updated-layers"],
)
def test_gpu_steps_in_sweeps_stay_exact(grad_clip, engine, tmp_path):
    # the gradients' sums out to pinned host memory and back on the copy-out stream, between the sweeps' weight
    # copies; float64: a missing wait would show far above 1e-10
    sweeps = engine["sweeps"]
    check_steps_match_plain_pytorch(
        "float64", "tiny-qwen2", grad_clip, "cuda", tmp_path, expect_sweeps=sweeps, **engine
    )


@pytest.mark.gpu
def test_gpu_cast_on_arrival_is_bit_identical_to_a_wire_copy(tmp_path, monkeypatch):
    # small staging buffers: every group crosses in many chunks, round the ring of four many times
    monkeypatch.setattr(megatrain_sched.weights, "STAGING_NUMEL", 1000)
    check_wire_copy_changes_nothing("cuda", tmp_path)


@pytest.mark.gpu
def test_gpu_partial_checkpoint_offload_stays_exact(tmp_path, monkeypatch):
    # what auto plans when only some layers' checkpoints fit: the first block goes to host, the rest stay
    from megatrain_plan import Planner

    monkeypatch.setattr(Planner, "_offloaded_to_fit", lambda self, tokens: 1)
    check_steps_match_plain_pytorch("float64", "tiny-qwen2", 0.3, "cuda", tmp_path, expect_offloaded=(1,))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_gpu_embedding_rows_updated_first_match_plain_pytorch(dtype, tmp_path, monkeypatch):
    check_embedding_rows_first(dtype, "tiny-qwen2", 0.0, "cuda", tmp_path, monkeypatch)


@pytest.mark.gpu
def test_gpu_embedding_rows_first_through_the_cast_equal_the_whole_table(tmp_path):
    """bf16 compute from fp32 masters (rows staged and cast on the GPU, in small chunks): the same losses as
    a run that copies the whole table at every step's start."""
    from megatrain import Trainer

    config = tiny_llama_config(
        tmp_path, "cuda", "bfloat16", 16, steps=5, batch_size=2, micro_batch_size=1, lr=1e-3, grad_clip=0.0, seed=3
    )
    losses = []
    for rows_first in (True, False):
        trainer = Trainer(config)
        if not rows_first:
            trainer.updates.rows_first = None
        generator = torch.Generator().manual_seed(5)
        losses.append([trainer.train_step(StepBatch(*random_batch(2, 16, 256, generator))).loss for _ in range(5)])
        trainer.close()
    assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=0)


@pytest.mark.gpu
def test_gpu_trainer_measures_its_plan_rates_once_per_shape(tmp_path, monkeypatch, capfd):
    """A bf16 run on the GPU plans with this GPU's rates at its own shape: measured by the first trainer
    of that shape, remembered for the next; a tiny model's rates (hundredths of a TFLOPS) are not zero. The first
    shape a machine measures measures its PCIe and AdamW rates too, kept as the machine's."""
    from megatrain_plan import Rates
    from megatrain_plan import rates as calibration

    monkeypatch.setenv("MEGATRAIN_MEASURE_RATES", "1")
    monkeypatch.setattr(calibration, "CALIBRATION_FILE", tmp_path / "calibration.json")
    config = tiny_llama_config(tmp_path, "cuda", "bfloat16", 16, steps=1, batch_size=2, micro_batch_size=1)
    first = Trainer(config)
    first.close()
    assert "measuring this GPU's block and head at the run's shape" in capfd.readouterr().err
    rates = first.plan.rates
    assert rates.source.startswith("GPU block and head measured") and 0 < rates.gpu_tflops != Rates().gpu_tflops
    assert 0 < rates.head_tflops != Rates().head_tflops and rates.gpu_kept_tflops > 0
    machine = calibration.load_rates()  # (named as the machine's)
    assert rates.source.endswith("PCIe and both AdamWs with them") and replace(machine, source=rates.source) == rates
    measured = (rates.pcie_gbps, rates.pcie_duplex_gbps, rates.cpu_adam_params_per_s, rates.gpu_adam_params_per_s)
    assert all(rate > 0 for rate in measured) and rates.cpu_adam_params_per_s != Rates().cpu_adam_params_per_s
    second = Trainer(config)
    second.close()
    assert second.plan.rates == rates and "measuring" not in capfd.readouterr().err


@pytest.mark.gpu
def test_gpu_compiled_kernels_compile_once_per_shape(tmp_path):
    """The compiled norms, rotary embedding, SwiGLU and loss head compile in the trainer's setup warm-up
    (one graph per shape and grad mode, shared by every layer and micro-batch: kept layers and recomputed
    ones); the steps compile and recompile nothing."""
    config = tiny_llama_config(
        tmp_path,
        "cuda",
        "bfloat16",
        64,
        engine=EngineSection(kept_layers=1),
        steps=3,
        batch_size=4,
        micro_batch_size=2,
        lr=1e-3,
        grad_clip=0.0,
        seed=3,
    )
    trainer = Trainer(config)
    assert trainer.warm_up_s > 0
    generator = torch.Generator().manual_seed(0)
    vocab = trainer.model_config.vocab_size
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            trainer.train_step(StepBatch(*random_batch(4, 64, vocab, generator)))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    trainer.close()


@pytest.mark.gpu
def test_gpu_steps_without_compilation_match_plain_pytorch(tmp_path):
    """engine.compile: false runs the templates' eager functions on the GPU (torch.compile builds no graph, in the
    setup's warm-up nor in the steps) and the steps stay exact. CPU twin:
    test_steps_without_compilation_match_plain_pytorch."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    try:
        check_steps_match_plain_pytorch("float32", "tiny-qwen3", 0.3, "cuda", tmp_path, compile=False)
    finally:
        set_compile(True)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [16384, 131072])
def test_gpu_the_planned_placement_runs_as_planned(tokens, tmp_path):
    """The planner's placement fits the GPU as the pipeline finds it: no fallback fires, the step runs it as
    planned. A small step makes layers resident and holds weights; a large one (Qwen2.5-1.5B at 128k tokens: not
    every layer's products fit in one sweep) runs in sweeps, each keeping more products than the whole step could,
    the embedding's gradient carried on the GPU from sweep to sweep."""
    from megatrain.config import Config, ModelSection, PrecisionSection, TrainSection
    from megatrain_data import DataSection

    config = Config(
        model=ModelSection(preset="qwen2.5-1.5b"),
        data=DataSection(seq_len=4096),
        train=TrainSection(steps=2, batch_size=tokens // 4096, micro_batch_size=4, grad_clip=0.0, warmup_steps=0),
        precision=PrecisionSection("bfloat16"),
        device="cuda",
        output_dir=str(tmp_path),
    )
    trainer = Trainer(config)
    n_layers = trainer.model_config.n_layers
    if tokens == 16384:
        assert trainer.plan.gpu_updated_layers > 0
    else:
        assert trainer.plan.placement.sweeps > 1 and "sweeps" in trainer.plan.placement.why
        assert 0 < trainer.plan.kept_layers <= n_layers
    ids = torch.randint(0, trainer.model_config.vocab_size, (tokens // 4096, 4096))
    for _ in range(2):
        trainer.train_step(StepBatch(ids, torch.roll(ids, -1, 1)))
    assert trainer.pipeline.fallback is None and trainer.pipeline.device_headroom >= 0
    assert trainer.pipeline.executed == trainer.placement
    trainer.close()
