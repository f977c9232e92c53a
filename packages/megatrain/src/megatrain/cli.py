"""The `megatrain` command: train, plan."""

import argparse
import sys

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatrain", description="Full-precision LLM training on one GPU.")
    commands = parser.add_subparsers(dest="command")
    train_parser = commands.add_parser("train", help="train a model (no arguments: the built-in default job)")
    _add_config_args(train_parser)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        config = load_config(args.config or default_config_path(), args.overrides)
        if args.command == "train":
            from .loop import train

            train(config)
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
