"""The `megatrain` command: train, plan."""

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


def run_plan(config, args) -> None:
    import json

    from .config import model_config_of
    from .plan import calibrate, check_plan, format_plan, make_plan

    model = model_config_of(config)
    rates = (
        calibrate(model, config.data.seq_len, config.train.micro_batch_size, config.engine.optimizer_state_dir)
        if args.calibrate
        else None
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
        "--gpu-memory-gib", type=float, help="plan for a GPU with this much memory instead of this machine's"
    )
    plan_parser.add_argument("--gpus", type=int, default=1, help="GPUs per host (data parallel, torchrun)")
    plan_parser.add_argument("--hosts", type=int, default=1, help="hosts, each with a replica of the state")
    convert_parser = commands.add_parser("convert", help="write a Hugging Face model directory from a checkpoint")
    convert_parser.add_argument("source", help="a checkpoint directory (step-NNNNNNNN) or a Hugging Face directory")
    convert_parser.add_argument("out", help="the Hugging Face directory to write")
    convert_parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    except ConfigError as error:
        print(f"megatrain: config error: {error}", file=sys.stderr)
        return 2
    except KNOWN_ERRORS as error:  # one readable line; anything else is a bug and keeps its traceback
        print(f"megatrain: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
