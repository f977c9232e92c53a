"""Host arenas that several processes map at once: one copy of the training state per host,
shared by the ranks (one per GPU) that run on it.

Each arena is a file in a memory-backed directory (/dev/shm); every rank opens it with
O_CREAT and sizes it with ftruncate (idempotent, so the ranks need no order among
themselves), maps it, and once all ranks have mapped it one of them unlinks the files: the
mappings stay valid and nothing is left behind, even if a rank dies.
"""

import errno
import mmap
import os
import shutil
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .errors import StoreError
from .progress import size_text

_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.bfloat16: np.uint16,  # numpy has no bf16: the bytes, viewed back as bf16
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.uint8: np.uint8,  # (a packed base's bytes)
}


class SharedArenas:
    """Named zero-initialised tensors backed by files in `directory` (a tmpfs such as /dev/shm)."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: list[Path] = []  # arrays kept elsewhere (the disk tier), unlinked with the arenas

    def tensor(self, name: str, dtype: torch.dtype, numel: int) -> Tensor:
        """The arena `name`, its memory taken in the directory now (`posix_fallocate`): a file sized alone is sparse,
        and a directory too small for the arenas it holds would kill the ranks with SIGBUS when they first touch
        a page past its room."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        path = self.directory / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
            self._take_room(fd, name, nbytes)
            mapping = mmap.mmap(fd, nbytes) if nbytes else None
        finally:
            os.close(fd)
        if mapping is None:
            return torch.zeros(0, dtype=dtype)
        array = np.frombuffer(mapping, dtype=_NUMPY[dtype], count=numel)  # keeps the mapping alive
        tensor = torch.from_numpy(array)
        return tensor.view(dtype) if dtype == torch.bfloat16 else tensor

    def _take_room(self, fd: int, name: str, nbytes: int) -> None:
        """Allocate the arena's pages (the ranks may do it at once: it is idempotent), or refuse in one line."""
        if not nbytes:
            return
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # (a directory whose file system cannot: as before)
                return
            free = shutil.disk_usage(self.directory).free
            self.unlink()  # (the run stops: nothing of it is left in the directory)
            raise StoreError(
                f"shared host memory: arena {name!r} needs {size_text(nbytes)} in {self.directory}, which has "
                f"{size_text(free)} free ({error.strerror}); enlarge it (mount -o remount,size=... /dev/shm) or set "
                "engine.shared_dir (or MEGATRAIN_SHARED_DIR) to a larger memory-backed directory"
            ) from None

    def file_array(self, directory: Path, name: str, dtype: np.dtype, numel: int) -> np.memmap:
        """A zero-filled array of `numel` elements memory-mapped from a file in `directory` (on disk: the
        disk tier's optimizer state), named after these arenas so that the host's processes share it and
        no other run's file is reused; every process opens it without truncating it."""
        path = Path(directory) / f"{self.directory.name}.{name}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            nbytes = numel * np.dtype(dtype).itemsize
            if os.fstat(fd).st_size != nbytes:
                os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        self._files.append(path)
        return np.memmap(path, dtype=dtype, mode="r+", shape=(numel,))

    def unlink(self) -> None:
        """Remove the files (the mappings stay valid); call once every process has mapped them."""
        shutil.rmtree(self.directory, ignore_errors=True)
        for path in self._files:
            path.unlink(missing_ok=True)
