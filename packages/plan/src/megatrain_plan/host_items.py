"""What a placement takes of host memory (`HostItems.host_items`): every host allocation of a run, counted in one place,
and the parameters the host's budget would hold in each training mode. `CostModel` takes these methods; they read
its model, machine and step."""

import math

from megatrain_optim import STATE_NAMES
from megatrain_sched import Placement
from megatrain_store import int8_nbytes, nf4_nbytes
from megatrain_templates.head import CHUNK_LOGITS

# Host memory a run on a GPU takes after it is planned beside the buffers the plan counts: the CUDA host allocator's
# small pinned blocks (batches, norms, rows), kernels loaded and compiled, cuBLAS's and the optimizer threads'
# workspaces. (Qwen2.5-7B on an H200: peak RSS 1.4 GiB over the store's arenas, the process's own footprint at
# planning included: benchmarks/results' host_gib against peak_rss_gib.)
RUNTIME_HOST_BYTES = 2**30
# ... and a run on the CPU beside its compute's memory: the allocator's slack and the optimizer threads' workspaces.
CPU_RUNTIME_HOST_BYTES = 2**26
# Groups of disk-tier moments resident at once: two read ahead, one being updated, two being written behind.
DISK_TIER_GROUPS_IN_MEMORY = 5
# the host items that grow with the model's parameters (the rest: the step's, `largest_params`)
PER_PARAMETER_ITEMS = (
    "master weights", "optimizer moments", "gradients held", "gradient pool", "frozen base weights", "wire copy",
    "KL reference copy", "disk tier's",
)  # fmt: skip
DTYPE_WORDS = {2: "bf16", 4: "fp32", 8: "fp64"}
# a trained parameter's AdamW moments, fp32 each, wherever they are (host, disk, GPU, parked)
MOMENT_BYTES = 4 * len(STATE_NAMES)


class HostItems:
    """The host-memory half of `CostModel` (a mix-in: it reads the cost model's `spec`, `machine`, `engine`, step
    and sizes)."""

    def host_items(self, placement: Placement) -> dict[str, int]:
        """Every host allocation of `placement`, by name, bytes per host: the one place they are counted (the
        store's arenas, the pipeline's pinned rooms, the optimizer's and generation's buffers, the runtime's)."""
        return {name: int(nbytes) for name, nbytes in self._host_allocations(placement) if nbytes > 0}

    def _host_allocations(self, placement: Placement):
        n_params, trainable = self.stored_params, self.stored_params - self.frozen_params
        share = 1 / self.machine.hosts if self.split else 1  # a host holds its part of what the hosts split
        on_disk = self.disk_bytes(placement)
        held_apart = self.frozen_params if self.adapter else 0  # (LoRA's base: in the compute dtype alone)
        yield "master weights", (n_params - held_apart) * 4 * share
        yield "frozen base weights", (held_apart - self.packed_params) * self.element + sum(self.packed.values())
        # a packed base's layer, unpacked while it loads, before it is packed (`PackedGroups.writing`: one buffer, reused)
        yield "packing buffer", max((self.group_sizes[g] for g in self.packed), default=0) * self.element
        yield "optimizer moments", trainable * MOMENT_BYTES * share - on_disk
        if on_disk:  # the groups read ahead, being updated and being written behind
            largest = sorted(self.group_sizes[placement.first_disk_group :], reverse=True)
            yield "disk tier's page cache", sum(largest[:DISK_TIER_GROUPS_IN_MEMORY]) * MOMENT_BYTES
        if placement.gradient_pool is None:  # a buffer per group, as the store allocates then
            reason = "for clipping" if self.full_grads else f"across {placement.sweeps} sweeps"
            yield f"gradients held {reason}", trainable * 4 * share
        else:
            yield "gradient pool", placement.gradient_pool * max(self.group_sizes) * 4 * share
        yield "wire copy", (n_params - held_apart) * self.element * self.wire_copy
        yield "KL reference copy", (n_params - held_apart) * self.element * self.reference_copy
        yield "generation copies", self.generation_host_bytes
        yield (
            "offloaded checkpoints",
            self.machine.gpus * sum(self.checkpoint_bytes(i, placement.tokens) for i in placement.offloaded),
        )
        yield "host-kept products", self.machine.gpus * len(placement.host_kept) * self.stage_products(placement)
        yield "embedding rows buffer", self._rows_buffer_bytes(placement)
        yield "runtime", self._runtime_host_bytes(placement)

    def largest_params(self, placement: Placement) -> dict[str, float]:
        """The parameters the host's budget would hold in each mode beside the step's other host items as planned:
        full training (fp32 master and moments, gradients held for clipping, a wire copy where on) and LoRA over a
        base held in the compute dtype, or packed in int8 or nf4 (the layers' matrices: the embedding, the head and the
        norms, held in the compute dtype, count as packed here; the adapters' few bytes aside); empty where the budget
        is unknown."""
        if self.machine.host_memory is None:
            return {}
        items = self.host_items(placement)
        fixed = sum(nbytes for name, nbytes in items.items() if not name.startswith(PER_PARAMETER_ITEMS))
        room = max(self.machine.host_memory - fixed, 0)
        full = 4 + MOMENT_BYTES + (4 if self.full_grads else 0) + self.element * self.wire_copy
        square = (self.model.d_model, self.model.d_model)  # (int8's row scales: 4 bytes a row of d_model or so)
        return {
            "full training": room / full,
            f"LoRA over a base in {DTYPE_WORDS[self.element]}": room / self.element,
            "LoRA over an int8 base": room / (int8_nbytes(square) / math.prod(square)),
            "LoRA over an nf4 base": room / (nf4_nbytes((2**20,)) / 2**20),
        }

    def stage_products(self, placement: Placement) -> int:
        """Bytes one keeping stage's matmul products take for `placement`'s tokens."""
        return placement.tokens * self.product_bytes_per_token

    def _rows_buffer_bytes(self, placement: Placement) -> int:
        """The pinned buffer the embedding's updated rows go to the GPU through (`megatrain.parts.rows_first`): a quarter
        of the table, fp32, rounded up to a power of two by the CUDA host allocator."""
        first = self.spec.stages[0]
        streams_rows = (
            first.template.forward_rows is not None
            and len(first.groups) == 1
            and first.groups[0] not in self.frozen
            and self.world == 1
        )
        if not streams_rows or self.wire_copy or 0 in placement.resident or placement.first_disk_group == 0:
            return 0
        nbytes = self.group_sizes[first.groups[0]] // 4 * 4
        return 2 ** math.ceil(math.log2(max(1, nbytes))) if self.machine.gpu_memory is not None else nbytes

    def _runtime_host_bytes(self, placement: Placement) -> int:
        """Host memory a run takes after it is planned beside its buffers: on a GPU, RUNTIME_HOST_BYTES; on the
        CPU, also the compute's own memory (weight slots, checkpoints, a block's work and the head's logits)."""
        if self.machine.gpu_memory is not None:
            return RUNTIME_HOST_BYTES
        # (no CUDA context, kernels or pinned blocks on the CPU: its own allocator's slack instead)
        tokens = placement.tokens
        slots = self.engine.n_slots * max(self.stage_sizes) * self.element
        checkpoints = sum(self.checkpoint_bytes(i, tokens) for i in self.blocks)
        products = len(placement.kept) * self.stage_products(placement)
        logits = 3 * min(self.micro_tokens, CHUNK_LOGITS // self.model.vocab_size) * self.model.vocab_size * 4
        work = 2 * max(self.stage_sizes) * 4 + self.recompute_bytes + logits
        # GRPO's generation from resident weights (auto, on the CPU): a copy of the model on the device, the host
        generation = self.model.n_params * self.element if self.objective.generation_device_copy else 0
        return CPU_RUNTIME_HOST_BYTES + slots + checkpoints + products + work + generation

    def disk_bytes(self, placement: Placement) -> int:
        first = len(self.group_sizes) if placement.first_disk_group is None else placement.first_disk_group
        return sum(self.group_sizes[first:]) * MOMENT_BYTES

    def host_bytes(self, placement: Placement) -> int:
        return sum(self.host_items(placement).values())
