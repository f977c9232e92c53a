"""Copy-in, compute and copy-out streams on a CUDA device; the same calls are no-ops on the CPU."""

from contextlib import nullcontext

import torch
from torch import Tensor


class Streams:
    """The three streams of the engine. Compute runs on the device's current stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.compute = torch.cuda.current_stream(device)
            self.copy_in = torch.cuda.Stream(device)
            self.copy_out = torch.cuda.Stream(device)
        else:
            self.compute = self.copy_in = self.copy_out = None

    def on(self, stream):
        """Context in which kernels and copies are queued on `stream`."""
        return torch.cuda.stream(stream) if self.cuda else nullcontext()

    def record(self, stream):
        """An event marking the work queued on `stream` so far (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        """Make `stream` wait for `event` (device side; the host does not block)."""
        if event is not None:
            stream.wait_event(event)

    def keep_alive(self, tensor: Tensor, stream) -> None:
        """Tell the caching allocator that `tensor` is in use on `stream` until its queued work ends."""
        if self.cuda:
            tensor.record_stream(stream)


def synchronize(event) -> None:
    """Block the host until `event` has completed (no-op for None)."""
    if event is not None:
        event.synchronize()
