import contextlib
import math
from dataclasses import replace

import pytest
import torch

import megatrain_optim.adamw as adamw_module
from megatrain_optim import (
    STATE_NAMES,
    AdamWConfig,
    BackgroundStepper,
    DeviceAdamW,
    DeviceClip,
    HostAdamW,
    HostUpdates,
    OptimError,
    Schedule,
    UpdatesAfterClipping,
    UpdatesAsGradientsLand,
    clip_coefficient,
    lr_at,
)
from megatrain_store import LOAD_BIAS, GroupLayout, HostStore

SPECS = [
    [("l0.w", (6, 5), True), ("l0.norm", (5,), False), ("l0.v", (4, 5), True)],
    [("l1.w", (9,), True), ("l1.b", (3,), False)],
]


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_both(weight_decay, max_norm, steps=4, betas=(0.9, 0.95)):
    """Same random gradients through HostAdamW and torch.optim.AdamW; returns max relative error."""
    torch.manual_seed(torch.seed() % 2**31)
    store = HostStore([GroupLayout.from_specs(s) for s in SPECS], state_names=("exp_avg", "exp_avg_sq"))
    ref = {name: torch.randn(shape, requires_grad=True) for group in SPECS for name, shape, _ in group}
    decay = [ref[n] for g in SPECS for n, _, d in g if d]
    no_decay = [ref[n] for g in SPECS for n, _, d in g if not d]
    ref_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=betas,
        eps=1e-8,
    )
    for g in range(store.n_groups):
        for name, view in store.master_views(g).items():
            view.copy_(ref[name].detach())
    opt = HostAdamW(store, AdamWConfig(lr=1e-2, betas=betas, eps=1e-8, weight_decay=weight_decay))
    for _ in range(steps):
        for g in range(store.n_groups):
            for name, view in store.layouts[g].views(store.grad(g)).items():
                grad = torch.randn(view.shape) * 3
                view.copy_(grad)
                ref[name].grad = grad.clone()
        total = math.sqrt(sum(float(store.grad(g).double().pow(2).sum()) for g in range(store.n_groups)))
        if max_norm:
            torch.nn.utils.clip_grad_norm_(list(ref.values()), max_norm)
        ref_opt.step()
        opt.begin_step()
        for g in reversed(range(store.n_groups)):  # order must not matter
            opt.update_group(g, lr=1e-2, clip_coef=clip_coefficient(total, max_norm))
    return max(rel_err(store.master_views(g)[n], ref[n].detach()) for g in range(2) for n in store.layouts[g].names)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
def test_matches_torch_adamw(weight_decay, max_norm):
    assert run_both(weight_decay, max_norm) < 1e-6


def test_unfused_fallback_matches_torch_adamw(monkeypatch):
    monkeypatch.setattr(adamw_module, "FUSED", False)
    assert run_both(0.1, 1.0) < 1e-6


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("clip_on_device", [False, True])
def test_device_updates_equal_host_updates(fused, clip_on_device, monkeypatch):
    """A group kept on the device steps exactly as the store's copy of it would: clipped (by a number, or by a
    `DeviceClip`'s tensors), skipped where its gradient is non-finite (read on the device; or where the DeviceClip
    says so), and back in the store after to_host. Both sides run torch's kernels here, so they agree to the bit (the
    host's own kernel agrees to the last bit of a few elements: test_host_kernel)."""
    monkeypatch.setattr(adamw_module, "FUSED", fused and adamw_module.FUSED)
    monkeypatch.setattr(adamw_module.host_kernel, "available", lambda: False)
    config = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    stores = [
        HostStore([GroupLayout.from_specs(s) for s in SPECS], state_names=("exp_avg", "exp_avg_sq")) for _ in "ab"
    ]
    for g in range(2):
        weights = torch.randn(stores[0].layouts[g].numel)
        for store in stores:
            store.master(g).copy_(weights)
    host, on_host = HostAdamW(stores[0], config), HostAdamW(stores[1], config)
    device = DeviceAdamW(on_host, [1], torch.device("cpu"))
    device.to_device()
    for clip, poisoned in [(1.0, False), (0.5, False), (1.0, True), (0.3, False)]:
        grad = torch.randn(stores[0].layouts[1].numel)
        if poisoned:
            grad[3] = float("inf")
        for optimizer in (host, on_host):
            optimizer.begin_step()
        if not poisoned:  # the host path skips a non-finite group by not updating it
            stores[0].grad(1).copy_(grad)
            host.update_group(1, 1e-2, clip)
        if clip_on_device:
            on_device = DeviceClip(torch.tensor(clip, dtype=torch.float64), torch.tensor(1 / clip), torch.tensor(0.0))
            device.update(1, grad.clone(), 1e-2, replace(on_device, skip=torch.tensor(float(poisoned))))
        else:
            device.update(1, grad.clone(), 1e-2, clip, sq_norm=grad.pow(2).sum())
        assert not torch.equal(stores[1].master(1), device.masters[1]) or poisoned  # the store waits for to_host
    device.to_host()
    for name in ("master", "state.exp_avg", "state.exp_avg_sq"):
        assert torch.equal(stores[1].held(name, 1), stores[0].held(name, 1)), name


@pytest.mark.parametrize("max_norm", [1.0, 0.25, 0.0])
def test_the_devices_clip_coefficient_is_clip_grad_norms(max_norm):
    """`DeviceClip.of_sums` computes on the device the coefficient `clip_coefficient` gives (to the last bit of the
    sqrt: torch's CPU sqrt may round the other way than the host's) and the fp32 scale the fused kernel divides by
    as the host's update gives it; a non-finite loss or norm sets its skip flag."""
    generator = torch.Generator().manual_seed(0)
    sq_sums = (torch.rand(500, generator=generator) * 4).pow(4).tolist() + [0.0, max_norm**2, 1.0]
    for sq_sum in sq_sums:
        sq_norm_sum = torch.tensor(sq_sum, dtype=torch.float32)
        clip = DeviceClip.of_sums(torch.tensor(2.5), sq_norm_sum, max_norm)
        assert clip.coef.item() == pytest.approx(clip_coefficient(math.sqrt(sq_sum), max_norm), rel=1e-15)
        assert torch.equal(clip.scale, torch.tensor(1.0 / clip.coef.item())) and clip.skip.item() == 0.0
    for loss, sq_sum in [(float("inf"), 1.0), (1.0, float("nan")), (float("nan"), float("inf"))]:
        assert DeviceClip.of_sums(torch.tensor(loss), torch.tensor(sq_sum), max_norm).skip.item() == 1.0


def test_a_device_groups_compute_dtype_copy_follows_its_master():
    """`keep_copies`: the master cast to the compute dtype, made at once, after every update and after `to_device`
    (a checkpoint loaded), bit for bit a cast of the master; a group not updated on the device is refused."""
    store = HostStore(
        [GroupLayout.from_specs(s) for s in SPECS], state_names=("exp_avg", "exp_avg_sq"), compute_dtype=torch.bfloat16
    )
    store.master(1).copy_(torch.randn(store.layouts[1].numel))
    optimizer = HostAdamW(store, AdamWConfig(lr=1e-2, weight_decay=0.1))
    device = DeviceAdamW(optimizer, [1], torch.device("cpu"))
    device.to_device()
    device.keep_copies([1])
    assert device.copies[1].dtype == torch.bfloat16 and torch.equal(device.copies[1], store.master(1).bfloat16())
    optimizer.begin_step()
    device.update(1, torch.randn(store.layouts[1].numel), 1e-2)
    assert not torch.equal(device.masters[1], store.master(1))
    assert torch.equal(device.copies[1], device.masters[1].bfloat16())
    store.master(1).normal_()
    device.to_device()
    assert torch.equal(device.copies[1], store.master(1).bfloat16())
    with pytest.raises(OptimError, match=r"groups \[0\] are copied but not updated on the GPU"):
        device.keep_copies([0, 1])
    device.keep_copies([])
    assert device.copies == {}


def test_parked_moments_wait_in_the_store_between_updates_and_come_back_bit_for_bit():
    """`park`: a parked group's moments leave the device at once and, after each update, at the next `wait_for`,
    into the store, which then holds exactly what an unparked twin holds on the device; `bring_back` (or the update
    itself, where nothing brought them back) restores them, and the masters follow the twin's bit for bit over
    several steps; unparking brings them back; a group not updated on the device is refused."""
    layouts = [GroupLayout.from_specs(s) for s in SPECS]
    stores = [HostStore(layouts, state_names=("exp_avg", "exp_avg_sq")) for _ in range(2)]
    start = torch.randn(layouts[1].numel)
    devices = []
    for store in stores:
        store.master(1).copy_(start)
        device = DeviceAdamW(HostAdamW(store, AdamWConfig(lr=1e-2, weight_decay=0.1)), [1], torch.device("cpu"))
        device.to_device()
        devices.append(device)
    parked, twin = devices
    parked.park([1])
    assert parked.held_bytes == 0
    for step in range(3):
        grad = torch.randn(layouts[1].numel)
        if step == 1:
            parked.bring_back([1])
            assert parked.held_bytes == 2 * 4 * layouts[1].numel  # on the device until its update parks them
        for device in devices:
            device.host.begin_step()
            device.update(1, grad.clone(), 1e-2, clip_coef=0.5)
        assert 1 not in parked._parked  # until the next `wait_for` (the pipeline's cast of its stage) parks it
        parked.wait_for([1])
        assert torch.equal(parked.masters[1], twin.masters[1])
        for name, state in zip(("exp_avg", "exp_avg_sq"), twin._moments_of(1)):
            assert torch.equal(stores[0].state(name, 1), state)
    parked.park([])
    assert torch.equal(parked._moments_of(1)[1], twin._moments_of(1)[1])
    with pytest.raises(OptimError, match=r"groups \[0\] are parked but not updated on the GPU"):
        parked.park([0, 1])


def test_device_groups_need_one_unsharded_store():
    store = HostStore([GroupLayout.from_specs(s) for s in SPECS], state_names=("exp_avg", "exp_avg_sq"), shard=(0, 2))
    with pytest.raises(OptimError, match="unsharded store"):
        DeviceAdamW(HostAdamW(store, AdamWConfig()), [1], torch.device("cpu"))


def test_wire_copy_refreshed():
    store = HostStore(
        [GroupLayout.from_specs(SPECS[0])],
        compute_dtype=torch.bfloat16,
        state_names=("exp_avg", "exp_avg_sq"),
        wire_copy=True,
    )
    store.master(0).normal_()
    store.grad(0).normal_()
    opt = HostAdamW(store, AdamWConfig(lr=0.1))
    opt.begin_step()
    opt.update_group(0, lr=0.1)
    assert torch.equal(store.wire(0), store.master(0).to(torch.bfloat16))


def test_bad_settings():
    with pytest.raises(OptimError, match="betas"):
        AdamWConfig(betas=(0.9, 1.5))
    with pytest.raises(OptimError, match=r"betas must be two numbers in \[0, 1\), got 0.9"):
        AdamWConfig(betas=0.9)  # (a TypeError from iterating a float)
    store = HostStore([GroupLayout.from_specs(SPECS[1])])
    with pytest.raises(OptimError, match="state_names"):
        HostAdamW(store, AdamWConfig())


def test_clip_coefficient_matches_clip_grad_norm():
    grads = [torch.randn(10) * 5, torch.randn(3)]
    params = [torch.zeros(10, requires_grad=True), torch.zeros(3, requires_grad=True)]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    coef = clip_coefficient(norm, 1.0)
    assert torch.allclose(params[0].grad, grads[0] * coef, rtol=1e-6)
    assert clip_coefficient(norm, 0.0) == 1.0
    assert clip_coefficient(0.5, 1.0) == 1.0


def test_schedules():
    cos = Schedule(lr=1.0, total_steps=110, warmup_steps=10, kind="cosine", min_lr_ratio=0.1)
    assert lr_at(0, cos) == pytest.approx(0.1)
    assert lr_at(9, cos) == pytest.approx(1.0)
    assert lr_at(10, cos) == pytest.approx(1.0)
    assert lr_at(60, cos) == pytest.approx(0.55)
    assert lr_at(110, cos) == pytest.approx(0.1)
    lin = Schedule(lr=1.0, total_steps=10, kind="linear", min_lr_ratio=0.0)
    assert lr_at(5, lin) == pytest.approx(0.5)
    assert lr_at(7, Schedule(lr=2.0, total_steps=10, kind="constant")) == 2.0
    with pytest.raises(OptimError, match="schedule must be one of constant, cosine, linear, wsd, got 'step'"):
        Schedule(lr=1.0, total_steps=10, kind="step")
    with pytest.raises(OptimError, match=r"min_lr_ratio must be in \[0, 1\]"):  # (above 1 the decay rose)
        Schedule(lr=1.0, total_steps=10, min_lr_ratio=2.0)
    with pytest.raises(OptimError, match="lr must be >= 0 and finite, got -0.1"):
        Schedule(lr=-0.1, total_steps=10)


def test_wsd_holds_the_peak_until_its_last_decay_steps():
    """Warmup, the peak, then the last decay_steps fall by decay_shape to min_lr_ratio * lr at total_steps."""
    wsd = dict(lr=1.0, total_steps=20, warmup_steps=5, kind="wsd", min_lr_ratio=0.1, decay_steps=10)
    for shape, halfway in (("cosine", 0.55), ("linear", 0.55), ("1-sqrt", 0.1 + 0.9 * (1 - 0.5**0.5))):
        schedule = Schedule(**wsd, decay_shape=shape)
        assert [lr_at(step, schedule) for step in (0, 4, 5, 9, 10)] == pytest.approx([0.2, 1, 1, 1, 1])
        assert lr_at(15, schedule) == pytest.approx(halfway) and lr_at(20, schedule) == pytest.approx(0.1)
    for decay_steps in (0, 16):
        with pytest.raises(OptimError, match=rf"decay_steps .* must be in \[1, 15\].*got {decay_steps}"):
            Schedule(**{**wsd, "decay_steps": decay_steps})
    with pytest.raises(OptimError, match="decay_shape must be one of cosine, linear, 1-sqrt, got 'exp'"):
        Schedule(**wsd, decay_shape="exp")
    with pytest.raises(OptimError, match="decay_steps and decay_shape are schedule wsd's, not cosine's"):
        Schedule(lr=1.0, total_steps=10, decay_steps=3)


def test_stepper_runs_in_order_and_propagates_errors():
    stepper = BackgroundStepper()
    order = []
    for g in range(5):
        stepper.submit(g, lambda g=g: order.append(g))
    stepper.wait_all()
    assert order == list(range(5))

    def boom():
        raise RuntimeError("worker failed")

    stepper.submit(7, boom)
    with pytest.raises(RuntimeError, match="worker failed"):
        stepper.wait(7)
    stepper.close()


def test_updates_beside_layers_on_the_cpu_run_on_one_thread_of_their_own():
    """Where the layers compute on the host's CPU too, the update worker's torch operations run on one thread and
    the training thread keeps its own (a second OpenMP team made the default job's layer passes about 20% slower on
    two cores); beside a GPU the worker runs on the process's threads."""
    store = HostStore([GroupLayout.from_specs(s) for s in SPECS], state_names=STATE_NAMES)
    threads_before = torch.get_num_threads()
    for shares_cores, expected in ((True, 1), (False, threads_before)):
        host = HostUpdates(HostAdamW(store, AdamWConfig()), {0: 0, 1: 1}, ["l0", "l1"], shares_cores=shares_cores)
        seen = []
        host.stepper.submit(0, lambda: seen.append(torch.get_num_threads()))
        host.stepper.wait(0)
        host.close()
        assert seen == [expected] and torch.get_num_threads() == threads_before


def test_stepper_takes_the_most_urgent_queued_work_first():
    import threading

    stepper = BackgroundStepper()
    gate, order = threading.Event(), []
    stepper.submit(99, gate.wait)  # holds the worker while the rest is queued
    for group in (5, 3, 4, 1, 2):  # arriving last layer first, as gradients do
        stepper.submit(group, lambda g=group: order.append(g), priority=group)
    stepper.submit(0, lambda: order.append("same priority, later"), priority=3)
    assert stepper.busy(1) and not order
    gate.set()
    stepper.wait_all()
    assert order == [1, 2, 3, "same priority, later", 4, 5]
    # work that would wait (its gradient has not landed) gives way to ready work, however urgent;
    # when none is ready, the oldest goes first (it lands first)
    landed, order = {1: False, 2: True, 3: False}, []
    stepper.submit(99, gate.clear)
    stepper.wait(99)
    stepper.submit(98, gate.wait)
    for group in (3, 2, 1):
        stepper.submit(group, lambda g=group: order.append(g), priority=group, ready=lambda g=group: landed[g])
    gate.set()
    stepper.wait(2)
    stepper.wait_all()
    assert order == [2, 3, 1]
    stepper.submit(6, gate.wait)
    stepper.close()
    assert not stepper.busy(6)


def test_sharded_updates_equal_one_update(tmp_path):
    """Three processes' worth of shards, each updating its slice of shared weights and moments,
    give the update of one unsharded store (weight decay runs cut at shard edges too), to fp32
    rounding: the fused kernel's vector lanes fall differently on a slice."""
    from megatrain_store import SharedArenas

    specs = [[("w", (40, 5), True), ("norm", (5,), False), ("v", (30, 4), True)]]
    layouts = [GroupLayout.from_specs(s) for s in specs]
    names = ("exp_avg", "exp_avg_sq")
    whole = HostStore(layouts, state_names=names)
    shards = [
        HostStore(layouts, state_names=names, shared=SharedArenas(tmp_path / "shm"), shard=(i, 3)) for i in range(3)
    ]
    weights, grad = torch.randn(layouts[0].numel), torch.randn(layouts[0].numel)
    whole.master(0).copy_(weights)
    shards[0].master(0).copy_(weights)
    config = AdamWConfig(lr=1e-2, weight_decay=0.1)
    optimizers = [HostAdamW(store, config) for store in [whole, *shards]]
    for step in range(2):
        whole.grad(0).copy_(grad * (step + 1))
        for store in shards:
            start, end = store.shard_range(0)
            store.grad(0).copy_(grad[start:end] * (step + 1))
        for optimizer in optimizers:
            optimizer.begin_step()
            optimizer.update_group(0, lr=1e-2, clip_coef=0.5)
    for name in ("exp_avg", "exp_avg_sq"):
        assert rel_err(shards[1].state(name, 0), whole.state(name, 0)) < 1e-6
    assert rel_err(shards[2].master(0), whole.master(0)) < 1e-6
    assert rel_err(shards[2].master(0), weights) > 1e-3  # the weights did move


def test_hosts_that_split_the_state_update_as_one_store(tmp_path):
    """Two hosts of two processes, each host holding the master and moments of half of every group
    (`owned`) and a full wire copy: every process's update equals the unsharded one on its range,
    and writes its range of the wire copy (the other host's half arrives by the network)."""
    from megatrain_store import SharedArenas, StoreError

    layouts = [GroupLayout.from_specs([("w", (50, 7), True), ("norm", (7,), False)])]
    names = ("exp_avg", "exp_avg_sq")
    whole = HostStore(layouts, state_names=names)
    hosts = [SharedArenas(tmp_path / f"host{h}") for h in range(2)]
    ranks = [
        HostStore(layouts, torch.bfloat16, names, shared=hosts[r // 2], shard=(r, 4), owned=(r // 2 * 2, 2))
        for r in range(4)
    ]
    weights, grad = torch.randn(layouts[0].numel), torch.randn(layouts[0].numel)
    whole.master(0).copy_(weights)
    for store in ranks[::2]:  # each host's first process fills its host's part
        with store.writing(0) as views:
            for view, part in zip(views.values(), weights.split([v.numel() for v in views.values()])):
                view.copy_(part.view_as(view))
    assert ranks[1].master(0).numel() == ranks[1].owned_numel(0) < layouts[0].numel
    assert torch.equal(ranks[3].wire(0), weights.to(torch.bfloat16))  # every host streams the whole group
    with pytest.raises(StoreError, match="writing"):
        ranks[0].master_views(0)
    optimizers = [HostAdamW(store, AdamWConfig(lr=1e-2, weight_decay=0.1)) for store in [whole, *ranks]]
    whole.grad(0).copy_(grad)
    for store in ranks:
        start, end = store.shard_range(0)
        store.grad(0).copy_(grad[start:end])
    for optimizer in optimizers:
        optimizer.begin_step()
        optimizer.update_group(0, lr=1e-2)
    for store in ranks:
        start, end = store.shard_range(0)
        offset = store.owned_range(0)[0]
        assert rel_err(store.master(0)[start - offset : end - offset], whole.master(0)[start:end]) < 1e-6
        assert (
            rel_err(
                store.state("exp_avg_sq", 0)[start - offset : end - offset], whole.state("exp_avg_sq", 0)[start:end]
            )
            < 1e-6
        )
        assert torch.equal(store.wire(0)[start:end], store.master(0)[start - offset : end - offset].to(torch.bfloat16))


LOAD_SPECS = [
    ("w", (8, 5), True),
    ("gate.bias{hi}", (6,), False, LOAD_BIAS),
    ("gate.bias{lo}", (6,), False, LOAD_BIAS),
    ("norm", (5,), False),
]


def load_bias_store(bias: torch.Tensor, **kwargs) -> HostStore:
    store = HostStore([GroupLayout.from_specs(LOAD_SPECS)], state_names=("exp_avg", "exp_avg_sq"), **kwargs)
    hi = bias.to(torch.bfloat16).float()
    if store.owns_all:
        store.master_views(0)["gate.bias{hi}"].copy_(hi)
        store.master_views(0)["gate.bias{lo}"].copy_(bias - hi)
    return store


def excess_loads(generator) -> torch.Tensor:
    """n_experts * picks - top_k * tokens of 6 experts, top-2 of 30 tokens: integers, some exactly 0."""
    picks = torch.multinomial(torch.ones(6), 60, replacement=True, generator=generator).bincount(minlength=6)
    picks[:2] = 10
    return (6 * picks - 2 * 30).float()


@pytest.mark.parametrize("rate", [0.0, 1e-3])
def test_load_balanced_bias_moves_against_its_excess_load(rate):
    """The pair's gradient slots hold each expert's excess load: the bias moves by rate * sign(mean - load)
    exactly as DeepSeek-V3's rule in fp32 (hi + lo, hi re-split exact in bfloat16), or not at all at rate 0,
    its moments stay zero, and neither the statistic nor the bias disturbs AdamW on the rest."""
    generator = torch.Generator().manual_seed(3)
    bias = 7 + 0.3 * torch.randn(6, generator=generator)
    store = load_bias_store(bias)
    w, norm = torch.randn(8, 5, requires_grad=True), torch.randn(5, requires_grad=True)
    store.master_views(0)["w"].copy_(w.detach())
    store.master_views(0)["norm"].copy_(norm.detach())
    groups = [{"params": [w], "weight_decay": 0.1}, {"params": [norm], "weight_decay": 0.0}]
    reference = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    optimizer = HostAdamW(store, AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1), load_bias_rate=rate)
    for _ in range(3):
        w.grad, norm.grad = torch.randn(8, 5, generator=generator), torch.randn(5, generator=generator)
        excess = excess_loads(generator)
        grads = store.layouts[0].views(store.grad(0))
        grads["w"].copy_(w.grad)
        grads["norm"].copy_(norm.grad)
        grads["gate.bias{hi}"].copy_(excess)
        grads["gate.bias{lo}"].copy_(excess)
        w.grad.mul_(0.5), norm.grad.mul_(0.5)  # the clip coefficient, which scales the statistic too
        reference.step()
        mean_load_minus_load = -excess / 6
        bias = bias + torch.sign(mean_load_minus_load) * rate
        optimizer.begin_step()
        optimizer.update_group(0, lr=1e-3, clip_coef=0.5)
    views = store.master_views(0)
    hi, lo = views["gate.bias{hi}"], views["gate.bias{lo}"]
    assert torch.equal(hi, hi.to(torch.bfloat16).float())
    assert torch.equal(hi + lo, bias)
    assert torch.equal(store.state("exp_avg_sq", 0)[40:52], torch.zeros(12))
    assert rel_err(views["w"], w.detach()) < 1e-6
    assert rel_err(views["norm"], norm.detach()) < 1e-6


@pytest.mark.parametrize("count", [2, 3, 5, 7])
def test_shards_move_a_load_balanced_bias_as_one_store(count, tmp_path):
    """Shards whose edges fall between an expert's hi and lo agree without talking: the shard holding both
    re-splits, one holding only the lo moves it, one holding only the hi leaves it. The sum is the
    unsharded update to fp32 rounding ((hi + lo) + step against hi + (lo + step))."""
    from megatrain_store import SharedArenas

    bias = 7 + 0.3 * torch.randn(6)
    whole = load_bias_store(bias)
    shared = SharedArenas(tmp_path / "shm")
    shards = [load_bias_store(bias, shared=shared, shard=(i, count)) for i in range(count)]
    shards[0].master(0).copy_(whole.master(0))
    excess = excess_loads(torch.Generator().manual_seed(count))
    optimizers = [HostAdamW(store, AdamWConfig(lr=1e-3), load_bias_rate=0.01) for store in [whole, *shards]]
    for step in range(2):
        grad = torch.zeros(whole.layouts[0].numel)
        grad[40:46] = grad[46:52] = excess * (step + 1)
        whole.grad(0).copy_(grad)
        for store in shards:
            start, end = store.shard_range(0)
            store.grad(0).copy_(grad[start:end])
        for optimizer in optimizers:
            optimizer.begin_step()
            optimizer.update_group(0, lr=1e-3)
    sharded, unsharded = shards[0].master_views(0), whole.master_views(0)
    total = sharded["gate.bias{hi}"] + sharded["gate.bias{lo}"]
    assert torch.allclose(total, unsharded["gate.bias{hi}"] + unsharded["gate.bias{lo}"], rtol=2e-7, atol=0)
    assert not torch.equal(total, bias)


def test_device_updates_move_load_balanced_biases_unless_the_gradient_is_not_finite():
    bias = 7 + 0.3 * torch.randn(6)
    stores = [load_bias_store(bias) for _ in "ab"]
    host, on_host = (HostAdamW(store, AdamWConfig(lr=1e-3), load_bias_rate=0.01) for store in stores)
    device = DeviceAdamW(on_host, [0], torch.device("cpu"))
    device.to_device()
    for poisoned in (False, True, False):
        grad = torch.randn(stores[0].layouts[0].numel)
        grad[40:46] = grad[46:52] = excess_loads(torch.Generator().manual_seed(int(poisoned)))
        if poisoned:
            grad[0] = float("nan")
        for optimizer in (host, on_host):
            optimizer.begin_step()
        if not poisoned:
            stores[0].grad(0).copy_(grad)
            host.update_group(0, 1e-3)
        device.update(0, grad.clone(), 1e-3, sq_norm=grad.pow(2).sum())
    device.to_host()
    assert torch.equal(stores[1].master(0), stores[0].master(0))
    assert not torch.equal(stores[1].master(0)[40:52], load_bias_store(bias).master(0)[40:52])


@pytest.mark.parametrize("clipping", [True, False])
def test_both_policies_time_a_resident_groups_update_as_gpu_work(clipping):
    """A resident group's update is work on the GPU's compute stream: both policies queue it inside `device_span`
    (a trace then counts it as the GPU's work, not as its idle time), clipped once the norm is known or unclipped as
    its gradient is made; a host group's update is not."""
    store = HostStore([GroupLayout.from_specs(s) for s in SPECS], state_names=STATE_NAMES)
    optimizer = HostAdamW(store, AdamWConfig())
    host = HostUpdates(optimizer, {0: 0, 1: 1}, ["layer0", "layer1"])
    device = DeviceAdamW(optimizer, [1], torch.device("cpu"))
    device.to_device()
    timed = []

    def span(name):
        timed.append(name)
        return contextlib.nullcontext()

    policy = (
        UpdatesAfterClipping(host, 1.0, device, device_span=span)
        if clipping
        else UpdatesAsGradientsLand(host, device, device_span=span)
    )
    policy.begin_step(0, 1e-3)
    grad = torch.randn(store.layouts[1].numel)
    policy.device_grads_made(1, grad, grad.pow(2).sum())
    store.grad(0).normal_()
    policy.grads_landed(0, None, store.grad(0).pow(2).sum())
    sq_norm_sum = grad.pow(2).sum() + store.grad(0).pow(2).sum()
    policy.gradients_complete(torch.tensor(1.0), sq_norm_sum)
    policy.end_step(skipped=False)
    host.wait_all()
    host.close()
    assert timed == ["adamw layer1"]


def test_clipping_refuses_a_pooled_store():
    """Clipping holds every gradient until the global norm is known: over a store whose gradients land in a pool of
    a few groups' size, the held gradients would fill it and the next landing would wait forever; refused at once."""
    store = HostStore([GroupLayout.from_specs(s) for s in SPECS], state_names=STATE_NAMES, grad_pool=1)
    host = HostUpdates(HostAdamW(store, AdamWConfig()), {0: 0, 1: 1}, ["layer0", "layer1"])
    with pytest.raises(OptimError, match=r"a gradient buffer per group \(grad_pool=None\), not a pool of 1 largest"):
        UpdatesAfterClipping(host, 1.0)


def test_auto_cpu_threads_leave_a_gpu_process_one_core(monkeypatch):
    """A process alone beside a GPU leaves one of torch's threads to the threads issuing the GPU's work, again
    the same where a process builds a second trainer; not on the CPU, not under an explicit OMP_NUM_THREADS or
    number, and torchrun's processes split the cores."""
    import os

    import megatrain_optim.launch as launch

    before = torch.get_num_threads()
    monkeypatch.setattr(launch, "_threads_at_start", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        for _ in range(2):
            launch.set_cpu_threads("auto", None, beside_gpu=True)
            assert torch.get_num_threads() == 7
        torch.set_num_threads(5)
        launch.set_cpu_threads("auto", None, beside_gpu=False)  # (on the CPU: torch's threads as they are)
        assert torch.get_num_threads() == 5
        launch.set_cpu_threads(3, None, beside_gpu=True)
        assert torch.get_num_threads() == 3
        launch.set_cpu_threads("auto", 2, beside_gpu=True)
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        monkeypatch.setenv("OMP_NUM_THREADS", "5")
        torch.set_num_threads(5)
        launch.set_cpu_threads("auto", None, beside_gpu=True)
        assert torch.get_num_threads() == 5
    finally:
        torch.set_num_threads(before)
