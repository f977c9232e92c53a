"""The ranks of a data-parallel run and how they share one host store: where a process sits (`Ranks`), the
collectives of a step and the shared flags by which a host's ranks wait for one another's updates (`RankSync`),
and the update hand-off that marks (and, where the hosts split the state, exchanges) each updated shard
(`RankSharing`, the `Sharing` of the update policies). How the processes are launched and joined is
`launch`'s; this module takes the process groups it made."""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from megatrain_store import HostStore

from .stepper import BackgroundStepper
from .updates import Sharing

# torch 2.13 renamed reduce_scatter_tensor (the old name warns on every rank); the GPU machines' 2.11 has the old only
reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class RankError(RuntimeError):
    """Another rank died or hung; the message says which and how to resume."""


@dataclass
class Ranks:
    """Where this process sits: torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_group: object = None  # the ranks of this host
    cross_group: object = None  # the ranks with this local rank on every host
    split_state: bool = False  # the hosts split the state (engine.shard_across_hosts)
    exchange_group: object = None  # split state: cross_group on gloo, for the exchange thread's weights
    host_mains_group: object = None  # split state: every host's first rank on gloo, to gather whole groups
    wait_s: float = 600.0  # how long a rank waits for another before it concludes that one is gone (rank_wait_s)

    @property
    def node(self) -> int:
        """This process's host index, 0 to n_nodes - 1 (every host runs `local_world_size` ranks)."""
        return self.rank // self.local_world_size

    @property
    def n_nodes(self) -> int:
        """How many hosts the run spans."""
        return self.world_size // self.local_world_size

    @property
    def is_main(self) -> bool:
        """Whether this is the run's rank 0."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """Whether this is its host's first rank (local rank 0)."""
        return self.local_rank == 0


class RankSync:
    """The collectives of a data-parallel step and the shared flags by which a host's ranks wait
    for one another's updates (flags[g, r] = optimizer steps rank r has applied to group g)."""

    def __init__(self, ranks: Ranks, store: HostStore, device: torch.device):
        self.ranks, self.store, self.device = ranks, store, device
        self.flags = store.shared.tensor("update-flags", torch.int64, store.n_groups * ranks.local_world_size)
        self.flags = self.flags.view(store.n_groups, ranks.local_world_size)
        self._exchange_failed: str | None = None

    def reduce_grad(self, group: int, buffer: Tensor) -> Tensor:
        """This rank's shard of the gradient summed over every rank (on the current stream)."""
        ranks = self.ranks
        shard = torch.empty(buffer.numel() // self.store.shard[1], dtype=buffer.dtype, device=buffer.device)
        if ranks.split_state:
            reduce_scatter(shard, buffer)
        else:
            reduce_scatter(shard, buffer, group=ranks.node_group)
            if ranks.n_nodes > 1:
                dist.all_reduce(shard, group=ranks.cross_group)
        start, end = self.store.shard_range(group)
        return shard[: end - start]

    def all_reduce(self, tensor: Tensor, across_hosts: bool = True) -> Tensor:
        """Sum `tensor` in place over every rank (or over this host's ranks)."""
        dist.all_reduce(tensor, group=None if across_hosts else self.ranks.node_group)
        return tensor

    def gather_rows(self, rows: Tensor) -> Tensor:
        """Every rank's `rows` (a host tensor of its share of a batch's rows, any length), in rank order."""
        return torch.cat(self.gather_objects(rows))

    def gather_objects(self, value) -> list:
        """Every rank's `value` (any picklable object), in rank order."""
        parts = [None] * self.ranks.world_size
        dist.all_gather_object(parts, value)
        return parts

    def sum_over_shards(self, tensor: Tensor) -> Tensor:
        """Sum per-shard quantities (squared gradient norms) over the ranks whose shards tile the
        gradient once: this host's, or every rank where the hosts split the state."""
        return self.all_reduce(tensor, across_hosts=self.ranks.split_state)

    def exchange_updated_weights(self, group: int) -> None:
        """Split state, after this rank updated its slice of `group`: send that slice of the wire copy
        to the ranks with this local rank on the other hosts and write theirs into this host's copy.
        Raw bytes travel (gloo has no bf16), padded to whole shards."""
        store, ranks = self.store, self.ranks
        if self._exchange_failed:  # the later groups' exchanges would each wait out the limit again
            raise RankError(self._exchange_failed)
        wire = store.wire(group)
        size = store.shard_size(group)
        start, end = store.shard_range(group)
        mine = torch.zeros(size, dtype=wire.dtype)
        mine[: end - start] = wire[start:end]
        parts = [torch.empty_like(mine) for _ in range(ranks.n_nodes)]
        try:
            dist.all_gather([p.view(torch.uint8) for p in parts], mine.view(torch.uint8), group=ranks.exchange_group)
        except (RuntimeError, dist.DistError) as error:
            self._exchange_failed = (
                f"rank {ranks.rank} (host {ranks.node}) did not receive the other hosts' updated weights of group "
                f"{group} within {ranks.wait_s:.0f} s: a host died or hung (see its log; {str(error).splitlines()[0]}). "
                "The last complete checkpoint is intact; resume from it with --resume, on the same or another number "
                "of hosts."
            )
            raise RankError(self._exchange_failed) from error
        for node, part in enumerate(parts):
            if node != ranks.node:
                first, last = store.shard_range(group, node * ranks.local_world_size + ranks.local_rank)
                wire[first:last] = part[: last - first]

    def gather_whole(self, group: int, arena: str) -> Tensor | None:
        """Split state: `group`'s whole flat master weights (`arena` "master") or optimizer state
        ("state.NAME"), gathered from every host's first rank to rank 0; None on the other ranks.
        Every host's first rank must call it for the same groups in the same order."""
        store, ranks = self.store, self.ranks
        own = store.held(arena, group)
        size = store.shard_size(group) * store.owned[1]
        part = torch.zeros(size, dtype=own.dtype)
        part[: own.numel()] = own
        parts = [torch.empty_like(part) for _ in range(ranks.n_nodes)] if ranks.is_main else None
        dist.gather(part, parts, dst=0, group=ranks.host_mains_group)
        if not ranks.is_main:
            return None
        whole = torch.empty(store.layouts[group].numel, dtype=own.dtype)
        for node, part in enumerate(parts):
            first = min(node * size, whole.numel())
            last = min(first + size, whole.numel())
            whole[first:last] = part[: last - first]
        return whole

    def max(self, number: int) -> int:
        """The largest of every rank's `number`, on every rank (a stop signal seen by one rank stops all, each exiting
        as that signal says, whether its own copy of it came yet or not)."""
        value = torch.tensor([number], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def mark_applied(self, group: int, steps: int) -> None:
        """Set this rank's shared flag: it has applied `steps` optimizer steps to `group` (seen by the host's ranks)."""
        self.flags[group, self.ranks.local_rank] = steps

    def applied(self, groups, steps: int) -> bool:
        """Whether every rank of this host has applied `steps` optimizer steps to `groups` (no waiting)."""
        return all(int(self.flags[group].min()) >= steps for group in groups)

    def wait_applied(self, groups, steps: int) -> None:
        """Block until every rank of this host has applied `steps` optimizer steps to `groups`;
        a rank that has not done so in `Ranks.wait_s` has died or hung, and this one stops too."""
        for group in groups:
            start = time.monotonic()
            while not self.applied((group,), steps):
                if time.monotonic() - start > self.ranks.wait_s:
                    behind = [r for r, done in enumerate(self.flags[group].tolist()) if done < steps]
                    raise RankError(
                        f"rank(s) {behind} of host {self.ranks.node} have not updated group {group} for step {steps} in "
                        f"{self.ranks.wait_s:.0f} s: a process died or hung (see its log). The last complete checkpoint "
                        "is intact; resume from it with --resume, on the same or another number of GPUs."
                    )
                time.sleep(1e-4)

    def barrier(self) -> None:
        """Block until every rank of the run gets here."""
        dist.barrier()


class RankSharing(Sharing):
    """What a rank does once it has updated its shard of a group: mark it in the host's shared flags, so the host's
    other ranks may read the group; where the hosts split the state, first swap its updated slice of the weights with
    the same local rank of the other hosts, from a thread of its own (the optimizer moves on to the next group while
    the network carries the last one). The exchanges run in `order` (each step's host groups, the same on every
    rank): the optimizer's update order depends on when each gradient landed, which differs between ranks, and
    collectives issued in different orders pair one group's bytes with another's. An update that comes early is
    held until the groups before it in `order` are updated."""

    def __init__(self, sync: RankSync, order: list[int]):
        self.sync = sync
        self.exchanger = BackgroundStepper(enabled=sync.ranks.split_state)
        self.order, self._next, self._held = list(order), 0, {}

    def updated(self, group: int, steps: int) -> None:
        """Runs on the optimizer's worker (one thread)."""
        if not self.sync.ranks.split_state:
            self.sync.mark_applied(group, steps)
            return

        def exchange() -> None:  # (skipped or not, every host's rank takes part in each exchange)
            self.sync.exchange_updated_weights(group)
            self.sync.mark_applied(group, steps)

        self._held[group] = exchange
        while self.order[self._next] in self._held:
            due = self.order[self._next]
            self.exchanger.submit(due, self._held.pop(due))
            self._next = (self._next + 1) % len(self.order)

    def mark(self, group: int, steps: int) -> None:
        """Set this rank's flag for `group` to `steps` with no exchange (a skipped step, a resume)."""
        self.sync.mark_applied(group, steps)

    def wait(self, groups, steps: int) -> None:
        """Block until this rank's exchanges of `groups` are done and every rank of the host has applied `steps`
        steps to them (re-raising an exchange's error)."""
        groups = tuple(groups)
        for group in groups:
            self.exchanger.wait(group)
        self.sync.wait_applied(groups, steps)

    def done(self, groups, steps: int) -> bool:
        """Whether `wait(groups, steps)` would return at once."""
        groups = tuple(groups)
        return not any(self.exchanger.busy(g) for g in groups) and self.sync.applied(groups, steps)

    def close(self) -> None:
        """Stop the exchange thread (after the exchange it is running)."""
        self.exchanger.close()
