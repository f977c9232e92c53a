"""The `megatrain` command: train, plan, convert, data, eval, generate, bench, presets.

Torch and the engine are imported inside `main`, so that Ctrl-C while they load (seconds) ends in one
line, as every error a user can fix does (exit 2 for a configuration, 1 otherwise, 130 for Ctrl-C, 128 +
the signal for a run stopped by one after its checkpoint); anything else is a bug and keeps its traceback."""

import argparse
import errno
import os
import signal
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is in --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _error_types() -> dict:
    """Exception type -> (exit code, what the line calls it), for the errors that end in one line (imports torch
    and the engine)."""
    from megatrain_data import DataError
    from megatrain_data.rewards import RewardError
    from megatrain_optim import OptimError, RankError
    from megatrain_plan import PlanError
    from megatrain_sched import SchedError
    from megatrain_store import StoreError, WeightsError
    from megatrain_store.checkpoints import SaveError
    from megatrain_store.rundir import RunDirError
    from megatrain_zoo import ZooError

    from .checkpoint import NonFiniteError
    from .config import ConfigError

    others = (StoreError, OptimError, SchedError, NonFiniteError, RankError, SaveError)
    # (data that cannot be read, a model that cannot be read, a preset misspelled: the user's input, as the config is)
    user_input = {
        ConfigError: (2, "config error"),
        RunDirError: (2, "config error"),  # (output_dir's: a StoreError, the user's setting)
        PlanError: (2, "config error"),
        DataError: (2, "data error"),
        ZooError: (2, "model error"),
        WeightsError: (2, "weights error"),
    }
    return user_input | {RewardError: (1, "reward error")} | {kind: (1, kind.__name__) for kind in others}


OS_ERROR_HINTS = {
    errno.ENOSPC: "the disk is full: free space on it, or {elsewhere}",
    errno.EDQUOT: "the disk quota is used up: free space, or {elsewhere}",
    errno.EROFS: "the file system is read-only: {elsewhere}",
    errno.EACCES: "no permission: {elsewhere}, or fix the permissions",
}


def _os_hint(number: int | None, elsewhere: str = "write elsewhere (output_dir)") -> str:
    """What to do about an OSError of `number`; `elsewhere` says how to write somewhere else."""
    return OS_ERROR_HINTS.get(number, "check the path").format(elsewhere=elsewhere)


def _error_line(error: BaseException, known: dict) -> tuple[int, str] | None:
    """(exit code, the one line to print) for an error a user can act on; None for a bug."""
    loop = sys.modules.get("megatrain.loop")
    if loop is not None and isinstance(error, loop.RunInterrupted):  # a signal, after the run's checkpoint
        return error.exit_code, f"megatrain: {error}" if str(error) else ""  # (said by the first rank only)
    reply = next((reply for kind, reply in known.items() if isinstance(error, kind)), None)
    if reply is not None:
        code, label = reply
        return code, f"megatrain: {label}: {error}"
    from megatrain_optim.launch import peer_ended  # (imported by `_error_types` already: torch is there)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and peer_ended(error):
        return 1, (
            "megatrain: another process of this run ended (its own line says why; one killed says nothing), so this "
            "one stops too; the last checkpoint resumes with `megatrain train --resume RUN`"
        )
    if isinstance(error, BrokenPipeError):  # (`megatrain plan | head`: the reader has all it wanted)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error flushing at exit)
        return 141, ""  # (128 + SIGPIPE, as a shell tool the pipe ended)
    if isinstance(error, OSError):
        hint = _os_hint(error.errno)
        where = f": {error.filename}" if error.filename else ""
        return 1, f"megatrain: {error.strerror or error}{where}; {hint}"
    return None


BUILT_IN_CONFIG = "YAML config file (default: the built-in small model on the built-in corpus)"
CHECKPOINT = "a run's output_dir, a step-NNNNNNNN or an HF directory"  # (what eval and generate read)
RUN_CONFIG = "YAML config file laid over the checkpoint's run config (default: that run's; no run's: the built-in one)"


class _Once(argparse.Action):
    """An option given at most once (a second --config replaced the first, unsaid)."""

    def __call__(self, parser, namespace, value, option=None):
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option} given twice; give one (settings of another file: --set KEY=VALUE)")
        setattr(namespace, self.dest, value)


def _add_config_args(parser: argparse.ArgumentParser, of_checkpoint: bool = False) -> None:
    parser.add_argument("--config", action=_Once, help=RUN_CONFIG if of_checkpoint else BUILT_IN_CONFIG)
    if of_checkpoint:
        parser.add_argument("--checkpoint", required=True, help=CHECKPOINT)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.lr=1e-4 (repeatable)",
    )


def run_bench(config, steps: int) -> None:
    import time

    import torch

    from .step import StepBatch
    from .trainer import Trainer

    trainer = Trainer(config)
    vocab, seq, batch = trainer.model_config.vocab_size, config.data.seq_len, config.train.batch_size
    rows = []
    for step in range(steps + 1):
        ids = torch.randint(0, vocab, (batch, seq))
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        start = time.perf_counter()
        metrics = trainer.train_step(StepBatch(ids, labels))
        trainer.finish_updates()
        if step:  # the first step warms up
            rows.append((time.perf_counter() - start, metrics))
    trainer.close()
    seconds = sum(r[0] for r in rows) / len(rows)
    tflops = sum(r[1].tflops * r[1].step_time_s for r in rows) / sum(r[0] for r in rows)
    rate = f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"  # (a CPU's: 0.0216, not 0.0)
    print(
        f"{config.model.preset or config.model.hf_dir}: {batch * seq:,} tokens/step, {seconds:.3f} s/step, "
        f"{batch * seq / seconds:,.0f} tokens/s, {rate} model TFLOPS on {trainer.device}"
    )


def dump_grpo_data(config, args) -> None:
    """`megatrain data` of a GRPO run: its first prompts as the model sees them (rendered, tokenized), with their
    reward columns; of a run on given completions (train.grpo.rollouts), their first rows as trained."""
    from megatrain_data import eos_token_text, load_chat_template, pad_token_id
    from megatrain_data.inspect import dump_given, dump_prompts
    from megatrain_data.prompts import load_prompts

    from .config import model_config_of
    from .rollouts import tokenizer_of

    tokenizer, path = tokenizer_of(config)
    eos = eos_token_text(tokenizer, model_config_of(config).eos_token_id, path.parent)
    grpo, data = config.train.grpo, config.data
    if grpo.rollouts is None:
        prompts = load_prompts(data, grpo.max_prompt_length, tokenizer, path, eos)
        return dump_prompts(prompts, args.dump, tokenizer if args.text else None)
    template = load_chat_template(path.parent, data.chat_template, eos)
    pad = pad_token_id(tokenizer, eos)
    dump_given(Path(grpo.rollouts), grpo.num_generations, template, tokenizer, args.dump, data.seq_len, pad, args.text)


def run_data(config, args) -> None:
    from megatrain_data import PairWindows, load_tokenizer
    from megatrain_data.inspect import dump_pairs, dump_rows
    from megatrain_data.multimodal import MediaRows, row_windows

    from .config import ConfigError, model_config_of
    from .loop import load_data

    if config.train.objective == "grpo":
        return dump_grpo_data(config, args)
    data = load_data(config, model_config_of(config), Path(config.output_dir))
    for line in data.report:
        print(f"megatrain: {line}", file=sys.stderr)
    tokenizer = None
    if args.text:
        if data.tokenizer is None:
            raise ConfigError("--text needs a tokenizer; data.tokens holds ids only")
        tokenizer = load_tokenizer(data.tokenizer)
    train = config.train
    if data.pairs:
        dump_pairs(PairWindows(data.train, train.batch_size, config.data.shuffle, train.seed), args.dump, tokenizer)
        return
    windows = row_windows(data.train, config.data.seq_len, train.batch_size, config.data.shuffle, train.seed)
    placeholders = data.train.placeholders if isinstance(data.train, MediaRows) else {}
    dump_rows(windows, args.dump, tokenizer, placeholders)


def _config(args, base: dict | None = None):
    """The command's config: --config (or, without a run's own config as `base`, the built-in default job)
    with --set overrides, its paths absolute (the tokenization cache's key holds them: a relative one made a second)."""
    from .config import default_config_path, load_config, with_absolute_paths

    config = load_config(args.config or (None if base is not None else default_config_path()), args.overrides, base)
    return with_absolute_paths(config)


def _at_least(value, lowest, option: str) -> None:
    from .config import ConfigError

    if value is not None and not lowest <= value < float("inf"):
        raise ConfigError(f"{option} must be >= {lowest}{' and finite' if value == float('inf') else ''}, got {value}")


def _check_sampling_flags(args) -> None:
    """`megatrain generate`'s, before the model loads (transformers' warpers raised a traceback after it; a top-p
    above 1 was taken as 1)."""
    from .config import ConfigError

    for name, lowest in (("max_new_tokens", 1), ("temperature", 0), ("top_k", 0)):
        _at_least(getattr(args, name), lowest, "--" + name.replace("_", "-"))
    if args.repetition_penalty is not None and not 0 < args.repetition_penalty < float("inf"):
        raise ConfigError(f"--repetition-penalty must be > 0 and finite, got {args.repetition_penalty}")
    if args.top_p is not None and not 0 < args.top_p <= 1:  # (NaN too)
        raise ConfigError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**63:  # (an OverflowError in the first decoding step)
        raise ConfigError(f"--seed must be in [0, 2**63), got {args.seed}")


def run_train(args) -> None:
    """`megatrain train`; with --resume, in the checkpoint's own run directory with its run's config."""
    from .checkpoint import resolve_resume, run_config
    from .config import config_changes
    from .loop import train

    resume = base = None
    if args.resume:
        resume = resolve_resume(Path(args.resume))  # (refused before any data or model is loaded)
        base = run_config(resume.directory, resume.manifest)
    config = _config(args, base)
    if resume is not None and os.environ.get("RANK", "0") == "0":
        changes = config_changes(base, config)
        print(
            f"megatrain: resuming in {config.output_dir} with the config of {resume.directory}"
            f"{'; changed: ' + ', '.join(changes) if changes else ''}",
            file=sys.stderr,
        )
    train(config, resume)


def run_convert(args) -> None:
    """`megatrain convert SOURCE DIR`: a model directory served as trained (a LoRA run's: its PEFT adapter directory,
    or with --merge its base model with the adapters merged in); says what it wrote."""
    from megatrain_data.serving import describe_export
    from megatrain_store.checkpoints import SaveError
    from megatrain_store.rundir import TRAINER_STATE, exported_step, write_trainer_state
    from megatrain_zoo.peft import check_export_target

    from .export import convert, lora_source

    out, source = Path(args.out), Path(args.source)
    check_export_target(out, {"the source": source}, args.overwrite)  # (DIR's own problems first, then what it reads)
    weights, resume = _weights_at(source)
    lora = lora_source(weights)
    base = {"the LoRA run's base model": lora.base} if lora is not None and lora.base is not None else {}
    check_export_target(out, {"the weights it converts": weights} | base, overwrite=True)
    try:
        written = convert(weights, out, args.dtype, serving=_serving_of_weights(weights), merge=args.merge)
        if resume is not None:  # (the step its weights hold: a run's final/ says its own, a model directory none)
            write_trainer_state(written, resume.step, resume.manifest["config"]["train"]["steps"])
        elif exported_step(weights) is not None:
            (written / TRAINER_STATE).write_bytes((weights / TRAINER_STATE).read_bytes())
    except OSError as error:  # (it is the DIR argument, not a run's output_dir, that cannot be written)
        hint = _os_hint(error.errno, "name another DIR to convert into")
        raise SaveError(f"convert cannot write {out} ({error.strerror or error}); {hint}") from None
    print(f"wrote {written}: {describe_export(written)}")


def _weights_at(path: Path):
    """The weights at `path` (`find_weights`) and, for a checkpoint, its `Resume`: its manifest and files verified
    before anything reads them (a damaged one refused in one line naming the one before it); None for a model
    directory."""
    from .checkpoint import MANIFEST, find_weights, resolve_resume

    weights = find_weights(path)
    return weights, resolve_resume(weights) if (weights / MANIFEST).exists() else None


def _serving_of_weights(weights: Path):
    """What a conversion of `weights` is served with: a checkpoint's, its run's tokenizer and chat template (kept in
    the run as it started, else found by its manifest's config); None for a model directory (its own files go along:
    a run's final/ holds its run's)."""
    import json

    from megatrain_data.serving import kept_in_run, serving_of_run
    from megatrain_zoo import ModelConfig

    from .checkpoint import MANIFEST, run_config
    from .config import load_config

    if not (weights / MANIFEST).exists():
        return None
    config = load_config(None, [], run_config(weights))
    run_dir = Path(config.output_dir)
    model = ModelConfig(**json.loads((weights / MANIFEST).read_text())["model"])
    return kept_in_run(run_dir) or serving_of_run(config, model, run_dir)


def run_eval(config, args) -> None:
    import json

    from megatrain_data.multimodal import row_windows

    from .loop import evaluate, load_data

    if config.train.objective == "dpo":
        return run_pair_eval(config, args)
    if config.train.objective == "grpo":
        from .config import ConfigError

        raise ConfigError(
            "megatrain eval scores held-out text or pairs; a GRPO run's prompts have no targets: use "
            "`megatrain generate --checkpoint RUN --prompts FILE` and score the completions"
        )
    trainer, what = trainer_for_weights(config, args.weights, args.verified)
    try:
        # (the trainer's config: weights of a model directory are its model.hf_dir, whose tokenizer reads the data)
        data = load_data(trainer.config, trainer.model_config, Path(config.output_dir), trainer.ranks)
        tokens, split = (data.validation, "validation") if data.validation is not None else (data.train, "training")
        windows = row_windows(tokens, config.data.seq_len, 1, shuffle=False, seed=0)
        result = evaluate(trainer, windows, args.batches, leave=True)
    finally:
        trainer.close()
    if trainer.is_main:
        source = config.data.dataset or config.data.text or config.data.tokens or "the built-in corpus"
        print(json.dumps({"checkpoint": what, "data": split, "source": source, **result}))


def check_held_out(config, base: dict | None) -> None:
    """Refuse to evaluate, on the run's own data, a validation fraction the run did not hold out (`base`: the run's
    config; None where the weights' run is unknown): those tokens were trained on, and their loss says nothing of
    held-out data."""
    from .config import ConfigError

    if base is None or not isinstance(config.data.validation, float):
        return
    trained = base.get("data", {})
    if any(trained.get(key) != getattr(config.data, key) for key in ("tokens", "text", "dataset")):
        return  # (other data: what the run held out does not matter)
    if trained.get("validation") == config.data.validation and base.get("train", {}).get("seed") == config.train.seed:
        return
    held = (
        "held out nothing"
        if trained.get("validation") is None
        else f"held out data.validation {trained['validation']!r}"
    )
    raise ConfigError(
        f"the run {held} (with train.seed {base.get('train', {}).get('seed')}): data.validation "
        f"{config.data.validation} would evaluate tokens it trained on; give held-out data as a file "
        "(--set data.validation=FILE), or leave data.validation and train.seed as the run had them"
    )


def check_model_overrides(config, args, base: dict | None) -> None:
    """Refuse `--set model.*` that eval and generate would not read (taken and ignored): a checkpoint's model is its
    manifest's, a model directory's its config.json. Read: a LoRA checkpoint's base (model.hf_dir, its fingerprint
    checked, held as model.adapter.base_dtype says), a PEFT directory's base and a DPO run's reference (the config's)."""
    from megatrain_zoo.peft import is_peft_directory

    from .config import ConfigError, load_config, with_absolute_paths
    from .config_values import flat_keys

    now = flat_keys(config.as_dict())
    was = flat_keys(with_absolute_paths(load_config(None, [], base)).as_dict()) if base is not None else {}
    read = ("model.hf_dir", "model.adapter.base_dtype") if args.verified and was.get("model.adapter.type") else ()
    given = dict.fromkeys(item.split("=", 1)[0].strip() for item in args.overrides)
    ignored = [
        key
        for key in given
        if (key + ".").startswith("model.") and key not in read
        and (base is None or any(now[k] != was.get(k) for k in now if (k + ".").startswith(key + ".")))
    ]  # fmt: skip
    if ignored and not is_peft_directory(args.weights) and (args.command, config.train.objective) != ("eval", "dpo"):
        source = f"the checkpoint's manifest ({args.weights})" if args.verified else args.weights / "config.json"
        raise ConfigError(
            f"--set {', '.join(ignored)}: megatrain {args.command} takes the model from {source}, not the config; "
            "leave model.* out, or name the weights of that model in --checkpoint"
        )


def trainer_for_weights(config, weights: Path, resume):
    """A trainer holding `weights` (a Hugging Face directory, a run's final/ among them, a checkpoint: its `resume`,
    or a LoRA run's adapters over their base) and no optimizer state: for evaluation and generation."""
    from dataclasses import replace

    from megatrain_zoo import ModelConfig
    from megatrain_zoo.peft import is_peft_directory

    from .config import AdapterSection, ModelSection
    from .export import lora_source
    from .trainer import Trainer

    if is_peft_directory(weights):  # (a LoRA run's final/, or an adapter of its own: over its base, adapters on)
        section = config.model if config.model.adapter.type else ModelSection(hf_dir=lora_source(weights).base_name)
        model = replace(section, adapter=AdapterSection(type="lora", path=str(weights)))
        return Trainer(replace(config, model=model), training=False), str(weights)
    if resume is None:
        return Trainer(replace(config, model=ModelSection(hf_dir=str(weights))), training=False), str(weights)
    trainer = Trainer(config, ModelConfig(**resume.manifest["model"]), training=False)
    trainer.load_state_dict(resume.state())
    return trainer, f"{weights} (step {resume.step})"


def run_generate(config, args) -> None:
    """`megatrain generate`: a JSON line per prompt, {prompt, completion}, from the checkpoint's weights."""
    import json

    from megatrain_data import eos_token_text, load_tokenizer, weights_tokenizer
    from megatrain_data.prompts import read_prompts
    from megatrain_zoo.generate import Sampling

    from .generate import generate_completions, sampling_settings
    from .rollouts import stop_ids

    prompts = read_prompts(args.prompts)
    trainer, _ = trainer_for_weights(config, args.weights, args.verified)
    try:
        model, data, hf_dir = trainer.model_config, trainer.config.data, trainer.config.model.hf_dir
        path = weights_tokenizer(data, args.weights, hf_dir and Path(hf_dir), model.vocab_size, model.arch)
        tokenizer = load_tokenizer(path)
        eos = eos_token_text(tokenizer, model.eos_token_id, path.parent)
        settings = sampling_settings(path.parent, args)
        sampling = Sampling(stop_ids=stop_ids(model, tokenizer, path, eos), **settings)
        texts = generate_completions(trainer, tokenizer, path, prompts, sampling, args.seed)
    finally:
        trainer.close()
    for prompt, text in zip(prompts, texts):
        print(json.dumps({"prompt": prompt, "completion": text}))


def run_pair_eval(config, args) -> None:
    """`megatrain eval` of a DPO run: its loss and TRL's metrics on held-out pairs (or the training pairs). The
    trainer starts from the run's initial weights, which give the reference's scores (the run's cache, or a pass),
    then takes the weights evaluated."""
    import json

    from .loop import evaluate_pairs, load_data
    from .reference import reference_scores
    from .trainer import Trainer

    trainer = Trainer(config, training=False)
    try:
        data = load_data(config, trainer.model_config, Path(config.output_dir), trainer.ranks)
        rows, split = (data.validation, "validation") if data.validation is not None else (data.train, "training")
        reference = None
        if config.train.dpo.needs_reference:
            reference = reference_scores(trainer, rows, Path(config.output_dir) / "cache", split)
        what = str(args.weights) if args.verified is None else f"{args.weights} (step {args.verified.step})"
        if args.verified is not None:
            trainer.load_state_dict(args.verified.state())
        else:  # (a model directory, or a LoRA run's final/: its adapters)
            trainer.load_weights(args.weights)
        result = evaluate_pairs(trainer, trainer.pair_windows(rows), reference, leave=True)
    finally:
        trainer.close()
    if trainer.is_main:
        source = config.data.dataset or config.data.text or config.data.tokens or "the built-in corpus"
        print(json.dumps({"checkpoint": what, "data": split, "source": source, **result}))


def run_plan(config, args) -> None:
    import json

    from megatrain_plan import calibrate, format_plan
    from megatrain_templates import set_compile

    from .config import model_config_of
    from .distributed import check_data_parallel
    from .objectives import check_model_settings
    from .planning import check_plan, make_planner, passes_checks, run_planner

    set_compile(config.engine.compile)  # the rates measured here run the templates as the run would
    check_data_parallel(config, args.gpus * args.hosts)  # (as the run's ranks would refuse it)
    model = model_config_of(config)
    check_model_settings(config, model)  # (as the run refuses them)
    gpu_memory = int(args.gpu_memory_gib * 2**30) if args.gpu_memory_gib else None
    host_memory = int(args.host_memory_gib * 2**30) if args.host_memory_gib else None
    machine = {"gpu_memory": gpu_memory, "gpus": args.gpus, "hosts": args.hosts, "host_memory": host_memory}
    if args.calibrate:
        rates = calibrate(model, config.data.seq_len, config.train.micro_batch_size, config.engine.optimizer_state_dir)
        planner = make_planner(config, model, rates, **machine)
    else:
        planner = run_planner(config, model, measure=gpu_memory is None, **machine)  # (another GPU: not this one's)
    plan = planner.plan(planner.place(planner.step_tokens))
    refused = not passes_checks(plan, planner)
    print(
        json.dumps(plan.as_dict(), indent=2)
        if args.json
        else format_plan(plan, config.model.preset or config.model.hf_dir, refused)
    )
    check_plan(plan, planner)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(prog="megatrain", description="Full-precision LLM training on one GPU.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command")
    for add in (_add_train, _add_plan, _add_convert, _add_data, _add_eval, _add_generate, _add_bench, _add_presets):
        add(commands)
    return parser


def _add_train(commands) -> None:
    train_parser = commands.add_parser("train", help="train a model (no arguments: the built-in default job)")
    _add_config_args(train_parser)
    train_parser.add_argument(
        "--resume",
        metavar="DIR",
        help="continue a run: its output_dir, its checkpoints/, a step-NNNNNNNN or its final/ (then its newest "
        "checkpoint); in that run directory, with the run's own config under --config and --set",
    )


def _add_plan(commands) -> None:
    plan_parser = commands.add_parser(
        "plan", help="memory and step-time estimate for a config; refuses what cannot fit"
    )
    _add_config_args(plan_parser)
    plan_parser.add_argument("--calibrate", action="store_true", help="measure GPU, PCIe and CPU-optimizer rates here")
    plan_parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_parser.add_argument("--gpu-memory-gib", type=float, help="plan for a GPU with this much memory free")
    plan_parser.add_argument(
        "--host-memory-gib", type=float, help="plan for a host whose run may take this much memory"
    )
    plan_parser.add_argument("--gpus", type=int, default=1, help="GPUs per host (data parallel, torchrun)")
    plan_parser.add_argument(
        "--hosts", type=int, default=1, help="hosts (a replica each, or engine.shard_across_hosts)"
    )


def _add_convert(commands) -> None:
    convert_parser = commands.add_parser("convert", help="write a Hugging Face model directory from a checkpoint")
    convert_parser.add_argument(
        "source", help="a run's output_dir (newest weights), a step-NNNNNNNN or an HF directory"
    )
    convert_parser.add_argument("out", help="the Hugging Face directory to write")
    convert_parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="of the weights")
    convert_parser.add_argument("--overwrite", action="store_true", help="replace the model DIR holds (else refused)")
    convert_parser.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: its base model with the adapters merged in (default: the PEFT adapter directory)",
    )


def _add_data(commands) -> None:
    data_parser = commands.add_parser("data", help="show the training sequences a config makes (template, mask)")
    _add_config_args(data_parser)
    data_parser.add_argument("--dump", type=int, default=4, metavar="N", help="how many sequences (or pairs)")
    data_parser.add_argument("--text", action="store_true", help="decoded text, trained spans marked (not ids)")


def _add_eval(commands) -> None:
    eval_parser = commands.add_parser("eval", help="validation loss and perplexity of a checkpoint, forward only")
    _add_config_args(eval_parser, of_checkpoint=True)
    eval_parser.add_argument("--batches", type=int, help="evaluate only the first N batches of train.batch_size rows")


def _add_generate(commands) -> None:
    generate_parser = commands.add_parser("generate", help="completions of prompts from a checkpoint's weights")
    _add_config_args(generate_parser, of_checkpoint=True)
    generate_parser.add_argument(
        "--prompts", required=True, help='a JSONL of {"prompt": text or messages}, or a text file of one per line'
    )
    # (a setting not given: generation_config.json's, as transformers' generate() takes it, else greedy and unfiltered)
    generate_parser.add_argument("--max-new-tokens", type=int, help="the most a completion takes (256)")
    generate_parser.add_argument("--temperature", type=float, help="0: greedy (without generation_config.json)")
    generate_parser.add_argument("--top-p", type=float, help="nucleus sampling's mass (1: all)")
    generate_parser.add_argument("--top-k", type=int, help="0: no top-k filter (transformers' default is 50)")
    generate_parser.add_argument("--repetition-penalty", type=float, help="transformers' (1: none)")
    generate_parser.add_argument("--seed", type=int, default=0, help="the sampling's seed (--temperature above 0)")


def _add_bench(commands) -> None:
    bench_parser = commands.add_parser("bench", help="time training steps of a config on random tokens")
    _add_config_args(bench_parser)
    bench_parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")


def _add_presets(commands) -> None:
    presets_parser = commands.add_parser("presets", help="the model presets model.preset names, with their sizes")
    presets_parser.add_argument("match", nargs="?", default="", help="only the names containing this, e.g. qwen3")


def run_presets(match: str) -> None:
    from megatrain_zoo import preset_table

    print("\n".join(preset_table(match)))


def run_command(args) -> None:
    """Run the parsed command (its errors propagate)."""
    if args.command == "convert":
        run_convert(args)
    elif args.command == "train":
        run_train(args)
    elif args.command == "eval":
        from .checkpoint import run_config

        _at_least(args.batches, 1, "--batches")
        args.weights, args.verified = _weights_at(Path(args.checkpoint))
        base = run_config(args.weights, args.verified and args.verified.manifest)
        config = _config(args, base)
        check_held_out(config, base)
        check_model_overrides(config, args, base)
        run_eval(config, args)
    elif args.command == "generate":
        from .checkpoint import run_config
        from .generate import require_transformers

        _check_sampling_flags(args)
        require_transformers("megatrain generate")
        args.weights, args.verified = _weights_at(Path(args.checkpoint))
        base = run_config(args.weights, args.verified and args.verified.manifest)
        check_model_overrides(config := _config(args, base), args, base)
        run_generate(config, args)
    elif args.command == "bench":
        _at_least(args.steps, 1, "--steps")
        run_bench(_config(args), args.steps)
    elif args.command == "plan":
        for option in ("gpus", "hosts", "gpu_memory_gib", "host_memory_gib"):
            _at_least(getattr(args, option), 1, f"--{option.replace('_', '-')}")
        for option in ("gpu_memory_gib", "host_memory_gib"):  # (in bytes, an int64: 1e308 GiB overflowed)
            if (getattr(args, option) or 0) * 2**30 >= 2**63:
                from .config import ConfigError

                raise ConfigError(
                    f"--{option.replace('_', '-')} {getattr(args, option)} is more bytes than a machine holds; give "
                    "the GiB it has"
                )
        run_plan(_config(args), args)
    elif args.command == "data":
        _at_least(args.dump, 1, "--dump")
        run_data(_config(args), args)
    elif args.command == "presets":
        run_presets(args.match)


def restore_sigint() -> None:
    """SIGINT raising KeyboardInterrupt where the command inherited it ignored (a script's `megatrain train &`): Ctrl-C
    and `kill -INT` did nothing before the run's own handler was on, nor after it gave SIG_IGN back."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> int:
    """The `megatrain` command; returns its exit code."""
    restore_sigint()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    known: dict = {}
    try:
        known = _error_types()  # (the imports of torch and the engine: a Ctrl-C among them is handled below)
        run_command(args)
    except KeyboardInterrupt as interrupt:  # (a run's own stop says what it lost: `loop.Stopped`)
        started = " (training had not started: no checkpoint or model was written)" if args.command == "train" else ""
        if os.environ.get("RANK", "0") == "0":  # (torchrun interrupts every rank)
            line = str(interrupt) or f"interrupted; {args.command} stopped before it finished{started}"
            print(f"megatrain: {line}", file=sys.stderr)
        return getattr(interrupt, "exit_code", 130)
    except Exception as error:
        reply = _error_line(error, known)
        if reply is None:
            raise
        code, line = reply
        line = " ".join(line.split())  # (one line, whatever the message's own layout)
        if line and _says_it(error, code, line):
            print(line, file=sys.stderr)
        return code
    return 0


def _says_it(error: Exception, code: int, line: str) -> bool:
    """Whether this process prints its error line: alone, yes; under torchrun, once for the ranks that fail alike
    (`exit_together`), which all exit with `code`; a run stopped by a signal is said by rank 0 alone already."""
    loop = sys.modules.get("megatrain.loop")
    interrupted = loop is not None and isinstance(error, loop.RunInterrupted)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or interrupted:
        return True
    from megatrain_optim.launch import exit_together

    return exit_together(code, line)


if __name__ == "__main__":
    sys.exit(main())
