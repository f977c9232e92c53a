"""LoRA adapters on a generic layer (transformers' own modules): each `nn.Linear` of the layer that the adapter
targets gets A [r, in] and B [out, r] under PEFT's names, and a forward hook adds scale * B(A(x)) to its output,
as PEFT's LoRA layer computes it, with A and B bound for the call. The skeleton's parameters stay the base model's,
so its checkpoints and transformers' conversions are untouched."""

from contextlib import contextmanager

import torch.nn.functional as F
from torch import Tensor, nn

from megatrain_templates import Lora, lora_names


class LinearAdapters:
    """The adapters of one decoder layer `layer` (named `prefix` in the model): their names and shapes, and the
    binding of their tensors for a call (`bound`)."""

    def __init__(self, layer: nn.Module, prefix: str, lora: Lora):
        self.lora = lora
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._bound: dict[str, Tensor] | None = None
        for name, module in layer.named_modules():
            path = f"{prefix}{name}"
            if isinstance(module, nn.Linear) and lora.adapts(f"{path}.weight"):
                down, up = lora_names(f"{path}.weight")
                self.shapes[down], self.shapes[up] = (lora.r, module.in_features), (module.out_features, lora.r)
                module.register_forward_hook(self._adding(down, up))
        self.names = tuple(self.shapes)

    def _adding(self, down: str, up: str):
        def add_delta(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            if self._bound is None:  # (a call without adapters: the skeleton traced alone)
                return output
            return output + F.linear(F.linear(args[0], self._bound[down]), self._bound[up]) * self.lora.scale

        return add_delta

    @contextmanager
    def bound(self, views: dict[str, Tensor]):
        """The adapters' tensors (`views`, by name) in the layer's linears for the calls inside."""
        self._bound = views
        try:
            yield
        finally:
            self._bound = None
