"""A frozen group held packed (issue 63, QLoRA): its matrices in NF4 or int8 (`quant.py`), the rest (norms, biases,
routers) as raw compute-dtype bytes, back to back in one uint8 buffer. `PackedLayout.pack` fills that buffer from
the group's flat compute-dtype weights; `unpack` writes them back into a flat compute-dtype buffer (a device slot:
the GPU dequantizes what crossed PCIe packed) on whatever device both buffers are on."""

import hashlib
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .errors import StoreError
from .io import load_tensors_into, read_safetensors_header, write_safetensors
from .layout import Entry, GroupLayout
from .quant import (
    QuantizedInt8,
    QuantizedNF4,
    dequantize_int8,
    dequantize_nf4,
    int8_nbytes,
    nf4_nbytes,
    quantize_int8,
    quantize_nf4,
)

FORMATS = ("nf4", "int8")
PACKED_ALIGN = 16  # each entry's bytes start at a multiple of this (the packed parts need 4)

_NBYTES = {"nf4": nf4_nbytes, "int8": int8_nbytes}
_QUANTIZE = {"nf4": quantize_nf4, "int8": quantize_int8}
_FROM_BYTES = {"nf4": QuantizedNF4.from_bytes, "int8": QuantizedInt8.from_bytes}
_DEQUANTIZE = {"nf4": dequantize_nf4, "int8": dequantize_int8}


def quantizes(entry: Entry) -> bool:
    """Whether a frozen base keeps `entry` quantized: its matrices (linear weights, experts' stacked matrices), as
    QLoRA quantizes every linear layer; not a router's or a gate's (`mlp.gate`, `shared_expert_gate`, `router`: a
    few weights that pick experts or scale a branch, kept exact) nor a vector (norms, biases), nor a bias however
    stored (gpt-oss' experts' biases stacked [n_experts, d]; ERNIE 4.5's router correction bias [1, n_experts], kept
    as a split-precision pair `NAME{hi}`, `NAME{lo}`: its low bits pick experts)."""
    module = entry.name.split(".")[-2] if "." in entry.name else ""
    bias = entry.name.split("{")[0].endswith("bias")
    return len(entry.shape) >= 2 and not module.endswith("gate") and "router" not in module and not bias


def round_trip(weight: Tensor, format: str) -> Tensor:
    """`weight` quantized in `format` and dequantized, in its dtype: what a packed base computes with."""
    return _DEQUANTIZE[format](_QUANTIZE[format](weight))


@dataclass(frozen=True)
class PackedEntry:
    entry: Entry  # where it lies in the group's flat compute-dtype weights
    start: int  # its first byte in the packed buffer
    nbytes: int
    format: str | None  # "nf4" or "int8"; None: raw compute-dtype bytes


@dataclass(frozen=True)
class PackedLayout:
    """Where each tensor of a group lies in its packed buffer, and in what format."""

    entries: tuple[PackedEntry, ...]
    nbytes: int
    dtype: torch.dtype  # the compute dtype unpacked into (and the raw entries' dtype)

    @property
    def numel(self) -> int:
        """Elements of the group's weights unpacked."""
        return sum(p.entry.numel for p in self.entries)

    @staticmethod
    def of(layout: GroupLayout, format: str, dtype: torch.dtype) -> "PackedLayout":
        if format not in FORMATS:
            raise StoreError(f"a frozen base is packed as one of {FORMATS}, got {format!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise StoreError(
                f"a {format} base dequantizes into float32, bfloat16 or float16, not {dtype}; train it in one of them"
            )
        element, start, entries = torch.empty(0, dtype=dtype).element_size(), 0, []
        for entry in layout.entries:
            kind = format if quantizes(entry) else None
            nbytes = _NBYTES[kind](entry.shape) if kind else entry.numel * element
            entries.append(PackedEntry(entry, start, nbytes, kind))
            start += -(-nbytes // PACKED_ALIGN) * PACKED_ALIGN
        return PackedLayout(tuple(entries), start, dtype)

    def pack(self, weights: Tensor, packed: Tensor, unchanged: Tensor | None = None, on: torch.device | None = None):
        """Quantize the group's flat weights (any float dtype) into `packed` ([nbytes] uint8, same device); with
        `unchanged` (what `packed` unpacks to), only the tensors that differ from it. `on`: quantize there (a GPU:
        a 120B model's layers in seconds where the CPU takes minutes), each tensor's bytes copied back."""
        for p in self.entries:
            span = slice(p.entry.offset, p.entry.offset + p.entry.numel)
            if unchanged is not None and torch.equal(weights[span], unchanged[span]):
                continue
            source = weights[span].view(p.entry.shape)
            out = packed[p.start : p.start + p.nbytes]
            if p.format is None:
                out.view(self.dtype).copy_(source.reshape(-1))
            elif on is None or on == packed.device:
                _QUANTIZE[p.format](source.to(self.dtype), out=out)
            else:
                out.copy_(_QUANTIZE[p.format](source.to(on, self.dtype)).to_bytes())

    def unpack(self, packed: Tensor, out: Tensor) -> Tensor:
        """Dequantize `packed` into the group's flat weights `out` ([numel] in self.dtype, on packed's device)."""
        for p in self.entries:
            view = out[p.entry.offset : p.entry.offset + p.entry.numel]
            self.unpack_entry(p, packed[p.start : p.start + p.nbytes], view.view(p.entry.shape))
        return out

    def named(self, name: str) -> PackedEntry:
        """The entry of tensor `name`."""
        return next(p for p in self.entries if p.entry.name == name)

    def unpack_entry(self, p: PackedEntry, part: Tensor, out: Tensor) -> Tensor:
        """Dequantize one entry's bytes `part` ([p.nbytes] uint8) into `out` (its shape, in self.dtype)."""
        if p.format is None:
            return out.copy_(part.view(self.dtype).view(out.shape))
        return _DEQUANTIZE[p.format](_FROM_BYTES[p.format](part, p.entry.shape, self.dtype), out=out)


class PackedGroups:
    """A store's packed groups: each one's `PackedLayout` and its bytes, back to back in `arena` ([total(layouts)]
    uint8); unpacked into new tensors, and packed again from what is written (on `pack_on` where given: a GPU)."""

    def __init__(self, layouts: dict[int, PackedLayout], arena: Tensor | None, pack_on: torch.device | None = None):
        self.layouts, self.arena, self.pack_on = layouts, arena, pack_on
        self.starts, _ = _starts(layouts)
        self._written: set[int] = set()  # the groups `writing` has filled (the others unpack to zeros)
        self._scratch: Tensor | None = None  # what a first write fills: the largest group's size, reused

    @staticmethod
    def total(layouts: dict[int, PackedLayout]) -> int:
        """Bytes of the arena `layouts` need, each group's start aligned."""
        return _starts(layouts)[1]

    def bytes(self, group: int) -> Tensor:
        return self.arena[self.starts[group] : self.starts[group] + self.layouts[group].nbytes]

    def unpack(self, group: int) -> Tensor:
        """The group's weights (flat, in the compute dtype), unpacked into a new tensor."""
        layout = self.layouts[group]
        return layout.unpack(self.bytes(group), torch.empty(layout.numel, dtype=layout.dtype))

    @contextmanager
    def writing(self, group: int, layout: GroupLayout):
        """Named views of the group's weights as they are (zeros before the first write), packed again on exit: only
        the tensors written, since quantizing a dequantized tensor once more may change it."""
        written = group in self._written
        whole = self.unpack(group) if written else self._zeros(layout.numel)
        before = whole.clone() if written else None
        yield layout.views(whole)
        self.layouts[group].pack(whole, self.bytes(group), unchanged=before, on=self.pack_on)
        self._written.add(group)

    def save(self, path: Path, key: str) -> int:
        """Write every group's bytes to `path` atomically (safetensors: a uint8 tensor a group, `key` in its
        metadata); the file's size in bytes."""
        path.parent.mkdir(parents=True, exist_ok=True)
        groups = [(f"group.{g}", self.bytes(g)) for g in sorted(self.layouts)]
        return write_safetensors(path, groups, {"key": key})

    def load(self, path: Path, key: str) -> bool:
        """Fill every group from `path` (`save`'s file) where it was saved under `key` with these groups' sizes, and
        say True; else (no file, a torn one, another checkpoint's or layout's) read nothing and say False."""
        if not PackedBaseFile(path).holds(key, self.layouts):
            return False
        load_tensors_into([path], {f"group.{g}": self.bytes(g) for g in self.layouts})
        self._written.update(self.layouts)
        return True

    def place(self, group: int, name: str, q: QuantizedNF4) -> None:
        """Put `q` (a checkpoint's NF4 weight, `nf4_from_bitsandbytes`) as tensor `name` of `group`'s bytes, as it
        is: after `writing` has filled the group (whose quantizing of the dequantized weight again may differ)."""
        p = self.layouts[group].named(name)
        if p.format != "nf4" or tuple(q.shape) != tuple(p.entry.shape):
            raise StoreError(f"{name} is held as {p.format} {p.entry.shape}, not as nf4 {q.shape}")
        start = self.starts[group] + p.start
        self.arena[start : start + p.nbytes].copy_(q.to_bytes())

    def _zeros(self, numel: int) -> Tensor:
        """[numel] zeros in the compute dtype, in one buffer that every first write reuses (a fresh one a layer
        faulted in a 120B model's 240 GB of pages while it loaded): the planner's "packing buffer". (Not pinned:
        torch's pinned allocator rounds up to a power of two, 4 GiB for a 120B layer's 2.9, past the plan.)"""
        if self._scratch is None:
            largest = max(layout.numel for layout in self.layouts.values())
            self._scratch = torch.empty(largest, dtype=next(iter(self.layouts.values())).dtype)
        return self._scratch[:numel].zero_()


def packed_cache_key(source: str, layouts: dict[int, PackedLayout]) -> str:
    """What a file of packed groups' bytes (`PackedGroups.save`) depends on: `source` (the checkpoint's identity) and
    every group's layout (its tensors' names, shapes, formats and dtype)."""
    return hashlib.sha256(repr((source, sorted(layouts.items()))).encode()).hexdigest()


class PackedBaseFile:
    """A file `PackedGroups.save` wrote: each group's packed bytes (a uint8 tensor "group.N"), its key in the
    metadata; read whole (`PackedGroups.load`) or a tensor at a time (a merge: `entry`)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def holds(self, key: str, layouts: dict[int, PackedLayout]) -> bool:
        """Whether the file is whole and was saved under `key` for groups of these layouts' sizes."""
        try:
            header = read_safetensors_header(self.path)
        except StoreError:  # (no file, or a torn one)
            return False
        sizes = {name: info["shape"] for name, info in header.items() if name != "__metadata__"}
        expected = {f"group.{g}": [layout.nbytes] for g, layout in layouts.items()}
        return header.get("__metadata__", {}).get("key") == key and sizes == expected

    def entry(self, group: int, layout: PackedLayout, name: str) -> Tensor:
        """Tensor `name` of `group` as the run computed with it (in layout.dtype), its bytes alone read and unpacked."""
        p = layout.named(name)
        with safe_open(str(self.path), framework="pt") as handle:
            part = handle.get_slice(f"group.{group}")[p.start : p.start + p.nbytes].contiguous()
        return layout.unpack_entry(p, part, torch.empty(p.entry.shape, dtype=layout.dtype))


def _starts(layouts: dict[int, PackedLayout]) -> tuple[dict[int, int], int]:
    """(each group's start in the arena, aligned to 64 bytes, in group order; the arena's size)."""
    starts, total = {}, 0
    for group in sorted(layouts):
        starts[group] = total
        total += -(-layouts[group].nbytes // 64) * 64
    return starts, total
