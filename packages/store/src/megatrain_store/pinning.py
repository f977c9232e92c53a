"""Page-locking host memory in place, so that host<->GPU copies run at full PCIe speed."""

import ctypes
import warnings
import weakref

import torch
from torch import Tensor


def cuda_available() -> bool:
    return torch.cuda.is_available()


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
    """Undo `pin_in_place` (cudaHostUnregister) for the memory that starts at `data_ptr`, the pinned tensor's
    `data_ptr()`; call it before that memory is freed. Its CUDA error code is not checked."""
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
