"""The host arenas' memory: taken on transparent huge pages, and page-locked in place so that host<->GPU copies
run at full PCIe speed."""

import ctypes
import mmap
import warnings
import weakref

import torch
from torch import Tensor


def cuda_available() -> bool:
    return torch.cuda.is_available()


HUGE_PAGE = 2 << 20  # x86-64's and most arm64 kernels' transparent huge page


def zeros_on_huge_pages(numel: int, dtype: torch.dtype) -> Tensor:
    """A zeroed tensor of `numel` elements on its own anonymous mapping, 2 MiB-aligned and advised for transparent
    huge pages, every page touched now (so that pinning is fast and a lack of memory shows here, not mid-run).

    Where the kernel allows it ("madvise" or "always" in /sys/kernel/mm/transparent_hugepage/enabled), 512 times
    fewer pages back the arena, and taking and page-locking them costs about half (9 GiB on an H200 host: zeroed
    0.74 -> 0.44 s, page-locked 0.92 -> 0.39 s; the store of a 7B takes 113 GiB). The CPU's loops over them ran as
    fast either way there (triad and fused AdamW, interleaved in one process). Elsewhere the advice is a no-op.
    The mapping is unmapped when the last tensor over it goes. Below one huge page it is plain torch.zeros: a
    huge page would hold a few bytes (a test's, a tiny model's group)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # (holds the mapping while any view of it lives)
    start = -whole.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:  # (a kernel built without transparent huge pages)
        pass
    tensor = whole[start : start + nbytes].view(dtype)
    return tensor.zero_()


def pin_in_place(tensor: Tensor) -> bool:
    """Page-lock `tensor`'s memory with cudaHostRegister; returns False (with a warning) if that fails.

    Registering memory that is already allocated and touched is several times faster than
    allocating pinned memory through the CUDA host allocator, which matters at 100+ GB.
    The caller must call `unpin` before the memory is freed.
    """
    if not cuda_available() or tensor.numel() == 0:
        return False
    if tensor.is_pinned():
        return True
    nbytes = tensor.numel() * tensor.element_size()
    cudart = torch.cuda.cudart()
    code = cudart.cudaHostRegister(tensor.data_ptr(), nbytes, 0)
    if int(code) != 0:
        _clear_cuda_error()
        warnings.warn(
            f"could not page-lock {nbytes / 2**20:.1f} MiB of host memory at {tensor.data_ptr():#x} "
            f"(cudaHostRegister error {int(code)}); "
            "host<->GPU copies from it run at pageable speed (about 7-9 GB/s instead of ~55 GB/s). "
            "Raise the locked-memory limit (ulimit -l unlimited) or lower the model/batch size.",
            stacklevel=2,
        )
        return False
    return True


def unpin(data_ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(data_ptr)


class PinnedSpan:
    """One span of elements of each of `tensors`, page-locked in place and widened as asked (the narrower span is
    unpinned first: registrations may not overlap), unpinned when this object goes."""

    def __init__(self, tensors: list[Tensor]):
        self.tensors, self.span = tensors, None
        self._pinned: list[int] = []
        weakref.finalize(self, lambda pinned: [unpin(p) for p in pinned], self._pinned)

    def cover(self, first: int, last: int) -> None:
        """Pin [first, last) of each tensor, and what the span pinned so far covered."""
        if self.span is not None:
            if self.span[0] <= first and last <= self.span[1]:
                return
            first, last = min(first, self.span[0]), max(last, self.span[1])
        while self._pinned:
            unpin(self._pinned.pop())
        for tensor in self.tensors:
            if pin_in_place(view := tensor[first:last]):
                self._pinned.append(view.data_ptr())
        self.span = (first, last)


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed cudaHostRegister: left set, the next
    CUDA call anywhere in the process (an NCCL barrier, say) raises it as its own failure.
    torch binds no cudaGetLastError, so it is called from the libcudart this process loaded."""
    try:
        with open("/proc/self/maps") as maps:
            path = next(line.split()[-1] for line in maps if "libcudart" in line)
        ctypes.CDLL(path).cudaGetLastError()
    except (OSError, StopIteration, AttributeError):
        pass
