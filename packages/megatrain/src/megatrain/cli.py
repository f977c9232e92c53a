"""The `megatrain` command: train, plan."""

import argparse
import sys
from pathlib import Path

from .config import ConfigError, default_config_path, load_config


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


def run_plan(config, args) -> None:
    import json

    from .config import model_config_of
    from .plan import calibrate, check_plan, format_plan, make_plan

    model = model_config_of(config)
    rates = calibrate(model, config.data.seq_len, config.train.micro_batch_size) if args.calibrate else None
    plan = make_plan(config, model, rates)
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
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        config = load_config(args.config or default_config_path(), args.overrides)
        if args.command == "train":
            from .loop import train

            train(config, Path(args.resume) if args.resume else None)
        elif args.command == "plan":
            run_plan(config, args)
    except ConfigError as error:
        print(f"megatrain: config error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # noqa: BLE001 - one readable line for known error types
        if type(error).__name__ in ("ZooError", "StoreError", "OptimError", "SchedError", "NonFiniteError"):
            print(f"megatrain: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
