"""AdamW over a HostStore's flat fp32 buffers, one group at a time.

One optimizer step = begin_step() then update_group(g) for every group, in any order
and on any thread; the result equals torch.optim.AdamW over the whole model. `DeviceAdamW`
keeps a few groups' masters and moments on the GPU instead and updates them there, in the
same step count.
"""

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from megatrain_store import LOAD_BIAS, HostStore, PinnedSpan

from . import host_kernel

STATE_NAMES = ("exp_avg", "exp_avg_sq")
# Elements per gathered chunk of rows in `update_rows` (16 MiB per fp32 buffer, three buffers)
ROWS_CHUNK_NUMEL = 2**22


class OptimError(ValueError):
    """A bad optimizer setting or state, with the fix in the message (a ValueError: a bad value, as Python's own)."""


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW's settings, as torch.optim.AdamW's arguments (weight decay decoupled, on the runs the store's layout
    marks as decayed); `OptimError` where one is out of range. `HostAdamW` reads betas, eps and weight_decay; each
    update's learning rate is the `lr` given to `update_group` (e.g. `lr_at(step, schedule)`), not this `lr`."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        if not self.lr >= 0:
            raise OptimError(f"lr must be >= 0, got {self.lr}")
        pair = isinstance(self.betas, tuple | list) and len(self.betas) == 2
        if not pair or not all(0.0 <= b < 1.0 for b in self.betas):
            raise OptimError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if not self.eps > 0:
            raise OptimError(f"eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0:
            raise OptimError(f"weight_decay must be >= 0, got {self.weight_decay}")


def _fused_available() -> bool:
    try:
        p, g, m, v = (torch.zeros(2) for _ in range(4))
        torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            [torch.ones(())],
            lr=0.1,
            beta1=0.9,
            beta2=0.9,
            weight_decay=0.0,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


FUSED = _fused_available()


def adamw_update_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
) -> None:
    """In-place AdamW on fp32 tensors of one device; `step` (0-dim fp32, on that device) is the
    already-incremented count.

    With `grad_scale`, gradients are divided by it first (used to apply a clip coefficient
    without a separate pass over the gradients); where `found_inf` (0-dim) is 1, nothing changes
    (a GPU update skips a non-finite gradient without the host reading it). The host's fp32 runs `host_kernel`'s
    where it has the threads to gain from it (it leaves the gradients as they were, and balances its threads)."""
    if found_inf is None and host_kernel.takes(params[0]):
        host_kernel.host_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            float(step),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            grad_scale=1.0 if grad_scale is None else float(grad_scale),
        )
        return
    if FUSED:
        torch._fused_adamw_(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            [step] * len(params),
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        return
    if found_inf is not None and bool(found_inf):
        return
    count = float(step)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        if grad_scale is not None:
            g.div_(grad_scale)
        p.mul_(1 - lr * weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / (1 - beta2**count) ** 0.5).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**count))


class HostAdamW:
    """AdamW state (two fp32 moments in the store, a step count) and per-group updates.

    The store's load-balanced router biases (`LOAD_BIAS`) move by `load_bias_rate` per step against
    the sign of their experts' excess load (DeepSeek-V3's aux-loss-free balancing: b += rate * sign(mean
    load - load)); 0 leaves them as they are."""

    def __init__(self, store: HostStore, config: AdamWConfig, load_bias_rate: float = 0.0):
        missing = [name for name in STATE_NAMES if name not in store.state_names]
        if missing:
            raise OptimError(f"the store has no buffers for {missing}; create it with state_names={STATE_NAMES}")
        if not load_bias_rate >= 0:
            raise OptimError(f"load_bias_rate must be >= 0, got {load_bias_rate}")
        self.store, self.config, self.load_bias_rate = store, config, load_bias_rate
        self.step_count = 0  # the steps taken (a resume sets it back before its next begin_step)
        self._step_tensor = torch.zeros(())
        self._runs = [layout.update_runs() for layout in store.layouts]
        self._row_temps: list[Tensor] | None = None  # update_rows' gathered gradient and moments

    @property
    def step_tensor(self) -> Tensor:
        """The current step count as the 0-dim tensor the update uses; a new object each step."""
        return self._step_tensor

    def begin_step(self) -> None:
        """Advance the step count; call once per optimizer step before its group updates."""
        self.step_count += 1
        self._step_tensor = torch.tensor(float(self.step_count), dtype=self.store.master_dtype)

    def update_group(self, group: int, lr: float, clip_coef: float = 1.0, step: Tensor | None = None) -> None:
        """AdamW on this process's shard of `group` (all of it unless the store is sharded) from its
        landed gradient (times clip_coef), then refresh the shard's wire copy if any.

        `step` is the `step_tensor` of the optimizer step the gradient belongs to (default: the
        current one): an update still queued when the next step begins must keep its own count."""
        if self.step_count == 0:
            raise OptimError("update_group called before begin_step")
        store = self.store
        start, end = store.shard_range(group)
        offset = store.owned_range(group)[0]  # master and moments hold [offset, ...) of the group
        master, grad = store.master(group), store.grad(group)  # grad holds [start, end) only
        exp_avg, exp_avg_sq = store.state("exp_avg", group), store.state("exp_avg_sq", group)
        grad_scale = None
        if clip_coef != 1.0:
            if FUSED and master.dtype == torch.float32:
                grad_scale = torch.tensor(1.0 / clip_coef)  # applied inside the kernel: no extra pass
            else:
                grad.mul_(clip_coef)  # the fused kernel takes only an fp32 scale
        self.update_runs(
            group, (master, grad, exp_avg, exp_avg_sq), (start, end), offset, lr, step, grad_scale=grad_scale
        )
        if start < end:
            store.refresh_wire(group, (start, end))

    def update_runs(
        self,
        group: int,
        buffers: tuple[Tensor, Tensor, Tensor, Tensor],
        span: tuple[int, int],
        offset: int,
        lr: float,
        step: Tensor | None = None,
        grad_scale: Tensor | None = None,
        found_inf: Tensor | None = None,
    ) -> None:
        """AdamW on [start, end) of `group` in `buffers` (master, gradient, exp_avg, exp_avg_sq, flat, of
        one device, as `step` is; the gradient holds [start, end), the others [offset, ...)), weight decay
        run by run; load-balanced biases by their rule."""
        cfg, (start, end) = self.config, span
        master, grad, exp_avg, exp_avg_sq = buffers
        step = self._step_tensor if step is None else step
        if self.load_bias_rate:
            self._move_load_biases(group, master, grad, span, offset, found_inf)
        for decay in (True, False):
            rule = "decay" if decay else "no_decay"
            runs = [
                (max(o, start), min(o + n, end))
                for o, n, r in self._runs[group]
                if r == rule and o < end and o + n > start
            ]
            if not runs:
                continue
            adamw_update_(
                [master[a - offset : b - offset] for a, b in runs],
                [grad[a - start : b - start] for a, b in runs],
                [exp_avg[a - offset : b - offset] for a, b in runs],
                [exp_avg_sq[a - offset : b - offset] for a, b in runs],
                step,
                lr=lr,
                beta1=cfg.betas[0],
                beta2=cfg.betas[1],
                eps=cfg.eps,
                weight_decay=cfg.weight_decay if decay else 0.0,
                grad_scale=grad_scale,
                found_inf=found_inf,
            )

    def _move_load_biases(
        self, group: int, master: Tensor, grad: Tensor, span: tuple[int, int], offset: int, found_inf: Tensor | None
    ) -> None:
        """Each load-balanced bias of [start, end) one `load_bias_rate` against the sign of its excess load
        (both halves' gradient slots hold it), kept a split-precision pair: an expert whose hi and lo are
        both here is re-split (hi exact in bfloat16, lo the rest); one whose hi lies in the shard before
        moves its lo alone, and that shard leaves the hi as it is, so the shards agree without talking."""
        start, end = span
        for o, n, rule in self._runs[group]:
            if rule != LOAD_BIAS or o >= end or o + n <= start:
                continue
            half = n // 2
            # experts whose hi, and whose lo, fall in [start, end)
            hi_first, hi_stop = max(o, start) - o, min(o + half, end) - o
            lo_first, lo_stop = max(o + half, start) - o - half, min(o + n, end) - o - half
            first, stop = max(hi_first, lo_first), min(hi_stop, lo_stop)
            if first < stop:
                hi = master[o + first - offset : o + stop - offset]
                lo = master[o + half + first - offset : o + half + stop - offset]
                total = hi + lo + self._load_step(grad[o + first - start : o + stop - start], found_inf)
                hi.copy_(total.to(torch.bfloat16))
                lo.copy_(total - hi)
            lo_alone = min(lo_stop, hi_first)
            if lo_first < lo_alone:
                lo = master[o + half + lo_first - offset : o + half + lo_alone - offset]
                lo.add_(self._load_step(grad[o + half + lo_first - start : o + half + lo_alone - start], found_inf))

    def _load_step(self, excess_load: Tensor, found_inf: Tensor | None) -> Tensor:
        step = excess_load.sign().mul_(-self.load_bias_rate)
        return step if found_inf is None else step.mul_(1 - found_inf)

    def update_rows(
        self,
        group: int,
        rows: Tensor,
        out: Tensor,
        lr: float,
        clip_coef: float = 1.0,
        step: Tensor | None = None,
    ) -> Tensor:
        """The master weights of only `rows` of a group of rows (an embedding table) as AdamW makes them,
        written to `out` ([len(rows), row], pinned for a copy to the GPU), leaving the store as it is.
        AdamW is elementwise, so these are the rows `update_group` makes (to the bit with `host_kernel`'s; torch's
        fused kernel's vector lanes may round a last bit apart); `write_rows` puts them in the store after it. The
        group must be unsharded, with one weight-decay setting throughout."""
        store, cfg = self.store, self.config
        runs = self._runs[group]
        if len(runs) != 1 or store.shard_range(group) != (0, store.layouts[group].numel) or not store.owns_all:
            raise OptimError(
                f"update_rows needs an unsharded group with one weight-decay setting; group {group} is not"
            )
        row = out.shape[1]
        tables = [t.view(-1, row) for t in (store.grad(group), *(store.state(n, group) for n in STATE_NAMES))]
        torch.index_select(store.master(group).view(-1, row), 0, rows, out=out)
        chunk = max(1, ROWS_CHUNK_NUMEL // row)
        if self._row_temps is None or self._row_temps[0].shape != (chunk, row):
            self._row_temps = [torch.empty(chunk, row, dtype=out.dtype) for _ in tables]  # reused: no page faults
        grad_scale = None
        if clip_coef != 1.0 and FUSED and out.dtype == torch.float32:  # as update_group applies it
            grad_scale = torch.tensor(1.0 / clip_coef)
        for start in range(0, len(rows), chunk):
            picked = rows[start : start + chunk]
            grad, exp_avg, exp_avg_sq = (
                torch.index_select(table, 0, picked, out=temp[: len(picked)])
                for table, temp in zip(tables, self._row_temps)
            )
            if clip_coef != 1.0 and grad_scale is None:
                grad.mul_(clip_coef)
            adamw_update_(
                [out[start : start + chunk]],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                self._step_tensor if step is None else step,
                lr=lr,
                beta1=cfg.betas[0],
                beta2=cfg.betas[1],
                eps=cfg.eps,
                weight_decay=cfg.weight_decay if runs[0][2] == "decay" else 0.0,
                grad_scale=grad_scale,
            )
        return out

    def write_rows(self, group: int, rows: Tensor, master_rows: Tensor) -> None:
        """Put `update_rows`' master rows into the store after `update_group` (its rows may differ in the
        last bit): the weights kept are the ones the GPU was given, so a resumed run sees them too."""
        self.store.master(group).view(-1, master_rows.shape[1]).index_copy_(0, rows, master_rows)
        self.store.refresh_wire(group)


class DeviceAdamW:
    """AdamW for groups whose master weights and moments stay on the GPU between steps (the embedding and
    first decoder layers, where a small step leaves the CPU optimizer slower than the GPU's work): each
    update runs on the device right after the group's backward (or once the clip coefficient is
    known), so neither its weights nor its gradient cross PCIe and the CPU does not touch it.

    With clipping the updates wait for the global norm, which is known only after the whole backward:
    `update_beside` queues them on a stream of their own, where they run beside the next forward instead of
    ahead of it (Qwen2.5-7B at 8k tokens on an H200, 27 resident blocks and the embedding: 72 ms of each 0.8 s
    step the GPU did nothing else), and `wait_for` orders a stage's cast after its groups' updates.

    Of the groups `keep_copies` names, a compute-dtype copy of the master stays on the device (`copies`), which each
    update and `to_device` refresh right after writing the master, on the same stream: what reads it never casts it
    (the pipeline's copied stages; a cast took 0.9 ms of a Qwen3-30B-A3B layer's forward, and again of its backward).

    The moments of the groups `park` names wait in the store's host memory (pinned here) from each update until
    `bring_back` queues them back, on a stream of their own both ways: the GPU holds none of them where a step's
    activations peak, at the forward's end (Qwen2.5-7B at 32k tokens on an H200: the table's and 10 blocks'
    moments, 23 GB, let 27 layers keep their matmul products where 20-21 did). Their device memory is the
    compute stream's (`home`): it is let go in that stream's order (`let_go_parked`), never by the caching
    allocator's events, which it would wait for wherever an allocation found the GPU full.

    The store keeps host copies of these groups: `to_device` loads them (before the first update,
    and after the store was written: a checkpoint loaded), `to_host` brings the store up to date
    (checkpoints, export). Step count and decay runs are those of the `HostAdamW` it extends."""

    def __init__(self, host: HostAdamW, groups: list[int], device: torch.device):
        store = host.store
        if not store.owns_all or store.shard[1] != 1:
            raise OptimError("GPU-updated groups need an unsharded store (one process holding all of the state)")
        late = [g for g in groups if g >= store.first_disk_group]
        if late:
            raise OptimError(f"groups {late} keep their optimizer state on disk; they cannot be updated on the GPU")
        self.host, self.device = host, torch.device(device)
        numel = {g: store.layouts[g].numel for g in groups}
        # zeros until to_device: what reads them before (a compile warm-up) sees finite numbers
        self.masters = {g: torch.zeros(numel[g], dtype=store.master_dtype, device=self.device) for g in groups}
        self.states = {
            g: [torch.zeros(numel[g], dtype=store.master_dtype, device=self.device) for _ in STATE_NAMES]
            for g in groups
        }
        self.copies: dict[int, Tensor] = {}  # group -> its master in the compute dtype (`keep_copies`)
        self.parking: set[int] = set()  # groups whose moments are parked in the store after each update (`park`)
        self._parked: set[int] = set()  # of those, the ones whose moments are there now (states[g] then None)
        self._back: dict[int, Any] = {}  # group -> an event its moments, brought back, are whole on the device after
        self._park_due: set[int] = set()  # parked groups updated since: parked at their next `wait_for`
        self._leaving: list[tuple[Any, list[Tensor]]] = []  # (the copy out's event, moments) parked, not let go yet
        self._pins = PinnedSpan([host.store.arenas[f"state.{name}"] for name in STATE_NAMES])
        self._stale_host: set[int] = set()  # updated here since the last to_host
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None  # `update_beside`'s
        self.moment_stream = torch.cuda.Stream(self.device) if cuda else None  # parks and brings back moments
        self.home = torch.cuda.current_stream(self.device) if cuda else None  # the compute stream
        # group -> (an event its update beside the compute stream ends with, the gradient that update reads)
        self._beside: dict[int, tuple[Any, Tensor]] = {}

    @property
    def groups(self) -> list[int]:
        """The resident store groups this optimizer updates (those it holds device masters of), in its order."""
        return list(self.masters)

    def update(
        self,
        group: int,
        grad: Tensor,
        lr: float,
        clip_coef: "float | DeviceClip" = 1.0,
        step: Tensor | None = None,
        sq_norm: Tensor | None = None,
    ) -> None:
        """Queue AdamW on `group` from its gradient (a flat device tensor, times clip_coef: a number, or the
        device's `DeviceClip`, whose skip flag set leaves the group as it is) on the current stream. `step` as in
        `HostAdamW.update_group`; with `sq_norm` (the gradient's squared norm, on the device) a non-finite
        gradient leaves the group as it is."""
        if step is None and self.host.step_count == 0:
            raise OptimError("update called before begin_step (or without its step count)")
        grad_scale = found_inf = None
        fused = FUSED and grad.dtype == torch.float32  # (the fused kernel takes an fp32 scale alone)
        if isinstance(clip_coef, DeviceClip):
            found_inf = clip_coef.skip
            if fused:
                grad_scale = clip_coef.scale
            else:
                grad.mul_(clip_coef.coef.to(grad.dtype))
        elif clip_coef != 1.0:
            if fused:  # as update_group applies it
                grad_scale = torch.full((), 1.0 / clip_coef, device=self.device)
            else:
                grad.mul_(clip_coef)
        if sq_norm is not None:
            found_inf = (~torch.isfinite(sq_norm)).float()
        # the count made here rather than copied: a copy from pageable memory would wait for the stream;
        # fp32 whatever the params (CUDA's fused kernel reads it as fp32)
        count = float(self.host.step_tensor if step is None else step)
        step_here = torch.full((), count, dtype=torch.float32, device=self.device)
        numel = self.masters[group].numel()
        buffers = (self.masters[group], grad, *self._moments_of(group))
        self.host.update_runs(group, buffers, (0, numel), 0, lr, step_here, grad_scale, found_inf)
        self._refresh_copy(group)
        self._stale_host.add(group)
        if group in self.parking:
            self._park_due.add(group)

    def park(self, groups: Iterable[int]) -> None:
        """Park these groups' moments in the store now, and again after each of their updates, and no other group's
        (those parked come back now). Their state arenas are pinned first, where the store pins."""
        groups = set(groups)
        if not groups <= set(self.masters):
            raise OptimError(f"groups {sorted(groups - set(self.masters))} are parked but not updated on the GPU")
        self.bring_back(sorted(self._parked - groups))
        if self.moment_stream is not None and groups:  # (copies from pageable memory: a sixth of PCIe's speed)
            starts, numel = self.host.store.state_starts, self.host.store.state_numel
            self._pins.cover(starts[min(groups)], starts[max(groups)] + numel(max(groups)))
        self.parking = groups
        self._park_due &= groups
        self.wait_for(groups)
        for group in sorted(groups - self._parked):
            self._park(group)

    def _park(self, group: int) -> None:
        """Copy `group`'s moments into the store after the work queued on the current stream (its update), on the
        moment stream; `let_go_parked` gives their device memory back."""
        states, self.states[group] = self.states[group], None
        self._parked.add(group)
        stored = [self.host.store.state(name, group) for name in STATE_NAMES]
        if self.moment_stream is None:
            for host, state in zip(stored, states):
                host.copy_(state)
            return
        if len(self._leaving) >= len(self.parking):  # a step's, none let go since (no pipeline calls it)
            self.let_go_parked()
        self.moment_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.moment_stream):
            for host, state in zip(stored, states):
                host.copy_(state, non_blocking=True)
            self._leaving.append((self.moment_stream.record_event(), states))

    def let_go_parked(self) -> None:
        """Order the home stream's next work after the parked moments' copies out and give their memory back to its
        allocations (called on it where the step needs the room: the forward after the resident stages)."""
        for copied_out, _ in self._leaving:
            self.home.wait_event(copied_out)
        self._leaving.clear()

    def bring_back(self, groups: Iterable[int]) -> None:
        """Queue the parked moments of `groups` back onto the device, on the moment stream after the work queued on
        the current one (whose memory they take: the backward's let go of); their next update waits for them."""
        store = self.host.store
        for group in groups:
            if group not in self._parked:
                continue
            self._parked.discard(group)
            numel = self.masters[group].numel()
            with torch.cuda.stream(self.home) if self.home is not None else nullcontext():  # (its memory)
                states = [torch.empty(numel, dtype=store.master_dtype, device=self.device) for _ in STATE_NAMES]
            self.states[group] = states
            stored = [store.state(name, group) for name in STATE_NAMES]
            if self.moment_stream is None:
                for state, host in zip(states, stored):
                    state.copy_(host)
                continue
            self.moment_stream.wait_stream(self.home)
            with torch.cuda.stream(self.moment_stream):
                for state, host in zip(states, stored):
                    state.copy_(host, non_blocking=True)
                self._back[group] = self.moment_stream.record_event()

    def _moments_of(self, group: int) -> list[Tensor]:
        """`group`'s moments on the device, for work queued on the current stream (brought back now if parked)."""
        self.bring_back((group,))
        back = self._back.pop(group, None)
        if back is not None:
            torch.cuda.current_stream(self.device).wait_event(back)
        return self.states[group]

    def _settle(self) -> None:
        """Block until the moments parked and brought back so far are where they went."""
        if self.moment_stream is not None:
            self.moment_stream.synchronize()
        self._back.clear()
        self._leaving.clear()

    def keep_copies(self, groups: Iterable[int]) -> None:
        """Keep a compute-dtype copy of these groups' masters (made now, after their updates queued so far), and
        no other's."""
        groups = set(groups)
        if not groups <= set(self.masters):
            raise OptimError(f"groups {sorted(groups - set(self.masters))} are copied but not updated on the GPU")
        self.wait_for(groups)
        dtype, kept = self.host.store.compute_dtype, self.copies
        self.copies = {g: kept[g] if g in kept else torch.empty_like(self.masters[g], dtype=dtype) for g in groups}
        for group in groups:
            self._refresh_copy(group)

    def _refresh_copy(self, group: int) -> None:
        if group in self.copies:
            self.copies[group].copy_(self.masters[group])

    def update_beside(
        self, group: int, grad: Tensor, *args, span: Callable[[], AbstractContextManager] = nullcontext, **kwargs
    ) -> None:
        """`update(group, grad, *args, **kwargs)`, queued inside `span()` on the optimizer's own stream after the
        work queued so far on the current one (which made `grad`), so that it runs beside what the current stream
        does next. Whatever reads the group's master after it calls `wait_for` first; until then its gradient is
        held here (the current stream's allocations reuse that memory only after the wait), and a DeviceClip's
        tensors, which no one holds, are recorded on the optimizer's stream. On the CPU, `update` as it is."""
        if self.stream is None:
            with span():
                self.update(group, grad, *args, **kwargs)
            return
        self.wait_for((group,))  # (an update beside not waited for yet: its gradient is let go only in order)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for clip in (arg for arg in (*args, *kwargs.values()) if isinstance(arg, DeviceClip)):
            for tensor in (clip.coef, clip.scale, clip.skip):
                tensor.record_stream(self.stream)
        with torch.cuda.stream(self.stream), span():
            self.update(group, grad, *args, **kwargs)
            self._beside[group] = (self.stream.record_event(), grad)

    def wait_for(self, groups: Iterable[int]) -> None:
        """Order the current stream's next work after the updates of `groups` queued beside it (device side: the
        host does not block), and let their gradients go; park the moments of those updated since they were last
        parked. Called on the stream that made the gradients (where the pipeline casts their stage, in the forward:
        the parks spread over it, none queued at the step's boundary, where the host reads the norm)."""
        for group in groups:
            beside = self._beside.pop(group, None)
            if beside is not None:
                torch.cuda.current_stream(self.device).wait_event(beside[0])
            if group in self._park_due:
                self._park_due.discard(group)
                self._park(group)

    @property
    def held_bytes(self) -> int:
        """Device bytes of the gradients that updates beside the compute stream still hold (`update_beside`), and of
        the moments of parked groups on the device: given back as the next step's casts wait for their updates, so
        free for that step."""
        gradients = sum(grad.nbytes for _, grad in self._beside.values())
        moments = sum(state.nbytes for g in self.parking - self._parked for state in self.states[g])
        leaving = sum(state.nbytes for _, states in self._leaving for state in states)
        return gradients + moments + leaving

    def to_host(self) -> None:
        """Copy the masters and moments updated here since the last call into the store (waits for them)."""
        self.wait_for(list(self._beside))
        self._settle()
        store = self.host.store
        for group in sorted(self._stale_host):
            store.master(group).copy_(self.masters[group])
            for name, state in zip(STATE_NAMES, self.states[group] or ()):  # (parked: the store has them)
                store.state(name, group).copy_(state)
            store.refresh_wire(group)
        self._stale_host.clear()

    def to_device(self) -> None:
        """Load the groups' masters and moments from the store (after it was written; parked moments stay there)."""
        self._park_due.clear()  # (a park now would write the old moments over the store's)
        self.wait_for(list(self._beside))
        self._settle()
        store = self.host.store
        for group, master in self.masters.items():
            master.copy_(store.master(group))
            self._refresh_copy(group)
            for name, state in zip(STATE_NAMES, self.states[group] or ()):
                state.copy_(store.state(name, group))
        self._stale_host.clear()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6)); 1 when off."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


@dataclass(frozen=True)
class DeviceClip:
    """A step's clip coefficient and skip flag as 0-dim tensors of the device its resident groups update on, so
    that their updates can be queued the moment the backward is queued, before the host reads the norm (which
    waits for the backward to end): the GPU then updates them while the host reads the norm and queues the next
    step, where it sat idle before (`UpdatesAfterClipping.gradients_complete`)."""

    coef: Tensor  # float64: `clip_coefficient`'s formula (the host's own sqrt may differ in the last bit)
    scale: Tensor  # fp32: 1 / coef, as the fused kernel divides the gradient by it (as `update_group` gives it)
    skip: Tensor  # fp32: 1 where the step is skipped (its loss or gradient norm not finite), else 0

    @classmethod
    def of_sums(cls, loss_sum: Tensor, sq_norm_sum: Tensor, max_norm: float) -> "DeviceClip":
        """From the step's summed loss and squared gradient norm (0-dim, on the device), computed there."""
        norm = sq_norm_sum.double().sqrt()
        one = torch.ones_like(norm)
        # (torch.div of two tensors: a Python number divided by a tensor is a reciprocal times it, rounded twice)
        coef = torch.div(one * max_norm, norm + 1e-6).clamp(max=1.0) if max_norm > 0 else one
        skip = (~(torch.isfinite(loss_sum) & torch.isfinite(sq_norm_sum))).float()
        return cls(coef, torch.div(one, coef).float(), skip)
