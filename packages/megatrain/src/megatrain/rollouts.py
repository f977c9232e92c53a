"""GRPO's steps: rows of prompts and completions with their advantages, generated from the current weights
(`GeneratedRollouts`) or read from a file of completions an outside engine sampled (`rollout_file.FileRollouts`);
`grpo.make_rollouts` builds the run's.

A step's `train.batch_size` rows are `batch_size / num_generations` prompts, each with `num_generations`
completions side by side (a group). Which prompts and which sample depend on the step alone: generation `g =
step // num_iterations` takes the g-th run of prompts of a seeded order (a fresh permutation each pass) and
samples with the seed (train.seed, g); a step within a generation's `num_iterations` reuses its rollout, whose
sampling policy's log-probabilities it keeps (`Rollout.old_logps`), and a checkpoint holds it, so a run resumed
anywhere continues as one that never stopped."""

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatrain_data import Batch, load_tokenizer
from megatrain_data.prompts import Prompts, rows_of
from megatrain_data.rewards import RewardError, completion_text
from megatrain_data.tokens import id_list, special_ids_of
from megatrain_templates import Rollout, group_advantages
from megatrain_zoo.generate import Generator, Sampling
from megatrain_zoo.hf_weights import check_weights_unchanged

from .config import Config, ConfigError
from .objectives import make_rewards
from .step import StepBatch

ROLLOUT_FILE = "rollout.safetensors"  # a checkpoint's rollout in use (several updates per rollout)


@dataclass
class StepRollout:
    """A step's rows and what GRPO and the run's records need of them."""

    batch: Batch
    rollout: Rollout
    metrics: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)  # prompt, completion, reward, advantage per completion


def tokenizer_of(config: Config):
    """(the run's tokenizer, its file): data.tokenizer, else the model directory's tokenizer.json."""
    path = config.data.tokenizer or (Path(config.model.hf_dir) / "tokenizer.json" if config.model.hf_dir else None)
    if path is None:
        raise ConfigError("train.objective grpo reads text: set data.tokenizer (or model.hf_dir with tokenizer.json)")
    return load_tokenizer(Path(path)), Path(path)


def stop_ids(model, tokenizer, tokenizer_path: Path, eos: str) -> tuple[int, ...]:
    """Where a completion ends: the tokenizer's EOS token (`eos`: `eos_token_text`'s), the model's EOS ids and
    generation_config.json's."""
    ids = {tokenizer.token_to_id(eos)} if eos and tokenizer.token_to_id(eos) is not None else set()
    ids.update(special_ids_of(tokenizer, model.eos_token_id))  # (a preset's: ordinary tokens of one megatrain trained)
    ids.update(id_list(_json(tokenizer_path.parent / "generation_config.json").get("eos_token_id")))
    return tuple(sorted(ids))


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def order(n: int, generation: int, per_generation: int, seed: int, shuffle: bool) -> list[int]:
    """The items (prompts or groups) of a generation: consecutive runs of a seeded permutation per pass."""
    first = generation * per_generation
    picked = []
    for position in range(first, first + per_generation):
        epoch, index = divmod(position, n)
        permutation = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        picked.append(int(permutation[index]))
    return picked


class _Rollouts:
    """What both sources share: the step's rollout (kept for its num_iterations updates, and in checkpoints)."""

    def __init__(self, trainer, config: Config):
        self.trainer, self.config, self.grpo = trainer, config, config.train.grpo
        self.current: tuple[int, StepRollout] | None = None
        source = self.grpo.ref_model or config.model.hf_dir
        if self.grpo.beta and source is not None and trainer.is_main:  # (the KL's reference: the same as the run's)
            record = Path(config.output_dir) / "cache" / "reference-weights.json"
            check_weights_unchanged(Path(source), record, "the GRPO reference")

    def step(self, step: int) -> StepRollout:
        generation = step // self.grpo.num_iterations
        if self.current is None or self.current[0] != generation:
            self.current = (generation, self._make(generation))
            self._keep_for_checkpoints()
        return self.current[1]

    def _make(self, generation: int) -> StepRollout:
        raise NotImplementedError

    def _keep_for_checkpoints(self) -> None:
        """Several updates per rollout: a checkpoint holds it (its tokens, advantages, old log-probabilities)."""
        if self.grpo.num_iterations == 1:
            return
        generation, made = self.current
        tensors = {"generation": torch.tensor([generation]), "input_ids": made.batch.input_ids}
        valid = made.batch.valid.to(torch.uint8)  # (safetensors as megatrain writes them: no bool)
        tensors |= {"labels": made.batch.labels, "valid": valid, "advantages": made.rollout.advantages}
        for name in ("old_logps", "ref_logps"):
            if getattr(made.rollout, name) is not None:
                tensors[name] = getattr(made.rollout, name)
        self.trainer.extra_state[ROLLOUT_FILE] = tensors

    def resume(self, checkpoint: Path) -> None:
        """The rollout a checkpoint was taken in, where its steps had updates of it left."""
        path = checkpoint / ROLLOUT_FILE
        if not path.exists():
            return
        from safetensors.torch import load_file

        t = load_file(str(path))
        rollout = Rollout(t["advantages"], t.get("old_logps"), t.get("ref_logps"))
        self.current = (
            int(t["generation"][0]),
            StepRollout(Batch(t["input_ids"], t["labels"], None, t["valid"].bool()), rollout),
        )
        self._keep_for_checkpoints()


class GeneratedRollouts(_Rollouts):
    """Completions of the run's prompts, generated from the current weights; rewards from its functions."""

    def __init__(self, trainer, config: Config, prompts: Prompts, tokenizer, stops: tuple[int, ...], pad_id: int):
        super().__init__(trainer, config)
        self.prompts, self.tokenizer, self.pad_id = prompts, tokenizer, pad_id
        self.rewards = make_rewards(config)
        self.generator = Generator(trainer, self.grpo.generation_weights, self.grpo.generation_decoding)
        g = self.grpo
        self.sampling = Sampling(g.max_completion_length, g.temperature, g.top_p, g.top_k, stops, g.repetition_penalty)
        self.conversational = any(isinstance(p, list) for p in prompts.given)
        self.said_plan = None
        if g.beta:  # (the store holds the initial weights still: a resumed checkpoint is loaded after this)
            trainer.keep_reference(Path(g.ref_model) if g.ref_model else None)

    def _make(self, generation: int) -> StepRollout:
        g, train = self.grpo, self.config.train
        chosen = order(
            len(self.prompts.ids),
            generation,
            train.batch_size // g.num_generations,
            train.seed,
            self.config.data.shuffle,
        )
        rows = [i for i in chosen for _ in range(g.num_generations)]
        prompt_ids = [self.prompts.ids[i] for i in rows]
        given = [self.prompts.given[i] for i in rows]
        columns = {name: [values[i] for i in rows] for name, values in self.prompts.columns.items()}
        start = time.perf_counter()
        completions, values = self._generated(prompt_ids, given, columns, seed=train.seed * 1_000_003 + generation)
        seconds = time.perf_counter() - start
        if self.said_plan != self.generator.last_plan and self.trainer.is_main:
            self.said_plan = self.generator.last_plan
            print(f"megatrain: generation: {self.said_plan.reason}", file=sys.stderr)
        texts = self.tokenizer.decode_batch(completions, skip_special_tokens=True)
        rewards, reward_metrics = self.rewards.combined(values)
        advantages, metrics = group_advantages(rewards, g.num_generations, g.scale_rewards)
        batch = rows_of(prompt_ids, completions, self.config.data.seq_len, self.pad_id)
        scored = StepBatch(batch.input_ids, batch.labels, valid=batch.valid)
        old = self.trainer.token_logps(scored) if g.num_iterations > 1 else None
        ref = self.trainer.token_logps(scored, reference=True) if g.beta else None
        generated = sum(len(c) for c in completions)
        metrics = (
            {k: float(v) for k, v in metrics.items()}
            | reward_metrics
            | _length_metrics(completions, self.sampling.stop_ids)
            | {"generation/seconds": seconds, "generation/tokens_per_s": generated / seconds}
        )
        samples = [
            {
                "prompt": completion_text(p) if isinstance(p, list) else p,
                "completion": t,
                "reward": float(r),
                "advantage": float(a),
            }
            for p, t, r, a in zip(given, texts, rewards, advantages)
        ]
        return StepRollout(batch, Rollout(advantages, old, ref), metrics, samples)

    def _generated(self, prompt_ids: list, given: list, columns: dict, seed: int) -> tuple[list, torch.Tensor]:
        """The step's completions and their reward functions' values ([rows, functions]): this rank's share of the
        groups (all of them in one process) generated and scored here, the other ranks' gathered."""
        sync, share = self.trainer.sync, self.trainer.rows.share(len(prompt_ids), self.grpo.num_generations)
        try:
            mine = self._scored_share(share, prompt_ids, given, columns, seed)
        except (ConfigError, RewardError) as error:
            if sync is None:
                raise
            mine = error  # (said on every rank, which would otherwise wait for this one's share)
        if sync is None:
            return mine
        parts = sync.gather_objects(mine)
        for part in parts:
            if isinstance(part, (ConfigError, RewardError)):
                raise part
        return [c for completions, _ in parts for c in completions], torch.cat([values for _, values in parts])

    def _scored_share(self, share: range, prompt_ids: list, given: list, columns: dict, seed: int):
        """(completions, reward values) of the step's rows `share`."""
        if not share:  # (fewer groups than ranks: none here)
            return [], torch.zeros(0, len(self.rewards.names), dtype=torch.float64)
        completions = self.generator.generate(
            [prompt_ids[i] for i in share], self.sampling, self.pad_id, seed, first_row=share.start
        )
        texts = self.tokenizer.decode_batch(completions, skip_special_tokens=True)
        shown = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        mine = {name: values[share.start : share.stop] for name, values in columns.items()}
        return completions, self.rewards.values(given[share.start : share.stop], shown, mine)


def _length_metrics(completions: list[list[int]], stops: tuple[int, ...]) -> dict:
    """TRL's completions/* metrics: lengths, and the share cut at the length limit (no stop token)."""
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    clipped = [not c or c[-1] not in stops for c in completions]
    return {
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": sum(clipped) / len(completions),
    }
