"""A forward's autograd graph kept for its backward, the tensors it saves handed to the pipeline as products.

A native template names the matmul products its backward would otherwise recompute (`ProductKeeper`); a template
that computes with code it does not own (transformers' modules, `megatrain_zoo.generic`) cannot, but autograd
can: every tensor the forward saves for the backward passes through `pack`. One that is the layer's weights or its
input (or a view of them) is kept as where it lies there, and read at the backward from the weights and input the
backward is given (the slot the weights are streamed into then; the checkpoint, maybe back from host memory); any
other is a product, which the pipeline keeps on the device or in pinned host memory and hands back. The graph
itself then holds no memory of its own: not even its output's, which the forward returns as a copy."""

import itertools
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor

GRAPH_KEY = "graph"  # the product naming a micro-batch's kept graph (an empty tensor: it only travels with them)
GRAPHS_KEPT = 4096  # graphs a template holds at most (a step's micro-batches; more only after a failed step)


class KeptGraphs:
    """The graphs a template's forwards kept, each until its backward."""

    def __init__(self):
        self._graphs: OrderedDict[str, _Graph] = OrderedDict()
        self._ids = itertools.count()

    def forward(
        self, compute: Callable[[Tensor], Tensor], x: Tensor, weights: list[Tensor], leaves: list[Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """`compute(x)` under autograd (the weights bound as `leaves`, views of `weights` that require grad), its
        graph kept: (its output, a copy of its own; the products its backward reads)."""
        graph = _Graph(weights, x)
        x_leaf = x.detach().requires_grad_(True)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(graph.pack, graph.unpack):
            out = compute(x_leaf)
        y = out.detach().clone()
        products = graph.products
        if not any(p.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() for p in products.values()):
            out.untyped_storage().resize_(0)  # (its data is the copy's; autograd needs only its place in the graph)
        graph.root, graph.inputs, graph.products = out, [x_leaf, *leaves], None
        key = f"{GRAPH_KEY} {next(self._ids)}"
        self._graphs[key] = graph
        while len(self._graphs) > GRAPHS_KEPT:
            self._graphs.popitem(last=False)
        return y, {**products, key: x.new_empty(0)}

    def backward(
        self, products: dict[str, Tensor], x: Tensor, weights: list[Tensor], grad_out: Tensor
    ) -> tuple[Tensor | None, ...]:
        """The gradients of the kept forward's (input, *leaves) for `grad_out`, its saved tensors read from
        `products` (as the pipeline hands them back), `x` and `weights` (the backward's own)."""
        key = next(name for name in products if name.startswith(GRAPH_KEY))
        graph = self._graphs.pop(key)
        graph.bind({name: p for name, p in products.items() if name != key}, x, weights)
        return torch.autograd.grad(graph.root, graph.inputs, grad_out, allow_unused=True)


def saved_bytes(compute: Callable[[Tensor], Tensor], x: Tensor, weights: list[Tensor]) -> int:
    """Bytes of the products `KeptGraphs.forward` would keep for `compute(x)`: computed and let go."""
    graph = _Graph(weights, x)
    x_leaf = x.detach().requires_grad_(True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(graph.pack, graph.unpack):
        compute(x_leaf)
    return sum(p.numel() * p.element_size() for p in graph.products.values())


class _Graph:
    """One forward's saved tensors: products by key, or (source, offset, shape, stride) in its weights or input."""

    def __init__(self, weights: list[Tensor], x: Tensor):
        self.sources = {f"weights {i}": w for i, w in enumerate(weights)} | {"input": x}
        self.products: dict[str, Tensor] = {}
        self._keys: dict[int, str] = {}  # id(saved tensor) -> its key (a tensor saved twice is kept once)
        self.root: Tensor | None = None
        self.inputs: list[Tensor] = []

    def pack(self, saved: Tensor):
        if saved.device != self.sources["input"].device:  # (a compiled graph's host scalar: it stays in the graph)
            return saved
        for name, source in self.sources.items():
            where = _within(saved, source)
            if where is not None:
                return name, where, tuple(saved.shape), saved.stride()
        if id(saved) not in self._keys:
            self._keys[id(saved)] = key = str(len(self._keys))
            self.products[key] = saved
        return self._keys[id(saved)]

    def unpack(self, packed) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        if isinstance(packed, str):
            return self.products[packed]
        name, offset, shape, stride = packed
        source = self.sources[name]
        return source.as_strided(shape, stride, source.storage_offset() + offset)

    def bind(self, products: dict[str, Tensor], x: Tensor, weights: list[Tensor]) -> None:
        self.products = products
        self.sources = {f"weights {i}": w for i, w in enumerate(weights)} | {"input": x}


def _within(saved: Tensor, source: Tensor) -> int | None:
    """`saved`'s offset in `source` where it is a view of the span `source` covers (same memory, dtype and
    device), else None."""
    if (
        saved.device != source.device
        or saved.dtype != source.dtype
        or saved.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
        or not source.is_contiguous()
    ):
        return None
    offset = saved.storage_offset() - source.storage_offset()
    last = offset + sum((size - 1) * stride for size, stride in zip(saved.shape, saved.stride()))
    return offset if offset >= 0 and last < source.numel() else None
