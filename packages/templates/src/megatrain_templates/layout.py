"""Parameter layout inside a layer's flat buffer.

A template lists its parameters once, as `ParamSpec`s in buffer order; offsets follow
from that order. The host store builds its per-layer buffers from the same specs, so
the template and the store always agree on where each tensor lives.
"""

import re
from contextlib import contextmanager
from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a layer: its name, shape and whether weight decay applies."""

    name: str
    shape: tuple[int, ...]
    weight_decay: bool = True

    @property
    def numel(self) -> int:
        return prod(self.shape)


def param_offsets(params: tuple[ParamSpec, ...]) -> dict[str, int]:
    """Element offset of each parameter in a flat buffer holding `params` back to back."""
    offsets, offset = {}, 0
    for spec in params:
        offsets[spec.name] = offset
        offset += spec.numel
    return offsets


def total_numel(params: tuple[ParamSpec, ...]) -> int:
    return sum(spec.numel for spec in params)


@dataclass(frozen=True)
class Span:
    """A contiguous range of a flat buffer viewed as one tensor (a fused parameter)."""

    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return prod(self.shape)

    def view(self, flat: Tensor) -> Tensor:
        return flat[self.offset : self.offset + self.numel].view(self.shape)


def fused_span(params: tuple[ParamSpec, ...], names: list[str]) -> Span:
    """The span covering `names`, which must be adjacent in `params` and share trailing dims.

    Adjacent weights such as q/k/v or gate/up are then one matrix, so one GEMM replaces three.
    """
    offsets = param_offsets(params)
    by_name = {spec.name: spec for spec in params}
    specs = [by_name[name] for name in names]
    start = offsets[names[0]]
    expected = start
    for name, spec in zip(names, specs):
        if offsets[name] != expected or spec.shape[1:] != specs[0].shape[1:]:
            raise ValueError(f"parameters {names} are not adjacent with equal trailing dims in the layout")
        expected += spec.numel
    rows = sum(spec.shape[0] for spec in specs)
    return Span(start, (rows, *specs[0].shape[1:]))


def span_of(params: tuple[ParamSpec, ...], name: str) -> Span:
    spec = next(spec for spec in params if spec.name == name)
    return Span(param_offsets(params)[name], spec.shape)


def accumulate(grad_flat: Tensor, span: Span, grad: Tensor) -> None:
    """Add `grad` (any dtype, any strides) into the span of a flat fp32 gradient buffer: one kernel
    that casts as it adds, with no contiguous or fp32 copy of `grad` first."""
    span.view(grad_flat).add_(grad.view(span.shape) if grad.is_contiguous() else grad)


def leaf(flat: Tensor, span: Span) -> Tensor:
    """A view of the span that autograd treats as a fresh leaf; the graph dies with the call."""
    return span.view(flat).detach().requires_grad_(True)


def check_buffers(buffers: list[Tensor], groups: tuple[tuple[ParamSpec, ...], ...], what: str) -> None:
    if len(buffers) != len(groups):
        raise ValueError(f"{what}: expected {len(groups)} flat buffers, got {len(buffers)}")
    for buffer, params in zip(buffers, groups):
        if buffer.dim() != 1 or buffer.numel() != total_numel(params):
            raise ValueError(
                f"{what}: flat buffer has shape {tuple(buffer.shape)}, layout needs ({total_numel(params)},)"
            )


_ROW_SLICE = re.compile(r"^(.*)\[(\d+):(\d+)\]$")


def row_slice_name(name: str, start: int, stop: int) -> str:
    """The name of rows start..stop (along dim 0) of tensor `name` kept as a tensor of its own (a
    layer split over several groups); files always hold `name` whole (see `file_tensors`)."""
    return f"{name}[{start}:{stop}]"


def row_slice_of(name: str) -> tuple[str, int, int] | None:
    """(tensor, start, stop) for a name made by `row_slice_name`; None for any other name."""
    match = _ROW_SLICE.match(name)
    return None if match is None else (match.group(1), int(match.group(2)), int(match.group(3)))


def file_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Stored tensors (name -> shape) as files name them: file name -> (shape, the stored tensors it
    is, back to back). Row slices `NAME[a:b]` join into NAME; every other tensor is itself."""
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    slices: dict[str, list[tuple[int, int, str, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        sliced = row_slice_of(name)
        if sliced is None:
            out[name] = (tuple(shape), (name,))
            continue
        base, start, stop = sliced
        if base not in slices:
            out[base] = ((), ())  # keeps the file order of its first slice
            slices[base] = []
        slices[base].append((start, stop, name, tuple(shape)))
    for base, parts in slices.items():
        parts.sort()
        rows = 0
        for start, stop, _, shape in parts:
            if start != rows or shape[0] != stop - start or shape[1:] != parts[0][3][1:]:
                raise ValueError(f"row slices of {base} do not tile it: {[p[2] for p in parts]}")
            rows = stop
        out[base] = ((rows, *parts[0][3][1:]), tuple(p[2] for p in parts))
    return out


class KeptGraph:
    """A forward's autograd graph kept for its backward, so that the backward runs without recomputing
    the forward (selective recomputation: a layer whose activations fit in GPU memory).

    The weights it was computed with lived in a device slot that later layers overwrite. So every
    tensor the graph saves that is a view of the weight buffers is stored as its place in them
    (buffer, offset, shape, strides) and read, in `backward`, from the buffers the weights are
    streamed into again, which may be another slot. The rest (activations) is kept as it is."""

    def __init__(self, weights: list[Tensor]):
        self._weights = weights  # while recording: the slot's; in backward: the slot it is streamed into again
        self.output: Tensor | None = None
        self.inputs: list[Tensor] = []

    def _pack(self, tensor: Tensor):
        storage = tensor.untyped_storage().data_ptr()
        for index, buffer in enumerate(self._weights):
            offset = tensor.storage_offset() - buffer.storage_offset()
            if storage == buffer.untyped_storage().data_ptr() and 0 <= offset < buffer.numel():
                return index, offset, tensor.shape, tensor.stride()
        return tensor

    def _unpack(self, packed) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        index, offset, shape, stride = packed
        buffer = self._weights[index]
        return buffer.as_strided(shape, stride, buffer.storage_offset() + offset)

    @contextmanager
    def recording(self):
        """Build the graph inside this block (autograd on, saved weight views recorded by place)."""
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def keep(self, output: Tensor, inputs: list[Tensor]) -> None:
        """The recorded forward's output and the leaves (block input first, then weight leaves) whose
        gradients `backward` returns."""
        self.output, self.inputs = output, inputs

    def backward(self, weights: list[Tensor], grad_output: Tensor) -> list[Tensor]:
        """Gradients of the inputs given to `keep`, in that order, with the weights read from `weights`
        (same layout as at recording); the graph is freed."""
        self._weights = weights
        grads = torch.autograd.grad(self.output, self.inputs, grad_output)
        self.output, self.inputs, self._weights = None, [], []
        return list(grads)
