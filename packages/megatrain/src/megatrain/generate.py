"""`megatrain generate` and GRPO's sampling as the meta-package gives them: prompts read from a file and rendered
with the run's tokenizer and chat template, completions from the trainer's weights by the zoo's generation engine
(`megatrain_zoo.generate`), and the one-line refusal where transformers is missing."""

import sys

from megatrain_zoo.generate import Generator, Sampling, file_sampling

from .config import ConfigError


def require_transformers(what: str) -> None:
    """Refuse in one line where transformers is not installed: generation runs the model's own transformers modules
    with their KV cache."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{what} decodes with the model's transformers modules and their KV cache: install transformers "
            "(pip install 'transformers>=5.0')"
        ) from None


def generate_completions(trainer, tokenizer, tokenizer_path, prompts: list, sampling: Sampling, seed: int) -> list[str]:
    """Completions (text) of `prompts` (text, or messages rendered with the chat template's generation prompt) from
    the trainer's weights, as many at a time as the KV cache's room allows (train.grpo.generation_weights: resident or
    streamed layers). A text prompt starts as the tokenizer starts a text (Llama's and Gemma's <bos>), as
    transformers' `tokenizer(text)` and megatrain's text documents do; a rendered conversation as its template wrote it."""
    from megatrain_data import eos_token_text, load_chat_template, pad_token_id
    from megatrain_data.prompts import render_prompt

    eos = eos_token_text(tokenizer, trainer.model_config.eos_token_id, tokenizer_path.parent)
    template = load_chat_template(tokenizer_path.parent, trainer.config.data.chat_template, eos)
    ids = [render_prompt(p, template, tokenizer, f"prompt {i + 1}") for i, p in enumerate(prompts)]
    grpo = trainer.config.train.grpo
    generator = Generator(trainer, grpo.generation_weights, grpo.generation_decoding)
    completions = generator.generate(ids, sampling, pad_token_id(tokenizer, eos), seed)
    print(f"megatrain: generation: {generator.last_plan.reason}", file=sys.stderr)
    return tokenizer.decode_batch(completions, skip_special_tokens=True)


def sampling_settings(folder, args) -> dict:
    """`Sampling`'s settings for `megatrain generate`: each flag given, else what the generation_config.json in
    `folder` (the tokenizer's, beside the weights) asks transformers' `generate()` for, else greedy and unfiltered
    with 256 new tokens; said in a line where the file sets them, and the file's settings megatrain does not apply."""
    settings = {"max_new_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    from_file, unapplied = file_sampling(folder)
    given = {name: getattr(args, name) for name in settings if getattr(args, name) is not None}
    taken = {name: value for name, value in from_file.items() if name not in given and value != settings[name]}
    if taken:
        said = ", ".join(f"{name} {value}" for name, value in taken.items())
        print(
            f"megatrain: generate: {said}, as {folder / 'generation_config.json'} sets (a flag overrides)",
            file=sys.stderr,
        )
    if unapplied:
        print(f"megatrain: generate: not applied from generation_config.json: {', '.join(unapplied)}", file=sys.stderr)
    return settings | taken | given
