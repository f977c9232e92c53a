"""What an export holds beside its weights, so that transformers, vLLM and `megatrain generate` serve it as it was
trained: the tokenizer its data was read with, the chat template its conversations were rendered with, the special
tokens, and a generation config that stops at the end of an assistant turn. Derived from a run's config alone, so
that its final/ and `megatrain convert` of any of its checkpoints hold the same files."""

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from megatrain_store import atomic_write_text, read_safetensors_header
from megatrain_store.progress import size_text

from .chat import SPECIAL_TOKEN_NAMES, ChatTemplate, load_chat_template, special_token_ids
from .errors import DataError
from .load import renders_conversations, run_tokenizer
from .tokens import eos_token_text, id_list, load_tokenizer, special_ids_of, special_token_text, tokenizer_settings

# copied from beside tokenizer.json as they are: the special tokens, and an image-text model's processor
COPIED_FILES = (
    "special_tokens_map.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")  # (copied, or rewritten with the template trained)
SERVING_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", *COPIED_FILES, *TEMPLATE_FILES)
PROBE_ANSWER = "megatrain probes the end of a turn"  # (an assistant turn whose closing token is looked for)
# encoded by the tokenizer trained with and by transformers' loading of the export: digits, runs of spaces, tabs and
# newlines, punctuation, code, accents, CJK and an emoji, where tokenizer classes' pre-tokenizers differ
PROBE_TEXT = "Hello, World! 12345 + 678 = 13023.\n\n  def f(x):\n\treturn x  # naïve café 日本語 🙂 "
FAST_CLASS = "PreTrainedTokenizerFast"  # (transformers' class that reads tokenizer.json as it is)
RUN_FOLDER = "tokenizer"  # in a run directory: what its exports are served with, written as the run starts


@dataclass(frozen=True)
class Serving:
    """What an export is served with. `tokenizer`: its tokenizer.json (None: unknown, the export holds weights
    alone); `template`: the chat template trained with (None: the run rendered no conversations, and the tokenizer's
    own files go along as they are); `model_dir`: the model directory (its generation_config.json's sampling
    defaults); `eos_token_id`: the model's."""

    tokenizer: Path | None
    template: ChatTemplate | None = None
    model_dir: Path | None = None
    eos_token_id: int | list[int] | None = None


def serving_of_run(config, model, run_dir: Path, tokenizer: Path | None = None) -> Serving:
    """The serving files of a run (its config, read for data, model.hf_dir and train.objective, and its model's
    vocab_size, eos_token_id and arch, config.json's model_type, in `run_dir`): the data's tokenizer (`tokenizer`
    where the caller read the data, else as `run_tokenizer` finds it: data.tokenizer, the model directory's, the one
    megatrain trained on the run's text) and the chat template its conversations were rendered with."""
    model_dir = Path(config.model.hf_dir) if config.model.hf_dir else None
    if tokenizer is None:
        tokenizer = run_tokenizer(config.data, model.vocab_size, Path(run_dir), model_dir, model.arch)
    if tokenizer is None:
        return Serving(None, None, model_dir, model.eos_token_id)
    eos = eos_token_text(load_tokenizer(tokenizer), model.eos_token_id, Path(tokenizer).parent)
    return Serving(Path(tokenizer), trained_template(config, Path(tokenizer), eos), model_dir, model.eos_token_id)


def keep_in_run(run_dir: Path, serving: Serving) -> None:
    """Write `serving`'s files into the run's tokenizer/ folder (whole or not at all), so that `megatrain convert` of
    any of its checkpoints serves them as its final/ does, though the data's tokenizer, its template file or the
    model directory have moved since (or convert runs in another directory than the run did)."""
    if serving.tokenizer is None:
        return
    folder, staging = run_dir / RUN_FOLDER, run_dir / f".{RUN_FOLDER}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    write_serving_files(staging, serving, {})
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)


def kept_in_run(run_dir: Path) -> Serving | None:
    """The serving files a run kept as it started (`keep_in_run`), None where it kept none (a run of an earlier
    megatrain, or on token ids without a tokenizer)."""
    tokenizer = Path(run_dir) / RUN_FOLDER / "tokenizer.json"
    return Serving(tokenizer) if tokenizer.exists() else None


def trained_template(config, tokenizer: Path, eos: str) -> ChatTemplate | None:
    """The chat template a run rendered its conversations with, as its data pipeline chooses it (data.chat_template,
    else the tokenizer's own, else the simple template); None where it trained on text or token ids."""
    data = config.data
    if data.tokens is not None or data.dataset is None:
        return None
    if config.train.objective == "grpo":  # (its prompts: rendered with a template only where there is one)
        return load_chat_template(tokenizer.parent, data.chat_template, eos)
    if not renders_conversations(data):
        return None
    return load_chat_template(tokenizer.parent, data.chat_template, eos) or load_chat_template(None, "simple", eos)


def write_serving_files(out_dir: Path, serving: Serving, config: dict) -> dict:
    """Write `serving`'s files into `out_dir` (a model directory being written, its config.json's model_type in it
    where it has one: transformers' choice of tokenizer class reads it): tokenizer.json, tokenizer_config.json
    (its chat template the one trained with, also as chat_template.jinja), special_tokens_map.json and
    generation_config.json (eos: the end-of-turn token, then the tokenizer's and the model's EOS). Returns the
    config.json to write (naming the EOS where the model names none)."""
    from tokenizers import Tokenizer

    if serving.tokenizer is None or not serving.tokenizer.exists():
        return config
    source = serving.tokenizer.parent
    shutil.copyfile(serving.tokenizer, out_dir / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    for name in COPIED_FILES + (TEMPLATE_FILES if serving.template is None else ()):
        if (source / name).exists():
            shutil.copyfile(source / name, out_dir / name)
    settings = _tokenizer_config(source, tokenizer, serving)
    atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(settings, indent=2))
    settings = _served_as_trained(out_dir, tokenizer, settings)
    if serving.template is not None:
        _write_template(out_dir, source, settings["chat_template"])
    if not (out_dir / "special_tokens_map.json").exists():
        atomic_write_text(out_dir / "special_tokens_map.json", json.dumps(_special_tokens(settings), indent=2))
    generation = _json(serving.model_dir / "generation_config.json") if serving.model_dir is not None else {}
    generation = generation or _json(source / "generation_config.json")
    stops = _stop_ids(tokenizer, settings, serving, generation.get("eos_token_id"), source)
    generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    atomic_write_text(out_dir / "generation_config.json", json.dumps(generation, indent=2))
    if serving.model_dir is not None:  # (a list of EOS ids, Llama 3.1's: the model's config keeps the first alone)
        given = _json(serving.model_dir / "config.json").get("eos_token_id")
        config = {**config, "eos_token_id": given} if isinstance(given, list) else config
    return _special_ids_in_config(config, tokenizer, settings)


def _special_ids_in_config(config: dict, tokenizer, settings: dict) -> dict:
    """config.json's bos, eos and pad ids as the tokenizer has them: those it holds as special tokens (a preset's
    name ordinary tokens of a tokenizer megatrain trained), the EOS its tokenizer_config.json names where none is."""
    config = dict(config)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            kept = special_ids_of(tokenizer, config[key])
            config[key] = kept if isinstance(config[key], list) and kept else kept[0] if kept else None
    eos_id = tokenizer.token_to_id(special_token_text(settings.get("eos_token")) or "")
    if config.get("eos_token_id") is None and eos_id is not None:
        config["eos_token_id"] = eos_id
    return config


def _tokenizer_config(source: Path, tokenizer, serving: Serving) -> dict:
    """tokenizer_config.json: the source's, naming a tokenizer class and the EOS where it does not (a tokenizer
    megatrain trained ends documents with <|endoftext|>), with the chat template trained with."""
    settings = tokenizer_settings(source)
    settings.setdefault("tokenizer_class", FAST_CLASS)
    eos = eos_token_text(tokenizer, _first(serving.eos_token_id), source)
    if settings.get("eos_token") is None and eos:
        settings["eos_token"] = eos
        settings.setdefault("pad_token", eos)  # (a tokenizer of no config: transformers' batches need a pad token)
    if serving.template is not None:
        settings["chat_template"] = _pinned(serving.template, settings)
    return settings


def _served_as_trained(out_dir: Path, tokenizer, settings: dict) -> dict:
    """tokenizer_config.json's settings, naming PreTrainedTokenizerFast (tokenizer.json read as it is) where the class
    it names makes transformers encode a probe text otherwise than the tokenizer trained with: some classes rebuild
    their own pre-tokenizer (transformers 5's Qwen2Tokenizer splits digits one by one over any tokenizer.json),
    others refuse a vocabulary without their tokens. Checked on `out_dir` as served, its config.json in it: for some
    model_types (qwen2's) transformers builds its own class whatever tokenizer_config.json names, and where even
    PreTrainedTokenizerFast is not read this says how to load the tokenizer as trained. Unchecked where
    transformers is not installed."""
    named = settings.get("tokenizer_class")
    misread = _misread_as(out_dir, tokenizer, settings)
    if misread is None:
        return settings
    if named != FAST_CLASS:
        settings = {**settings, "tokenizer_class": FAST_CLASS}
        atomic_write_text(out_dir / "tokenizer_config.json", json.dumps(settings, indent=2))
        misread = _misread_as(out_dir, tokenizer, settings)
    if misread is None:
        print(
            f"serving files: transformers' {named} does not encode text as the tokenizer.json trained with does (it"
            f" builds its own pre-tokenizer or refuses the vocabulary): the exported tokenizer_config.json names"
            f" {FAST_CLASS}, which reads tokenizer.json as it is",
            file=sys.stderr,
        )
    else:
        print(f"serving files: {_misread_fix(misread, _model_type(out_dir), 'DIR')}", file=sys.stderr)
    return settings


def _misread_as(tokenizer_dir: Path, tokenizer, settings: dict) -> str | None:
    """The class transformers' AutoTokenizer of `tokenizer_dir` builds (the class named where it refuses the
    tokenizer) where it encodes a probe text otherwise than `tokenizer` (the tokenizer.json trained with); None where
    it encodes as trained, or transformers is not installed."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    probe = PROBE_TEXT + (special_token_text(settings.get("eos_token")) or "")
    try:
        served = AutoTokenizer.from_pretrained(tokenizer_dir)
        ids = served.encode(probe, add_special_tokens=False)
    except Exception:  # noqa: BLE001 (any class's refusal of this tokenizer.json)
        return settings.get("tokenizer_class") or "its tokenizer class"
    return None if ids == tokenizer.encode(probe, add_special_tokens=False).ids else type(served).__name__


def _misread_fix(served_as: str, model_type: str | None, export: str) -> str:
    """What a user does about an export that transformers' AutoTokenizer reads as `served_as`, not as trained."""
    why = f" (for config.json's model_type {model_type}, whatever tokenizer_config.json names)" if model_type else ""
    return (
        f"transformers' AutoTokenizer builds {served_as}{why}, which encodes text otherwise than the tokenizer.json "
        f"trained with: load the tokenizer with `PreTrainedTokenizerFast.from_pretrained({export})`"
    )


def _model_type(model_dir: Path) -> str | None:
    return _json(model_dir / "config.json").get("model_type")


def _pinned(template: ChatTemplate, settings: dict) -> str:
    """The template's text, rendering the special tokens it was trained with where tokenizer_config.json names others
    (the simple template ends a turn with the data's EOS, which may not be the tokenizer's): a `set` of each first."""
    named = _special_tokens(settings)
    differing = {name: text for name, text in template.special_tokens.items() if named.get(name) != text}
    return "".join(f"{{%- set {name} = {json.dumps(text)} %}}" for name, text in differing.items()) + template.template


def _write_template(out_dir: Path, source: Path, template: str) -> None:
    """The template trained with as chat_template.jinja (which transformers reads before tokenizer_config.json's),
    and in a processor's chat_template.json where the source has one."""
    atomic_write_text(out_dir / "chat_template.jinja", template)
    if (source / "chat_template.json").exists():
        atomic_write_text(out_dir / "chat_template.json", json.dumps({"chat_template": template}, indent=2))


def _stop_ids(tokenizer, settings: dict, serving: Serving, given, source: Path) -> list[int]:
    """Where a completion ends: the end-of-turn token of the template trained with (else of the tokenizer's own, in
    `source`) first, then the tokenizer's EOS, the generation config's `given` ones and the model's."""
    eos = special_token_text(settings.get("eos_token"))
    template = serving.template
    if template is None:
        try:
            template = load_chat_template(source, None, eos or "")
        except DataError:  # (a template that does not parse is the tokenizer's own business: no end of turn)
            template = None
    ids = [end_of_turn_id(template, tokenizer)] if template is not None else []
    ids.append(tokenizer.token_to_id(eos or ""))
    ids += id_list(given) + special_ids_of(tokenizer, serving.eos_token_id)
    return list(dict.fromkeys(i for i in ids if i is not None))


def end_of_turn_id(template: ChatTemplate, tokenizer) -> int | None:
    """The special token that closes an assistant turn as the template renders it (<|im_end|>, <|eot_id|>, the EOS):
    the first one after a probe answer; None where the template renders none there."""
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": PROBE_ANSWER}]
    try:
        text = template.render(messages)[0]
    except Exception:  # a template may refuse the probe (jinja's errors, a raise_exception)
        return None
    if PROBE_ANSWER not in text:
        return None
    end = text.rindex(PROBE_ANSWER) + len(PROBE_ANSWER)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    special = special_token_ids(tokenizer)
    return next((i for i, (start, _) in zip(encoding.ids, encoding.offsets) if start >= end and i in special), None)


def describe_export(out_dir: Path) -> str:
    """What an export holds, in words: its weights, its tokenizer, its chat template and where generation stops; for
    an adapter over a preset (its base a seed's weights, which no directory holds), how to serve it; where
    transformers' AutoTokenizer does not encode as its tokenizer.json does, how to load the tokenizer."""
    files = sorted(out_dir.glob("*.safetensors"))
    tensors = sum(len(read_safetensors_header(path)) - 1 for path in files)  # (less each header's __metadata__)
    parts = [f"weights ({tensors} tensors, {size_text(sum(path.stat().st_size for path in files))})"]
    adapter = _json(out_dir / "adapter_config.json")
    served = (
        "; an adapter over a base that no directory holds: `megatrain convert RUN OUT --merge` serves it"
        if adapter and not adapter.get("base_model_name_or_path")
        else ""
    )
    if not (out_dir / "tokenizer.json").exists():
        none = "no tokenizer (its source names none, as a run on token ids without data.tokenizer or model.hf_dir does)"
        return f"{', '.join(parts)}; {none}: copy the model's tokenizer files in{served}"
    parts.append("tokenizer")
    settings = tokenizer_settings(out_dir)
    if (out_dir / "chat_template.jinja").exists() or settings.get("chat_template"):
        parts.append("chat template")
    tokenizer = load_tokenizer(out_dir / "tokenizer.json", "the export's tokenizer")
    stops = _json(out_dir / "generation_config.json").get("eos_token_id")
    if stops is not None:
        names = [tokenizer.id_to_token(i) or str(i) for i in id_list(stops)]
        parts.append(f"generation stopping at {', '.join(names)}")
    misread = _misread_as(out_dir, tokenizer, settings)
    if misread is not None:
        served += "; " + _misread_fix(misread, _model_type(out_dir), json.dumps(str(out_dir)))
    return ", ".join(parts) + served


def _json(path: Path) -> dict:
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return values if isinstance(values, dict) else {}


def _special_tokens(settings: dict) -> dict:
    """The special tokens a template reads (bos_token, eos_token, ...), as text."""
    texts = {name: special_token_text(settings.get(name)) for name in SPECIAL_TOKEN_NAMES}
    return {name: text for name, text in texts.items() if text is not None}


def _first(value):
    """The first of a config's token ids (an id or a list of them)."""
    return value[0] if isinstance(value, list) else value
