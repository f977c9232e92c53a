"""How a config's values become its sections' fields: a YAML file (refusing a key given twice) and `--set key=value`
overrides into nested mappings, then each value coerced to its field's type (a number written as text, a list of
names as comma-separated text), with one line naming the key and what it takes where a value does not fit."""

import difflib
import math
import re
from dataclasses import fields, is_dataclass
from typing import Any, get_type_hints

import yaml

from megatrain_data import DataError
from megatrain_optim import OptimError


class ConfigError(Exception):
    """A configuration the trainer cannot run, with the fix in the message."""


def build_section(cls, values: dict, where: str, root=None):
    """The section `cls` (at `where`, a dotted path in the config `root`) from `values`, each coerced to its field's
    type."""
    root = root or cls
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {type(values).__name__}")
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in values.items():
        name = f"{where}.{key}" if where else key
        if not isinstance(key, str):  # (YAML reads `1:`, `~:` and `on:` as a number, null and a boolean)
            raise ConfigError(
                f"config key {key} in {where or 'the top level'} is not a name (YAML reads it as "
                f"{_YAML_KINDS.get(type(key), type(key).__name__)}); {where or 'top level'} accepts {sorted(known)}"
            )
        if key not in known:
            close = _close_keys(key, known, root)
            mean = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
            raise ConfigError(f"unknown config key {name!r}; {mean}{where or 'top level'} accepts {sorted(known)}")
        hint = hints[key]
        if is_dataclass(hint):
            kwargs[key] = build_section(hint, value or {}, name, root)
        else:
            kwargs[key] = _coerce(value, hint, name)
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ConfigError(f"{where or 'config'}: {error}") from error
    except DataError as error:  # (the data section checks itself, as data; in a config it is the config's error)
        raise ConfigError(str(error)) from error
    except OptimError as error:  # (the train section's schedule, checked by megatrain_optim.Schedule)
        raise ConfigError(f"{where}.{error}") from error


_YAML_KINDS = {type(None): "null", bool: "a boolean", int: "a number", float: "a number"}
OTHER_NAMES = dict(  # other trainers' names for keys (Hugging Face's TrainingArguments, TRL): a "did you mean"
    learning_rate="lr", max_steps="steps", max_grad_norm="grad_clip", save_steps="save_every", eval_steps="eval_every",
    per_device_train_batch_size="micro_batch_size", max_seq_length="seq_len", max_length="seq_len")  # fmt: skip
# text keys that take several comma-separated names, also written as a YAML list
COMMA_SEPARATED = ("data.dataset", "train.report_to")


def _close_keys(key: str, known: dict, root) -> list[str]:
    """What an unknown `key` of a section whose keys are `known` may mean: another trainer's name for one of them, else
    the key of that name (or its other name) in other sections of `root` (`lr:` at the top level is train.lr's),
    else a look-alike of one of its keys."""
    if OTHER_NAMES.get(key) in known:
        return [OTHER_NAMES[key]]
    names = {key, OTHER_NAMES.get(key)}
    elsewhere = [path for path in _key_paths(root) if path.rpartition(".")[2] in names]
    return elsewhere or difflib.get_close_matches(key, known, n=1)


def _key_paths(cls, prefix: str = "") -> list[str]:
    """The dotted path of every key and section of the config class `cls`."""
    hints = get_type_hints(cls)
    paths = []
    for f in fields(cls):
        paths.append(prefix + f.name)
        if is_dataclass(hints[f.name]):
            paths += _key_paths(hints[f.name], f"{prefix}{f.name}.")
    return paths


def _coerce(value: Any, hint, name: str):
    """`value` as the field `name` of type `hint` takes it, or `ConfigError` saying what it takes."""
    args = getattr(hint, "__args__", None) or (hint,)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(f"config key {name!r} has no value; it takes {_type_words(hint)}")
    tuple_hint = next((t for t in (hint, *args) if getattr(t, "__origin__", None) is tuple), None)
    if tuple_hint is not None:
        coerced = _coerce_tuple(value, tuple_hint)
    else:
        coerced = _coerce_scalar(value, args, joins_lists=name in COMMA_SEPARATED)
    if coerced is None:
        raise ConfigError(f"config key {name!r} has value {value!r}; it takes {_type_words(hint)}")
    return coerced


def _coerce_tuple(value: Any, hint) -> tuple | None:
    """A list of names (or comma-separated names, see `_split_names`) or of numbers, as `hint` (a tuple type) says;
    None if not one. Names in a list are taken as written: a regex's spaces and commas are its own."""
    if hint.__args__[0] is str:
        names = _split_names(value) if isinstance(value, str) else value
        if isinstance(names, (list, tuple)) and all(isinstance(v, str) for v in names):
            return tuple(names)
        return None
    if isinstance(value, (list, tuple)):
        try:
            numbers = tuple(float(v) for v in value)
        except (TypeError, ValueError):
            return None
        return numbers if all(math.isfinite(v) for v in numbers) else None
    return None


def _split_names(text: str) -> list[str]:
    """Comma-separated names (`--set train.grpo.reward_funcs=exact_match,format:^<think>`), spaces around them
    dropped; a `format:REGEX` takes the rest of the text as written, commas and spaces included, so it goes last."""
    regex = re.search(r"(?:^|,)\s*(format:.*)", text, re.DOTALL)  # (not "my_format:f", a module's function)
    head = text[: regex.start()] if regex else text
    names = [name.strip() for name in head.split(",") if name.strip()]
    return names + [regex.group(1)] if regex else names


def _coerce_scalar(value: Any, types: tuple, joins_lists: bool = False):
    """`value` as the first of `types` (float, int, bool, str) that takes it; None if none does. A number is finite
    (YAML and float() read nan, inf and .inf); a list of names is text only for a key that `joins_lists` (a list for
    one value, `output_dir: [a, b]`, trained into ./a,b)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    # (YAML 1.1 reads 3e-4 and 1e3, without a decimal point, as strings)
    as_float = _float_or_none(value) if number or isinstance(value, str) else None
    if float in types and as_float is not None:
        return as_float if math.isfinite(as_float) else None
    if int in types and number and isinstance(value, int):
        return value
    if int in types and as_float is not None and as_float.is_integer():  # 1e3 steps, or 2.0
        return int(as_float)
    if bool in types and isinstance(value, bool):
        return value
    if str in types and (number or isinstance(value, str)):
        return str(value)
    if str in types and joins_lists and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # a YAML list of names for a comma-separated field
    return None


def _float_or_none(value) -> float | None:
    try:
        return float(value)
    except ValueError:
        return None


_TYPE_WORDS = {int: "a whole number", float: "a finite number", bool: "true or false", str: "text", type(None): "null"}


def _type_words(hint) -> str:
    """What a field of type `hint` takes, in words."""
    if getattr(hint, "__origin__", None) is tuple:
        what = "names" if hint.__args__[0] is str else "finite numbers"
        return f"a list of {what}" if Ellipsis in hint.__args__ else f"a list of {len(hint.__args__)} {what}"
    args = getattr(hint, "__args__", None)
    if args:
        return " or ".join(_type_words(arg) for arg in args)
    return _TYPE_WORDS.get(hint, getattr(hint, "__name__", str(hint)))


def set_path(values: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = values
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is not a section")
    if isinstance(node.get(parts[-1]), dict) and not isinstance(value, dict):
        raise ConfigError(f"cannot set {dotted!r} to {value!r}: it is a section; set its keys ({dotted}.KEY=VALUE)")
    node[parts[-1]] = value


def flat_keys(values: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out |= flat_keys(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that gives a key twice (PyYAML keeps the last one, silently: a second
    `lr:` or `data:` section replaced the first)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def check_override_text(item: str) -> None:
    """Refuse an override holding bytes that are not UTF-8 (the shell hands them over as lone surrogates, which
    YAML's reader refuses with a traceback), naming the byte."""
    bad = next((i for i, char in enumerate(item) if "\udc80" <= char <= "\udcff"), None)
    if bad is not None:
        raw = item.encode("utf-8", "surrogateescape")
        offset = len(item[:bad].encode("utf-8", "surrogateescape"))
        shown = raw.decode("utf-8", "replace")
        raise ConfigError(
            f"--set {shown!r}: byte offset {offset} (0x{raw[offset]:02x}) is not UTF-8; type the value as UTF-8 text"
        )


# keys of which a config sets one: an override of one replaces the others (model.hf_dir=DIR on a preset's config)
