"""A frozen group held packed (issue 63, QLoRA): its matrices in NF4 or int8 (`quant.py`), the rest (norms, biases,
routers) as raw compute-dtype bytes, back to back in one uint8 buffer. `PackedLayout.pack` fills that buffer from
the group's flat compute-dtype weights; `unpack` writes them back into a flat compute-dtype buffer (a device slot:
the GPU dequantizes what crossed PCIe packed) on whatever device both buffers are on."""

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import StoreError
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
    few weights that pick experts or scale a branch, kept exact) nor a vector (norms, biases)."""
    module = entry.name.split(".")[-2] if "." in entry.name else ""
    return len(entry.shape) >= 2 and not module.endswith("gate") and "router" not in module


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
            part = packed[p.start : p.start + p.nbytes]
            if p.format is None:
                view.copy_(part.view(self.dtype))
            else:
                _DEQUANTIZE[p.format](
                    _FROM_BYTES[p.format](part, p.entry.shape, self.dtype), out=view.view(p.entry.shape)
                )
        return out
