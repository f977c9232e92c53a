"""LoRA adapters on a generic layer (transformers' own modules): each `nn.Linear` of the layer that the adapter
targets gets A [r, in] and B [out, r] under PEFT's names, and a forward hook adds scale * B(A(x)) to its output,
as PEFT's LoRA layer computes it (of x through LoRA dropout's mask in a training pass: `dropping`), with A and B
bound for the call. The skeleton's parameters stay the base model's,
so its checkpoints and transformers' conversions are untouched."""

from contextlib import contextmanager

import torch.nn.functional as F
from torch import Tensor, nn

from megatrain_templates import DropoutKey, Lora, dropout_noise, lora_names


class LinearAdapters:
    """The adapters of one decoder layer `layer` (named `prefix` in the model): their names and shapes, and the
    binding of their tensors for a call (`bound`)."""

    def __init__(self, layer: nn.Module, prefix: str, lora: Lora):
        self.lora = lora
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._bound: dict[str, Tensor] | None = None
        self._dropout: DropoutKey | None = None
        for name, module in layer.named_modules():
            path = f"{prefix}{name}"
            if isinstance(module, nn.Linear) and lora.adapts(f"{path}.weight"):
                down, up = lora_names(f"{path}.weight")
                self.shapes[down], self.shapes[up] = (lora.r, module.in_features), (module.out_features, lora.r)
                module.register_forward_hook(self._adding(name, down, up))
        self.names = tuple(self.shapes)

    def _adding(self, name: str, down: str, up: str):
        def add_delta(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            if self._bound is None:  # (a call without adapters: the skeleton traced alone)
                return output
            x = args[0]
            if self._dropout is not None and self.lora.dropout > 0:  # (keyed by the module's name in the layer)
                x = x * dropout_noise(x, self.lora.dropout, self._dropout.generator_seed(name))
            return output + F.linear(F.linear(x, self._bound[down]), self._bound[up]) * self.lora.scale

        return add_delta

    @contextmanager
    def bound(self, views: dict[str, Tensor]):
        """The adapters' tensors (`views`, by name) in the layer's linears for the calls inside."""
        self._bound = views
        try:
            yield
        finally:
            self._bound = None

    @contextmanager
    def dropping(self, dropout: DropoutKey | None):
        """LoRA dropout on the adapters' input for the calls inside, its masks keyed by `dropout` (None: none)."""
        self._dropout = dropout
        try:
            yield
        finally:
            self._dropout = None
