"""A Hugging Face model directory's config.json as a `ModelConfig`, whichever way the model trains: a native
template's (`hf.py`), transformers' own modules' (`generic.py`), or a whole image-text model's (`image_text.py`)."""

import importlib.util
import json
import re
from pathlib import Path

from megatrain_store.checkpoints import CHECKPOINTS, MANIFEST
from megatrain_store.rundir import FINAL, LOCK

from .config import ModelConfig, TemplateLacks, ZooError
from .generic import generic_model_config
from .hf import _TEXT_MODEL_OF, check_hf_numbers, config_from_hf, has_template
from .peft import PEFT_CONFIG
from .skeleton import GenericError


def model_config_from_hf(hf: dict, implementation: str = "auto", image_text: str | bool = "auto") -> ModelConfig:
    """`config_from_hf`, or where `implementation` says so, or no native template exists (auto), the config of the
    model that runs transformers' own modules (`generic.py`). An image-text config.json (one with a vision_config)
    trains whole (`image_text.py`) where `image_text` is true, or auto and megatrain has no native template for its
    text model; else its text model alone."""
    vision = bool(hf.get("vision_config"))  # (Gemma 4's text-only checkpoints write vision_config: null)
    whole = vision and (image_text is True or (image_text == "auto" and not has_template(hf)))
    if vision and not whole and hf.get("model_type") not in _TEXT_MODEL_OF:
        raise ZooError(
            f"{hf.get('model_type')}'s text model cannot train alone (megatrain reads it alone only from Gemma 3, "
            "Llama 4, Mistral 3 and Qwen3.5 checkpoints); set model.image_text: auto to train the whole model"
        )
    if implementation != "transformers" and not whole:
        try:
            return config_from_hf(hf)
        except TemplateLacks as error:
            if implementation == "native":
                raise
            if importlib.util.find_spec("transformers") is None:
                raise ZooError(
                    f"{error}; or install transformers (pip install 'megatrain-zoo[transformers]') to train it "
                    "through transformers' own modules"
                ) from None
    if importlib.util.find_spec("transformers") is None:
        what = "is an image-text model, trained whole" if whole else "runs, as implementation transformers asks,"
        raise ZooError(
            f"{hf.get('model_type')} {what} through transformers' own modules: install transformers "
            "(pip install 'megatrain-zoo[transformers]')"
        )
    try:
        return generic_model_config(hf, image_text=whole)
    except GenericError as error:
        raise ZooError(str(error)) from error


def _special_floats(pairs: dict) -> "dict | float":
    """transformers writes infinities and NaNs of a config as {"__float__": "Infinity"} (Granite 4.0-H's
    time_step_limit)."""
    return float(pairs["__float__"]) if set(pairs) == {"__float__"} else pairs


def read_hf_config(model_dir: Path, implementation: str = "auto", image_text: str | bool = "auto") -> ModelConfig:
    """A directory's config.json as a `ModelConfig`: a native family's (`implementation` native or auto), or one that
    runs transformers' own modules (transformers, or auto for a family with no native template); an image-text
    model's whole or its text model alone (`model_config_from_hf`)."""
    _check_a_model_directory(Path(model_dir))
    path = Path(model_dir) / "config.json"
    try:
        hf = json.loads(path.read_text(), object_hook=_special_floats)
        if not isinstance(hf, dict):
            raise ZooError(f"{path} holds a JSON {type(hf).__name__}, not a model's settings; download it again")
        if has_template(hf):  # (the others' fields are transformers' to check)
            check_hf_numbers(hf, str(path))
        return model_config_from_hf(hf, implementation, image_text)
    except (FileNotFoundError, NotADirectoryError):
        hub_name = not Path(model_dir).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(model_dir))
        fetch = (
            f"; it is read from disk, not the hub: `hf download {model_dir} --local-dir DIR` fetches it"
            if hub_name
            else ""
        )
        raise ZooError(
            f"{path} not found: model.hf_dir must be a Hugging Face model directory with config.json{fetch}"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ZooError(f"{path} is not valid JSON ({error}); download the model's config.json again") from error
    except KeyError as error:
        raise ZooError(f"{path} lacks the setting {error}; is it a Hugging Face model's config.json?") from error


def _check_a_model_directory(model_dir: Path) -> None:
    """Refuse, naming what to give instead, what megatrain writes that is no model directory: a run directory (its
    config.json is the run's), a checkpoint (its manifest and master weights) and LoRA adapters (PEFT's files)."""
    try:
        if "model_type" in json.loads((model_dir / "config.json").read_text()):
            return  # (a model's config.json, whatever else the directory holds)
    except (OSError, ValueError, TypeError):
        pass
    if (model_dir / MANIFEST).is_file():
        fix = f"`megatrain convert {model_dir} OUT` writes its model directory, or --resume {model_dir} continues it"
        raise ZooError(f"{model_dir} is a megatrain checkpoint, not a model directory: {fix}")
    if (model_dir / CHECKPOINTS).is_dir() or (model_dir / LOCK).exists():
        final = model_dir / FINAL
        model = f"its model is {final}" if (final / "config.json").is_file() else f"`megatrain convert {model_dir} OUT`"
        raise ZooError(f"{model_dir} is a megatrain run directory, not a model directory: {model} (model.hf_dir)")
    if (model_dir / PEFT_CONFIG).is_file():
        raise ZooError(
            f"{model_dir} holds LoRA adapters, not a model: set model.hf_dir to their base model and "
            f"model.adapter.path: {model_dir}"
        )


def check_reference_model(ref_dir: Path, policy, setting: str = "train.dpo.ref_model") -> None:
    """Refuse, before any weights are loaded, a reference whose architecture or vocabulary is not the policy's."""
    if not (Path(ref_dir) / "config.json").is_file():
        raise ZooError(
            f"{setting} {ref_dir} holds no config.json: name a Hugging Face model directory (the policy's model with "
            "other weights), or leave it unset to use the initial weights"
        )
    try:
        reference = read_hf_config(ref_dir)
    except ZooError as error:
        raise ZooError(f"{setting} {ref_dir}: {error}") from None
    for field in ("arch", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings"):
        if getattr(reference, field) != getattr(policy, field):
            raise ZooError(
                f"{setting} {ref_dir} has {field} {getattr(reference, field)!r} where the policy has "
                f"{getattr(policy, field)!r}; the reference must be the policy's model with other weights "
                "(its SFT checkpoint, say), or leave ref_model unset to use the initial weights"
            )
