"""The planner's rules where the host's memory decides: whether a placement fits the host's budget, the gradient
pool's depth, the groups whose moments go to the disk tier and the layers keeping their products in pinned host
memory. `Planner` takes them (`HostRules` reads the cost model and the planner's `placement_of` and `_kept`)."""

from dataclasses import replace

from megatrain_sched import Placement

from .costs import (
    DISK_TIER_RAM_SHARE,
    GRADIENT_POOL,
    HOST_KEPT_OPTIMIZER_SHARE,
    HOST_KEPT_PCIE_SHARE,
    HOST_KEPT_RAM_SHARE,
    POOL_HOST_SHARE,
    gradient_pool_size,
)
from .counts import Counts


class HostRules:
    """The host-memory half of `Planner`'s rules (a mix-in)."""

    def _host_holds(self, placement: Placement) -> bool:
        """Whether the host's budget holds `placement` (a budget left unset holds any)."""
        return self.machine.host_memory is None or self.host_bytes(placement) <= self.machine.host_memory

    def _least_pool(self, counts: Counts) -> float | None:
        """The smallest gradient pool `counts` can have (None: every gradient held, for clipping or sweeps)."""
        return None if self.full_grads or counts.sweeps > 1 else float(GRADIENT_POOL)

    def _gradient_pool(self, counts: Counts, why: dict) -> float | None:
        """Gradient landing buffers, in largest groups: none with clipping (every gradient is held); as set; else
        deep enough for what the optimizer has left when the backward ends, where the host has the room."""
        if self._least_pool(counts) is None:  # (a step in sweeps holds every gradient until the last)
            return None
        setting = self.engine.gradient_pool
        if setting != "auto":
            return float(setting)
        placement = self.placement_of(counts)
        pool = gradient_pool_size(
            self.optimizer_s(placement), self.host_backward_s(placement), self.group_sizes, self.rates
        )
        host = self.machine.host_memory
        deeper = self.host_bytes(replace(placement, gradient_pool=pool))
        if pool > GRADIENT_POOL and host is not None and deeper > POOL_HOST_SHARE * host:
            return float(GRADIENT_POOL)  # the deeper pool is a speed-up, not worth the host memory it lacks
        if pool > GRADIENT_POOL:
            why["gradient_pool"] = f"a gradient pool of {pool:g} largest groups holds what the CPU optimizer has left"
        return pool

    def _first_disk_group(self, placement: Placement, why: dict) -> int:
        """The first group whose moments go to the disk tier (the last groups go): none without
        engine.optimizer_state_dir; with disk_state_fraction auto, as few as bring the plan, its page cache
        included, within DISK_TIER_RAM_SHARE of the host's budget; else that fraction of the parameters."""
        n_groups, fraction = len(self.group_sizes), self.engine.disk_state_fraction
        if not self.engine.optimizer_state_dir:
            return n_groups
        host, first = self.machine.host_memory, n_groups
        if fraction != "auto":
            to_move = fraction * self.model.n_params
            while first > 0 and to_move > 0:
                first -= 1
                to_move -= self.group_sizes[first]
        else:
            while first > 0 and (
                host is None or self.host_bytes(replace(placement, first_disk_group=first)) > DISK_TIER_RAM_SHARE * host
            ):
                first -= 1
        if first < n_groups:
            reason = "the host cannot hold them" if fraction == "auto" else f"engine.disk_state_fraction {fraction}"
            why["disk"] = f"the moments of groups {first}-{n_groups - 1} live on disk: {reason}"
        return first

    def _host_kept(self, counts: Counts, small: bool, step: dict, why: dict) -> int:
        """Layers (before those kept on the GPU) keeping their products in pinned host memory: as set; in a large
        step, where the optimizer leaves the host's memory bandwidth to spare and nothing is on disk, as many as
        the host's room allows and the forward's idle copy-out carries while the layers between two of them
        compute."""
        candidates = max(0, self.keepable - self._kept(counts))
        setting = self.engine.host_kept_layers
        if setting != "auto":
            return min(setting, candidates)
        placement = self.placement_of(replace(counts, kept=self._kept(counts)), **step)
        machine, stage_products = self.machine, counts.tokens * self.product_bytes_per_token
        layers_s = self.layers_s(placement)
        if (
            machine.gpu_memory is None
            or machine.host_memory is None
            or small
            or self.disk_bytes(placement)
            or not stage_products
            or self.engine.kept_layers == 0  # products kept nowhere, as asked
            or self.optimizer_s(placement) > HOST_KEPT_OPTIMIZER_SHARE * self.step_layers_s(placement)
        ):
            return 0
        host_room = HOST_KEPT_RAM_SHARE * machine.host_memory - self.host_bytes(placement)
        # one layer's forward, less its checkpoint's copy out, against one stage's copy out: how far apart they go
        link = HOST_KEPT_PCIE_SHARE * self.rates.pcie_gbps * 1e9
        layer_forward_s = self.forward_share(placement) * layers_s / self.model.n_layers
        layer_forward_s -= self.checkpoint_bytes(1, counts.tokens) / link * counts.offloaded / len(self.blocks)
        spacing = stage_products / link / max(layer_forward_s, 1e-9)
        host_kept = min(
            candidates, int(host_room // (machine.gpus * stage_products)), int(candidates / max(1.0, spacing))
        )
        if host_kept > 0:
            why["host_kept"] = (
                f"{host_kept} more layers keep their products in pinned host memory: the host has the room"
            )
        return max(0, host_kept)
