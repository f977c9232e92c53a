"""Completions from a trainer's current weights: transformers' own `generate` (its KV cache, sampling and stopping)
run on the family's transformers modules (`megatrain_zoo.generic.HFSkeleton`) with the weights of megatrain's
store, in the compute dtype on the trainer's device, resident for the whole generation. The skeleton is the one
the generic template trains with, or, for a family with a native template, the same model built from the
config.json megatrain exports; weights reach it as transformers' loader converts a checkpoint. Exact by
construction: greedy decoding equals transformers' `generate` on the exported model."""

import json
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from megatrain_zoo import config_to_hf
from megatrain_zoo.checkpoint_layout import CheckpointLayout
from megatrain_zoo.generic import HFSkeleton


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: greedy (temperature 0) or sampled with transformers' temperature, top-p and top-k;
    each ends at one of `stop_ids` (kept, as the end of a trained completion) or after `max_new_tokens`."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()


class _Generating(nn.Module):
    """transformers' `generate` as a module's forward, so `torch.func.functional_call` binds the weights for it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model.generate(**kwargs)


class Generator:
    """Completions of a trainer's model from its current weights (`weights_changed` after they move)."""

    def __init__(self, trainer):
        self.trainer = trainer
        model = trainer.model_config
        hf = json.loads(model.hf_config) if model.implementation == "transformers" else config_to_hf(model)
        self.skeleton = HFSkeleton(hf)
        self.layout = CheckpointLayout(self.skeleton)
        self._weights: dict[str, Tensor] | None = None

    def weights_changed(self) -> None:
        self._weights = None

    def _bound(self) -> dict[str, Tensor]:
        """The model's parameters in the compute dtype on the device, converted a stage's group at a time."""
        if self._weights is None:
            trainer = self.trainer
            masters = trainer.named_weights()
            sources = self.layout.sources(list(masters), "the store")
            parts = self.skeleton.parts
            self._weights = {}
            for names in [parts.embedding, *parts.layers, parts.head]:
                loaded = self.layout.load({key: masters[key] for name in names for key in sources[name]})
                for name in names:
                    self._weights[name] = loaded[name].to(trainer.device, trainer.compute_dtype)
        return self._weights

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling, pad_id: int, seed: int = 0) -> list[list[int]]:
        """Each prompt's completion (token ids, ending at its stop token where one came), drawn with `seed`
        (the same seed draws the same completions; the global RNG is left as it was)."""
        device = self.trainer.device
        self.skeleton.to(device)
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # (left-padded: the completions start together)
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        options = dict(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=sampling.max_new_tokens,
            do_sample=sampling.temperature > 0,
            pad_token_id=pad_id,
            eos_token_id=list(sampling.stop_ids) or None,
        )
        if hasattr(self.skeleton.config, "output_router_logits"):  # (a load-balancing loss is no generation's)
            options["output_router_logits"] = False
        if sampling.temperature > 0:
            options |= dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        else:
            options |= dict(temperature=None, top_p=None, top_k=None)
        weights = {f"model.{name}": w for name, w in self._bound().items()}
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = torch.func.functional_call(_Generating(self.skeleton.model), weights, (), options, strict=False)
        return [_until_stop(row[longest:].tolist(), sampling.stop_ids) for row in out.cpu()]


def _until_stop(tokens: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """A completion up to and including its first stop token (what follows is padding)."""
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens


def read_prompts(path) -> list:
    """A prompts file's prompts: JSONL records with `prompt` (text or messages), or one text prompt per line."""
    from pathlib import Path

    from .config import ConfigError

    path = Path(path)
    if not path.exists():
        raise ConfigError(f'--prompts {path} does not exist; give a JSONL of {{"prompt": ...}} or a text file')
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix in (".jsonl", ".json"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{path} line {number} is not JSON: {error}") from None
            if not isinstance(record, dict) or "prompt" not in record:
                raise ConfigError(f"{path} line {number} has no 'prompt' field")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ConfigError(f"--prompts {path} holds no prompts")
    return prompts


def generate_completions(trainer, tokenizer, tokenizer_path, prompts: list, sampling: Sampling, seed: int) -> list[str]:
    """Completions (text) of `prompts` (text, or messages rendered with the chat template's generation prompt) from
    the trainer's weights, a batch at a time of train.batch_size."""
    from .chat import load_chat_template
    from .data import eos_token_text
    from .records import pad_token_id
    from .rollouts import render_prompt

    eos = eos_token_text(tokenizer, trainer.model_config.eos_token_id)
    template = load_chat_template(tokenizer_path.parent, trainer.config.data.chat_template, eos)
    ids = [render_prompt(p, template, tokenizer, f"prompt {i + 1}") for i, p in enumerate(prompts)]
    generator, texts, batch = Generator(trainer), [], trainer.config.train.batch_size
    for start in range(0, len(ids), batch):
        completions = generator.generate(
            ids[start : start + batch], sampling, pad_token_id(tokenizer, eos), seed + start
        )
        texts += tokenizer.decode_batch(completions, skip_special_tokens=True)
    return texts
