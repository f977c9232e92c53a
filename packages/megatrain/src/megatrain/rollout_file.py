"""GRPO on completions sampled elsewhere (vLLM, SGLang, a precomputed set): `train.grpo.rollouts`, a JSONL file of
one completion per line, `num_generations` consecutive lines per prompt (a group):

    {"prompt": "...", "completion": "...", "reward": 1.0}
    {"prompt": [{"role": "user", "content": "..."}], "completion_ids": [...], "advantage": 0.7, "logps": [...]}

`prompt` is text or messages (rendered with the chat template's generation prompt); the completion is `completion`
(text, tokenized as it is) or `completion_ids` (the engine's tokens, exactly); `reward` (advantages computed per
step as for generated completions) or `advantage` (taken as given); `logps`, optional, the sampling policy's
log-probability of each completion token (the importance ratio's denominator; without it, the current policy's
at the rollout's first update). The reference's log-probabilities (train.grpo.beta > 0) come from one
forward-only pass over every row before training, cached beside the run's data."""

import sys
import time
from pathlib import Path

import numpy as np
import torch

from megatrain_data import Batch, load_chat_template
from megatrain_data.prompts import given_completions, rows_of
from megatrain_store import atomic_write
from megatrain_templates import Rollout, group_advantages

from .config import Config, ConfigError
from .reference import reference_key
from .rollouts import StepRollout, _Rollouts, order
from .step import StepBatch


class FileRollouts(_Rollouts):
    def __init__(self, trainer, config: Config, tokenizer, tokenizer_path: Path, eos: str, pad_id: int):
        super().__init__(trainer, config)
        self.tokenizer, self.pad_id = tokenizer, pad_id
        template = load_chat_template(tokenizer_path.parent, config.data.chat_template, eos)
        self.records, self.prompt_ids, self.completion_ids = given_completions(
            Path(self.grpo.rollouts), self.grpo.num_generations, template, tokenizer
        )
        self.n_groups = len(self.records) // self.grpo.num_generations
        self._check_lengths()
        self.reference = None
        if self.grpo.beta:
            self.reference = reference_token_logps(
                trainer, self._rows(range(len(self.records))), Path(config.output_dir) / "cache"
            )
        if trainer.is_main:
            print(
                f"megatrain: GRPO on {len(self.records)} given completions ({self.n_groups} prompts of "
                f"{self.grpo.num_generations}) from {self.grpo.rollouts}",
                file=sys.stderr,
            )

    def _rows(self, rows) -> Batch:
        return rows_of(
            [self.prompt_ids[i] for i in rows],
            [self.completion_ids[i] for i in rows],
            self.config.data.seq_len,
            self.pad_id,
        )

    def _check_lengths(self) -> None:
        limits = (self.grpo.max_prompt_length, self.grpo.max_completion_length)
        for what, ids, limit in zip(("prompt", "completion"), (self.prompt_ids, self.completion_ids), limits):
            longest = max(range(len(ids)), key=lambda i: len(ids[i]))
            if len(ids[longest]) > limit:
                raise ConfigError(
                    f"{self.grpo.rollouts} line {longest + 1}: its {what} has {len(ids[longest])} tokens, over "
                    f"train.grpo.max_{what}_length {limit}; raise it"
                )

    def _make(self, generation: int) -> StepRollout:
        g, train = self.grpo, self.config.train
        groups = order(
            self.n_groups, generation, train.batch_size // g.num_generations, train.seed, self.config.data.shuffle
        )
        rows = [group * g.num_generations + k for group in groups for k in range(g.num_generations)]
        batch = self._rows(rows)
        records = [self.records[i] for i in rows]
        metrics = {}
        if all("advantage" in r for r in records):
            advantages = torch.tensor([float(r["advantage"]) for r in records], dtype=torch.float64)
        else:
            rewards = torch.tensor([float(r["reward"]) for r in records], dtype=torch.float64)
            advantages, metrics = group_advantages(rewards, g.num_generations, g.scale_rewards)
            metrics = {k: float(v) for k, v in metrics.items()}
        old = self._given_logps(rows, batch)
        if old is None and g.num_iterations > 1:
            old = self.trainer.token_logps(StepBatch(batch.input_ids, batch.labels, valid=batch.valid))
        ref = None if self.reference is None else self.reference[rows]
        lengths = torch.tensor([len(self.completion_ids[i]) for i in rows], dtype=torch.float64)
        metrics["completions/mean_length"] = lengths.mean().item()
        return StepRollout(batch, Rollout(advantages, old, ref), metrics)

    def _given_logps(self, rows: list[int], batch) -> torch.Tensor | None:
        """The sampling policy's log-probabilities the file gives, at the labels' places (None where it gives
        none)."""
        if not all("logps" in self.records[i] for i in rows):
            return None
        old = torch.zeros(batch.labels.shape, dtype=torch.float64)
        for row, index in enumerate(rows):
            start = len(self.prompt_ids[index]) - 1
            old[row, start : start + len(self.completion_ids[index])] = torch.tensor(
                self.records[index]["logps"], dtype=torch.float64
            )
        return old


def reference_token_logps(trainer, batch, cache_dir: Path) -> torch.Tensor:
    """Every row's token log-probabilities under the reference (train.grpo.ref_model, else the initial weights, which
    the store holds before a checkpoint is loaded), one forward-only pass, cached as DPO's (`reference_key`)."""
    config = trainer.config
    key = reference_key(trainer, (batch.input_ids.numpy(), batch.labels.numpy()), config.train.grpo.ref_model)
    path = cache_dir / f"reference-tokens-{key}.npy"
    if path.exists():
        return torch.from_numpy(np.load(path))
    if config.train.grpo.ref_model is not None:
        trainer.load_weights(Path(config.train.grpo.ref_model))
    start, rows = time.perf_counter(), config.train.batch_size
    logps = torch.cat(
        [
            trainer.token_logps(
                StepBatch(batch.input_ids[i : i + rows], batch.labels[i : i + rows], valid=batch.valid[i : i + rows])
            )
            for i in range(0, len(batch.input_ids), rows)
        ]
    )
    if config.train.grpo.ref_model is not None:
        trainer.load_weights(None)
    if trainer.is_main:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda handle: np.save(handle, logps.numpy()))
        print(
            f"megatrain: reference log-probabilities of {len(logps)} completions in {time.perf_counter() - start:.1f} s "
            f"(forward only), cached in {path}",
            file=sys.stderr,
        )
    return logps
