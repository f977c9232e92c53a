"""A config as the planner's inputs (`megatrain.planning`), `megatrain plan`, and what the planner reads of an
objective; the planner itself is tested on its own inputs in packages/plan."""

import json
import re

import pytest

from megatrain import planning
from megatrain.cli import main
from megatrain.config import ConfigError, load_config, model_config_of
from megatrain.planning import check_plan, make_plan, make_planner
from megatrain_plan import RUNTIME_HOST_BYTES, Planner, Rates, host_memory
from megatrain_zoo import preset


@pytest.fixture(autouse=True)
def host_side_of_a_gpu_run(monkeypatch):
    """These tests plan a GPU run's host side on this CPU machine (device=cpu stands for 'no GPU decides'): its
    runtime item is a GPU run's, not the CPU compute's memory a run on this CPU would take."""
    monkeypatch.setattr(Planner, "_runtime_host_bytes", lambda self, placement: RUNTIME_HOST_BYTES)


def simulate_host(monkeypatch, gib: float) -> None:
    """Plan as on a host whose operating system gives the run `gib` GiB (less the stated margin)."""
    monkeypatch.setattr(host_memory, "os_room", lambda: (int(gib * 2**30), "a simulated host"))


def config_for(preset, tokens, **extra):
    overrides = [
        f"model.preset={preset}",
        "data.seq_len=2048",
        f"train.batch_size={tokens // 2048}",
        "train.micro_batch_size=8",
        "train.grad_clip=0",
        "device=cpu",
        "precision.compute_dtype=bfloat16",
    ]
    return load_config(None, overrides + [f"{k}={v}" for k, v in extra.items()])


def test_plan_command(capsys, monkeypatch):
    simulate_host(monkeypatch, 1000)
    assert main(["plan", "--set", "model.preset=llama3-8b", "--set", "device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "8.03B parameters" in out and "host memory" in out and "step time" in out
    simulate_host(monkeypatch, 16)
    assert main(["plan", "--set", "model.preset=llama3-8b", "--set", "device=cpu"]) == 2
    out, err = capsys.readouterr()
    # a refused plan is not timed (its rates were not measured), and says one figure of what fits, the table's
    assert "step time        not predicted: this machine cannot run the plan" in out and "model TFLOPS" not in out
    in_table = float(re.search(r"holds about ([\d.]+)M with full training", out).group(1))
    in_refusal = float(re.search(r"about ([\d.]+)M parameters fit as planned", err).group(1))
    assert in_refusal == pytest.approx(in_table, rel=0.02)
    simulate_host(monkeypatch, 2)  # (below what the step itself takes on the CPU: no saving of the state helps)
    assert main(["plan", "--set", "model.preset=llama3-8b", "--set", "device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "step's own items (embedding rows buffer, runtime) alone take" in err
    # (on the CPU the step's activations are host memory: a smaller step helps first)
    assert "a smaller train.batch_size or data.seq_len, a smaller model or a host with more memory" in err


def test_plan_command_plans_for_another_gpu(monkeypatch, capsys):
    """--gpu-memory-gib plans for a GPU this machine lacks: a 120B model's checkpoints partly in host memory, a
    gpt-oss-120b layer's experts in parts, and in the GPU's dtype where the config leaves it to the device."""
    simulate_host(monkeypatch, 2000)
    settings = ["model.preset=dense-120b", "device=cpu", "data.seq_len=2048", "train.batch_size=32"]
    settings += ["train.micro_batch_size=4", "train.grad_clip=0", "precision.compute_dtype=bfloat16"]
    settings += ["engine.kept_layers=0"]
    assert main(["plan", "--gpu-memory-gib", "140"] + [a for s in settings for a in ("--set", s)]) == 0
    assert "stages' activation checkpoints in host memory" in capsys.readouterr().out
    settings = ["model.preset=gpt-oss-120b", "device=cpu", "data.seq_len=2048", "train.batch_size=16"]
    settings += ["train.micro_batch_size=1", "train.grad_clip=0", "precision.compute_dtype=bfloat16"]
    assert main(["plan", "--gpu-memory-gib", "24"] + [a for s in settings for a in ("--set", s)]) == 0
    assert "each MoE layer's experts stream in parts of 16" in capsys.readouterr().out
    # precision.compute_dtype auto is the GPU's bf16 there, not this CPU's fp32
    settings = ["model.preset=qwen2.5-7b", "device=cpu", "data.seq_len=2048", "train.batch_size=8"]
    assert main(["plan", "--gpu-memory-gib", "80"] + [a for s in settings for a in ("--set", s)]) == 0
    assert "with LoRA over a base in bf16" in capsys.readouterr().out


def test_the_planners_refusals_are_config_errors(monkeypatch):
    simulate_host(monkeypatch, 64)
    planner = make_planner(config_for("qwen2.5-7b", 65536))
    message = r"needs 92.7 GiB .* may take 61.4 GiB .*; optimizer moments take 56.7 GiB: engine.optimizer_state_dir"
    with pytest.raises(ConfigError, match=message):
        check_plan(planner.plan(planner.place(planner.step_tokens)), planner)


def test_grpo_counts_the_kl_reference_copy():
    """Generated rollouts with the KL term keep the reference weights in the compute dtype (2 B/param in bf16);
    given completions score their reference once before training and keep none."""
    grpo = {"train.objective": "grpo", "train.grpo.max_completion_length": 1024}
    rates = Rates()
    plain = make_plan(config_for("qwen2.5-7b", 32768, **grpo), rates=rates)
    kl = make_plan(config_for("qwen2.5-7b", 32768, **grpo, **{"train.grpo.beta": 0.04}), rates=rates)
    assert kl.host_bytes - plain.host_bytes == 2 * plain.n_params and kl.reference_copy
    given = {"train.grpo.beta": 0.04, "train.grpo.rollouts": "r.jsonl"}
    assert make_plan(config_for("qwen2.5-7b", 32768, **grpo, **given), rates=rates).host_bytes == plain.host_bytes


def test_dpo_reads_its_whole_step_first_and_runs_in_one_sweep(monkeypatch):
    """DPO's loss reads every micro-batch's scores before any backward: never in sweeps, and a set count is refused;
    its reference pass is predicted."""
    simulate_host(monkeypatch, 1000)
    dpo = make_plan(config_for("gemma-3-4b", 131072, **{"train.objective": "dpo"}), gpu_memory=79 * 2**30)
    assert dpo.placement.sweeps == 1 and dpo.reference_tokens_per_s > 0
    with pytest.raises(ConfigError, match="engine.sweeps 2: train.objective dpo reads every micro-batch"):
        config_for("qwen2.5-7b", 131072, **{"train.objective": "dpo", "engine.sweeps": 2})


def test_measure_rates_is_a_config_key_the_variable_overrides(monkeypatch):
    """engine.measure_rates: false plans with the remembered or default rates; MEGATRAIN_MEASURE_RATES, where set,
    overrides the key either way."""
    asked = []
    monkeypatch.setattr(planning, "run_rates", lambda *args, spec=None: asked.append(args[-1]) or Rates())
    model = preset("qwen2.5-0.5b")
    measuring = config_for("qwen2.5-0.5b", 16384)
    not_measuring = config_for("qwen2.5-0.5b", 16384, **{"engine.measure_rates": "false"})
    monkeypatch.delenv("MEGATRAIN_MEASURE_RATES", raising=False)
    for config, measure in ((measuring, True), (not_measuring, True), (measuring, False)):
        planning.rates_of(config, model, measure)
    assert asked == [True, False, False]
    for variable, config in (("1", not_measuring), ("0", measuring)):
        monkeypatch.setenv("MEGATRAIN_MEASURE_RATES", variable)
        planning.rates_of(config, model)
    assert asked[3:] == [True, False]


@pytest.mark.parametrize(
    "settings, refusal",
    [
        (["data.seq_len=100000"], "data.seq_len 100000 is larger than the model allows"),
        (["engine.host_memory_gib=0.01"], "host memory: llama with 0.1M parameters needs"),
        (  # (the refusal advised a smaller step, which saved nothing)
            ["model.adapter.type=lora", "model.adapter.r=1000000000000"],
            "LoRA's rank r=1000000000000 is past the model's hidden size 64, and its adapters' master weights alone",
        ),
    ],
)
def test_what_the_machine_cannot_run_is_refused_before_its_rates_are_measured(monkeypatch, capsys, settings, refusal):
    """Measuring a shape compiles and times its kernels (half a minute on a GPU): a data.seq_len the model's positions
    do not reach, or a model the host cannot hold, is refused first, in the line the plan's checks give, by the run
    and by `megatrain plan`."""
    from megatrain.trainer import Trainer

    monkeypatch.setattr(planning, "run_rates", None)  # (measuring would fail here)
    monkeypatch.setenv("MEGATRAIN_MEASURE_RATES", "1")
    config = load_config(None, ["model.preset=tiny-llama", "device=cpu", "data.seq_len=16", *settings])
    with pytest.raises(ConfigError, match=refusal):
        Trainer(config)
    assert main(["plan", *(f"--set={key}" for key in ["model.preset=tiny-llama", "device=cpu", *settings])]) == 2
    assert refusal in capsys.readouterr().err


def test_a_run_that_fits_is_planned_at_its_measured_rates(monkeypatch):
    """A run whose plan passes its checks is planned at the rates measured for it, on its layers as the plan builds
    them (a MoE's experts in parts, with LoRA: the measured layers are those the run runs)."""
    measured, built = Rates(gpu_tflops=123.0), []
    monkeypatch.setattr(
        planning, "run_rates", lambda *args, spec=None: built.append(spec) or (measured if args[-1] else Rates())
    )
    monkeypatch.setenv("MEGATRAIN_MEASURE_RATES", "1")
    config = load_config(None, ["model.preset=tiny-llama", "device=cpu", "data.seq_len=16"])
    assert planning.run_planner(config, model_config_of(config)).rates is measured
    parts = ["engine.experts_per_stage=3", "model.adapter.type=lora", "model.adapter.r=4"]
    config = load_config(None, ["model.preset=tiny-olmoe", "device=cpu", "data.seq_len=16", *parts])
    planner = planning.run_planner(config, model_config_of(config))
    assert built[-1].expert_parts == planner.spec.expert_parts != () and built[-1].adapter == planner.spec.adapter
    assert planning.run_planner(config, model_config_of(config), measure=False).rates == Rates()


def test_two_trainers_of_one_config_share_no_model_state():
    """Each Trainer builds its own model, once, for its planner and its run: its router statistics (a mixture of
    experts' load, set per step) are its alone."""
    from megatrain.trainer import Trainer

    config = load_config(None, ["model.preset=tiny-mixtral", "device=cpu", "data.seq_len=16", "train.batch_size=2"])
    first, second = Trainer(config), Trainer(config)
    assert first.spec is not second.spec and first.spec.router_load is not second.spec.router_load
    assert first.planner.spec is first.spec and second.planner.spec is second.spec


def test_a_host_refusal_suggests_only_a_lighter_mode_than_the_configured_one():
    """A LoRA run over an int8 base a little over the host is pointed to nf4, not to the int8 it already uses (its
    own mode's estimate counts the embedding and head as packed, which they are not)."""
    settings = ["model.preset=dense-120b", "data.seq_len=4096", "train.batch_size=8", "train.micro_batch_size=4"]
    config = load_config(None, [*settings, "model.adapter.type=lora", "model.adapter.base_dtype=int8"])
    planner = make_planner(config, gpu_memory=141 * 2**30, host_memory=120 * 2**30)
    nf4 = r"it fits with LoRA over an nf4 base \(model.adapter: \{type: lora, base_dtype: nf4\}\)$"
    with pytest.raises(ConfigError, match=nf4):
        check_plan(planner.plan(planner.place(planner.step_tokens)), planner)


def test_a_refusal_that_names_host_kept_products_counts_what_fits_without_them(monkeypatch, capsys):
    """engine.host_kept_layers set past the host: the refusal names them and the model that fits once they go
    (it said "about -5888.8M parameters fit as planned": beside them none does)."""
    simulate_host(monkeypatch, 140)
    settings = ["model.preset=qwen2.5-7b", "data.seq_len=4096", "train.batch_size=32", "train.micro_batch_size=4"]
    settings += ["engine.host_kept_layers=20", "device=cpu", "precision.compute_dtype=bfloat16"]
    argv = ["plan", "--gpu-memory-gib", "80", "--host-memory-gib", "140"]
    assert main(argv + [a for s in settings for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert "host-kept products take" in err and "engine.host_kept_layers: 0" in err, err
    fitting = float(re.search(r"about ([\d.]+)B parameters fit without them", err).group(1))
    assert 7.62 < fitting < 14, err  # (the 7B fits without them: 16 B/param of 140 GiB less the runtime)


def test_a_cpu_plan_on_unmeasured_rates_predicts_no_step(monkeypatch, capsys, tmp_path):
    """engine.measure_rates: false on the CPU leaves the default rates, an H100 machine's: the plan says it does
    not predict the step (it said 22 model TFLOPS for two CPU cores), the run's line names no step time."""
    import megatrain_plan.rates as rates

    monkeypatch.setattr(rates, "CALIBRATION_FILE", tmp_path / "calibration.json")
    assert main(["plan", "--set", "engine.measure_rates=false", "--set", "device=cpu"]) == 0
    out = capsys.readouterr().out
    assert "step time        not predicted: this CPU's rates are not measured" in out and "TFLOPS" not in out


def test_rates_far_off_the_steps_are_dropped_for_the_next_run_to_measure(monkeypatch, capsys, tmp_path):
    """A CPU run's rates measured for its shape, then made 1000 times too slow (as a measurement beside other work
    leaves them): the run's fourth step says so and drops them, and the next run of the shape measures them again (a
    measurement was otherwise kept for good: a 0.2 s step was predicted 3.4 s). A step off by under
    PREDICTION_OFF_MIN_S (tiny steps' noise) keeps them."""
    import megatrain_plan.rates as rates

    monkeypatch.setattr(rates, "CALIBRATION_FILE", tmp_path / "calibration.json")
    monkeypatch.setenv("MEGATRAIN_MEASURE_RATES", "1")  # (the tests plan on the defaults)

    def train(name: str, steps: int) -> str:  # (3 steps: no fourth to check the rates against, under any load)
        settings = ["model.preset=tiny-llama", "device=cpu", f"output_dir={tmp_path / name}", f"train.steps={steps}"]
        assert main(["train", *(a for s in settings for a in ("--set", s))]) == 0
        return capsys.readouterr().err

    assert "measuring this CPU's layers" in train("first", 3)
    saved = json.loads(rates.CALIBRATION_FILE.read_text())
    (key,) = saved["shapes"]
    for name, rate in saved["shapes"][key].items():  # (every rate: the copies' alone predicted 0.14 s of a 0.2 s step)
        if isinstance(rate, float):
            saved["shapes"][key][name] = rate / 1000
    rates.CALIBRATION_FILE.write_text(json.dumps(saved))
    assert "the rates measured for this shape are off" in train("second", 5)
    assert key not in json.loads(rates.CALIBRATION_FILE.read_text())["shapes"]
    assert "measuring this CPU's layers" in train("third", 3)
    assert rates.stale_rates_note(0.03, 0.07, None, None, None, 64, 1) is None  # (twice as long, by 0.04 s)
