import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from megatrain_store import (
    LOAD_BIAS,
    GroupLayout,
    HostStore,
    StoreError,
    bytes_per_param,
    check_files,
    file_record,
    load_tensors_into,
    write_safetensors,
)


def make_layouts():
    return [
        GroupLayout.from_specs([("a.w", (3, 5), True), ("a.norm", (5,), False), ("a.v", (2, 5), True)]),
        GroupLayout.from_specs([("b.w", (7,), True)]),
    ]


def test_layout_round_trip_and_update_runs():
    layout = make_layouts()[0]
    assert layout.numel == 15 + 5 + 10
    flat = torch.arange(layout.numel, dtype=torch.float32)
    views = layout.views(flat)
    assert torch.equal(torch.cat([v.reshape(-1) for v in views.values()]), flat)
    assert views["a.norm"].data_ptr() == flat[15:].data_ptr()  # views, not copies
    assert layout.update_runs() == [(0, 15, "decay"), (15, 5, "no_decay"), (20, 10, "decay")]
    assert layout.gradient_runs() == [(0, 30)]


def test_load_balanced_biases_are_runs_of_their_own_pair_by_pair():
    layout = GroupLayout.from_specs(
        [
            ("w", (2, 3), True),
            ("b1{hi}", (4,), False, LOAD_BIAS),
            ("b1{lo}", (4,), False, LOAD_BIAS),
            ("b2{hi}", (4,), False, LOAD_BIAS),
            ("b2{lo}", (4,), False, LOAD_BIAS),
            ("norm", (3,), False),
        ]
    )
    assert layout.update_runs() == [(0, 6, "decay"), (6, 8, LOAD_BIAS), (14, 8, LOAD_BIAS), (22, 3, "no_decay")]
    assert layout.gradient_runs() == [(0, 6), (22, 3)]
    with pytest.raises(ValueError, match="no lo half"):
        GroupLayout.from_specs([("b{hi}", (4,), False, LOAD_BIAS), ("n", (4,), False)])
    with pytest.raises(ValueError, match="followed by its lo half"):
        GroupLayout.from_specs(
            [("b{hi}", (4,), False, LOAD_BIAS), ("n", (4,), False), ("b{lo}", (4,), False, LOAD_BIAS)]
        )
    with pytest.raises(ValueError, match="update must be"):
        GroupLayout.from_specs([("x", (1,), True, "sgd")])
    for shape in [(4, -2), (2.5,)]:  # (-2 x -2 made a 4-element tensor of a shape no view takes)
        with pytest.raises(ValueError, match=r"x: shape must be whole numbers >= 0"):
            GroupLayout.from_specs([("x", shape, True)])


def test_duplicate_names_refused():
    with pytest.raises(ValueError, match="duplicate"):
        GroupLayout.from_specs([("x", (1,), True), ("x", (2,), True)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wire_copy", [False, True])
def test_store_buffers_and_accounting(dtype, wire_copy):
    store = HostStore(make_layouts(), compute_dtype=dtype, state_names=("exp_avg", "exp_avg_sq"), wire_copy=wire_copy)
    for group in range(store.n_groups):
        store.master(group).normal_()
        store.refresh_wire(group)
        keeps_copy = wire_copy and dtype != torch.float32
        # without a copy the GPU receives the fp32 master itself and casts it there
        assert store.wire(group).dtype == (dtype if keeps_copy else torch.float32)
        assert torch.equal(store.wire(group).to(dtype), store.master(group).to(dtype))
        assert store.grad(group).dtype == torch.float32
        assert store.state("exp_avg", group).shape == store.master(group).shape
    # buffers of different groups never overlap
    assert store.master(1).data_ptr() >= store.master(0).data_ptr() + 4 * store.layouts[0].numel
    report = store.memory_report()
    assert report.n_params == 30 + 7
    # arenas are padded for alignment, so per-parameter bytes are at least the nominal figure
    assert report.bytes_per_param >= bytes_per_param(dtype, 2, wire_copy=wire_copy)
    assert ("wire" in report.arenas) == keeps_copy
    assert bytes_per_param(dtype, 2, full_grads=False, wire_copy=wire_copy) == (14 if keeps_copy else 12)


def test_unknown_state_name():
    store = HostStore(make_layouts(), state_names=("exp_avg",))
    with pytest.raises(StoreError, match="exp_avg_sq"):
        store.state("exp_avg_sq", 0)


def test_safetensors_round_trip_atomic(tmp_path):
    store = HostStore(make_layouts(), compute_dtype=torch.bfloat16)
    for group in range(store.n_groups):
        store.master(group).normal_()
    named = [(n, t) for g in range(store.n_groups) for n, t in store.master_views(g).items()]
    path = tmp_path / "model.safetensors"
    write_safetensors(path, named, metadata={"format": "pt"})
    loaded = load_file(str(path))
    for name, tensor in named:
        assert torch.equal(loaded[name], tensor)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temp file left

    other = HostStore(make_layouts())
    targets = {n: t for g in range(other.n_groups) for n, t in other.master_views(g).items()}
    load_tensors_into([path], targets)
    for name, tensor in named:
        assert torch.equal(targets[name], tensor)


def test_safetensors_from_a_dict_as_from_pairs(tmp_path):
    """A {name: tensor} dict, as safetensors' `save_file` takes, is written as its (name, tensor) pairs are (it was
    iterated for its names alone and failed to unpack them)."""
    generator = torch.Generator().manual_seed(0)
    named = {"a.w": torch.randn(3, 4, generator=generator), "b": torch.randn(5, generator=generator).bfloat16()}
    write_safetensors(tmp_path / "dict.safetensors", named)
    write_safetensors(tmp_path / "pairs.safetensors", list(named.items()))
    assert (tmp_path / "dict.safetensors").read_bytes() == (tmp_path / "pairs.safetensors").read_bytes()
    loaded = load_file(str(tmp_path / "dict.safetensors"))
    assert loaded.keys() == named.keys() and all(torch.equal(loaded[n], t) for n, t in named.items())


def test_temporary_files_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    """What a write killed midway leaves (`atomic_write`'s temporary, named by its pid) goes; a live writer's stays."""
    import os

    from megatrain_store.io import remove_stale_temporaries

    dead = _a_dead_pid()
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / f".tokens.npy.tmp-{dead}").write_bytes(b"x" * 1000)
    (tmp_path / f".config.json.tmp-{os.getpid()}").write_bytes(b"y" * 10)  # (a write under way: this process's)
    (tmp_path / ".notes.tmp-draft").write_text("a user's file")
    assert remove_stale_temporaries(tmp_path) == 1000
    assert sorted(p.name for p in tmp_path.rglob(".*")) == [f".config.json.tmp-{os.getpid()}", ".notes.tmp-draft"]


def _a_dead_pid() -> int:
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_damaged_files_are_refused_without_writing(tmp_path):
    store = HostStore(make_layouts())
    targets = {n: t for g in range(store.n_groups) for n, t in store.master_views(g).items()}
    good = {n: torch.randn(t.shape) for n, t in targets.items()}

    path = tmp_path / "missing.safetensors"
    write_safetensors(path, [(n, t) for n, t in good.items() if n != "b.w"])
    with pytest.raises(StoreError, match="b.w"):
        load_tensors_into([path], targets)

    path = tmp_path / "shape.safetensors"
    write_safetensors(path, [(n, t if n != "a.v" else torch.zeros(5, 2)) for n, t in good.items()])
    with pytest.raises(StoreError, match="a.v.*shape"):
        load_tensors_into([path], targets)

    path = tmp_path / "truncated.safetensors"
    write_safetensors(path, good.items())
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(StoreError, match="truncated"):
        load_tensors_into([path], targets)
    assert all(float(t.abs().sum()) == 0 for t in targets.values())  # nothing was written


def test_gradient_pool_hands_out_and_recycles_buffers():
    import threading

    store = HostStore(make_layouts(), grad_pool=1)
    first = store.acquire_grad(0)
    assert first.numel() == store.layouts[0].numel and store.grad(0).data_ptr() == first.data_ptr()
    assert store.acquire_grad(0).data_ptr() == first.data_ptr()  # idempotent while held
    got = []
    waiter = threading.Thread(target=lambda: got.append(store.acquire_grad(1)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # the pool is taken: acquire blocks
    store.release_grad(0)
    waiter.join(2)
    assert got and got[0].numel() == store.layouts[1].numel and got[0].data_ptr() == first.data_ptr()
    with pytest.raises(StoreError, match="acquire_grad"):
        store.grad(0)
    report = store.memory_report()
    assert report.arenas["grad"] == 4 * 64  # the largest group (30 elements), aligned to 64
    with pytest.raises(StoreError, match="largest group"):
        HostStore(make_layouts(), grad_pool=0.5)


def test_gradient_pool_holds_several_small_groups_where_a_large_one_fits():
    layouts = [GroupLayout.from_specs([(f"g{i}.w", (n,), True)]) for i, n in enumerate((256, 64, 64, 64, 64))]
    store = HostStore(layouts, grad_pool=1)
    small = [store.acquire_grad(g) for g in (1, 2, 3, 4)]  # four 64-element gradients share the room of one 256
    starts = sorted(t.data_ptr() for t in small)
    assert len(set(starts)) == 4 and starts[-1] - starts[0] == 3 * 64 * 4
    for group, value in zip((1, 2, 3, 4), (1.0, 2.0, 3.0, 4.0)):
        store.grad(group).fill_(value)
    assert [float(store.grad(g)[0]) for g in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 4.0]  # no overlap
    for group in (3, 1, 4, 2):  # out of order: the freed pieces join again
        store.release_grad(group)
    assert store.acquire_grad(0).numel() == 256


def test_gradient_pool_resizes_between_steps():
    layouts = [GroupLayout.from_specs([(f"g{i}.w", (n,), True)]) for i, n in enumerate((256, 64, 64))]
    store = HostStore(layouts, grad_pool=1)
    store.acquire_grad(1)
    with pytest.raises(StoreError, match=r"cannot change while groups \[1\] hold buffers"):
        store.resize_grad_pool(2)
    store.release_grad(1)
    store.resize_grad_pool(2)
    assert store.grad_pool == 2 and store.memory_report().arenas["grad"] == 4 * 512
    both = [store.acquire_grad(0), store.acquire_grad(1), store.acquire_grad(2)]  # room for the large one and more
    assert len({t.data_ptr() for t in both}) == 3
    per_group = HostStore(layouts)
    per_group.resize_grad_pool(3)  # one buffer per group stays so
    assert per_group.grad_pool is None


def test_disk_tier_state_lives_in_files(tmp_path):
    store = HostStore(make_layouts(), state_names=("exp_avg", "exp_avg_sq"), state_dir=tmp_path)
    store.state("exp_avg", 1).fill_(3.0)
    store.prefetch_state(1)
    store.write_behind_state(1)
    store._reader.shutdown(wait=True)
    store._writer.shutdown(wait=True)
    on_disk = store._state_maps["exp_avg"]  # (a file of this store alone, unlinked once mapped)
    assert isinstance(on_disk, np.memmap) and not any(tmp_path.iterdir())
    assert (on_disk[store.starts[1] : store.starts[1] + 7] == 3.0).all()
    assert float(store.state("exp_avg", 1).sum()) == 21.0  # still readable after its pages were dropped
    report = store.memory_report()
    assert report.arenas["state.exp_avg"] == 0 and report.disk["state.exp_avg"] > 0


def test_stores_given_one_state_directory_keep_their_own_state(tmp_path):
    """Two runs with one engine.optimizer_state_dir: each its own files (they once shared, and overwrote, one)."""
    stores = [HostStore(make_layouts(), state_names=("exp_avg",), state_dir=tmp_path) for _ in range(2)]
    for value, store in enumerate(stores):
        store.state("exp_avg", 1).fill_(value + 1.0)
        store.write_behind_state(1)
    for value, store in enumerate(stores):
        store._writer.shutdown(wait=True)
        assert (store.state("exp_avg", 1) == value + 1.0).all()


def test_disk_tier_for_the_last_groups_only(tmp_path):
    layouts = make_layouts() + [GroupLayout.from_specs([("c.w", (100,), True)])]
    store = HostStore(layouts, state_names=("exp_avg",), state_dir=tmp_path, first_disk_group=1)
    for group in range(store.n_groups):
        store.state("exp_avg", group).fill_(group + 1.0)
        store.write_behind_state(group)  # a no-op for group 0, whose state is in RAM
    store._reader.shutdown(wait=True)
    store._writer.shutdown(wait=True)
    on_disk = store._state_maps["exp_avg"]
    assert on_disk.size == store.starts[2] - store.starts[1] + 100 + 28  # groups 1 and 2, group starts aligned
    assert (on_disk[:7] == 2.0).all() and (on_disk[store.starts[2] - store.starts[1] :][:100] == 3.0).all()
    for group in range(store.n_groups):
        assert (store.state("exp_avg", group) == group + 1.0).all()
    report = store.memory_report()
    assert report.arenas["state.exp_avg"] == 4 * store.starts[1]  # only group 0 in RAM
    with pytest.raises(StoreError, match="first_disk_group"):
        HostStore(layouts, state_names=("exp_avg",), state_dir=tmp_path, first_disk_group=4)


def test_shared_arenas_and_gradient_shards(tmp_path):
    """Two stores over the same shared arenas (as two processes of a host map them) see one copy
    of the master and the state; each holds gradients for its own shard only, and the shards
    tile every group."""
    from megatrain_store import SharedArenas

    layouts = [GroupLayout.from_specs([("a", (70, 3), True)]), GroupLayout.from_specs([("b", (5,), False)])]
    stores = [
        HostStore(layouts, state_names=("m",), shared=SharedArenas(tmp_path / "shm"), shard=(index, 2))
        for index in range(2)
    ]
    stores[0].master(0).copy_(torch.arange(210.0))
    stores[1].state("m", 1).fill_(7.0)
    assert torch.equal(stores[1].master(0), torch.arange(210.0))
    assert torch.equal(stores[0].state("m", 1), torch.full((5,), 7.0))
    for group, layout in enumerate(layouts):
        ranges = [store.shard_range(group) for store in stores]
        assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == layout.numel
        assert [store.grad(group).numel() for store in stores] == [end - start for start, end in ranges]
    assert stores[1].shard_range(1) == (5, 5)  # a group smaller than one aligned shard: all in the first
    SharedArenas(tmp_path / "shm").unlink()
    assert not (tmp_path / "shm").exists()
    assert torch.equal(stores[0].master(0), torch.arange(210.0))  # mappings outlive the files


def frozen_first_layouts():
    """An embedding-like group (frozen in the tests below) and the two trainable groups of `make_layouts`."""
    return [GroupLayout.from_specs([("e.table", (11, 6), True), ("e.norm", (6,), False)]), *make_layouts()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("copies", [{}, {"wire_copy": True, "reference_copy": True}])
def test_frozen_groups_in_the_compute_dtype_hold_their_weights_alone(dtype, copies):
    torch.manual_seed(0)
    layouts, names = frozen_first_layouts(), ("exp_avg", "exp_avg_sq")
    store = HostStore(layouts, dtype, names, frozen={0}, frozen_in_compute_dtype=True, **copies)
    plain = HostStore(layouts, dtype, names, frozen={0}, **copies)  # the frozen group as a master
    element = dtype.itemsize
    # the frozen group: its weights once, in the compute dtype; nothing in any other arena
    assert store.arenas["frozen"].dtype == dtype and store.arenas["frozen"].numel() == 128  # 72, aligned
    copied = [arena for arena in ("master", "wire", "reference") if arena in plain.arenas]
    for arena in copied:
        assert store.arenas[arena].numel() == plain.arenas[arena].numel() - 128
    for arena in ("grad", *(f"state.{name}" for name in names)):  # (none of a frozen group, with or without)
        assert store.arenas[arena].numel() == plain.arenas[arena].numel()
    assert store.master_numel(0) == 0 and store.grad(0).numel() == 0 and store.state("exp_avg", 0).numel() == 0
    saved = sum(plain.arenas[arena].element_size() * 128 for arena in copied)
    assert store.memory_report().total_bytes == plain.memory_report().total_bytes - saved + 128 * element
    assert bytes_per_param(dtype, 2, frozen=True) == element
    # whatever reads or writes the group's weights sees that one compute-dtype buffer
    weights = {name: torch.randn(view.shape) for name, view in store.master_views(0).items()}
    with store.writing(0) as views:
        for name, view in views.items():
            view.copy_(weights[name])
    frozen = store.arenas["frozen"][:72]
    for read in (store.master, store.wire, lambda g: store.held("master", g)):
        assert read(0).dtype == dtype and read(0).data_ptr() == frozen.data_ptr()
    for name, view in store.master_views(0).items():
        assert torch.equal(view, weights[name].to(dtype))
    # the trainable groups are as without the flag; refreshing and keeping copies leaves the frozen group be
    for group in (1, 2):
        assert store.master(group).dtype == store.master_dtype and store.grad(group).numel() == layouts[group].numel
        store.master(group).normal_()
    store.refresh_wire()
    for group in (1, 2):
        assert torch.equal(store.wire(group).to(dtype), store.master(group).to(dtype))
    if copies:
        store.keep_reference()
        assert store.reference(0).data_ptr() == frozen.data_ptr()
        assert torch.equal(store.reference(1), store.master(1).to(dtype))
    assert torch.equal(store.master_views(0)["e.table"], weights["e.table"].to(dtype))


def test_frozen_groups_in_the_compute_dtype_round_trip_through_files(tmp_path):
    torch.manual_seed(1)
    stores = [
        HostStore(frozen_first_layouts(), torch.bfloat16, frozen={0}, frozen_in_compute_dtype=True) for _ in range(2)
    ]
    for group in range(3):
        stores[0].master(group).normal_()
    named = [(n, t) for g in range(3) for n, t in stores[0].master_views(g).items()]
    write_safetensors(tmp_path / "model.safetensors", named)
    assert load_file(str(tmp_path / "model.safetensors"))["e.table"].dtype == torch.bfloat16
    targets = {n: t for g in range(3) for n, t in stores[1].master_views(g).items()}
    load_tensors_into([tmp_path / "model.safetensors"], targets)
    for group in range(3):
        assert torch.equal(stores[1].master(group), stores[0].master(group))


def test_frozen_groups_in_the_compute_dtype_are_shared_and_never_split_over_hosts(tmp_path):
    from megatrain_store import SharedArenas

    torch.manual_seed(2)
    stores = [
        HostStore(
            frozen_first_layouts(),
            torch.bfloat16,
            frozen={0},
            frozen_in_compute_dtype=True,
            shared=SharedArenas(tmp_path / "shm"),
            shard=(index, 2),
        )
        for index in range(2)
    ]
    weights = torch.randn(72)
    stores[0].master(0).copy_(weights)
    assert torch.equal(stores[1].wire(0), weights.to(torch.bfloat16))  # one copy for the host's processes
    SharedArenas(tmp_path / "shm").unlink()
    with pytest.raises(StoreError, match=r"frozen groups \[0\].*owned"):
        HostStore(frozen_first_layouts(), frozen={0}, frozen_in_compute_dtype=True, shard=(0, 2), owned=(0, 1))


def test_check_files_names_a_missing_truncated_or_corrupt_file(tmp_path):
    """A file recorded by `file_record` passes `check_files` as written; missing, cut short or with a byte changed,
    it is refused naming the file and what is wrong with it."""
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 64)
    records = {"weights.bin": file_record(path)}
    check_files(tmp_path, records)
    data = bytearray(path.read_bytes())
    data[1000] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="weights.bin fails its CRC32 check: the file is corrupt"):
        check_files(tmp_path, records)
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(StoreError, match="has 16383 bytes, the manifest says 16384: the file is truncated"):
        check_files(tmp_path, records)
    path.unlink()
    with pytest.raises(StoreError, match="checkpoint file .*weights.bin is missing"):
        check_files(tmp_path, records)


def test_shared_arenas_take_their_room_or_refuse_in_one_line(tmp_path, monkeypatch):
    """An arena's pages are allocated as it is made: a directory without room for it refuses then, naming the arena,
    its size and the fix, and removes the run's arenas, where a sparse file would have killed the ranks with SIGBUS
    at their first touch."""
    import errno
    import os

    from megatrain_store import SharedArenas, StoreError

    arenas = SharedArenas(tmp_path / "shm")
    taken = arenas.tensor("master", torch.float32, 1000)
    assert taken.numel() == 1000 and os.stat(tmp_path / "shm" / "master").st_blocks * 512 >= 4000  # (not sparse)

    def no_room(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_room)
    with pytest.raises(StoreError, match=r"arena 'exp_avg' needs 4.0 MiB in .*engine.shared_dir"):
        arenas.tensor("exp_avg", torch.float32, 2**20)
    assert not (tmp_path / "shm").exists()  # (the run stops: it leaves nothing there)


def test_a_pinned_span_widens_without_overlapping_registrations_and_unpins_when_it_goes(monkeypatch):
    """`PinnedSpan.cover`: a span inside the pinned one pins nothing more; a wider one unpins the old registration
    of each tensor before pinning the union (CUDA refuses overlapping ones); what is pinned is unpinned when the span
    goes. (cudaHostRegister stood in for: this machine has no GPU.)"""
    import gc

    from megatrain_store import pinning

    pinned: set[int] = set()
    calls: list[tuple[str, int, int]] = []

    def pin(tensor):
        assert not any(tensor.data_ptr() <= p < tensor.data_ptr() + tensor.nbytes for p in pinned)
        calls.append(("pin", tensor.data_ptr(), tensor.nbytes))
        pinned.add(tensor.data_ptr())
        return True

    def unpin(ptr):
        calls.append(("unpin", ptr, 0))
        pinned.remove(ptr)

    monkeypatch.setattr(pinning, "pin_in_place", pin)
    monkeypatch.setattr(pinning, "unpin", unpin)
    arenas = [torch.zeros(1000), torch.zeros(1000)]
    span = pinning.PinnedSpan(arenas)
    span.cover(100, 200)
    span.cover(120, 180)  # inside: nothing
    assert [c[0] for c in calls] == ["pin", "pin"] and span.span == (100, 200)
    span.cover(50, 150)  # the union, 50..200, after the old registrations go
    assert [c[0] for c in calls[2:]] == ["unpin", "unpin", "pin", "pin"] and span.span == (50, 200)
    assert pinned == {a[50:].data_ptr() for a in arenas} and calls[-1][2] == 150 * 4
    del span
    gc.collect()
    assert pinned == set()
