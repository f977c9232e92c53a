"""The device memory a run may count on: what the GPU has free now, and what this process's caching allocator holds
unused (the buffers a finished pass freed are the run's again; the CUDA context and other processes' are not)."""

import torch


def free_device_bytes(device: torch.device) -> int:
    """Device memory free now, with what the caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
