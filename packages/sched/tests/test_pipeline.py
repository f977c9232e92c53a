"""The scheduler on the CPU: orderings, gradients against autograd, tied groups, slot counts."""

from collections import namedtuple
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import megatrain_sched.timeline as timeline_module
from megatrain_sched import (
    EXTRAS_MARGIN,
    Hooks,
    LayerPipeline,
    MicroBatch,
    Placement,
    PlacementError,
    SchedError,
    Stage,
    StageTemplate,
    Timeline,
    staging_buffers,
)
from megatrain_sched.gradients import sq_norm
from megatrain_sched.pipeline import expandable_device_memory
from megatrain_sched.weights import cast_numels
from megatrain_store import GroupLayout, HostStore

Spec = namedtuple("Spec", "name shape numel")
V, D = 11, 6


def spec(name, *shape):
    return Spec(name, shape, int(torch.Size(shape).numel()))


class Lookup(StageTemplate):
    groups = ((spec("table", V, D),),)
    backward_reads_weights = False  # the pipeline copies no weights for its backward

    def forward(self, w, ids):
        return w[0].view(V, D)[ids]

    def backward(self, w, ids, grad, grads):
        grads[0].view(V, D).index_add_(0, ids.reshape(-1), grad.reshape(-1, D))


class Mix(StageTemplate):
    """y = tanh(x @ M); its forward can keep the product x @ M for the backward, and y too (its extra)."""

    groups = ((spec("m", D, D),),)
    d_model = D  # (the checkpoints' width)

    def forward(self, w, x):
        return torch.tanh(x @ w[0].view(D, D))

    def forward_keeping_products(self, w, x, extras=False):
        product = x @ w[0].view(D, D)
        y = torch.tanh(product)
        return y, {"product": product, **({"tanh": y} if extras else {})}

    def product_bytes_per_token(self, element_size):
        return D * element_size

    def extra_product_bytes_per_token(self, element_size):
        return D * element_size

    def backward(self, w, x, grad, grads, products=None):
        m = w[0].view(D, D)
        products = products or {}
        product = products["product"] if "product" in products else x @ m
        tanh = products["tanh"] if "tanh" in products else torch.tanh(product)
        pre_grad = grad * (1 - tanh**2)
        if grads[0] is not None:  # (None: its group is frozen)
            grads[0].view(D, D).add_(x.reshape(-1, D).T @ pre_grad.reshape(-1, D))
        return pre_grad @ m.T


class Readout(StageTemplate):
    """loss = sum over labelled positions of (x . table[label])^2, optionally tied to the lookup table."""

    def __init__(self, tied):
        self.tied = tied
        self.groups = ((spec("table", V, D),), (spec("bias", D),)) if tied else ((spec("proj", V, D), spec("bias", D)),)

    def _split(self, w):
        return (w[0].view(V, D), w[1]) if self.tied else (w[0][: V * D].view(V, D), w[0][V * D :])

    def loss(self, w, x, labels, scale, grads):
        table, bias = self._split(w)
        g_table, g_bias = self._split(grads)
        mask = (labels >= 0).unsqueeze(-1).to(x.dtype)
        rows = table[labels.clamp_min(0)]
        dot = ((x + bias) * rows).sum(-1, keepdim=True) * mask
        grad_x = 2 * dot * rows * scale
        g_table.index_add_(
            0, labels.clamp_min(0).reshape(-1), (2 * dot * (x + bias) * scale).reshape(-1, D).to(g_table.dtype)
        )
        g_bias.add_(grad_x.reshape(-1, D).sum(0))
        return (dot**2).sum(), grad_x


def build(n_mix, tied, n_slots=2, **placed):
    """A lookup, `n_mix` Mix blocks and a readout on the CPU; `placed`: `Placement.build`'s stage indices (and
    the step's fields)."""
    readout = Readout(tied)
    templates = [Lookup()] + [Mix() for _ in range(n_mix)]
    layouts = [GroupLayout.from_specs([(s.name, s.shape, True) for s in t.groups[0]]) for t in templates]
    layouts.append(GroupLayout.from_specs([(s.name, s.shape, True) for s in readout.groups[-1]]))
    store = HostStore(layouts)
    for g in range(store.n_groups):
        store.master(g).normal_()
    stages = [Stage(t, (i,), f"s{i}") for i, t in enumerate(templates)]
    stages.append(Stage(readout, (0, len(layouts) - 1) if tied else (len(layouts) - 1,), "head"))
    landed = []
    pipeline = LayerPipeline(
        stages,
        store,
        torch.device("cpu"),
        n_slots=n_slots,
        placement=Placement.build(len(stages), **placed),
        hooks=Hooks(on_grads_landed=lambda g, e, sq: landed.append(g)),
        timeline=Timeline(enabled=True),
    )
    return store, pipeline, landed


def autograd_reference(store, n_mix, tied, batches, scale):
    params = [store.master(g).clone().requires_grad_() for g in range(store.n_groups)]
    total = 0.0
    for ids, labels in batches:
        x = params[0].view(V, D)[ids]
        for i in range(n_mix):
            x = torch.tanh(x @ params[1 + i].view(D, D))
        head = params[-1]
        table = params[0].view(V, D) if tied else head[: V * D].view(V, D)
        bias = head if tied else head[V * D :]
        mask = (labels >= 0).unsqueeze(-1).to(x.dtype)
        total = total + ((((x + bias) * table[labels.clamp_min(0)]).sum(-1, keepdim=True) * mask) ** 2).sum()
    (total * scale).backward()
    return total.detach(), [p.grad for p in params]


def close(got, expected, rtol=1e-4):
    """Equal to fp32 rounding relative to the whole tensor: a few elements that cancel (N(0, 1) weights,
    several layers) may differ elementwise by more than rtol of themselves."""
    return bool((got - expected).norm() <= rtol * expected.norm())


def make_batches(n_micro, micro=2, seq=5):
    out = []
    for _ in range(n_micro):
        ids = torch.randint(0, V, (micro, seq))
        labels = torch.randint(0, V, (micro, seq))
        labels[:, -1] = -100
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_slots, held", [(2, ()), (3, ()), (2, (1, 2))])
def test_gradients_match_autograd(tied, n_slots, held):
    store, pipeline, landed = build(3, tied, n_slots, held=held)
    batches = make_batches(3)
    result = pipeline.run([MicroBatch(i, lab) for i, lab in batches], loss_scale=0.1)
    loss, grads = autograd_reference(store, 3, tied, batches, 0.1)
    assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
    for g in range(store.n_groups):
        assert close(store.grad(g), grads[g]), g
        assert torch.allclose(result.group_sq_norms[g], grads[g].pow(2).sum(), rtol=1e-4)
    assert sorted(landed) == list(range(store.n_groups))  # every group's gradient sent exactly once


@pytest.mark.parametrize(
    "placed",
    [
        {"kept": (3, 4)},
        {"kept": (4,), "host_kept": (1, 3)},
        {"offloaded": (1, 2, 3, 4)},
        {"offloaded": (1, 2, 3, 4), "kept": (4,), "host_kept": (2,)},  # kept layers' checkpoints too
        {"offloaded": (1, 2), "kept": (1, 4), "held": (2,)},  # any stages, not only the first or last ones
    ],
)
def test_kept_products_and_offloaded_checkpoints_match_autograd(placed):
    store, pipeline, _ = build(4, tied=True, **placed)
    batches = make_batches(3)
    for _ in range(2):  # the second step reuses the first's host buffers
        result = pipeline.run([MicroBatch(i, lab) for i, lab in batches], loss_scale=0.1)
    loss, grads = autograd_reference(store, 4, True, batches, 0.1)
    assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
    assert all(close(store.grad(g), grads[g]) for g in range(store.n_groups))
    assert pipeline.executed == pipeline.placement and pipeline.fallback is None  # run as given


@pytest.mark.parametrize("sweeps", [2, 3])
@pytest.mark.parametrize("placed", [{}, {"offloaded": (1, 2), "kept": (4,), "host_kept": (2,)}, {"held": (1, 2)}])
def test_a_step_in_sweeps_lands_the_gradients_of_one_sweep(sweeps, placed):
    """The micro-batches in consecutive parts, forward and backward each: every gradient lands once a step, after
    the last sweep, holding the sum over all of them (the earlier sweeps' sum went out and came back)."""
    store, pipeline, landed = build(4, tied=True, sweeps=sweeps, **placed)
    batches = make_batches(5)
    for step in range(2):  # the second step's first sweep starts its sums afresh
        result = pipeline.run([MicroBatch(i, lab) for i, lab in batches], loss_scale=0.1)
        assert sorted(landed) == sorted(list(range(store.n_groups)) * (step + 1))
    loss, grads = autograd_reference(store, 4, True, batches, 0.1)
    assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
    for g in range(store.n_groups):
        assert close(store.grad(g), grads[g]), g
        assert torch.allclose(result.group_sq_norms[g], grads[g].pow(2).sum(), rtol=1e-4)
    grad_outs = [what for kind, what, _ in result.log if kind == "grad_out"]
    assert sorted(grad_outs) == sorted(list(range(store.n_groups)) * sweeps)  # each sweep's sum went out
    computes = [what for kind, what, _ in result.log if kind == "compute"]
    assert computes == pipeline._train_order * sweeps


def test_resident_groups_keep_their_gradient_on_the_device_from_sweep_to_sweep():
    store, host_pipeline, _ = build(4, tied=False)
    device_masters = {g: store.master(g).clone() for g in (1, 2)}
    handed = []
    pipeline = LayerPipeline(
        host_pipeline.stages,
        store,
        torch.device("cpu"),
        placement=Placement.build(len(host_pipeline.stages), resident=(1, 2), sweeps=2),
        device_masters=device_masters,
        hooks=Hooks(on_device_grads=lambda g, grad, sq: handed.append((g, grad.clone(), sq.clone()))),
    )
    batches = make_batches(4)
    pipeline.run([MicroBatch(i, lab) for i, lab in batches], loss_scale=0.5)
    _, grads = autograd_reference(store, 4, False, batches, 0.5)
    assert sorted(g for g, _, _ in handed) == [1, 2]  # once a step, after the last sweep
    for g, grad, sq in handed:
        assert close(grad, grads[g]) and torch.allclose(sq, grads[g].pow(2).sum(), rtol=1e-4)
    assert all(close(store.grad(g), grads[g]) for g in (0, 3, 4, 5))


@pytest.mark.parametrize("sweeps", [1, 2])
def test_where_stages_are_parked_the_head_s_gradient_keeps_its_buffer_from_step_to_step(sweeps):
    """`Placement.persistent_gradients`: with stages parked, the head's gradient buffer is allocated when placed and
    zeroed for each sweep's gradient, never new: each step's gradients are autograd's (none of an earlier step's or
    sweep's left in it); placed again unparked, the buffer is given back."""
    store, host_pipeline, _ = build(4, tied=False)
    masters = {g: store.master(g).clone() for g in (0, 1)}
    placement = Placement.build(len(host_pipeline.stages), resident=(0, 1), parked=(0,), sweeps=sweeps)
    assert placement.persistent_gradients == (5,)
    pipeline = LayerPipeline(
        host_pipeline.stages, store, torch.device("cpu"), placement=placement, device_masters=masters
    )
    head_buffer = pipeline.gradients._persistent[5][0]
    for _ in range(3):
        batches = make_batches(4)
        pipeline.run([MicroBatch(i, lab) for i, lab in batches], loss_scale=0.5)
        _, grads = autograd_reference(store, 4, False, batches, 0.5)
        assert all(close(store.grad(g), grads[g]) for g in (2, 3, 4, 5))
        assert pipeline.gradients._persistent[5][0] is head_buffer
    assert close(head_buffer[: store.layouts[5].numel], grads[5])  # (the buffer the last gradient went out of)
    pipeline.place(replace(placement, parked=()), masters)
    assert replace(placement, parked=()).persistent_gradients == () and pipeline.gradients._persistent == {}


def test_sweeps_need_a_landing_buffer_per_group_and_no_step_objective():
    store, pipeline, _ = build(2, tied=True)
    placement = Placement.build(len(pipeline.stages), sweeps=2)
    pooled = HostStore(store.layouts, grad_pool=1)
    with pytest.raises(SchedError, match="needs a landing buffer per group"):
        LayerPipeline(pipeline.stages, pooled, torch.device("cpu"), placement=placement)
    with pytest.raises(SchedError, match="run it in one sweep"):
        LayerPipeline(pipeline.stages, store, torch.device("cpu"), placement=placement, objective=lambda logps: None)
    with pytest.raises(PlacementError, match="1 or more sweeps"):
        pipeline.place(Placement.build(len(pipeline.stages), sweeps=0))


@pytest.mark.parametrize(
    "choices, message",
    [
        ({"kept": (-2,)}, r"kept names stages \[-2\], outside the 4 stages 0..3"),
        ({"held": (4,)}, r"held names stages \[4\], outside"),
        ({"resident": (1,), "held": (1, 2)}, r"stages \[1\] are named both resident and held"),
        ({"kept": (2,), "host_kept": (2,)}, r"stages \[2\] are named both kept and host_kept"),
    ],
)
def test_a_placement_of_stages_that_are_not_there_or_named_twice_is_refused(choices, message):
    """A Pythonic `kept=(-2,)` (the last block) or an index past the last stage did nothing, without a word."""
    with pytest.raises(PlacementError, match=message):
        Placement.build(4, **choices)


def test_the_warm_up_takes_the_host_memory_of_a_whole_step():
    """The warm-up runs one micro-batch but takes the host memory a whole step's offloaded checkpoints and host-kept
    products go to, exact bytes (the CUDA host allocator would round each up to a power of two): the first step
    takes none (pinning 20 GB there made it twice as long)."""
    store, pipeline, _ = build(4, tied=True, offloaded=(1, 2, 3, 4), kept=(4,), host_kept=(2,))
    step = [MicroBatch(i, lab) for i, lab in make_batches(3)]
    pipeline.warm_up(step[:1], step)
    stage_bytes = sum(mb.input_ids.numel() for mb in step) * D * store.compute_dtype.itemsize
    taken = dict(pipeline.activations.host_memory.buffers)
    expected = {("checkpoint", stage): stage_bytes for stage in range(1, 5)} | {("products", 0): stage_bytes}
    assert {use: buffer.numel() for use, buffer in taken.items()} == expected
    pipeline.run(step, loss_scale=1.0)
    assert pipeline.executed.offloaded == (1, 2, 3, 4) and pipeline.executed.host_kept == (2,)
    assert pipeline.activations.host_memory.buffers.keys() == taken.keys()
    assert all(pipeline.activations.host_memory.buffers[use] is buffer for use, buffer in taken.items())


@pytest.mark.parametrize("n_slots, held_layers", [(2, 0), (3, 0), (2, 3)])
def test_weights_present_before_every_compute(n_slots, held_layers):
    store, pipeline, _ = build(4, tied=True, n_slots=n_slots, held=tuple(range(1, 1 + held_layers)))
    log = []
    for _ in range(2):  # the second step copies every stage in again: the weights have changed
        log = pipeline.run([MicroBatch(i, lab) for i, lab in make_batches(2)], loss_scale=1.0).log
    held = {}
    copies = 0
    for kind, what, slot in log:
        if kind in ("copy_in", "cast"):
            held[slot] = what
            copies += kind == "copy_in"
        elif kind == "reuse":
            assert held[slot] == what
        elif kind == "no_copy":
            held[slot] = None  # a backward that reads no weights (the lookup's) is given none
            assert what == 0
        elif kind == "compute":
            assert held.get(slot) in (what, None), f"stage {what} computed in slot {slot} holding {held.get(slot)}"
            assert held.get(slot) is not None or what == 0
    n_stages = len(pipeline.stages)
    forward_copies = n_stages  # every stage copied once in forward ...
    # ... and again in backward, except the head, the stage next to it, the lookup and the held ones
    backward_copies = n_stages - 3 - held_layers
    assert copies == forward_copies + backward_copies + (0 if n_slots == 2 else 1)
    held = [what for kind, what, slot in log if kind == "compute" and str(slot).startswith("held")]
    assert held == [*range(1, 1 + held_layers), *range(held_layers, 0, -1)]  # the first blocks, both ways
    grad_outs = [what for kind, what, _ in log if kind == "grad_out"]
    assert sorted(grad_outs) == list(range(store.n_groups))


def test_streamed_stages_after_resident_ones_are_copied_while_those_compute():
    """Resident blocks cast into a slot of their own, so the rotating slots are free for the streamed stages after
    them: with the table and the first three blocks resident, the last block's and the head's copies are queued
    before the first block computes, each into a slot no queued compute still reads (the table, larger than a
    block, is cast into a rotating slot)."""
    store, host_pipeline, _ = build(4, tied=False)
    device_masters = {g: store.master(g).clone() for g in range(4)}  # the table and the first three blocks
    pipeline = LayerPipeline(
        host_pipeline.stages,
        store,
        torch.device("cpu"),
        placement=Placement.build(len(host_pipeline.stages), resident=(0, 1, 2, 3)),
        device_masters=device_masters,
    )
    log = pipeline.run([MicroBatch(i, lab) for i, lab in make_batches(2)], loss_scale=1.0).log
    issued = [(kind, what, slot) for kind, what, slot in log if kind in ("copy_in", "cast", "reuse", "compute")]
    first_block = issued.index(("compute", 1, "cast"))
    assert ("cast", 0, 0) in issued and {("copy_in", 4, 1), ("copy_in", 5, 0)} <= set(issued[:first_block])
    holds: dict = {}  # slot -> the stage whose weights it holds, in the order the work was queued
    for kind, what, slot in issued:
        if kind in ("copy_in", "cast"):
            holds[slot] = what
        elif kind == "compute" and what != 0:  # (the table's backward reads no weights)
            assert holds[slot] == what, f"stage {what} computed in slot {slot} holding {holds[slot]}"
    assert [what for kind, what, slot in issued if kind == "cast"] == [0, 1, 2, 3, 2, 1]  # (3's backward: reused)


def test_device_master_stages_are_cast_from_them_and_hand_their_gradients_over():
    """Stages whose masters live on the device: no copy from the store, no before_fetch, their gradient
    handed to on_device_grads (with its squared norm) instead of landing; held layers skip them. Each cast is
    preceded by before_cast of its groups (where the compute stream waits for their updates)."""
    store, host_pipeline, _ = build(4, tied=False)
    device_masters = {g: torch.randn_like(store.master(g)) for g in (1, 2)}  # not what the store holds
    handed, fetched, landed, before_cast = {}, [], [], []
    pipeline = LayerPipeline(
        host_pipeline.stages,
        store,
        torch.device("cpu"),
        placement=Placement.build(len(host_pipeline.stages), resident=(1, 2), held=(3,)),
        device_masters=device_masters,
        hooks=Hooks(
            on_device_grads=lambda g, grad, sq: handed.setdefault(g, (grad.clone(), sq.clone())),
            before_fetch=lambda groups: fetched.append(groups),
            on_grads_landed=lambda g, e, sq: landed.append(g),
            before_cast=lambda groups: before_cast.append(groups),
        ),
    )
    batches = make_batches(2)
    result = pipeline.run([MicroBatch(i, lab) for i, lab in batches], loss_scale=0.5)
    for g, master in device_masters.items():
        store.master(g).copy_(master)  # the model the pipeline ran
    loss, grads = autograd_reference(store, 4, False, batches, 0.5)
    assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
    for g in range(store.n_groups):
        got = handed[g][0] if g in device_masters else store.grad(g)
        assert close(got, grads[g]), g
        assert torch.allclose(result.group_sq_norms[g], grads[g].pow(2).sum(), rtol=1e-4)
    assert all(torch.allclose(sq, grads[g].pow(2).sum(), rtol=1e-4) for g, (_, sq) in handed.items())
    assert sorted(landed) == [0, 3, 4, 5] and sorted(handed) == [1, 2]
    assert (1,) not in fetched and (2,) not in fetched
    casts = [(kind, what) for kind, what, slot in result.log if slot == "cast" and kind in ("cast", "reuse")]
    # in a slot of their own, cast at their turn: stage 2's backward finds its forward's cast there
    assert casts == [("cast", 1), ("cast", 2), ("reuse", 2), ("cast", 1)]
    assert before_cast == [(1,), (2,), (1,)]
    held = [what for kind, what, slot in result.log if kind == "compute" and str(slot).startswith("held")]
    assert held == [3, 3]  # the first block not updated on the device


def test_copied_stages_bind_their_copies_at_their_turn_and_are_never_cast():
    """A copied block computes on the copy it is given (here unlike its master, to tell them apart), forward and
    backward, after before_cast of its groups at each turn (where the stream waits for the update that refreshes
    it), with no cast or copy; its gradient is handed over as a resident one's. The cast slot serves the resident
    blocks that are not copied."""
    store, host_pipeline, _ = build(4, tied=False)
    device_masters = {g: torch.randn_like(store.master(g)) for g in (1, 2)}
    device_copies = {2: torch.randn_like(store.master(2))}
    handed, before_cast = {}, []
    pipeline = LayerPipeline(
        host_pipeline.stages,
        store,
        torch.device("cpu"),
        placement=Placement.build(len(host_pipeline.stages), resident=(1, 2), copied=(2,)),
        device_masters=device_masters,
        device_copies=device_copies,
        hooks=Hooks(
            on_device_grads=lambda g, grad, sq: handed.setdefault(g, grad.clone()),
            before_cast=lambda groups: before_cast.append(groups),
        ),
    )
    batches = make_batches(2)
    result = pipeline.run([MicroBatch(i, lab) for i, lab in batches], loss_scale=0.5)
    store.master(1).copy_(device_masters[1])
    store.master(2).copy_(device_copies[2])  # the weights stage 2 ran with
    loss, grads = autograd_reference(store, 4, False, batches, 0.5)
    assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
    assert all(close(handed[g] if g in handed else store.grad(g), grads[g]) for g in range(store.n_groups))
    kinds = ("cast", "copy", "copy_in", "reuse")
    bound = [(kind, what) for kind, what, _ in result.log if kind in kinds and what in (1, 2)]
    # (stage 1's backward finds its forward's cast still there: the copied stage took no slot between)
    assert bound == [("cast", 1), ("copy", 2), ("copy", 2), ("reuse", 1)]
    assert before_cast == [(1,), (2,), (2,)]
    assert pipeline.weights.cast_slot.buffer.numel() == store.layouts[1].numel


def test_a_copied_stage_needs_its_copy_and_its_residence():
    store, pipeline, _ = build(2, tied=False)
    masters = {g: store.master(g).clone() for g in (0, 1)}
    with pytest.raises(PlacementError, match=r"stage 1 \(.*\) cannot be resident\+copy"):
        pipeline.place(Placement.build(len(pipeline.stages), resident=(0, 1), copied=(1,)), masters)
    with pytest.raises(PlacementError, match=r"stage 0 .* cannot be resident\+copy: only a block"):
        pipeline.place(Placement.build(len(pipeline.stages), resident=(0, 1), copied=(0,)), masters, masters)
    with pytest.raises(PlacementError, match=r"stages \[1\] are copied but not resident"):
        Placement.build(len(pipeline.stages), resident=(0,), copied=(1,))


def test_parked_stages_come_back_after_the_backwards_their_placement_names(monkeypatch):
    """`Placement.moments_back_after`: the j-th parked stage's groups go to `bring_back` once the j-th block's
    backward from the last down has sent its gradients, before the parked stage's own backward; a parked stage
    binding a group another stage binds, one that would come back after its own backward, or one not resident is
    refused."""
    store, pipeline, _ = build(4, tied=False)
    masters = {g: store.master(g).clone() for g in (0, 1)}
    events = []
    hooks = Hooks(bring_back=lambda groups: events.append(("back", groups)))
    placement = Placement.build(len(pipeline.stages), resident=(0, 1), parked=(0, 1))
    assert placement.moments_back_after == {0: 4, 1: 3}
    pipeline = LayerPipeline(
        pipeline.stages, store, torch.device("cpu"), placement=placement, device_masters=masters, hooks=hooks
    )
    send = pipeline.gradients.send
    monkeypatch.setattr(
        pipeline.gradients, "send", lambda stage, log: events.append(("sent", stage)) or send(stage, log)
    )
    pipeline.run([MicroBatch(i, lab) for i, lab in make_batches(2)], loss_scale=1.0)
    sent_and_back = [("sent", 5), ("sent", 4), ("back", (0,)), ("sent", 3), ("back", (1,)), ("sent", 2)]
    assert events == sent_and_back + [("sent", 1), ("sent", 0)]
    with pytest.raises(PlacementError, match=r"parked stages \[3\] would get their moments back after their own"):
        Placement.build(len(pipeline.stages), resident=(0, 1, 2, 3), parked=(0, 1, 3))
    with pytest.raises(PlacementError, match=r"stages \[2\] are parked but not resident"):
        Placement.build(len(pipeline.stages), resident=(0, 1), parked=(2,))
    store, tied, _ = build(4, tied=True)
    masters = {g: store.master(g).clone() for g in (0, 1, 5)}
    with pytest.raises(PlacementError, match=r"parked stages \[0\] bind groups other stages bind too"):
        tied.place(Placement.build(len(tied.stages), resident=(0, 1, 5), parked=(0,)), masters)


def test_a_stage_binding_device_and_host_masters_is_refused():
    store, pipeline, _ = build(2, tied=True)
    with pytest.raises(SchedError, match="binds groups with device masters and groups without"):
        LayerPipeline(pipeline.stages, store, torch.device("cpu"), device_masters={0: store.master(0).clone()})
    placement = Placement.build(len(pipeline.stages), resident=(1,))
    with pytest.raises(PlacementError, match="stage 1 .* is resident but its groups lack device masters"):
        LayerPipeline(pipeline.stages, store, torch.device("cpu"), placement=placement)


def test_layer_major_order():
    """Every micro-batch passes through a stage before the next stage's weights are used."""
    store, pipeline, _ = build(2, tied=False)
    log = pipeline.run([MicroBatch(i, lab) for i, lab in make_batches(3)], loss_scale=1.0).log
    computes = [what for kind, what, _ in log if kind == "compute"]
    n = len(pipeline.stages)
    assert computes == list(range(n)) + list(range(n - 2, -1, -1))


def test_before_fetch_called_for_each_copy():
    store, pipeline, _ = build(2, tied=False)
    fetched = []
    pipeline.hooks.before_fetch = lambda groups: fetched.append(groups)
    pipeline.run([MicroBatch(i, lab) for i, lab in make_batches(1)], loss_scale=1.0)
    assert fetched[0] == (0,) and (3,) in fetched


def test_timeline_chrome_trace(tmp_path):
    store, pipeline, _ = build(2, tied=False)
    pipeline.run([MicroBatch(i, lab) for i, lab in make_batches(1)], loss_scale=1.0)
    path = tmp_path / "trace.json"
    pipeline.timeline.write_chrome_trace(path)
    import json

    events = json.loads(path.read_text())["traceEvents"]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert {"copy_in s1", "fwd s1", "bwd s1", "grad_out s1", "begin sweep 0"} <= names
    # the host's start of the step (its part of the step boundary) ends before the step's first computation begins
    start = next(e for e in events if e["name"] == "begin sweep 0")
    first = min((e for e in events if e["name"].startswith("fwd")), key=lambda e: e["ts"])
    assert start["ts"] + start["dur"] <= first["ts"]


def test_bad_stage_lists():
    store, pipeline, _ = build(1, tied=False)
    with pytest.raises(SchedError, match="n_slots"):
        LayerPipeline(pipeline.stages, store, torch.device("cpu"), n_slots=1)
    n = len(pipeline.stages)
    with pytest.raises(PlacementError, match="stage 1 .* cannot be held: only blocks before the last"):
        LayerPipeline(pipeline.stages, store, torch.device("cpu"), placement=Placement.build(n, held=(1,)))
    with pytest.raises(PlacementError, match="stage 0 .* is no block"):
        LayerPipeline(pipeline.stages, store, torch.device("cpu"), placement=Placement.build(n, offloaded=(0,)))
    with pytest.raises(PlacementError, match="places 2 stages; the model has 3"):
        LayerPipeline(pipeline.stages, store, torch.device("cpu"), placement=Placement.build(2))
    with pytest.raises(SchedError, match="loss"):
        LayerPipeline(pipeline.stages[:-1], store, torch.device("cpu"))
    wrong = [Stage(Mix(), (0,), "bad")] + list(pipeline.stages[1:])
    with pytest.raises(SchedError, match="expects 36 elements in group 0"):
        LayerPipeline(wrong, store, torch.device("cpu"))


@pytest.mark.parametrize(
    "ids_shape, labels_shape, bad_label, message",
    [
        ((2, 5), (2, 4), None, r"micro-batch 0: input_ids \(2, 5\) and labels \(2, 4\)"),
        ((5,), (5,), None, r"micro-batch 0: input_ids \(5,\) and labels \(5,\)"),
        ((2, 5), (2, 5), -1, "micro-batch 0: label -1 is neither a token id nor -100"),
    ],
)
def test_micro_batches_the_templates_would_misread_are_refused_before_any_stage_runs(
    ids_shape, labels_shape, bad_label, message
):
    store, pipeline, landed = build(1, tied=False)
    ids, labels = torch.randint(0, V, ids_shape), torch.randint(0, V, labels_shape)
    if bad_label is not None:
        labels[..., -1] = bad_label  # (nanoGPT's "no loss"; the heads read -100, torch's cross_entropy refuses -1)
    for step in (pipeline.run, pipeline.evaluate):
        with pytest.raises(SchedError, match=message):
            step([MicroBatch(ids, labels)], *([1.0] if step == pipeline.run else []))
    assert landed == []


def test_timeline_keeps_only_recent_steps():
    store, pipeline, _ = build(2, tied=False)
    batches = [MicroBatch(i, lab) for i, lab in make_batches(1)]
    pipeline.run(batches, loss_scale=1.0)
    per_step = len(pipeline.timeline.spans)
    for _ in range(4):
        pipeline.run(batches, loss_scale=1.0)
    assert len(pipeline.timeline.spans) <= 2 * per_step  # bounded on long runs (the last step plus the current)
    pipeline.timeline.keep_steps = None
    for _ in range(3):
        pipeline.run(batches, loss_scale=1.0)
    assert len(pipeline.timeline.spans) >= 3 * per_step


class _FakeEvent:
    """A CUDA timing event's interface over a clock the test sets: recorded at `now`, done once `now` passes it."""

    now = 0.0

    def __init__(self, stream):
        delay = stream if isinstance(stream, float) else 0.0  # (a "stream" of the test: how long its work runs)
        self.at, self.done_at = _FakeEvent.now, _FakeEvent.now + delay

    def query(self):
        return _FakeEvent.now >= self.done_at

    def synchronize(self):
        _FakeEvent.now = max(_FakeEvent.now, self.done_at)

    def elapsed_time(self, other):
        return other.at - self.at


def test_a_step_start_does_not_wait_for_spans_still_running_beside_it(monkeypatch):
    """A step's start resolves only the spans whose work has finished (the GPU optimizer's clipped updates run on
    beside the next forward: waiting for them there had the forward wait too), the rest later, each against its own
    step's origin."""
    monkeypatch.setattr(timeline_module, "_timing_event", _FakeEvent)
    streams = SimpleNamespace(cuda=True, device=None, compute=SimpleNamespace(synchronize=lambda: None))
    timeline = Timeline(enabled=True, keep_steps=None)
    timeline.start_step(streams)
    with timeline.device_span("fwd", "compute", streams, 0.0):
        _FakeEvent.now += 5.0
    with timeline.device_span("adamw", "gpu_optimizer", streams, 7.0):  # its work ends 7 ms after it is queued
        _FakeEvent.now += 1.0
    timeline.start_step(streams)  # at 6 ms: the update runs until 12
    assert [span["name"] for span in timeline.spans] == ["fwd"]
    timeline.resolve()
    (adamw,) = [span for span in timeline.spans if span["name"] == "adamw"]
    assert adamw["end_us"] - adamw["start_us"] == pytest.approx(1e3)  # (the fake's end is recorded at 6 ms)
    assert adamw["start_us"] - timeline.spans[0]["start_us"] == pytest.approx(5e3)  # against the first step's origin


def test_the_placement_runs_as_given_unless_the_device_lacks_the_memory_it_counts_on(caplog):
    """Where the free memory falls short of what the placement counts on, the first layers keeping products on the
    device recompute them, then the first blocks' checkpoints go to host memory, as few as make up the difference;
    the change is logged in one line and the step stays exact."""
    tokens = 3 * 2 * 5
    stage = tokens * D * 4  # a stage's checkpoints, and its products (fp32)
    need = 10 * stage
    store, pipeline, _ = build(4, tied=False, kept=(2, 3, 4), tokens=tokens, device_step_bytes=need)
    batches = make_batches(3)
    micro = [MicroBatch(i, lab) for i, lab in batches]
    pipeline.free_device_memory = lambda: need
    pipeline.run(micro, loss_scale=0.1)
    assert pipeline.executed == pipeline.placement and pipeline.fallback is None
    pipeline.free_device_memory = lambda: need - stage - 1  # one product stage and a byte short: two go
    with caplog.at_level("WARNING", logger="megatrain_sched"):
        result = pipeline.run(micro, loss_scale=0.1)
    assert pipeline.executed.kept == (4,) and pipeline.executed.offloaded == ()
    assert "2 layers recompute their matmul products instead of keeping them, 0 more" in pipeline.fallback
    assert caplog.records[-1].getMessage() == f"megatrain_sched: {pipeline.fallback}"
    loss, grads = autograd_reference(store, 4, False, batches, 0.1)
    assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
    assert all(close(store.grad(g), grads[g]) for g in range(store.n_groups))
    pipeline.free_device_memory = lambda: need - 4 * stage  # no products, then one checkpoint
    pipeline.run(micro, loss_scale=0.1)
    assert pipeline.executed.kept == () and pipeline.executed.offloaded == (1,)
    # a step of other tokens than the placement was made for counts what it keeps at its own size
    pipeline.free_device_memory = lambda: need
    pipeline.run(micro + micro[:1], loss_scale=0.1)
    # 10 tokens more of 4 stages' checkpoints and 3 stages' products: 1.75 stages of products at 40 tokens
    assert pipeline.executed.kept == (4,)


def test_layers_keeping_products_keep_their_extras_where_the_headroom_holds_them():
    """A step lets the layers keeping their products on the device keep their extra products too
    (`extra_product_bytes_per_token`), last layers first, as many as its headroom holds beyond `EXTRAS_MARGIN`;
    all of them where device memory is not counted (the CPU). The step stays exact."""
    tokens = 3 * 2 * 5
    extra = tokens * D * 4  # a stage's extra products (fp32)
    need = 10 * extra
    store, pipeline, _ = build(4, tied=False, kept=(2, 3, 4), tokens=tokens, device_step_bytes=need)
    batches = make_batches(3)
    micro = [MicroBatch(i, lab) for i, lab in batches]
    loss, grads = autograd_reference(store, 4, False, batches, 0.1)
    for free, extras in [
        (None, (2, 3, 4)),
        (need + EXTRAS_MARGIN + 2 * extra, (3, 4)),
        (need + EXTRAS_MARGIN + 2 * extra - 1, (4,)),
        (need, ()),
    ]:
        pipeline.free_device_memory = None if free is None else (lambda free=free: free)
        result = pipeline.run(micro, loss_scale=0.1)
        assert pipeline.extras == extras and pipeline.executed.kept == (2, 3, 4)
        assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
        assert all(close(store.grad(g), grads[g]) for g in range(store.n_groups))


def test_a_step_in_sweeps_fits_its_placement_once_by_its_largest_sweep():
    """The first sweep, the largest, fits the placement to the free memory; the later ones run it as fitted (they
    find the gradients carried from sweep to sweep allocated, which the placement counts on already)."""
    tokens = 2 * 2 * 5  # two micro-batches a sweep
    need = 10 * tokens * D * 4
    store, pipeline, _ = build(4, tied=True, kept=(3, 4), tokens=tokens, device_step_bytes=need, sweeps=2)
    asked = []
    pipeline.free_device_memory = lambda: asked.append(len(asked)) or need - (len(asked) > 1) * need
    micro = [MicroBatch(i, lab) for i, lab in make_batches(3)]
    assert [len(part) for part in pipeline.sweeps_of(micro)] == [2, 1]
    pipeline.run(micro, loss_scale=0.1)
    assert asked == [0] and pipeline.fallback is None and pipeline.executed == pipeline.placement


def test_a_new_placement_between_steps(monkeypatch):
    """`place` changes held buffers and host memory between steps; the result stays exact."""
    store, pipeline, _ = build(4, tied=True, held=(1, 2), offloaded=(1, 2, 3, 4), host_kept=(3,))
    batches = make_batches(2)
    micro = [MicroBatch(i, lab) for i, lab in batches]
    pipeline.run(micro, loss_scale=1.0)
    assert set(pipeline.activations.host_memory.buffers) == {*(("checkpoint", s) for s in range(1, 5)), ("products", 0)}
    pipeline.place(Placement.build(len(pipeline.stages), held=(2, 3), offloaded=(1,)))
    assert set(pipeline.weights.held) == {2, 3} and set(pipeline.activations.host_memory.buffers) == {("checkpoint", 1)}
    result = pipeline.run(micro, loss_scale=1.0)
    loss, grads = autograd_reference(store, 4, True, batches, 1.0)
    assert torch.allclose(result.loss_sum, loss, rtol=1e-5)
    assert all(close(store.grad(g), grads[g]) for g in range(store.n_groups))


def test_expandable_segments_unless_the_user_set_the_allocator(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    expandable_device_memory()
    assert calls == ["expandable_segments:True"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")  # the user's choice stands
    expandable_device_memory()
    assert calls == ["expandable_segments:True"]


def test_the_staging_ring_holds_a_whole_stage_up_to_four_chunks():
    chunk = 2**26  # 256 MiB of fp32
    assert staging_buffers(233_000_000) == (4, chunk)  # a 7B layer, whole
    assert staging_buffers(95_000_000) == (2, chunk)  # a Gemma-3-4B layer, whole
    assert staging_buffers(671_000_000) == (4, chunk)  # a 262k vocabulary's table: the ring's cap, 1 GiB
    assert staging_buffers(1000) == (2, 1000)  # a tiny model: two stage-sized buffers, one fills while one casts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_groups_held_in_the_compute_dtype_give_the_gradients_their_masters_give(dtype):
    """A frozen lookup, a trained block, a frozen block (its backward reads its weights, and computes only the
    input's gradient) and a trained head: held once in the compute dtype (`frozen_in_compute_dtype`), the frozen
    groups compute what their masters cast to it compute, bit for bit, and no staging ring is sized for them."""
    torch.manual_seed(0)
    templates = [Lookup(), Mix(), Mix(), Readout(tied=False)]
    layouts = [GroupLayout.from_specs([(s.name, s.shape, True) for s in t.groups[0]]) for t in templates]
    weights = [torch.randn(layout.numel) for layout in layouts]
    batches = [MicroBatch(ids, labels) for ids, labels in make_batches(2)]
    runs = []
    for in_compute_dtype in (False, True):
        store = HostStore(layouts, dtype, frozen={0, 2}, frozen_in_compute_dtype=in_compute_dtype)
        for group, values in enumerate(weights):
            store.master(group).copy_(values)
        stages = [Stage(t, (i,), f"s{i}") for i, t in enumerate(templates)]
        landed = []
        hooks = Hooks(on_grads_landed=lambda g, e, sq: landed.append(g))
        pipeline = LayerPipeline(stages, store, torch.device("cpu"), hooks=hooks)
        result = pipeline.run(batches, loss_scale=0.1)
        assert sorted(landed) == [1, 3]  # no gradient of a frozen group
        runs.append((store, result))
        # the groups that travel as fp32 masters, which a GPU would cast through the staging ring
        as_masters = set() if dtype == torch.float32 else {1, 3} if in_compute_dtype else {0, 1, 2, 3}
        assert cast_numels(stages, store) == [layouts[g].numel * (g in as_masters) for g in range(4)]
    (plain, before), (store, after) = runs
    assert store.arenas["master"].numel() < plain.arenas["master"].numel()
    assert store.arenas["frozen"].dtype == dtype and [store.master_numel(g) for g in (0, 2)] == [0, 0]
    assert torch.equal(after.loss_sum, before.loss_sum)
    for group in (1, 3):
        assert torch.equal(store.grad(group), plain.grad(group))
        assert torch.equal(after.group_sq_norms[group], before.group_sq_norms[group])
    for group in (0, 2):
        assert store.grad(group).numel() == 0 and torch.equal(store.master(group), weights[group].to(dtype))


def test_a_product_kept_in_host_memory_keeps_its_layout():
    """A product laid out densely in another order of dimensions (a compiled graph saves such, and its backward
    asserts the strides) has them in host memory, in the buffer or past its end, and back on the device; one with
    gaps is copied contiguous."""
    from megatrain_sched.activations import _Cursor

    permuted = torch.randn(2, 12, 4, 16).transpose(1, 2)
    cursor = _Cursor(torch.zeros(8192, dtype=torch.uint8), pin=False)
    for host in cursor.take(permuted), cursor.take(permuted):  # (the second past the buffer's 8192 bytes)
        host.copy_(permuted)
        assert host.stride() == permuted.stride() and torch.equal(host, permuted)
        assert torch.empty_like(host).stride() == permuted.stride()  # (as `_reload` brings it back)
    assert cursor.take(torch.randn(2, 8)[:, :4]).stride() == (4, 1)


@pytest.mark.parametrize("n", [0, 1, 1023, 1024, 1025, 4_207_008])
def test_a_groups_squared_gradient_norm_is_exact_at_millions_of_elements(n):
    """A layer's gradient norm is one reduction over its flat buffer, where torch's clip_grad_norm_ takes one a
    parameter: the reduction keeps float64's accuracy at any length (fp32's own whole-buffer norm on the CPU was 4e-4
    off at 4.2M elements), chunk edges included."""
    generator = torch.Generator().manual_seed(n)
    flat = torch.randn(n, generator=generator) * torch.rand(n, generator=generator) ** 4
    exact = flat.double().square().sum().item()
    assert sq_norm(flat).item() == pytest.approx(exact, rel=1e-6, abs=1e-30)
