"""The setup's warm-up step: what is built on first use (compiled kernels for each shape, cuBLAS's plans, the
allocator's pools, the pinned host memory of offloaded activations) is built before the first step, not inside it."""

import time

import torch

from .step import StepBatch


def warm_up_pipeline(trainer) -> float:
    """Seconds to run a step's forward and backward once on random tokens, each micro-batch shape of a configured
    batch once, gradients dropped, and the step's pinned host memory taken (`LayerPipeline.warm_up`); the weights
    are only read. Fine-tuning rows come as the data will bring them (padding marked, packed documents' positions
    restarting), so the attention kernels they take are built too."""
    start = time.perf_counter()
    train, data = trainer.config.train, trainer.config.data
    tokens = torch.randint(
        0, trainer.model_config.vocab_size, (train.rows_per_step, data.seq_len), generator=torch.Generator()
    )
    valid = positions = None
    if data.dataset is not None:
        valid = torch.ones_like(tokens, dtype=torch.bool)
        if data.pack:  # two documents a row
            positions = (torch.arange(data.seq_len) % max(1, data.seq_len // 2)).expand_as(tokens).contiguous()
    step = trainer.rows.micro_batches(StepBatch(tokens, tokens, positions, valid))
    shapes = {}
    for micro in step:
        shapes.setdefault(micro.input_ids.shape, micro)
    if shapes:
        trainer.pipeline.warm_up(list(shapes.values()), step)
    return time.perf_counter() - start
