"""What an image-text micro-batch gives its model besides the token ids: the processor's pixel tensors."""

import torch
from torch import Tensor


class Media:
    """An image-text micro-batch's model inputs by transformers' argument names (`pixel_values`, `image_grid_thw`,
    `pixel_values_videos`, `token_type_ids`, ...), with its token ids (`input_ids`, [rows, seq]): what the model's
    forward reads to encode the images and videos, splice them in at their placeholder tokens and place them (a
    multimodal rotary embedding's positions). Each tensor holds the micro-batch's images (or rows, for a per-token
    tensor such as `token_type_ids`) along its first dimension, in the rows' order; `cache` keeps what the
    templates compute once per micro-batch (the vision blocks' and decoder layers' arguments)."""

    def __init__(self, input_ids: Tensor, tensors: dict[str, Tensor]):
        self.input_ids, self.tensors = input_ids, dict(tensors)
        self.cache: dict = {}

    def to(self, device: torch.device, non_blocking: bool = False) -> "Media":
        """A copy with the token ids and every tensor on `device` (the cache is not carried)."""
        moved = {name: t.to(device, non_blocking=non_blocking) for name, t in self.tensors.items()}
        return Media(self.input_ids.to(device, non_blocking=non_blocking), moved)

    @staticmethod
    def of_rows(input_ids: Tensor, rows: list[dict[str, Tensor]]) -> "Media":
        """A micro-batch's media from its rows' (each row's processor outputs, those of no image left out); tensors
        of different sizes past their first dimension padded with zeros to the largest, as the processor pads a
        batch (LLaVA-NeXT's tiles of an image: the model reads each image's own)."""
        names = dict.fromkeys(name for row in rows for name in row)
        return Media(input_ids, {name: _padded_cat([row[name] for row in rows if name in row]) for name in names})


def _padded_cat(tensors: list[Tensor]) -> Tensor:
    largest = [max(sizes) for sizes in zip(*(t.shape[1:] for t in tensors))]
    padded = []
    for t in tensors:
        pad = [p for have, want in zip(reversed(t.shape[1:]), reversed(largest)) for p in (0, want - have)]
        padded.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(padded)
