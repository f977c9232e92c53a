"""Pinned host-memory store: flat per-group arenas, accounting, atomic safetensors I/O."""

from .device import free_device_bytes
from .errors import StoreError
from .io import (
    Pending,
    atomic_write,
    atomic_write_text,
    fsync_dir,
    load_tensors_into,
    match_tensors,
    open_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from .layout import ADAMW, LOAD_BIAS, Entry, GroupLayout
from .pinning import pin_in_place, unpin
from .shared import SharedArenas
from .store import HostStore, MemoryReport, bytes_per_param

__all__ = [
    "ADAMW",
    "Entry",
    "GroupLayout",
    "HostStore",
    "LOAD_BIAS",
    "MemoryReport",
    "Pending",
    "SharedArenas",
    "StoreError",
    "atomic_write",
    "atomic_write_text",
    "bytes_per_param",
    "free_device_bytes",
    "fsync_dir",
    "load_tensors_into",
    "match_tensors",
    "open_safetensors",
    "pin_in_place",
    "read_safetensors_header",
    "unpin",
    "write_safetensors",
]
