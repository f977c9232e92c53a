"""PEFT's adapter directories: `adapter_config.json` (the LoRA settings) beside `adapter_model.safetensors` (the
adapters, named `base_model.model.` + the model's own names), read into a run's adapter groups and written from
them, so that an adapter trained here loads with `peft.PeftModel.from_pretrained` and back."""

import json
from pathlib import Path

from megatrain_templates import Lora

from .config import ZooError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def read_peft_config(adapter_dir: Path) -> Lora:
    """The LoRA settings of a PEFT adapter directory (r, lora_alpha, lora_dropout, target_modules)."""
    path = Path(adapter_dir) / PEFT_CONFIG
    if not path.is_file():
        raise ZooError(f"{adapter_dir} holds no {PEFT_CONFIG}: model.adapter.path must name a PEFT adapter directory")
    settings = json.loads(path.read_text())
    if settings.get("peft_type", "LORA") != "LORA":
        raise ZooError(f"{path}: peft_type {settings['peft_type']!r}; megatrain trains LORA adapters")
    targets = settings.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    return Lora(int(settings["r"]), float(settings["lora_alpha"]), targets, float(settings.get("lora_dropout", 0.0)))


def load_peft_adapter(store, spec, adapter_dir: Path) -> None:
    raise NotImplementedError  # TEMP: being written
