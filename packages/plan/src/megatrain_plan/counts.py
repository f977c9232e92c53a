"""A placement in the making (`Counts`): what the planner's rules decide, stage counts by choice, before
`Planner.placement_of` names the stages."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Counts:
    """A placement in the making: how many stages take each choice, by the planner's rules of which."""

    tokens: int  # per GPU and sweep
    sweeps: int = 1  # forward-backward sweeps a step runs in
    resident: int = 0  # blocks (the first; with the embedding, and the head where tied)
    held: int = 0  # blocks after the resident ones
    offloaded: int = 0  # blocks, the first, whose checkpoints go to host memory
    kept: int = 0  # blocks, the last keepable ones, keeping their products on the GPU
    host_kept: int = 0  # blocks before those, spread evenly, keeping theirs in host memory
    copied: int = 0  # resident blocks (the first) keeping their weights in the compute dtype too
    parked: int = 0  # resident stages (the first) whose moments wait in host memory from update to backward
