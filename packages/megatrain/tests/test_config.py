import json
import re
from pathlib import Path

import pytest
import yaml

from megatrain.config import Config, ConfigError, TrainSection, config_changes, config_from_dict, load_config
from megatrain.trackers import check_trackers


def test_defaults_are_the_builtin_job():
    config = load_config()
    assert config == Config()
    assert config.model.preset == "small-llama"


def test_yaml_and_overrides(write_config):
    config = load_config(write_config(), ["train.lr=2e-4", "train.betas=[0.8, 0.9]", "data.shuffle=true"])
    assert config.train.lr == 2e-4 and config.train.betas == (0.8, 0.9) and config.data.shuffle is True
    assert config.train.micro_batch_size == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lrr=1"], "unknown config key 'train.lrr'.*lr"),
        (["train.learning_rate=1"], "unknown config key 'train.learning_rate'; did you mean 'lr'\\?"),  # (HF's name)
        (["train.max_steps=1"], "unknown config key 'train.max_steps'; did you mean 'steps'\\?"),
        (["modle.preset=x"], "unknown config key 'modle'"),
        (["train.batch_size=6", "train.micro_batch_size=4"], "divisible by train.micro_batch_size"),
        (["train.steps=ten"], "train.steps"),
        (["precision.compute_dtype=fp8"], "compute_dtype"),
        (["model.preset=tiny-llama", "model.hf_dir=/x"], "exactly one of model.preset"),
        (["data.seq_len="], "config key 'data.seq_len' has no value; it takes a whole number"),
        (["train.objective=dpo", "train.dpo.max_prompt_length=32"], "max_prompt_length 32 leaves no room"),
        (["data.seq_len=1"], "seq_len must be >= 2"),
        (["device=tpu"], "device must be"),
        (["train"], "key.sub=value"),
        (["engine.kept_layers=-1"], "engine.kept_layers must be auto or an integer >= 0"),
        (["engine.kept_layers=some"], "engine.kept_layers must be auto or an integer >= 0"),
        (["engine.held_layers=1.5"], "engine.held_layers must be auto or an integer >= 0"),
        (["engine.gpu_updated_layers=-1"], "engine.gpu_updated_layers must be auto or an integer >= 0"),
        (["engine.gradient_pool=0.5"], "engine.gradient_pool must be auto or a number >= 1"),
        (["engine.disk_state_fraction=0.5"], "engine.optimizer_state_dir names no directory for them"),
    ],
)
def test_bad_configs_name_the_key_and_fix(write_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(), overrides)


def test_an_override_of_one_alternative_replaces_the_files_other(write_config):
    """`--set model.hf_dir=DIR` on a preset's config (the built-in default's, say) trains DIR's model."""
    config = load_config(write_config(), ["model.hf_dir=/x", "data.text=corpus.txt"])
    assert (config.model.preset, config.model.hf_dir) == (None, "/x")
    assert (config.data.tokens, config.data.text) == (None, "corpus.txt")
    assert load_config(None, ["model.hf_dir=/x"]).model.preset is None


def test_the_readmes_example_config_loads_with_no_optional_package():
    readme = (Path(__file__).parents[3] / "README.md").read_text()
    (example,) = re.findall(r"```yaml\n(.*?)```", readme, re.S)
    config = config_from_dict(yaml.safe_load(example))
    check_trackers(config)
    assert config.model.preset == "llama3.2-1b"


def test_the_engine_keys_that_were_environment_variables_load():
    """engine.compile, cpu_threads, rank_wait_s and shared_dir: their defaults are what the environment variables'
    were, and each takes a value from the file or an override."""
    engine = Config().engine
    assert (engine.compile, engine.cpu_threads, engine.rank_wait_s, engine.shared_dir) == (
        True,
        "auto",
        600,
        "/dev/shm",
    )
    overrides = ["engine.compile=false", "engine.cpu_threads=2", "engine.rank_wait_s=5", "engine.shared_dir=/mnt/shm"]
    engine = load_config(None, overrides).engine  # (CI's machine has 2 cores: more threads are refused)
    assert (engine.compile, engine.cpu_threads, engine.rank_wait_s, engine.shared_dir) == (False, 2, 5.0, "/mnt/shm")


def test_micro_batch_defaults_to_batch():
    assert TrainSection(batch_size=8).micro_batch_size == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.warmup_steps=-10"], r"train.warmup_steps must be >= 0"),
        (["train.seed=-1"], r"train.seed must be >= 0"),
        (["train.keep_last=0"], r"train.keep_last must be >= 1"),
        (["train.save_every=-1"], r"train.save_every must be >= 0"),
        (["train.min_lr_ratio=5"], r"train.min_lr_ratio must be in \[0, 1\]"),
        (["train.eps=0"], r"train.eps must be > 0"),
        (["train.betas=[0.9, 1.5]"], r"train.betas must be two numbers in \[0, 1\)"),
        (["train.max_bad_steps=0"], r"train.max_bad_steps must be >= 1"),
        (["output_dir=null"], r"config key .output_dir. has no value; it takes text"),
        (["output_dir=''"], r"output_dir must name a directory"),
        (["train.report_to=[tensorboard, comet]"], r"train.report_to names \['comet'\]"),
        (["engine.cpu_threads=0"], r"engine.cpu_threads must be auto or an integer >= 1"),
        (["engine.rank_wait_s=0"], r"engine.rank_wait_s must be a number of seconds > 0"),
        (["engine.shared_dir=''"], r"engine.shared_dir must name a memory-backed directory"),
        # (a configuration audit's findings: each was taken, or a traceback)
        (["train.grad_clip=nan"], r"'train.grad_clip' has value 'nan'; it takes a finite number"),
        (["train.eps=.inf"], r"'train.eps' has value inf; it takes a finite number"),
        (["train.betas=[0.9, .nan]"], r"'train.betas' has value \[0.9, nan\]; it takes a list of 2 finite numbers"),
        (["engine.cpu_threads=100000"], r"engine.cpu_threads 100000 is more than this machine's \d+ cores"),
        (["device=cuda:abc"], r"device must be cpu, cuda, cuda:N or auto, got 'cuda:abc'"),
        (["train.objective=':'"], r"train.objective must be one of .* or module:Class"),
        (["model.adapter.r=8", "model.adapter.path=/x"], r"model.adapter.r, model.adapter.path set without model\.a"),
        (["train.objective=grpo", "train.grpo.num_generations=1"], r"num_generations must be >= 2"),
        (["train=null"], r"cannot set 'train' to None: it is a section; set its keys"),
        (["data.dataset=','"], r"data.dataset names no dataset"),
        (["data.mix_weights=[1, 2]"], r"data.mix_weights weigh the datasets of data.dataset"),
        (["fallback_dir=''"], r"fallback_dir '' must name a directory on another disk"),
        (["output_dir=[a, b]"], r"config key 'output_dir' has value \['a', 'b'\]; it takes text"),
        (["engine.optimizer_state_dir=''"], r"engine.optimizer_state_dir '' must name a directory"),
        (["data.chat_template=''"], r"data.chat_template is empty"),
        (["train.grpo.rollouts=''"], r"train.grpo.rollouts is empty"),
        (["model.adapter.type=[lora]"], r"config key 'model.adapter.type' has value \['lora'\]"),
        (["output_dir=runs/a", "fallback_dir=runs/a"], r"fallback_dir 'runs/a' must name a directory"),
        (["train.grpo.log_completions_every=-1"], r"train.grpo.log_completions_every must be >= 0 \(0: never\)"),
    ],
)
def test_values_out_of_range_are_refused(write_config, overrides, message):
    """Each of these was taken silently (keep_last 0 kept every checkpoint, save_every -1 saved every step) or
    failed deep in a run with a traceback."""
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(), overrides)


def test_report_to_takes_a_list_or_names_and_tensorboard_true_is_its_alias(write_config):
    assert load_config(write_config(), ["train.report_to=[wandb, mlflow]"]).train.trackers == ("wandb", "mlflow")
    assert load_config(write_config(), ["train.report_to=wandb"]).train.trackers == ("wandb",)
    assert load_config(write_config(), ["train.report_to=none"]).train.trackers == ()
    assert TrainSection(tensorboard=True, report_to="mlflow").trackers == ("tensorboard", "mlflow")
    assert TrainSection().trackers == ()


def test_a_config_directory_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a directory"):
        load_config(tmp_path)


def test_a_resumed_runs_config_lies_under_the_file_and_the_overrides(write_config, tmp_path):
    """A section the file names replaces the run's whole (as the file is written); --set replaces one key;
    what neither names stays the run's; the changes are listed."""
    run = Config(output_dir=str(tmp_path / "run"), train=TrainSection(steps=4, lr=1e-3)).as_dict()
    file = tmp_path / "file.yaml"
    file.write_text("train: {steps: 8, batch_size: 4}\n")
    config = load_config(file, ["train.seed=3"], base=run)
    assert config.output_dir == str(tmp_path / "run")  # (the file does not name it)
    assert (config.train.steps, config.train.lr, config.train.seed) == (8, TrainSection.lr, 3)
    assert config_changes(run, config) == [
        "train.steps 4 -> 8",
        "train.batch_size 8 -> 4",
        "train.micro_batch_size 8 -> 4",
        "train.lr 0.001 -> 0.0003",
        "train.seed 0 -> 3",
    ]


def test_a_module_a_config_names_is_found_in_the_working_directory(tmp_path, monkeypatch):
    """The console script's path holds its bin directory, not the working directory: `my_objectives:Class` in the
    directory megatrain runs in is found all the same, after every installed package."""
    import sys

    from megatrain_data.rewards import import_user_module

    (tmp_path / "my_objectives_here.py").write_text("ANSWER = 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert import_user_module("my_objectives_here").ANSWER == 42
    assert sys.path[-1] == str(tmp_path)


def test_whole_numbers_written_as_floats_are_taken(write_config):
    """YAML reads 1e3 as text and 2.0 as a float: a whole-number field takes either where it is whole."""
    config = load_config(write_config(), ["train.steps=1e3", "train.batch_size=8.0", "train.save_every=2e2"])
    assert (config.train.steps, config.train.batch_size, config.train.save_every) == (1000, 8, 200)


def test_reward_funcs_in_one_override_keep_a_regex_whole():
    """Comma-separated names in one --set, a format:REGEX last taking the rest as written (its spaces and commas);
    a YAML list takes each name as written."""
    grpo = ["train.objective=grpo", "train.grpo.num_generations=2", "data.format=prompt", "data.dataset=p.jsonl"]
    given = load_config(None, [*grpo, "train.grpo.reward_funcs=exact_match, my_format:score,format:^a{1,3} $"])
    assert given.train.grpo.reward_funcs == ("exact_match", "my_format:score", "format:^a{1,3} $")
    listed = load_config(None, [*grpo, 'train.grpo.reward_funcs=["format:^ ", "format:x,y"]'])
    assert listed.train.grpo.reward_funcs == ("format:^ ", "format:x,y")


@pytest.mark.parametrize(
    "setting, objective",
    [("train.dpo.loss_type=ipo", "sft"), ("train.grpo.beta=0.1", "sft"), ("train.grpo.rollouts=r.jsonl", "dpo")],
)
def test_an_objectives_settings_under_another_objective_are_refused(setting, objective):
    """A run that forgot train.objective: dpo trained SFT with its train.dpo unread, unsaid; GRPO's generation
    settings are any run's (`megatrain generate` reads them)."""
    name = setting.split("=")[0]
    section = name.rsplit(".", 1)[0]
    with pytest.raises(
        ConfigError, match=f"{name} is set, but train.objective is {objective}, which reads no {section}"
    ):
        load_config(None, [setting, f"train.objective={objective}", "data.format=preference", "data.dataset=p.jsonl"])
    assert load_config(None, ["train.grpo.generation_weights=streamed"]).train.grpo.generation_weights == "streamed"


def test_a_resumed_runs_own_objective_settings_are_not_the_users():
    """A run's saved config holds every section whole (an SFT run's train.grpo too, with the defaults of the megatrain
    that wrote it): only what the command gives is checked."""
    saved = load_config(None, []).as_dict()
    saved["train"]["grpo"]["max_completion_length"] = 999  # (a default another version had)
    assert load_config(None, ["train.steps=5"], base=saved).train.steps == 5
    with pytest.raises(ConfigError, match="train.grpo.beta is set, but train.objective is sft"):
        load_config(None, ["train.grpo.beta=0.1"], base=saved)


def test_a_runs_saved_config_given_as_its_config_is_taken(tmp_path):
    """A run's config.json (every section whole, train.dpo's and train.grpo's defaults too) given as --config runs the
    same job again; it was refused as setting train.dpo.beta under sft."""
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(load_config(None, ["train.steps=7"]).as_dict()))
    assert load_config(saved, []).train.steps == 7
    with pytest.raises(ConfigError, match="train.dpo.beta is set, but train.objective is sft"):
        load_config(saved, ["train.dpo.beta=0.5"])


def test_eval_every_without_validation_data_is_refused_in_the_config():
    with pytest.raises(ConfigError, match="train.eval_every needs held-out data"):
        load_config(None, ["train.eval_every=10"])


def test_a_key_given_twice_in_a_config_file_is_refused_naming_its_line(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `lr:` trained at lr 5, a second `data:` section replaced
    the first, without a word."""
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 2\n  lr: 1.0e-3\n  lr: 5\n")
    with pytest.raises(ConfigError, match=r"twice.yaml line 4: invalid YAML \('lr' is given twice\)"):
        load_config(path)
    path.write_text("data:\n  seq_len: 64\ntrain:\n  steps: 2\ndata:\n  seq_len: 32\n")
    with pytest.raises(ConfigError, match=r"line 5: invalid YAML \('data' is given twice\)"):
        load_config(path)


@pytest.mark.parametrize("text, key", [("train:\n  1: 2\n", "1"), ("~: 2\n", "None"), ("train:\n  on: 2\n", "True")])
def test_a_key_yaml_reads_as_no_name_is_one_clear_error(tmp_path, text, key):
    """YAML reads `1:`, `~:` and `on:` as a number, null and a boolean: the "did you mean" lookup took such a key for
    text and ended in a TypeError traceback."""
    path = tmp_path / "odd.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"config key {key} .*is not a name.*accepts \["):
        load_config(path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["lr=1e-3"], r"unknown config key 'lr'; did you mean 'train.lr'\? top level accepts"),
        (["train.seq_len=64"], r"unknown config key 'train.seq_len'; did you mean 'data.seq_len'\? train accepts"),
        (["train.max_seq_length=64"], r"'train.max_seq_length'; did you mean 'data.seq_len'\?"),  # (TRL's name)
        (["trace=true"], r"unknown config key 'trace'; did you mean 'engine.trace'\?"),  # (not 'train')
        (["train.beta=0.5"], r"'train.beta'; did you mean 'train.dpo.beta' or 'train.grpo.beta'\?"),
        (["dpo.beta=0.5"], r"unknown config key 'dpo'; did you mean 'train.dpo'\?"),
    ],
)
def test_a_key_in_another_section_names_where_it_belongs(overrides, message):
    """A key written in the wrong section (`lr:` at the top level, `seq_len:` under train) listed the section's keys,
    or suggested a look-alike of the wrong one (`trace:` -> 'train'), without saying where the key is."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
