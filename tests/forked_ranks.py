"""torchrun's ranks, forked from one process that imported torch and megatrain once: the launcher of the tests that
compare a data-parallel run with one process (a launch of two ranks under torchrun imports torch three times: 6.7 s
on CI's two cores, most of it those imports). What torchrun itself does (its signals, exit codes, a rank's failure
stopping the others) is tested under torchrun.

    python forked_ranks.py --nproc-per-node=N [--standalone | --nnodes=H --node-rank=h --master-addr=A
        --master-port=P] -m megatrain ARGS

Each rank gets the environment torchrun gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, OMP_NUM_THREADS=1, TORCHELASTIC_RUN_ID) and, as under torchrun, joins the store that the
launcher of host 0 holds; where one fails the others are stopped and this exits 1, as torchrun does."""

import os
import signal
import socket
import sys
import threading

# what `megatrain train` imports, here once: the forked ranks share it
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # noqa: F401

from megatrain import checkpoint, loop, trainer  # noqa: F401
from megatrain.cli import main


def options(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's `--name=value` options (and `--standalone`) before `-m megatrain`, and the arguments after it."""
    split = argv.index("-m")
    if argv[split + 1] != "megatrain":
        raise SystemExit(f"forked_ranks.py runs `-m megatrain` only, not {argv[split + 1]}")
    named = dict(arg.removeprefix("--").partition("=")[::2] for arg in argv[:split])
    return named, argv[split + 2 :]


def free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def rank_environment(named: dict[str, str], local_rank: int) -> dict[str, str]:
    local_world, node = int(named["nproc-per-node"]), int(named.get("node-rank", 0))
    return {
        "RANK": str(node * local_world + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(local_world * int(named.get("nnodes", 1))),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": named.get("master-addr", "127.0.0.1"),
        "MASTER_PORT": named["master-port"],
        "OMP_NUM_THREADS": "1",
        "TORCHELASTIC_RUN_ID": named["run-id"],
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def run_rank(environment: dict[str, str], args: list[str]) -> None:
    """In the forked child: megatrain with `args` as this rank; never returns."""
    os.environ.update(environment)
    code = 1
    try:
        code = main(args)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def launch(argv: list[str]) -> int:
    named, args = options(argv)
    if "standalone" in named:
        named["master-port"] = free_port()
    named["run-id"] = named["master-port"]  # (the same on every host's launcher, as torchrun's rendezvous id)
    # a fork copies only the calling thread: one holding a lock elsewhere would leave it held in every rank
    assert threading.active_count() == 1, "a thread runs before the ranks fork"
    children = set()
    for local_rank in range(int(named["nproc-per-node"])):
        pid = os.fork()
        if pid == 0:
            run_rank(rank_environment(named, local_rank), args)
        children.add(pid)
    # (after the forks: the store serves from threads of its own; the ranks wait for it to listen)
    store = None
    if named.get("node-rank", "0") == "0":
        address, port = named.get("master-addr", "127.0.0.1"), int(named["master-port"])
        store = dist.TCPStore(address, port, is_master=True, wait_for_workers=False)
    failed = 0
    while children:
        pid, status = os.wait()
        children.remove(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = 1
            for other in children:  # (torchrun's answer to a rank's failure)
                os.kill(other, signal.SIGTERM)
    del store  # (served until every rank has ended)
    return failed


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1:]))
