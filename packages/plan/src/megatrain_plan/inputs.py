"""What the planner plans with, each a small frozen value: the machine (`Machine`), one step's shape
(`StepShape`), the engine's settings the user chose (`EngineChoices`) and what the training objective holds
beside the model's state (`ObjectiveMemory`). The caller builds them (the `megatrain` meta-package from its
config) with the model's spec and the rates (`rates.Rates`)."""

from dataclasses import dataclass

import torch

from megatrain_store import free_device_bytes

from .host_memory import host_budget, process_bytes


@dataclass(frozen=True)
class Machine:
    """What a run has: one GPU's memory free for it (None: no GPU), the host memory its plan may take (None:
    unknown; `host_memory.host_budget`) and where that number came from, GPUs per host, hosts, and the resident
    memory the process held when it was planned (outside the plan's host bytes)."""

    gpu_memory: int | None
    host_memory: int | None
    gpus: int = 1
    hosts: int = 1
    host_source: str = "as given"
    process_bytes: int = 0
    # the device is this host's CPU: its compute, copies and updates take turns on the same cores (a step is their
    # sum), where a GPU's overlap
    shares_cores: bool = False

    @classmethod
    def of(
        cls,
        device: torch.device,
        host_memory_gib: float | None = None,
        gpu_memory: int | None = None,
        host_memory: int | None = None,
        gpus: int = 1,
        hosts: int = 1,
    ) -> "Machine":
        """This machine for a run on `device`, or one with `gpu_memory` / `host_memory` bytes free for the run (a
        plan for another machine); `host_memory_gib` lowers the host's budget (`host_budget`). A GPU's is what it
        has free now, with what this process's allocator holds unused (the CUDA context and other processes'
        memory are not the run's); the host's is asked after the GPU's, so that the CUDA context is already
        outside it."""
        if gpu_memory is None and device.type == "cuda":
            gpu_memory = free_device_bytes(device)
        if host_memory is not None:
            return cls(gpu_memory, host_memory, gpus, hosts, f"{host_memory / 2**30:g} GiB as given")
        budget = host_budget(host_memory_gib)
        return cls(gpu_memory, budget.bytes, gpus, hosts, budget.source, process_bytes())


@dataclass(frozen=True)
class StepShape:
    """One optimizer step as the planner sees it: its rows (sequences) of `seq_len` tokens over all GPUs, in
    micro-batches of `rows_per_micro_batch`, computed in `dtype`."""

    seq_len: int
    rows_per_step: int  # all GPUs' (a DPO pair is two rows)
    rows_per_micro_batch: int
    dtype: torch.dtype  # the compute dtype
    micro_batch_size: int | None = None  # train.micro_batch_size as the user set it (None: rows_per_micro_batch)
    clipping: bool = False  # global-norm clipping: every gradient is held until the norm is known
    router_z_loss: bool = False  # a MoE router's z-loss, whose gradient divides by the whole step's tokens
    frozen_parts: frozenset[str] = frozenset()  # an image-text model's parts trained frozen (train.freeze_*)

    @property
    def micro_tokens(self) -> int:
        return self.rows_per_micro_batch * self.seq_len

    def micro_batches(self, tokens: int) -> int:
        """The micro-batches a step of `tokens` (a GPU's) runs in: the most sweeps it can be cut into."""
        return max(1, -(-tokens // self.micro_tokens))

    @property
    def micro_batch(self) -> int:
        """The micro-batch as the user counts it (DPO: pairs), for refusals naming train.micro_batch_size."""
        return self.micro_batch_size or self.rows_per_micro_batch


@dataclass(frozen=True)
class EngineChoices:
    """The `engine.*` settings the planner reads: auto leaves a choice to its rules, anything else overrides
    it (their meanings: the config's `engine` section)."""

    n_slots: int = 2
    offload_checkpoints: bool | str = "auto"
    kept_layers: int | str = "auto"
    host_kept_layers: int | str = "auto"
    held_layers: int | str = "auto"
    gpu_updated_layers: int | str = "auto"
    copied_layers: int | str = "auto"
    parked_layers: int | str = "auto"
    gradient_pool: float | str = "auto"
    sweeps: int | str = "auto"
    optimizer_state_dir: str | None = None
    disk_state_fraction: float | str = "auto"
    wire_copy: bool = False
    shard_across_hosts: bool = False
    experts_per_stage: int | str = "auto"


@dataclass(frozen=True)
class ObjectiveMemory:
    """What a training objective holds in memory beside the model's state, and what it asks of a step."""

    reference_copy: bool = False  # GRPO's KL: the reference weights, a compute-dtype copy in host memory
    generation_host_bytes: int = 0  # GRPO's streamed generation: the host copies of layers it converts
    # GRPO's generation from resident weights on the CPU: a copy of the model in the device's (host) memory
    generation_device_copy: bool = False
    reference_pass_steps: int = 0  # DPO's reference pass (forward only): steps' rows a pass streams once for
    sweepable: bool = True  # whether a step may run in sweeps (no statistics of all its micro-batches first)
