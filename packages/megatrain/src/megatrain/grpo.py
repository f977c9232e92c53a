"""GRPO's rollouts for a run: its settings checked before anything loads, then the kind its config names built
(generated from its prompts, `rollouts.GeneratedRollouts`, or read from train.grpo.rollouts,
`rollout_file.FileRollouts`)."""

import sys

from megatrain_data import eos_token_text, pad_token_id
from megatrain_data.prompts import load_prompts

from .config import Config, ConfigError
from .generate import require_transformers
from .objectives import make_rewards
from .rollout_file import FileRollouts
from .rollouts import GeneratedRollouts, stop_ids, tokenizer_of


def check_grpo_settings(config: Config, ranks=None) -> None:
    """Refuse GRPO settings that cannot run, before anything is loaded."""
    g, data = config.train.grpo, config.data
    if g.rollouts is None and ranks is not None and ranks.split_state:
        raise ConfigError(
            "GRPO generating its completions needs every host to hold the whole weights: set "
            "engine.shard_across_hosts: false, or give train.grpo.rollouts (given completions train on split hosts)"
        )
    if g.rollouts is None and data.dataset is None:
        raise ConfigError(
            "train.objective grpo generates from prompts: set data.dataset (format prompt), or train.grpo.rollouts"
        )
    if g.rollouts is None:
        require_transformers("GRPO sampling its completions (train.grpo.rollouts unset)")
        make_rewards(config)  # (a misspelled function or a bad regex: said before the model is loaded)
    if data.seq_len < g.max_prompt_length + g.max_completion_length:
        raise ConfigError(
            f"data.seq_len {data.seq_len} cannot hold a prompt of train.grpo.max_prompt_length "
            f"{g.max_prompt_length} and a completion of max_completion_length {g.max_completion_length}: "
            f"set data.seq_len to {g.max_prompt_length + g.max_completion_length} or lower those"
        )
    if data.pack:
        raise ConfigError("data.pack: GRPO trains a row per completion; set data.pack: false")


def make_rollouts(trainer, config: Config):
    """The run's rollouts: generated from its prompts, or read from train.grpo.rollouts; said in one line."""
    tokenizer, path = tokenizer_of(config)
    eos = eos_token_text(tokenizer, trainer.model_config.eos_token_id, path.parent)
    pad = pad_token_id(tokenizer, eos)
    if config.train.grpo.rollouts is not None:
        return FileRollouts(trainer, config, tokenizer, path, eos, pad)
    prompts = load_prompts(config.data, config.train.grpo.max_prompt_length, tokenizer, path, eos)
    stops = stop_ids(trainer.model_config, tokenizer, path, eos)
    if trainer.is_main:
        print(
            f"megatrain: GRPO on {len(prompts.ids)} prompts, {config.train.grpo.num_generations} completions each "
            f"of up to {config.train.grpo.max_completion_length} tokens (stop tokens {list(stops)}), generated "
            f"from the current weights (train.grpo.generation_weights {config.train.grpo.generation_weights})",
            file=sys.stderr,
        )
    return GeneratedRollouts(trainer, config, prompts, tokenizer, stops, pad)
