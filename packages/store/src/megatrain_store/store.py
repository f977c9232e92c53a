"""The host store: every persistent byte of training state, as a few large arenas.

Each arena holds all groups back to back (a group = one transfer unit, e.g. a decoder
layer); a group's buffers are slices of the arenas. The GPU side reads `wire` and
writes `grad`; the CPU optimizer reads `grad` and updates `master` and `state`.
"""

import math
import mmap
import os
import tempfile
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .errors import StoreError
from .extents import Extents
from .layout import GroupLayout
from .packed import PackedGroups, PackedLayout
from .pinning import cuda_available, pin_in_place, unpin
from .shared import SharedArenas

# Group starts are aligned to 64 elements (256 B in fp32) for vectorized CPU loops and DMA.
ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held by each arena; `bytes_per_param` is total over parameter count."""

    n_params: int
    arenas: dict[str, int]
    pinned: dict[str, bool]
    pin_seconds: float = 0.0  # time spent page-locking the pinned arenas
    disk: dict[str, int] | None = None  # arenas in memory-mapped files (the disk tier), not counted in RAM

    @property
    def total_bytes(self) -> int:
        """Bytes of all arenas (in RAM; the disk tier apart)."""
        return sum(self.arenas.values())

    @property
    def bytes_per_param(self) -> float:
        """`total_bytes` per model parameter."""
        return self.total_bytes / max(1, self.n_params)

    def as_dict(self) -> dict:
        """The report as JSON-ready values, with the totals and the pinning rate (GB/s; None if nothing was pinned)."""
        return {
            "n_params": self.n_params,
            "total_bytes": self.total_bytes,
            "bytes_per_param": round(self.bytes_per_param, 3),
            "arenas": self.arenas,
            "pinned": self.pinned,
            "pin_seconds": round(self.pin_seconds, 3),
            "pin_gb_per_s": round(self.pinned_bytes / 1e9 / self.pin_seconds, 1) if self.pin_seconds else None,
            "disk": self.disk or {},
        }

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the page-locked arenas."""
        return sum(size for name, size in self.arenas.items() if self.pinned.get(name))


def _owned_shards(shard: tuple[int, int], owned: tuple[int, int] | None) -> tuple[int, int]:
    """The (first, number) of shards this process owns (None: all), checked with its own (index, count) shard."""
    if not 0 <= shard[0] < shard[1]:
        raise StoreError(f"shard must be (index, count) with 0 <= index < count, got {shard}")
    owned = (0, shard[1]) if owned is None else owned
    if not (0 <= owned[0] and owned[1] >= 1 and sum(owned) <= shard[1]):
        raise StoreError(f"owned must be (first shard, number of shards) within the {shard[1]} shards, got {owned}")
    if not owned[0] <= shard[0] < sum(owned):
        raise StoreError(f"this process's shard {shard[0]} must be among the owned shards {owned}")
    return owned


def private_file_array(directory: Path, prefix: str, dtype: np.dtype, numel: int) -> np.memmap:
    """A zero-filled array of `numel` elements memory-mapped from a new file in `directory` that no other process
    sees: it is unlinked once mapped, so two runs given one directory never share (and corrupt) a file, and its
    disk space returns when the process ends, however it ends."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, numel * np.dtype(dtype).itemsize)
        return np.memmap(path, dtype=dtype, mode="r+", shape=(numel,))
    finally:
        os.close(fd)
        os.unlink(path)


class HostStore:
    """Flat per-group host buffers: fp32 master, fp32 grads, named state, optionally a wire copy and a reference.

    What the GPU copies in is `wire(group)`: the fp32 master itself unless `wire_copy` keeps a second,
    compute-dtype copy (bf16: 2 B/param more host memory for half the host->GPU bytes, worth it only when a step
    has too few tokens to hide the copies); the scheduler casts an fp32 master to the compute dtype on the GPU.
    `grad_pool=None` gives every group its own gradient landing buffer (needed when all gradients are held until
    the global norm is known); N >= 1 gives a pool of N times the largest group's gradient from which
    `acquire_grad` hands each group a buffer of its size (first fit) and `release_grad` takes it back.
    `state_dir` puts the optimizer state of groups `first_disk_group` .. n-1 in memory-mapped files there (the
    disk tier; `prefetch_state` reads a group's ahead, `write_behind_state` flushes it on a background thread).
    float64 compute (everything in fp64) exists for exactness tests. `pin=None` pins the arenas the GPU copies
    from/to when CUDA is available.

    Several processes (one per GPU) share one host's state: with `shared`, the arenas are mapped from files every
    process of the host opens, and `shard=(index, count)` makes this process hold gradients only for its 1/count
    slice of each group (`shard_range`), the part it updates. Several hosts may split the state: `owned=(first,
    n)` keeps master weights and optimizer state only for shards first .. first+n-1 of each group (`owned_range`);
    `master(group)` and `state(name, group)` are then that range, a full compute-dtype wire copy of every group
    is kept for streaming, and whole groups are written through `writing(group)`.

    `frozen` groups (a frozen vision tower's) keep their weights only: no gradient buffer and no optimizer state;
    `frozen_in_compute_dtype` holds those weights once, in the compute dtype (a LoRA run's base: 2 B/param in bf16),
    in an arena of their own, "frozen": `master`, `wire`, `reference` and `writing` of such a group are that
    buffer (whole groups on every host: no `owned`). The `packed` groups among them (a QLoRA base's layers) are held
    in `packed_format` ("nf4" or "int8", `packed.PackedLayout`) in the "packed" arena: their `master`, `wire` and
    `reference` are those bytes (the device unpacks them, `packing(group)`), `weights(group)` unpacks them on the host,
    and `writing` packs what was written (on `pack_on`, a GPU, where given). `reference_copy` keeps one more
    compute-dtype copy of every group, written by `keep_reference` (e.g. GRPO's KL reference), which forward-only
    passes stream from.
    """

    def __init__(
        self,
        layouts: list[GroupLayout],
        compute_dtype: torch.dtype = torch.float32,
        state_names: tuple[str, ...] = (),
        pin: bool | None = None,
        grad_pool: float | None = None,
        state_dir: Path | None = None,
        first_disk_group: int = 0,
        wire_copy: bool = False,
        shared: SharedArenas | None = None,
        shard: tuple[int, int] = (0, 1),
        owned: tuple[int, int] | None = None,
        reference_copy: bool = False,
        frozen: frozenset[int] = frozenset(),
        frozen_in_compute_dtype: bool = False,
        packed: frozenset[int] = frozenset(),
        packed_format: str | None = None,
        pack_on: torch.device | None = None,
    ):
        if compute_dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise StoreError(f"compute dtype {compute_dtype} is not supported; use float32 or bfloat16")
        self.master_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        self.layouts = list(layouts)
        self.compute_dtype = compute_dtype
        self.state_names = tuple(state_names)
        self.n_params = sum(layout.numel for layout in self.layouts)
        self.shared = shared
        self.shard, self.owned = shard, _owned_shards(shard, owned)
        self.owns_all = self.owned == (0, shard[1])
        self.frozen = frozenset(frozen)
        # the frozen groups whose weights are held in the compute dtype alone, in the "frozen" arena
        self.frozen_in_compute_dtype = self.frozen if frozen_in_compute_dtype else frozenset()
        self._check_held_apart(packed, packed_format)
        packings = {g: PackedLayout.of(self.layouts[g], packed_format, compute_dtype) for g in sorted(packed)}
        self.frozen_starts, frozen_total = self._starts(
            lambda group: self.layouts[group].numel if group in self.frozen_in_compute_dtype - set(packed) else 0
        )
        # the whole-group copies (wire, reference): every group back to back, those in the frozen arena left out
        self.starts, self._arena_numel = self._starts(
            lambda group: 0 if group in self.frozen_in_compute_dtype else self.layouts[group].numel
        )
        # master weights: the owned range of each group, back to back; optimizer state likewise, frozen groups left out
        self.owned_starts, owned_total = self._starts(self.master_numel)
        self.state_starts, state_total = self._starts(self.state_numel)
        # gradients: this shard's slice of each group, back to back (none of a frozen group)
        self.grad_starts, grad_total = self._starts(self.grad_numel)

        self.arenas: dict[str, Tensor] = {"master": self._allocate(self.master_dtype, owned_total, name="master")}
        if self.frozen_in_compute_dtype:
            self.arenas["frozen"] = self._allocate(compute_dtype, frozen_total, name="frozen")
        if packings:
            self.arenas["packed"] = self._allocate(torch.uint8, PackedGroups.total(packings), name="packed")
        self.packed = PackedGroups(packings, self.arenas.get("packed"), pack_on)
        if (wire_copy and compute_dtype != self.master_dtype) or not self.owns_all:
            self.arenas["wire"] = self._allocate(compute_dtype, name="wire")
        if reference_copy:
            self.arenas["reference"] = self._allocate(compute_dtype, name="reference")
        self._allocate_grads(grad_pool, grad_total)
        self._allocate_state(state_dir, first_disk_group, state_total)
        self._pin_transfer_arenas(cuda_available() if pin is None else pin)

    def _check_held_apart(self, packed: frozenset[int], packed_format: str | None) -> None:
        """The frozen groups held in the compute dtype (and the packed among them) are whole on every host, and
        packed groups are such groups with a format."""
        if self.frozen_in_compute_dtype and not self.owns_all:
            raise StoreError(
                f"frozen groups {sorted(self.frozen_in_compute_dtype)} are held in the compute dtype and cannot be "
                f"split over hosts (owned={self.owned}); keep every host's copy whole (owned=None)"
            )
        if not set(packed) <= self.frozen_in_compute_dtype or (packed and packed_format is None):
            raise StoreError(
                f"packed groups {sorted(packed)} must be frozen groups held apart (frozen_in_compute_dtype) and name "
                f"their packed_format; frozen apart: {sorted(self.frozen_in_compute_dtype)}"
            )

    def _allocate_grads(self, grad_pool: float | None, grad_total: int) -> None:
        """The gradient arena: one buffer per group (`grad_pool` None), or a pool of `grad_pool` x the largest."""
        self.grad_pool = grad_pool
        if grad_pool is None:
            self.arenas["grad"] = self._allocate(self.master_dtype, grad_total)
            return
        if not grad_pool >= 1:
            raise StoreError(
                f"grad_pool must be >= 1 (times the largest group's gradient), or None for one buffer per "
                f"group; got {grad_pool}"
            )
        self.arenas["grad"] = self._allocate(self.master_dtype, self._pool_numel(grad_pool))
        self._grad_extents = Extents(self.arenas["grad"].numel())  # each group's landing buffer in the pool

    def _allocate_state(self, state_dir: Path | None, first_disk_group: int, state_total: int) -> None:
        """The optimizer-state arenas in RAM, and the files of the groups from `first_disk_group` on."""
        self.state_dir = Path(state_dir) if state_dir is not None else None
        if not 0 <= first_disk_group <= self.n_groups:
            raise StoreError(f"first_disk_group must be in 0..{self.n_groups}, got {first_disk_group}")
        # groups from here on keep their optimizer state in files (all of it in RAM without a state_dir)
        self.first_disk_group = first_disk_group if state_dir is not None else self.n_groups
        ram_numel = self.state_starts[self.first_disk_group] if self.first_disk_group < self.n_groups else state_total
        self._state_maps: dict[str, np.memmap] = {}
        on_disk = self.first_disk_group < self.n_groups
        # one thread reads ahead, one writes behind: the disk serves both directions at once
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-read") if on_disk else None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatrain-write") if on_disk else None
        for name in self.state_names:
            self.arenas[f"state.{name}"] = self._allocate(self.master_dtype, ram_numel, name=f"state.{name}")
            if on_disk:
                self._map(name, state_total - ram_numel)

    def _pin_transfer_arenas(self, should_pin: bool) -> None:
        """Page-locks the arenas that cross PCIe (the wire copy or master, the frozen weights, packed or not,
        gradients, the reference copy)."""
        wire_arena = "wire" if "wire" in self.arenas else "master"
        self.pinned = {name: False for name in self.arenas}
        start = time.perf_counter()
        self._should_pin = should_pin
        # page-locked arenas' addresses, unpinned when the store goes (or an arena is replaced)
        self._pinned_ptrs: list[int] = []
        weakref.finalize(self, lambda ptrs: [unpin(p) for p in ptrs], self._pinned_ptrs)
        if should_pin:
            for name in (wire_arena, "grad", *(n for n in ("frozen", "packed", "reference") if n in self.arenas)):
                self._pin(name)
        self.pin_seconds = time.perf_counter() - start

    def _starts(self, numel) -> tuple[list[int], int]:
        """(each group's aligned start in an arena holding `numel(group)` elements of each, back to back; its size)."""
        starts, total = [], 0
        for group in range(self.n_groups):
            starts.append(total)
            total += _align(numel(group))
        return starts, total

    def master_numel(self, group: int) -> int:
        """Elements of `group`'s master weights this store holds (its owned range; none where the frozen arena
        holds the group)."""
        return 0 if group in self.frozen_in_compute_dtype else self.owned_numel(group)

    def grad_numel(self, group: int) -> int:
        """Elements of `group`'s gradient this process lands (its shard; none where frozen)."""
        return 0 if group in self.frozen else self.shard_numel(group)

    def state_numel(self, group: int) -> int:
        """Elements of `group`'s optimizer state this store holds (its owned range; none where frozen)."""
        return 0 if group in self.frozen else self.owned_numel(group)

    def _pin(self, arena: str) -> None:
        self.pinned[arena] = pin_in_place(self.arenas[arena])
        if self.pinned[arena]:
            self._pinned_ptrs.append(self.arenas[arena].data_ptr())

    def _pool_numel(self, grad_pool: float) -> int:
        largest = _align(max(self.grad_numel(group) for group in range(self.n_groups)))
        return _align(math.ceil(grad_pool * largest))

    def resize_grad_pool(self, grad_pool: float) -> None:
        """Make the gradient pool `grad_pool` times the largest group (between steps: no gradient may be held;
        a store with a buffer per group keeps it)."""
        if self.grad_pool is None or grad_pool == self.grad_pool:
            return
        if not grad_pool >= 1:
            raise StoreError(f"grad_pool must be >= 1 (times the largest group's gradient), got {grad_pool}")
        self._grad_extents.reset(0)  # (refused while a group holds a buffer)
        old = self.arenas.pop("grad")
        if self.pinned.get("grad"):
            self._pinned_ptrs.remove(old.data_ptr())
            unpin(old.data_ptr())
        del old  # freed before the new one is taken
        self.arenas["grad"] = self._allocate(self.master_dtype, self._pool_numel(grad_pool))
        self.pinned["grad"] = False
        if self._should_pin:
            self._pin("grad")
        self.grad_pool = grad_pool
        self._grad_extents.reset(self.arenas["grad"].numel())

    def _map(self, name: str, numel: int) -> None:
        """A zero-filled file-backed array of `numel` elements for optimizer state `name` in `state_dir`."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / f"state.{name}.bin"
        dtype = np.float64 if self.master_dtype == torch.float64 else np.float32
        try:
            if self.shared is not None:  # one file for the host's processes, removed with the shared arenas
                array = self.shared.file_array(self.state_dir, f"state.{name}.bin", dtype, numel)
            else:
                array = private_file_array(self.state_dir, f"state.{name}.", dtype, numel)
        except OSError as error:
            need = numel * np.dtype(dtype).itemsize
            raise StoreError(
                f"cannot create {need / 2**30:.1f} GiB state file {path}: {error}; free disk space or "
                "choose another engine.optimizer_state_dir"
            ) from error
        self._state_maps[name] = array

    def _disk_offset(self, group: int) -> int:
        """Where `group`'s optimizer state starts in the state files, in elements."""
        return self.state_starts[group] - self.state_starts[self.first_disk_group]

    def _state_range(self, name: str, group: int) -> tuple[mmap.mmap, int, int]:
        """The page-aligned byte range of `group` in state file `name`."""
        array = self._state_maps[name]
        start = self._disk_offset(group) * array.itemsize
        end = start + self.state_numel(group) * array.itemsize
        page = mmap.PAGESIZE
        return array._mmap, start // page * page, end - start // page * page

    def prefetch_state(self, group: int) -> None:
        """Start reading `group`'s optimizer state from disk on a background thread (returns at once).

        The thread faults every page in itself: MADV_WILLNEED alone is only a hint, and a
        large group then still faults page by page inside the optimizer's update."""
        if group < self.first_disk_group:
            return

        def read():
            for name, array in self._state_maps.items():
                handle, offset, length = self._state_range(name, group)
                handle.madvise(mmap.MADV_WILLNEED, offset, length)
                per_page = mmap.PAGESIZE // array.itemsize
                first = offset // array.itemsize
                np.add.reduce(array[first : first + length // array.itemsize : per_page])  # one read per page

        self._reader.submit(read)

    def write_behind_state(self, group: int) -> None:
        """Flush `group`'s updated optimizer state to disk on a background thread and let the
        kernel drop its pages, so the disk tier's resident memory stays a few layers."""
        if group < self.first_disk_group:
            return

        def flush():
            for name in self._state_maps:
                handle, offset, length = self._state_range(name, group)
                handle.flush(offset, length)
                handle.madvise(mmap.MADV_DONTNEED, offset, length)

        self._writer.submit(flush)

    def _allocate(self, dtype: torch.dtype, numel: int | None = None, name: str | None = None) -> Tensor:
        """A zeroed arena; `name`d ones are shared between the host's processes when the store is."""
        numel = self._arena_numel if numel is None else numel
        if name is not None and self.shared is not None:
            return self.shared.tensor(name, dtype, numel)
        try:
            # zeros, not empty: touching every page now makes pinning fast and failures early.
            return torch.zeros(numel, dtype=dtype)
        except RuntimeError as error:
            need = numel * torch.empty(0, dtype=dtype).element_size()
            raise StoreError(
                f"could not allocate {need / 2**30:.1f} GiB of host memory for a {dtype} arena: {error}. "
                "Use a smaller model, enable the disk tier, or run `megatrain plan` to see what fits."
            ) from error

    @property
    def n_groups(self) -> int:
        return len(self.layouts)

    def shard_size(self, group: int) -> int:
        """Elements per shard of `group` (the last shards may hold fewer, or none): a multiple of
        64 so shards stay aligned, times the shard count at least the group's size."""
        count = self.shard[1]
        return _align(-(-self.layouts[group].numel // count))

    def shard_range(self, group: int, index: int | None = None) -> tuple[int, int]:
        """[start, end) of this process's shard (or shard `index`) within `group`'s flat buffers."""
        numel, size = self.layouts[group].numel, self.shard_size(group)
        start = min((self.shard[0] if index is None else index) * size, numel)
        return start, min(start + size, numel)

    def shard_numel(self, group: int) -> int:
        start, end = self.shard_range(group)
        return end - start

    def owned_range(self, group: int) -> tuple[int, int]:
        """[start, end) of `group` whose master weights and optimizer state this store holds."""
        numel, size = self.layouts[group].numel, self.shard_size(group)
        first, count = self.owned
        start = min(first * size, numel)
        return start, min((first + count) * size, numel)

    def owned_numel(self, group: int) -> int:
        start, end = self.owned_range(group)
        return end - start

    def _slice(self, arena: str, group: int) -> Tensor:
        if group in self.packed.layouts and arena in ("master", "wire", "reference"):
            return self.packed.bytes(group)  # (held once)
        if group in self.frozen_in_compute_dtype and arena in ("master", "wire", "reference"):
            start = self.frozen_starts[group]  # (its weights, held once)
            return self.arenas["frozen"][start : start + self.layouts[group].numel]
        if arena == "grad":
            start = self.grad_starts[group]
            return self.arenas[arena][start : start + self.grad_numel(group)]
        if arena in ("wire", "reference"):  # (whole groups, whatever this host owns)
            start = self.starts[group]
            return self.arenas[arena][start : start + self.layouts[group].numel]
        if arena.startswith("state."):
            start = self.state_starts[group]
            return self.arenas[arena][start : start + self.state_numel(group)]
        start = self.owned_starts[group]
        return self.arenas[arena][start : start + self.master_numel(group)]

    def master(self, group: int) -> Tensor:
        """fp32 master weights of `group`, flat: [owned_range) of it (all of it unless hosts split the state); a
        group in the frozen arena: its compute-dtype weights."""
        return self._slice("master", group)

    def wire(self, group: int) -> Tensor:
        """What is copied to the device for `group`, flat: the compute-dtype copy if kept, else the master (a group
        in the frozen arena: its compute-dtype weights)."""
        return self._slice("wire" if "wire" in self.arenas else "master", group)

    def packing(self, group: int) -> PackedLayout | None:
        """How a packed group's bytes (`wire(group)`) unpack into its weights; None for any other group."""
        return self.packed.layouts.get(group)

    def weights(self, group: int) -> Tensor:
        """`group`'s weights as the device computes with them, flat: `wire(group)`, or a packed group's bytes
        unpacked into a new compute-dtype tensor (its dequantized weights)."""
        if group in self.packed.layouts:
            return self.packed.unpack(group)
        return self.wire(group)

    def reference(self, group: int) -> Tensor:
        """The reference copy of `group`, flat, in the compute dtype (what `keep_reference` last took; a group in
        the frozen arena: its weights, which never change)."""
        if "reference" not in self.arenas:
            raise StoreError("this store keeps no reference copy; create it with reference_copy=True")
        return self._slice("reference", group)

    def keep_reference(self) -> None:
        """Take the current weights of every group as the reference (one process of a host that shares it)."""
        for group in range(self.n_groups):
            if group in self.frozen_in_compute_dtype:
                continue  # (its reference is its weights)
            self.reference(group).copy_(self.wire(group))  # (whole: the master where no wire copy is kept)

    def grad(self, group: int) -> Tensor:
        """fp32 gradient landing buffer of this shard of `group`, flat (with a pool: the one it holds)."""
        if self.grad_pool is None:
            return self._slice("grad", group)
        start = self._grad_extents.start(group)
        if start is None:
            raise StoreError(f"group {group} holds no gradient buffer; call acquire_grad({group}) first")
        return self.arenas["grad"][start : start + self.shard_numel(group)]

    def acquire_grad(self, group: int) -> Tensor:
        """The landing buffer for `group`'s gradient; with a pool, blocks until enough of it is free."""
        if self.grad_pool is None:
            return self._slice("grad", group)
        start = self._grad_extents.take(group, _align(self.shard_numel(group)))
        return self.arenas["grad"][start : start + self.shard_numel(group)]

    def release_grad(self, group: int) -> None:
        """Return `group`'s landing buffer to the pool once its gradient has been consumed."""
        if self.grad_pool is not None:
            self._grad_extents.give(group)

    def state(self, name: str, group: int) -> Tensor:
        """Named fp32 optimizer state of `group`, flat (same range as the master)."""
        if name not in self.state_names:
            raise StoreError(f"no optimizer state named {name!r}; this store holds {list(self.state_names)}")
        if group >= self.first_disk_group:
            start = self._disk_offset(group)
            return torch.from_numpy(self._state_maps[name][start : start + self.state_numel(group)])
        return self._slice(f"state.{name}", group)

    def master_views(self, group: int) -> dict[str, Tensor]:
        """The named parameters of `group` as views of its master (this store must hold all of it)."""
        if not self.owns_all:
            raise StoreError(
                f"this store holds only [{self.owned_range(group)}) of group {group}'s master weights (hosts split the "
                "state); write whole groups through writing(group)"
            )
        if group in self.packed.layouts:
            raise StoreError(f"group {group} is held packed: read it through weights(group), write it through writing")
        return self.layouts[group].views(self.master(group))

    def held(self, arena: str, group: int) -> Tensor:
        """What this store holds of `group` in `arena`: "master" or "state.NAME" (its owned range)."""
        return self.master(group) if arena == "master" else self.state(arena.removeprefix("state."), group)

    @contextmanager
    def writing(self, group: int, arena: str = "master"):
        """Named views of a whole group to fill (the master, or optimizer state `state.NAME`); on exit
        the store keeps its owned range and, for the master, refreshes the wire copy of the group.
        They are the store's own buffers when it holds the whole group, else a temporary buffer (a packed group's:
        its weights as they are, packed again on exit)."""
        if group in self.packed.layouts and arena == "master":
            with self.packed.writing(group, self.layouts[group]) as views:
                yield views
            return
        own = self.held(arena, group)
        whole = own if self.owns_all else torch.zeros(self.layouts[group].numel, dtype=self.master_dtype)
        yield self.layouts[group].views(whole)
        if not self.owns_all:
            start, end = self.owned_range(group)
            own.copy_(whole[start:end])
            if arena == "master":
                self.wire(group).copy_(whole)
        elif arena == "master":
            self.refresh_wire(group)

    def refresh_wire(self, group: int | None = None, span: tuple[int, int] | None = None) -> None:
        """Rewrite the wire copy of `group` (None: of every group; `span`: only [start, end) of it, within
        the owned range) from its master, after the master was written outside the optimizer; a no-op
        without a wire copy, and for the groups in the frozen arena (their weights are what is copied)."""
        if "wire" not in self.arenas:
            return
        for g in range(self.n_groups) if group is None else (group,):
            if g in self.frozen_in_compute_dtype:
                continue
            offset, owned_end = self.owned_range(g)
            start, end = span or (offset, owned_end)
            self.wire(g)[start:end].copy_(self.master(g)[start - offset : end - offset])

    def memory_report(self) -> MemoryReport:
        """Bytes each host arena takes now, which are pinned, the time pinning took, and state in memory-mapped files."""
        sizes = {name: t.numel() * t.element_size() for name, t in self.arenas.items()}
        on_disk = {f"state.{name}": array.nbytes for name, array in self._state_maps.items()}
        return MemoryReport(self.n_params, sizes, dict(self.pinned), self.pin_seconds, on_disk)


def bytes_per_param(
    compute_dtype: torch.dtype,
    n_state: int,
    full_grads: bool = True,
    wire_copy: bool = False,
    reference_copy: bool = False,
    frozen: bool = False,
) -> int:
    """Host bytes per parameter of a HostStore: master + grad + state (fp32 each) + the wire copy and the
    reference copy if kept; a gradient pool (`full_grads=False`) adds a few layers' worth, not a byte per parameter.
    `frozen`: a parameter of a frozen group held in the compute dtype (`frozen_in_compute_dtype`), its one copy."""
    element = torch.finfo(compute_dtype).bits // 8
    if frozen:
        return element
    wire = element if wire_copy and compute_dtype != torch.float32 else 0
    return 4 + wire + (element if reference_copy else 0) + (4 if full_grads else 0) + 4 * n_state
