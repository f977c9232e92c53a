"""Atomic, streaming safetensors files and checked loading into the store.

Files are written tensor by tensor (no second in-memory copy of the model), to a
temporary name in the same directory, fsynced, then renamed over the target: a crash
at any instant leaves either the old file or the new one, never a torn one.
"""

import json
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from .errors import StoreError, WeightsError

# MEGATRAIN_CACHE is the machine's, not a run's: where this machine keeps what it measured of itself and what it
# built for itself (its rates, its compiled kernels), shared by every run on it (a config names what to train,
# not where the machine's caches live).
MACHINE_CACHE = Path(os.environ.get("MEGATRAIN_CACHE", Path.home() / ".cache" / "megatrain"))

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
}


def fsync_dir(directory: Path) -> None:
    """fsync `directory` itself, so that a file created or renamed in it (its entry) survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable) -> None:
    """Call write(file) on a temporary file next to `path`, fsync, rename over `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)


def remove_stale_temporaries(directory: Path) -> int:
    """Delete the temporary files that `atomic_write`s killed midway (their processes no longer alive) left in
    `directory` and its folders, where a cache of tokens can be gigabytes; returns the bytes freed. Not deeper: an
    output_dir may be a big tree the run did not make."""
    freed, directory = 0, Path(directory)
    for tmp in [*directory.glob(".*.tmp-*"), *directory.glob("*/.*.tmp-*")]:
        pid = tmp.name.rpartition(".tmp-")[2]
        if not pid.isdigit() or _alive(int(pid)) or not tmp.is_file():
            continue
        size = tmp.stat().st_size
        tmp.unlink(missing_ok=True)
        freed += size
    return freed


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's, which this one may not signal, too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` as UTF-8 to `path` with `atomic_write`: a reader sees the old file or the whole new one."""
    atomic_write(path, lambda handle: handle.write(text.encode()))


@dataclass(frozen=True)
class Pending:
    """A tensor to write that is produced only when its turn comes (`load()`, called once, in file
    order): a file can then stream from sources that are never all in memory at once, such as
    state gathered from other hosts one group at a time."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], Tensor]

    def numel(self) -> int:
        return torch.Size(self.shape).numel()

    def element_size(self) -> int:
        return self.dtype.itemsize


def file_crc32(path: Path, chunk: int = 64 * 2**20) -> int:
    """The CRC32 of a file's bytes, read in chunks."""
    crc = 0
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def file_record(path: Path) -> dict:
    """What `check_files` checks a file against: its size and CRC32."""
    return {"bytes": path.stat().st_size, "crc32": file_crc32(path)}


def check_files(directory: Path, records: dict[str, dict]) -> None:
    """Refuse, naming the file, where one of `records` (by name in `directory`: `file_record`) is missing, of
    another size, or fails its CRC32 check."""
    for filename, expected in records.items():
        path = directory / filename
        if not path.exists():
            raise WeightsError(f"checkpoint file {path} is missing")
        if path.stat().st_size != expected["bytes"]:
            raise WeightsError(
                f"checkpoint file {path} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}: the file is "
                "truncated or was replaced"
            )
        if file_crc32(path) != expected["crc32"]:
            raise WeightsError(f"checkpoint file {path} fails its CRC32 check: the file is corrupt")


def write_safetensors(
    path: Path,
    tensors: Mapping[str, Tensor | Pending] | Iterable[tuple[str, Tensor | Pending]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write named tensors, a {name: tensor} mapping (as safetensors' `save_file` takes) or (name, tensor) pairs
    (views are fine: each is written from its own memory; `Pending` ones are loaded as they are written) atomically.

    Returns the file size in bytes."""
    items = list(tensors.items()) if isinstance(tensors, Mapping) else [(name, t) for name, t in tensors]
    header: dict = {}
    offset = 0
    for name, tensor in items:
        if tensor.dtype not in _DTYPE_NAMES:
            raise StoreError(f"cannot write tensor {name!r} of dtype {tensor.dtype} to safetensors")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)

    def write(handle):
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for name, tensor in items:
            if isinstance(tensor, Pending):
                expected, tensor = tensor, tensor.load()
                if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
                    raise StoreError(
                        f"tensor {name!r} arrived as {tensor.dtype}{tuple(tensor.shape)}, not as announced"
                    )
            if tensor.numel():
                handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)

    atomic_write(Path(path), write)
    return 8 + len(encoded) + offset


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file, with a clear error for a damaged file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError(f"header length {length} exceeds the file size {size}")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:
        raise WeightsError(
            f"{path} is not a readable safetensors file ({error}); it is truncated or corrupt"
        ) from error
    data_size = size - 8 - length
    for name, info in header.items():
        if name != "__metadata__" and info["data_offsets"][1] > data_size:
            raise WeightsError(f"{path}: tensor {name!r} runs past the end of the file; the file is truncated")
    return header


def match_tensors(
    paths: list[Path], shapes: dict[str, tuple[int, ...]], ignore: Callable[[str], bool] = lambda name: False
) -> dict[str, Path]:
    """Which of the safetensors `paths` holds each tensor named in `shapes`, reading headers only.

    Shapes must match exactly; missing and unexpected names (unless `ignore`d) are errors,
    so a checkpoint can be checked against a model before any memory is allocated for it."""
    where: dict[str, Path] = {}
    for path in paths:
        header = read_safetensors_header(path)
        for name, info in header.items():
            if name == "__metadata__" or ignore(name):
                continue
            if name not in shapes:
                raise WeightsError(f"{path}: unexpected tensor {name!r}; the file does not belong to this model")
            if tuple(info["shape"]) != tuple(shapes[name]):
                raise WeightsError(
                    f"{path}: tensor {name!r} has shape {tuple(info['shape'])}, the model needs "
                    f"{tuple(shapes[name])}; the checkpoint is for a different configuration"
                )
            where[name] = path
    missing = [name for name in shapes if name not in where]
    if missing:
        raise WeightsError(
            f"tensor(s) missing from {[str(p) for p in paths]}: {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            "the checkpoint is incomplete or for a different model"
        )
    return where


@contextmanager
def open_safetensors(paths: Iterable[Path]):
    """{path: an open safe_open handle} for each of `paths`, closed on exit."""
    with ExitStack() as stack:
        yield {path: stack.enter_context(safe_open(str(path), framework="pt")) for path in set(paths)}


def load_tensors_into(
    paths: list[Path], targets: dict[str, Tensor], ignore: Callable[[str], bool] = lambda name: False
) -> None:
    """Copy every tensor named in `targets` from the safetensors `paths` into it, one at a time,
    after `match_tensors` has checked them all: a bad file leaves the targets untouched."""
    where = match_tensors(paths, {name: tuple(t.shape) for name, t in targets.items()}, ignore)
    with open_safetensors(where.values()) as handles:
        for name, path in where.items():
            targets[name].copy_(handles[path].get_tensor(name))


def finite_record(record: dict) -> dict:
    """A metrics record as JSON can hold it: a NaN or Inf value becomes null and the record says
    `"non_finite": true` (bare NaN is not JSON, and other tools reject it)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not bad:
        return record
    return {k: (None if k in bad else v) for k, v in record.items()} | {"non_finite": True}


def write_jsonl(path: Path, record: dict) -> None:
    """Append `record` to a JSON-lines file (`finite_record`), on the disk when this returns."""
    with open(path, "a") as handle:
        handle.write(json.dumps(finite_record(record), allow_nan=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
