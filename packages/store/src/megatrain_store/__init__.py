"""Pinned host-memory store: flat per-group arenas, accounting, atomic safetensors I/O, packed 4/8-bit weights."""

from .device import free_device_bytes
from .errors import StoreError, WeightsError
from .io import (
    MACHINE_CACHE,
    Pending,
    atomic_write,
    atomic_write_text,
    check_files,
    file_record,
    fsync_dir,
    load_tensors_into,
    match_tensors,
    open_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from .layout import ADAMW, LOAD_BIAS, Entry, GroupLayout
from .packed import PackedBaseFile, PackedLayout, packed_cache_key
from .pinning import PinnedSpan, pin_in_place, unpin
from .quant import (
    BITSANDBYTES_NF4_PARTS,
    QuantizedInt8,
    QuantizedNF4,
    dequantize_int8,
    dequantize_nf4,
    int8_nbytes,
    nf4_from_bitsandbytes,
    nf4_nbytes,
    quantize_int8,
    quantize_nf4,
    set_fused_dequantize,
)
from .shared import SharedArenas
from .store import HostStore, MemoryReport, bytes_per_param

__all__ = [
    "MACHINE_CACHE",
    "check_files",
    "file_record",
    "BITSANDBYTES_NF4_PARTS",
    "ADAMW",
    "Entry",
    "GroupLayout",
    "HostStore",
    "LOAD_BIAS",
    "MemoryReport",
    "PackedBaseFile",
    "PackedLayout",
    "Pending",
    "QuantizedInt8",
    "QuantizedNF4",
    "SharedArenas",
    "StoreError",
    "WeightsError",
    "atomic_write",
    "atomic_write_text",
    "bytes_per_param",
    "dequantize_int8",
    "dequantize_nf4",
    "free_device_bytes",
    "fsync_dir",
    "int8_nbytes",
    "load_tensors_into",
    "match_tensors",
    "nf4_from_bitsandbytes",
    "nf4_nbytes",
    "open_safetensors",
    "packed_cache_key",
    "PinnedSpan",
    "pin_in_place",
    "quantize_int8",
    "quantize_nf4",
    "read_safetensors_header",
    "set_fused_dequantize",
    "unpin",
    "write_safetensors",
]
