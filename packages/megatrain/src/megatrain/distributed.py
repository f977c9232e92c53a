"""The config's side of several GPUs and hosts (`megatrain_optim.launch` joins the processes, and its note says how
the ranks share the work): the engine keys with the environment variables that override them, and the refusal of a
batch the ranks cannot split."""

import os
from pathlib import Path

from megatrain_optim import Ranks
from megatrain_optim.launch import join_ranks
from megatrain_optim.launch import shared_arenas as _shared_arenas
from megatrain_store import SharedArenas

from .config import ConfigError, EngineSection


def init_ranks(device_type: str, engine: EngineSection) -> Ranks | None:
    """Join the process group torchrun describes (None when alone), with engine.cpu_threads, engine.shard_across_hosts
    and engine.rank_wait_s (MEGATRAIN_RANK_WAIT_S overrides it, as every rank's launch sets it)."""
    wait_s = float(os.environ.get("MEGATRAIN_RANK_WAIT_S", engine.rank_wait_s))
    return join_ranks(device_type, engine.cpu_threads, engine.shard_across_hosts, wait_s)


def shared_arenas(ranks: Ranks, shared_dir: str) -> SharedArenas:
    """This host's shared arenas under `shared_dir` (engine.shared_dir; MEGATRAIN_SHARED_DIR overrides it, for a host
    whose memory-backed directory is elsewhere)."""
    return _shared_arenas(ranks, Path(os.environ.get("MEGATRAIN_SHARED_DIR", shared_dir)))


def check_data_parallel(config, world_size: int) -> None:
    """Refuse, before anything is allocated (or planned: `megatrain plan --gpus`), a configuration `world_size`
    ranks cannot split evenly."""
    train = config.train
    unit = world_size * train.micro_batch_size
    if train.batch_size % unit:
        share, rest = divmod(train.batch_size, world_size)
        if rest:
            fix = f"train.batch_size: {unit * max(1, train.batch_size // unit)}"
        else:  # (a micro-batch that divides each rank's share keeps the step's batch, and so its result)
            fix = f"train.micro_batch_size: {next(m for m in range(train.micro_batch_size, 0, -1) if share % m == 0)}"
        raise ConfigError(
            f"train.batch_size ({train.batch_size}) must be a multiple of the number of ranks ({world_size}) "
            f"times train.micro_batch_size ({train.micro_batch_size}): each rank runs whole micro-batches of its "
            f"share; e.g. {fix}"
        )
