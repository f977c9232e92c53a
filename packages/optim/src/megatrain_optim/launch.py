"""How a data-parallel run's processes join, on several GPUs and hosts: one process per GPU (launched by torchrun),
data parallel, one copy of the training state per host, or one copy split over the hosts.

Every rank streams all layers through its GPU and runs its share of the step's sequences.
A group's gradient is summed over the ranks of a host on the GPUs (NCCL reduce-scatter; gloo
on the CPU), then, with several hosts, over the hosts (all-reduce of each shard among the
ranks with the same local rank), so each rank ends up with its 1/L slice of the global
gradient (L ranks per host) and sends only that slice to host memory; its CPU threads update
only that slice of the shared master weights and moments. Every host keeps a full replica of
the state (host bytes per parameter do not grow with the GPUs); ranks of a host see one
another's updates through shared memory and wait for them through shared flags, not collectives.

With `split_state` (megatrain's engine.shard_across_hosts) the hosts split the state instead: the gradient is reduce-
scattered over all N ranks, so rank r owns slice r of each group and host h the contiguous
slices of its ranks; a host keeps master weights and moments for its part only, plus a full
compute-dtype copy of the weights to stream (2 B/param in bf16). After updating its slice a
rank sends it, in the compute dtype, to the ranks with its local rank on the other hosts and
receives theirs (gloo, from a thread beside the optimizer's), before it marks the group updated: H hosts
of M bytes then train a model of about H x M / (12 + 2 H) parameters (vs M / 12 replicated).
"""

import functools
import os
import signal
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from megatrain_store import SharedArenas

from .ranks import RankError, Ranks


def launch_shape() -> tuple[int, int]:
    """(processes per host, hosts) as torchrun describes them; (1, 1) when run alone."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise RankError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local}: uneven hosts")
    return local, world // local


def exit_together(code: int, line: str, wait_s: float = 10.0) -> bool:
    """Under torchrun, where this rank fails with `line` and exit `code`: whether the caller should print the line
    (another rank where its line differs from rank 0's; rank 0 prints its own at once, before it waits: a refusal
    only it makes, a missing data file, fails the others' next collective, and torchrun may end it before the wait
    is over), after waiting up to `wait_s` for every rank to fail too (through torchrun's store), so that a failure
    they all meet alike (a config error) is said once and every rank exits with `code`: torchrun stops the
    remaining ranks with SIGTERM once one has exited, which this rank ignores from here on, as it is ending. Alone:
    True at once."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world == 1 or "MASTER_ADDR" not in os.environ:
        return True
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
    # (blocked, not handled: a handler would be reset before the interpreter's teardown, where a signal then kills)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    failed = f"megatrain/{attempt}/failed"
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=wait_s)
        )
        store.set(f"{failed}/{rank}", line)
        deadline = time.monotonic() + wait_s
        arrived = store.add(failed, 1)
        while arrived < world and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(failed, 0)
        return rank != 0 and (not store.check([f"{failed}/0"]) or store.get(f"{failed}/0").decode() != line)
    except (RuntimeError, OSError, ValueError):  # (no store to reach: each rank says its own)
        return rank != 0


def peer_ended(error: BaseException) -> bool:
    """Whether a collective failed because another rank's process ended (gloo's and NCCL's words for it)."""
    words = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    return isinstance(error, dist.DistNetworkError) or (
        isinstance(error, RuntimeError) and any(word in str(error) for word in words)
    )


def leave_ranks() -> None:
    """Leave the process group (a local teardown, no collective): left to the interpreter's exit, gloo's
    threads can be destroyed still running, which aborts a finished rank ("terminate called ...")."""
    if dist.is_initialized():
        dist.destroy_process_group()


def join_ranks(device_type: str, cpu_threads: int | str, split_state: bool, wait_s: float) -> Ranks | None:
    """Set this process's CPU threads (`set_cpu_threads`) and join the process group torchrun describes (NCCL on
    CUDA, gloo on the CPU); None when alone. `split_state`: the hosts split the training state (see the module's
    note); `wait_s`: how long a rank waits for another."""
    local_world, hosts = launch_shape()
    world = local_world * hosts
    set_cpu_threads(cpu_threads, local_world if world > 1 else None, beside_gpu=device_type == "cuda")
    if world == 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    rank = dist.get_rank()
    ranks = Ranks(rank, world, int(os.environ.get("LOCAL_RANK", rank % local_world)), local_world)
    ranks.split_state = split_state and hosts > 1
    ranks.wait_s = wait_s
    # every process creates every group, in the same order (torch.distributed's rule)
    for node in range(ranks.n_nodes):
        group = dist.new_group(list(range(node * local_world, (node + 1) * local_world)))
        if node == ranks.node:
            ranks.node_group = group
    for local in range(local_world):
        group = dist.new_group(list(range(local, world, local_world)))
        if local == ranks.local_rank:
            ranks.cross_group = group
    if ranks.split_state:
        # host tensors, on gloo; the exchange runs on a thread of its own, beside the main thread's
        # collectives, so it has process groups of its own
        # (a host that stops sending is noticed after wait_s, as a local rank that stops updating)
        limit = timedelta(seconds=ranks.wait_s)
        for local in range(local_world):
            group = dist.new_group(list(range(local, world, local_world)), backend="gloo", timeout=limit)
            if local == ranks.local_rank:
                ranks.exchange_group = group
        ranks.host_mains_group = dist.new_group(list(range(0, world, local_world)), backend="gloo")
    return ranks


def set_cpu_threads(cpu_threads: int | str, local_world: int | None, beside_gpu: bool = False) -> None:
    """torch's CPU threads for this process: `cpu_threads` where a number; "auto": the host's cores split among its
    `local_world` processes under torchrun (which sets OMP_NUM_THREADS=1 per worker, leaving the CPU AdamW one core);
    for a process alone torch's threads as they are, less one of its default beside a GPU (`beside_gpu`; none where
    OMP_NUM_THREADS sets them): the threads that issue the GPU's work and copies then keep a core, where the AdamW's
    parallel regions, each as slow as its slowest thread, would share it (an optimizer-bound MoE step on an H200 ran
    faster in 4 of 5 pairs, by 1.7% on average; a compute-bound dense one equal:
    benchmarks/results/cpu-threads-h200.json)."""
    alone = _threads_at_start()
    if cpu_threads != "auto":
        torch.set_num_threads(cpu_threads)
    elif local_world is not None:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    elif beside_gpu and alone > 2 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(alone - 1)


@functools.cache
def _threads_at_start() -> int:
    """torch's CPU threads before `set_cpu_threads` first set them (a process may build several trainers)."""
    return torch.get_num_threads()


def shared_arenas(ranks: Ranks, shared_dir: Path) -> SharedArenas:
    """This host's shared arenas, in a directory every rank of the host agrees on, under `shared_dir` (a
    memory-backed directory: /dev/shm)."""
    token = [uuid.uuid4().hex[:12] if ranks.is_main else None]
    dist.broadcast_object_list(token, src=0)
    return SharedArenas(Path(shared_dir) / f"megatrain-{token[0]}-node{ranks.node}")
