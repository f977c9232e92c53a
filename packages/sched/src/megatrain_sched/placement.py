"""Where each stage's weights and activations live during a training step: the plan `LayerPipeline` runs.

A planner (megatrain's cost model, or a caller by hand) decides one `Placement` for a step size; the
pipeline executes it as given and changes it only where the device would run out of memory, saying so.
"""

import functools
from dataclasses import asdict, dataclass, field

# where a stage's weights live between uses
STREAMED = "streamed"  # copied in for each pass (forward, backward)
HELD = "held"  # copied in for the forward, kept in a device buffer of its own until its backward
RESIDENT = "resident"  # fp32 master and moments live on the device and are updated there: cast, never copied
# resident, and its compute-dtype copy lives on the device too, refreshed by each update: neither cast nor copied
RESIDENT_COPY = "resident+copy"
# where a block's activation checkpoint and its forward's matmul products wait for its backward
DEVICE, HOST = "device", "host"
RECOMPUTE = "recompute"  # products not kept: the backward recomputes them from the checkpoint

_CHOICES = {
    "weights": (STREAMED, HELD, RESIDENT, RESIDENT_COPY),
    "checkpoint": (DEVICE, HOST),
    "products": (RECOMPUTE, DEVICE, HOST),
}


class PlacementError(ValueError):
    """A placement with an unknown choice, or one that does not match the stages it is given to."""


@dataclass(frozen=True)
class StagePlacement:
    """One stage's choices (see the module's constants). The embedding and head have no checkpoint or
    products of their own: theirs stay `device` and `recompute`."""

    weights: str = STREAMED
    checkpoint: str = DEVICE
    products: str = RECOMPUTE

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise PlacementError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Placement:
    """A step's placement: one `StagePlacement` per pipeline stage (embedding, blocks, head), and the step's
    own choices, which the store and optimizer act on (the pipeline reads only `stages`, `tokens`, `sweeps`,
    `device_step_bytes` and what `parked` implies)."""

    stages: tuple[StagePlacement, ...]
    tokens: int = 0  # tokens per sweep (this process's) it was made for: a step's, in one sweep; 0: any
    # forward-backward sweeps a step runs its micro-batches in, gradients summed over them before the one update:
    # each sweep keeps what a step of its size keeps (more layers' products than the whole step could)
    sweeps: int = 1
    # device bytes the step takes beside the persistent buffers (slots, held weights, resident state):
    # checkpoints and products kept there, gradients, a recompute, the head's chunk. None: not counted
    device_step_bytes: int | None = None
    gradient_pool: float | None = None  # gradient landing buffers, in largest groups; None: one per group
    first_disk_group: int | None = None  # groups from here on keep their optimizer state on disk; None: none
    wire_copy: bool = False  # a compute-dtype copy of the weights in host memory (half the PCIe bytes)
    experts_per_stage: int = 0  # a MoE layer's experts streamed in parts of this many (0: whole layers)
    # resident stages whose groups' moments wait in host memory from the stage's forward (after its update) to the
    # backward `moments_back_after` names, which brings them back: the GPU holds none of them at the step's peak
    parked: tuple[int, ...] = ()
    why: dict = field(default_factory=dict, compare=False)  # the planner's reasons, by choice (for people)

    @classmethod
    def build(
        cls,
        n_stages: int,
        resident: tuple[int, ...] = (),
        held: tuple[int, ...] = (),
        offloaded: tuple[int, ...] = (),
        kept: tuple[int, ...] = (),
        host_kept: tuple[int, ...] = (),
        copied: tuple[int, ...] = (),
        parked: tuple[int, ...] = (),
        **step,
    ) -> "Placement":
        """A placement of `n_stages` stages from the stage indices of each choice that is not the default (`copied`:
        resident stages that keep their compute-dtype copy; `parked`: resident stages whose moments wait in host
        memory); an index outside 0..n_stages-1, a stage named in two choices of one field (resident and held
        weights, products kept and host-kept), or copied or parked and not resident, is refused (`PlacementError`)."""
        chosen = {"resident": resident, "held": held, "offloaded": offloaded, "kept": kept, "host_kept": host_kept}
        chosen |= {"copied": copied, "parked": parked}
        for name, indices in chosen.items():
            outside = [i for i in indices if not 0 <= i < n_stages]
            if outside:
                raise PlacementError(f"{name} names stages {outside}, outside the {n_stages} stages 0..{n_stages - 1}")
        for first, second in (("resident", "held"), ("kept", "host_kept")):
            both = sorted(set(chosen[first]) & set(chosen[second]))
            if both:
                raise PlacementError(f"stages {both} are named both {first} and {second}; a stage takes one of them")
        for name in ("copied", "parked"):
            if not set(chosen[name]) <= set(resident):
                raise PlacementError(f"stages {sorted(set(chosen[name]) - set(resident))} are {name} but not resident")
        stages = []
        for index in range(n_stages):
            weights = RESIDENT if index in resident else HELD if index in held else STREAMED
            weights = RESIDENT_COPY if index in copied else weights
            products = DEVICE if index in kept else HOST if index in host_kept else RECOMPUTE
            stages.append(StagePlacement(weights, HOST if index in offloaded else DEVICE, products))
        return cls(tuple(stages), parked=tuple(sorted(set(parked))), **step)

    def __post_init__(self):
        object.__setattr__(self, "parked", tuple(self.parked))  # (from JSON: a list)
        last_block = len(self.stages) - 2
        late = [stage for stage, back in self.moments_back_after.items() if back <= stage]
        if late:
            raise PlacementError(
                f"parked stages {late} would get their moments back after their own backward (the j-th parked stage's "
                f"come back after the backward of block {last_block} - j): park fewer, or earlier stages"
            )

    @functools.cached_property  # (the planner's cost model reads it for every placement it weighs)
    def moments_back_after(self) -> dict[int, int]:
        """Parked stage -> the stage after whose backward its moments come back: the j-th parked stage's (in stage
        order, the order the next updates need them in) after the j-th backward of a block, from the last block
        down, where the backward has let go of that block's activations. Every one comes back before its own
        stage's backward (refused otherwise), so that an update made as its gradient lands has them too."""
        last_block = len(self.stages) - 2
        return {stage: last_block - j for j, stage in enumerate(self.parked)}

    @functools.cached_property
    def moments_leave_before(self) -> int:
        """The stage before whose forward the parked moments' device memory is given back (the compute stream waits
        for their copies out there): the first stage after the resident ones, whose updates park them."""
        return next((i for i in range(len(self.stages)) if i not in self.resident), len(self.stages) - 1)

    @functools.cached_property
    def persistent_gradients(self) -> tuple[int, ...]:
        """Stages whose fp32 gradient buffers stay on the device from step to step: the head's, where stages are
        parked and it is not resident. Parked moments leave and come back as blocks that kept products are carved
        out of in between, so a step's largest buffer, the head's gradient (2.0 GiB for Qwen2.5-7B), found the bytes
        free but in no one range, and the caching allocator emptied its cache twice a step, waiting for every
        stream (decision 032). Allocated once, before any of that, it keeps its range."""
        head = len(self.stages) - 1
        return (head,) if self.parked and head not in self.resident else ()

    def where(self, **choice: str) -> tuple[int, ...]:
        """The indices of the stages with these choices, e.g. `where(products=DEVICE)`."""
        return tuple(i for i, stage in enumerate(self.stages) if all(getattr(stage, k) == v for k, v in choice.items()))

    @property
    def step_tokens(self) -> int:
        """Tokens per step (this process's) it was made for: every sweep's."""
        return self.tokens * self.sweeps

    # (the stage sets are cached: a frozen placement's never change, and a planner's search reads them hundreds of
    # thousands of times)
    @functools.cached_property
    def resident(self) -> tuple[int, ...]:
        """Stages updated on the device, copied or cast."""
        return tuple(sorted(self.where(weights=RESIDENT) + self.copied))

    @functools.cached_property
    def copied(self) -> tuple[int, ...]:
        """Resident stages whose compute-dtype copy stays on the device (their update refreshes it)."""
        return self.where(weights=RESIDENT_COPY)

    @functools.cached_property
    def held(self) -> tuple[int, ...]:
        """Stages whose weights are `HELD`: copied in for the forward, kept in their own device buffer until the
        backward."""
        return self.where(weights=HELD)

    @functools.cached_property
    def offloaded(self) -> tuple[int, ...]:
        """Stages whose checkpoints wait in pinned host memory until their backward."""
        return self.where(checkpoint=HOST)

    @functools.cached_property
    def kept(self) -> tuple[int, ...]:
        """Stages whose products are kept on the device."""
        return self.where(products=DEVICE)

    @functools.cached_property
    def host_kept(self) -> tuple[int, ...]:
        """Stages whose products wait in pinned host memory."""
        return self.where(products=HOST)

    @functools.cached_property
    def keeping(self) -> tuple[int, ...]:
        """Stages keeping their products, on the device or in host memory: the backwards that recompute no GEMM."""
        return tuple(sorted(self.kept + self.host_kept))

    def runs(self) -> list[tuple[int, int, StagePlacement]]:
        """(first, last, choices) of each run of consecutive blocks with the same choices; the embedding (the
        first stage) and the head (the last) are runs of their own."""
        last_stage = len(self.stages) - 1
        runs: list[tuple[int, int, StagePlacement]] = []
        for index, stage in enumerate(self.stages):
            if runs and runs[-1][2] == stage and index not in (1, last_stage):
                runs[-1] = (runs[-1][0], index, stage)
            else:
                runs.append((index, index, stage))
        return runs

    def as_dict(self) -> dict:
        """JSON-ready: the step's fields and the stages as runs (`from_dict` reads it back)."""
        fields = {k: v for k, v in asdict(self).items() if k != "stages"}
        fields["stages"] = [{"first": first, "last": last, **asdict(stage)} for first, last, stage in self.runs()]
        return fields

    @classmethod
    def from_dict(cls, data: dict) -> "Placement":
        """The placement `as_dict` wrote."""
        try:
            stages = [None] * (data["stages"][-1]["last"] + 1)
            for run in data["stages"]:
                choices = StagePlacement(run["weights"], run["checkpoint"], run["products"])
                stages[run["first"] : run["last"] + 1] = [choices] * (run["last"] + 1 - run["first"])
            step = {k: v for k, v in data.items() if k != "stages"}
            return cls(tuple(stages), **step)
        except (KeyError, IndexError, TypeError) as error:
            raise PlacementError(f"not a placement written by Placement.as_dict: {error!r}") from error

    def table(self, names: list[str], device: str = DEVICE) -> str:
        """A text table: one line per run of stages with the same choices, `names` giving each stage's and
        `device` the device's name."""
        rows = [("stages", "weights", "checkpoint", "matmul products")]
        for first, last, stage in self.runs():
            label = names[first] if first == last else f"{names[first]} .. {names[last]} ({last - first + 1})"
            where = {DEVICE: device, HOST: HOST}
            checkpoint = "-" if first == 0 or last == len(self.stages) - 1 else f"on {where[stage.checkpoint]}"
            products = "recomputed" if stage.products == RECOMPUTE else f"kept on {where[stage.products]}"
            rows.append((label, stage.weights, checkpoint, products if checkpoint != "-" else "-"))
        widths = [max(len(row[c]) for row in rows) for c in range(4)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
