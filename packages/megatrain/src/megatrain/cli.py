"""The `megatrain` command: train, plan, data, eval, convert, bench."""

import argparse
import sys
from pathlib import Path

from megatrain_optim import OptimError
from megatrain_sched import SchedError
from megatrain_store import StoreError
from megatrain_zoo import ZooError

from .config import ConfigError, default_config_path, load_config
from .distributed import RankError
from .trainer import NonFiniteError

KNOWN_ERRORS = (ZooError, StoreError, OptimError, SchedError, NonFiniteError, RankError)


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (default: the built-in small model on the built-in corpus)")
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

    from .trainer import Trainer

    trainer = Trainer(config)
    vocab, seq, batch = trainer.model_config.vocab_size, config.data.seq_len, config.train.batch_size
    rows = []
    for step in range(steps + 1):
        ids = torch.randint(0, vocab, (batch, seq))
        labels = torch.roll(ids, -1, 1)
        labels[:, -1] = -100
        start = time.perf_counter()
        metrics = trainer.train_step(ids, labels)
        trainer.finish_updates()
        if step:  # the first step warms up
            rows.append((time.perf_counter() - start, metrics))
    trainer.close()
    seconds = sum(r[0] for r in rows) / len(rows)
    tflops = sum(r[1].tflops * r[1].step_time_s for r in rows) / sum(r[0] for r in rows)
    print(
        f"{config.model.preset or config.model.hf_dir}: {batch * seq:,} tokens/step, {seconds:.3f} s/step, "
        f"{batch * seq / seconds:,.0f} tokens/s, {tflops:.1f} model TFLOPS on {trainer.device}"
    )


def hf_labels(batch, row: int) -> list[int]:
    """Labels of a row in the Hugging Face convention: labels[t] = input_ids[t] where token t is trained
    (the engine's labels are shifted: its label at t - 1 is the target token t)."""
    ids, shifted = batch.input_ids[row].tolist(), batch.labels[row].tolist()
    return [-100] + [ids[t] if shifted[t - 1] != -100 else -100 for t in range(1, len(ids))]


def marked_text(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The decoded row with each trained span between ⟦ and ⟧."""
    pieces, run, trained = [], [], None
    for token, label in zip(ids, labels):
        if (label != -100) != trained and run:
            pieces.append(("⟦{}⟧" if trained else "{}").format(tokenizer.decode(run, skip_special_tokens=False)))
            run = []
        trained = label != -100
        run.append(token)
    if run:
        pieces.append(("⟦{}⟧" if trained else "{}").format(tokenizer.decode(run, skip_special_tokens=False)))
    return "".join(pieces)


def run_data(config, args) -> None:
    import json

    from .config import model_config_of
    from .data import TokenWindows
    from .loop import load_data

    data = load_data(config, model_config_of(config), Path(config.output_dir))
    for line in data.report:
        print(f"megatrain: {line}", file=sys.stderr)
    tokenizer = None
    if args.text:
        if data.tokenizer is None:
            raise ConfigError("--text needs a tokenizer; data.tokens holds ids only")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(data.tokenizer))
    train = config.train
    windows = TokenWindows(data.train, config.data.seq_len, train.batch_size, config.data.shuffle, train.seed)
    shown, step = 0, 0
    while shown < args.dump:
        batch = windows.batch(step)
        for row in range(len(batch.input_ids)):
            if shown == args.dump:
                break
            ids, labels = batch.input_ids[row].tolist(), hf_labels(batch, row)
            if tokenizer is not None:
                print(f"--- sequence {shown} (step {step}, row {row}); trained spans in ⟦ ⟧")
                print(marked_text(tokenizer, ids, labels))
            else:
                record = {"input_ids": ids, "labels": labels}
                if batch.position_ids is not None:
                    record["position_ids"] = batch.position_ids[row].tolist()
                print(json.dumps(record))
            shown += 1
        step += 1


def run_eval(config, args) -> None:
    import json
    from dataclasses import replace

    from megatrain_zoo import ModelConfig

    from .checkpoint import MANIFEST, find_checkpoint, load_checkpoint, verify_checkpoint
    from .config import ModelSection
    from .data import TokenWindows
    from .loop import evaluate, load_data
    from .trainer import Trainer

    source = Path(args.checkpoint)
    if (source / "config.json").exists() and not (source / MANIFEST).exists():  # a Hugging Face directory
        trainer = Trainer(replace(config, model=ModelSection(hf_dir=str(source))), training=False)
        what = str(source)
    else:
        directory = find_checkpoint(source)
        manifest = verify_checkpoint(directory)
        trainer = Trainer(config, ModelConfig(**manifest["model"]), training=False)
        load_checkpoint(trainer, directory)  # the weights (a trainer for evaluation holds no optimizer state)
        what = f"{directory} (step {manifest['step']})"
    try:
        data = load_data(config, trainer.model_config, Path(config.output_dir), trainer.ranks)
        tokens, split = (data.validation, "validation") if data.validation is not None else (data.train, "training")
        windows = TokenWindows(tokens, config.data.seq_len, 1, shuffle=False, seed=0)
        result = evaluate(trainer, windows, args.batches, leave=True)
    finally:
        trainer.close()
    if trainer.is_main:
        print(json.dumps({"checkpoint": what, "data": split, **result}))


def run_plan(config, args) -> None:
    import json

    from .config import model_config_of
    from .plan import check_plan, format_plan, make_plan
    from .rates import calibrate, run_rates

    model = model_config_of(config)
    rates = (
        calibrate(model, config.data.seq_len, config.train.micro_batch_size, config.engine.optimizer_state_dir)
        if args.calibrate
        else run_rates(config, model, measure=args.gpu_memory_gib is None)  # planning for another GPU: not this one's
    )
    gpu_memory = int(args.gpu_memory_gib * 2**30) if args.gpu_memory_gib else None
    plan = make_plan(config, model, rates, gpu_memory, args.gpus, args.hosts)
    print(
        json.dumps(plan.as_dict(), indent=2)
        if args.json
        else format_plan(plan, config.model.preset or config.model.hf_dir)
    )
    check_plan(plan, config, model)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain", description="Full-precision LLM training on one GPU.")
    commands = parser.add_subparsers(dest="command")
    train_parser = commands.add_parser("train", help="train a model (no arguments: the built-in default job)")
    _add_config_args(train_parser)
    train_parser.add_argument(
        "--resume", metavar="DIR", help="continue from a checkpoint directory or a run's output_dir"
    )
    plan_parser = commands.add_parser(
        "plan", help="memory and step-time estimate for a config; refuses what cannot fit"
    )
    _add_config_args(plan_parser)
    plan_parser.add_argument("--calibrate", action="store_true", help="measure GPU, PCIe and CPU-optimizer rates here")
    plan_parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan_parser.add_argument(
        "--gpu-memory-gib", type=float, help="plan for a GPU with this much memory free instead of this machine's"
    )
    plan_parser.add_argument("--gpus", type=int, default=1, help="GPUs per host (data parallel, torchrun)")
    plan_parser.add_argument(
        "--hosts", type=int, default=1, help="hosts (a replica of the state each, or a part: engine.shard_across_hosts)"
    )
    convert_parser = commands.add_parser("convert", help="write a Hugging Face model directory from a checkpoint")
    convert_parser.add_argument("source", help="a checkpoint directory (step-NNNNNNNN) or a Hugging Face directory")
    convert_parser.add_argument("out", help="the Hugging Face directory to write")
    convert_parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    data_parser = commands.add_parser("data", help="show the training sequences a config makes (template, mask)")
    _add_config_args(data_parser)
    data_parser.add_argument("--dump", type=int, default=4, metavar="N", help="how many sequences (default 4)")
    data_parser.add_argument(
        "--text", action="store_true", help="decoded text with trained spans marked, instead of JSON lines of ids"
    )
    eval_parser = commands.add_parser("eval", help="validation loss and perplexity of a checkpoint, forward only")
    _add_config_args(eval_parser)
    eval_parser.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint (step-NNNNNNNN), a run's output_dir or a Hugging Face directory",
    )
    eval_parser.add_argument("--batches", type=int, help="evaluate only the first N batches of train.batch_size rows")
    bench_parser = commands.add_parser("bench", help="time training steps of a config on random tokens")
    _add_config_args(bench_parser)
    bench_parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "convert":
            from .hf_io import convert

            print(f"wrote {convert(Path(args.source), Path(args.out), args.dtype)}")
            return 0
        config = load_config(args.config or default_config_path(), args.overrides)
        if args.command == "bench":
            run_bench(config, args.steps)
        if args.command == "train":
            from .loop import train

            train(config, Path(args.resume) if args.resume else None)
        elif args.command == "plan":
            run_plan(config, args)
        elif args.command == "data":
            run_data(config, args)
        elif args.command == "eval":
            run_eval(config, args)
    except ConfigError as error:
        print(f"megatrain: config error: {error}", file=sys.stderr)
        return 2
    except KNOWN_ERRORS as error:  # one readable line; anything else is a bug and keeps its traceback
        print(f"megatrain: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
