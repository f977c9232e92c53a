"""LoRA adapters on a generic layer (transformers' own modules): each `nn.Linear` of the layer that the adapter
targets gets A [r, in] and B [out, r] under PEFT's names, and a forward hook adds scale * B(A(x)) to its output,
as PEFT's LoRA layer computes it (of x through LoRA dropout's mask in a training pass: `dropping`), with A and B
bound for the call. The skeleton's parameters stay the base model's,
so its checkpoints and transformers' conversions are untouched."""

from contextlib import contextmanager

import torch.nn.functional as F
from torch import Tensor, nn

from megatrain_templates import ALL_LINEAR, DropoutKey, Lora, dropout_noise, lora_names

from .config import ZooError

# PEFT refuses LoRA on these modules of these model types (its Mamba check): an adapter there would not load in PEFT
PEFT_MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
PEFT_MAMBA_REFUSED = frozenset({"out_proj", "conv1d"})


class LinearAdapters:
    """The adapters of one decoder layer `layer` (named `prefix` in the model of `model_type`): their names and
    shapes, and the binding of their tensors for a call (`bound`). Adapted: the targeted `nn.Linear`s, as PEFT's
    (not a router subclassing it, whose forward returns the routing), but those PEFT refuses (`PEFT_MAMBA_REFUSED`:
    left out of all-linear, refused by name); transformers' Conv1D (GPT-2's) is refused: its adapters are not built."""

    def __init__(self, layer: nn.Module, prefix: str, lora: Lora, model_type: str = ""):
        self.lora = lora
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._bound: dict[str, Tensor] | None = None
        self._dropout: DropoutKey | None = None
        for name, module in layer.named_modules():
            path = f"{prefix}{name}"
            if not lora.adapts(f"{path}.weight") or not _adaptable(module, path, lora, model_type):
                continue
            down, up = lora_names(f"{path}.weight")
            self.shapes[down], self.shapes[up] = (lora.r, module.in_features), (module.out_features, lora.r)
            module.register_forward_hook(self._adding(name, down, up))
        self.names = tuple(self.shapes)

    def _adding(self, name: str, down: str, up: str):
        def add_delta(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            if self._bound is None:  # (a call without adapters: the skeleton traced alone)
                return output
            if not isinstance(output, Tensor):  # (an nn.Linear whose own forward returns more than its product)
                raise ZooError(
                    f"model.adapter: {name} ({type(module).__name__}) returns a {type(output).__name__}, not a "
                    "tensor LoRA can add to; name model.adapter.target_modules without it"
                )
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


def _adaptable(module: nn.Module, path: str, lora: Lora, model_type: str) -> bool:
    """Whether LoRA adapts `module` (targeted at `path`), refusing in one line what it cannot adapt as named."""
    if type(module).__name__ == "Conv1D":  # (transformers.pytorch_utils': a weight [in, out], PEFT's fan_in_fan_out)
        raise ZooError(
            f"model.adapter: {path} is a transformers Conv1D layer, which megatrain's LoRA does not adapt yet; train "
            "the whole model (leave out model.adapter)"
        )
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is not nn.Linear.forward and type(module).__name__.endswith("Router"):
        if ALL_LINEAR in lora.target_modules:  # (Phi-MoE's, Llama 4's: their forward returns the routing)
            return False
        raise ZooError(
            f"model.adapter.target_modules: {path} is a router ({type(module).__name__}) whose forward returns the "
            "routing, which LoRA cannot add to; name the other linear layers"
        )
    leaf = path.rsplit(".", 1)[-1]
    if model_type in PEFT_MAMBA_TYPES and leaf in PEFT_MAMBA_REFUSED:
        if ALL_LINEAR in lora.target_modules:
            return False
        raise ZooError(
            f"model.adapter.target_modules: PEFT takes no LoRA on {model_type}'s {leaf} (its adapters would not load "
            "in PEFT); target the other linear layers"
        )
    return True
