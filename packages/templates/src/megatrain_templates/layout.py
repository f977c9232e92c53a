"""Parameter layout inside a layer's flat buffer.

A template lists its parameters once, as `ParamSpec`s in buffer order; offsets follow
from that order. The host store builds its per-layer buffers from the same specs, so
the template and the store always agree on where each tensor lives.
"""

import re
from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor

# A ParamSpec's `update`: AdamW from its gradient, or (a split-precision router correction bias) moved by
# its experts' load, whose statistic the backward writes into its gradient slots (megatrain_store.LOAD_BIAS)
ADAMW, LOAD_BIAS = "adamw", "load_bias"


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a layer: its name, shape, whether weight decay applies and how it is updated."""

    name: str
    shape: tuple[int, ...]
    weight_decay: bool = True
    update: str = ADAMW

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
    """Elements of a flat buffer holding `params` back to back (the sum of their numels)."""
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
        """The span of `flat` (a group's flat buffer) as a tensor of `shape`, sharing its memory."""
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


def add_matmul_(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out += a @ b in `out`'s dtype. Half-precision inputs on CUDA accumulate into an fp32 `out` inside
    the GEMM: no half-precision product is rounded and written, and no pass reads it back to add it
    (a 7B block's weight gradients: ~1.2 ms of its ~43 ms forward and backward at 16k tokens)."""
    if out.dtype == a.dtype:
        torch.addmm(out, a, b, out=out)
    elif a.is_cuda and out.dtype == torch.float32:
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:
        out.add_(a @ b)


@dataclass(frozen=True)
class BoundWeight:
    """A weight matrix (`value`, a view of the layer's slot) whose gradient the backward of
    `ops.linear` adds straight into `grad` (its span of the flat fp32 gradient buffer), instead of
    autograd returning it as a tensor of its own to be added afterwards. Given `product` (what the
    forward's `linear` made with it, kept by a `ProductKeeper`), `linear` returns that instead of
    recomputing it."""

    value: Tensor
    grad: Tensor
    product: Tensor | None = None


@dataclass(frozen=True)
class ProductKeeper:
    """A weight matrix whose forward `linear` keeps its product in `products[name]`, for a backward
    to reuse (`BoundWeight.product`) instead of recomputing the GEMM; but not where `products` holds `unless`
    by then (a product kept in its place: the backward then recomputes this one)."""

    value: Tensor
    name: str
    products: dict
    unless: str | None = None

    def keeps(self) -> bool:
        return self.unless is None or self.unless not in self.products

    def put(self, product: Tensor) -> Tensor:
        """`product`, kept in `products[name]` where this keeps it."""
        if self.keeps():
            self.products[self.name] = product
        return product


def leaf(flat: Tensor, span: Span) -> Tensor:
    """A view of the span that autograd treats as a fresh leaf; the graph dies with the call."""
    return span.view(flat).detach().requires_grad_(True)


def check_buffers(buffers: list[Tensor], groups: tuple[tuple[ParamSpec, ...], ...], what: str) -> None:
    if len(buffers) != len(groups):
        raise ValueError(f"{what}: expected {len(groups)} flat buffers, got {len(buffers)}")
    for buffer, params in zip(buffers, groups):
        if buffer is None:  # (a frozen group's gradient: none)
            continue
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


_SPLIT_PRECISION = ("{hi}", "{lo}")


def split_precision_names(name: str) -> tuple[str, str]:
    """The two stored tensors of tensor `name` kept as hi + lo, where hi is exact in bfloat16 and lo the
    rest: a layer's slot in bf16 then holds it to ~16 bits instead of 8, and fp32/fp64 slots exactly.
    For a small fp32 tensor whose low bits decide something, such as DeepSeek-V3's router correction
    bias (values near 7 whose spread is a few tenths: bf16 steps by 1/32 there)."""
    return name + _SPLIT_PRECISION[0], name + _SPLIT_PRECISION[1]


def split_precision_of(name: str) -> tuple[str, int] | None:
    """(tensor, 0 for its hi part or 1 for its lo part) for a name made by `split_precision_names`."""
    for part, suffix in enumerate(_SPLIT_PRECISION):
        if name.endswith(suffix):
            return name.removesuffix(suffix), part
    return None


def split_precision(value: Tensor) -> tuple[Tensor, Tensor]:
    """(hi, lo) with hi exact in bfloat16 and hi + lo == value exactly, in value's dtype."""
    hi = value.to(torch.bfloat16).to(value.dtype)
    return hi, value - hi


def join_stored(covered: tuple[str, ...], tensors: list[Tensor]) -> Tensor:
    """A file tensor from its stored tensors (`file_tensors`' names for it, in order, all flat or all
    shaped): hi + lo for a split-precision pair, else the tensors back to back."""
    if split_precision_of(covered[0]) is not None:
        return tensors[0] + tensors[1]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def file_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Stored tensors (name -> shape) as files name them: file name -> (shape, the stored tensors it
    is). Row slices `NAME[a:b]` join into NAME, back to back; a split-precision pair `NAME{hi}`,
    `NAME{lo}` is NAME = hi + lo (`split_precision_names`); every other tensor is itself."""
    out: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
    slices: dict[str, list[tuple[int, int, str, tuple[int, ...]]]] = {}
    for name, shape in shapes.items():
        split = split_precision_of(name)
        if split is not None:
            out[split[0]] = (tuple(shape), split_precision_names(split[0]))
            continue
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
