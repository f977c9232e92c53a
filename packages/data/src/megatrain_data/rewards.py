"""GRPO's reward functions, with TRL's signature: `f(prompts, completions, **columns) -> list[float | None]`, the
completions as text (or, for conversational prompts, as [{"role": "assistant", "content": text}]), every other
column of the prompt dataset by name, one value per completion; None where the function has no opinion (it is then
left out of the weighted sum, as TRL's nansum does). Built in: `exact_match` (the completion, stripped, is the
`answer` column), `numeric_answer` (the completion's last number, or its \\boxed{} one, equals `answer`'s), and
`format:REGEX` (the completion matches REGEX from its start, as TRL's format rewards do). A run's names are
resolved to functions by `reward_function` (a `module:function` is the user's code, found as a config's objective
is: `import_user_module`)."""

import importlib
import math
import os
import re
import sys
from collections.abc import Callable

import torch

from .errors import DataError


class RewardError(Exception):
    """A reward function failed on a step's completions (raised, or gave no finite reward per completion): the
    user's code, not the config; a megatrain run saves its trained steps before it stops (megatrain/loop.py)."""


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def completion_text(completion) -> str:
    """A completion's text, whether given as text or as TRL's conversational [{"role", "content"}]."""
    if isinstance(completion, list):
        return "".join(str(message.get("content", "")) for message in completion)
    return str(completion)


def exact_match(prompts, completions, answer, **_) -> list[float]:
    """1 where the completion, stripped, is the answer, else 0."""
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def _last_number(text: str) -> float | None:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    numbers = _NUMBER.findall(boxed[-1] if boxed else text)
    return float(numbers[-1].replace(",", "")) if numbers else None


def numeric_answer(prompts, completions, answer, **_) -> list[float]:
    """1 where the completion's answer number (its last \\boxed{} one, else its last number) equals the answer's."""
    rewards = []
    for completion, expected in zip(completions, answer):
        got, want = _last_number(completion_text(completion)), _last_number(str(expected))
        rewards.append(float(got is not None and want is not None and math.isclose(got, want, abs_tol=1e-6)))
    return rewards


def format_reward(pattern: str) -> Callable:
    compiled = re.compile(pattern, re.DOTALL)

    def matches(prompts, completions, **_) -> list[float]:
        return [float(compiled.match(completion_text(c)) is not None) for c in completions]

    return matches


BUILTIN = {"exact_match": exact_match, "numeric_answer": numeric_answer}


def builtin_reward(name: str) -> Callable | None:
    """The built-in reward function `name` says (exact_match, numeric_answer, format:REGEX), None for any other
    name; `re.error` where a format's regex does not compile."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith("format:"):
        return format_reward(name.removeprefix("format:"))
    return None


class Rewards:
    """The weighted sum of a run's reward functions over a step's completions, with each function's values."""

    def __init__(self, names: tuple[str, ...], functions: list[Callable], weights: tuple[float, ...] | None):
        """`functions`: one per name (the name says it in metrics and errors); `weights`: one per function (None:
        1 each)."""
        self.names, self.functions = names, functions
        self.weights = torch.tensor(weights or [1.0] * len(names), dtype=torch.float64)
        # in metrics, TRL's names: a function's own (`rewards/length_penalty/mean` for `my_rewards:length_penalty`),
        # a built-in's as written; the names as written where two functions share a name
        short = [name if builtin_reward(name) else getattr(f, "__name__", name) for name, f in zip(names, functions)]
        self.metric_names = short if len(set(short)) == len(short) else list(names)

    def __call__(self, prompts: list, completions: list, columns: dict[str, list]) -> tuple[torch.Tensor, dict]:
        """(each completion's reward [n] float64, metrics: TRL's rewards/NAME/mean and /std)."""
        return self.combined(self.values(prompts, completions, columns))

    def values(self, prompts: list, completions: list, columns: dict[str, list]) -> torch.Tensor:
        """Each function's value of each completion, [n, functions] float64 (NaN: no opinion)."""
        return torch.stack(
            [self._values(n, f, prompts, completions, columns) for n, f in zip(self.names, self.functions)], 1
        )

    def combined(self, values: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The weighted rewards of `values` (those of a whole step, gathered from its ranks) and their metrics."""
        unscored = values.isnan().all(1).nonzero().flatten().tolist()
        if unscored:
            raise RewardError(
                f"no reward function scored completion {unscored[0]} of the step ({len(unscored)} of its "
                f"{len(values)} completions so: {', '.join(self.names)} each returned None); have one of them "
                "return a reward for every completion"
            )
        total = (values * self.weights).nansum(1)
        metrics = {}
        for index, name in enumerate(self.metric_names):
            column = values[:, index]
            column = column[~column.isnan()]
            metrics[f"rewards/{name}/mean"] = column.mean().item() if len(column) else math.nan
            metrics[f"rewards/{name}/std"] = column.std().item() if len(column) > 1 else 0.0
        return total, metrics

    @staticmethod
    def _values(name: str, function: Callable, prompts, completions, columns) -> torch.Tensor:
        try:
            values = function(prompts=prompts, completions=completions, **columns)
        except Exception as error:  # noqa: BLE001 (a user's function: any error is named, with where)
            raise RewardError(
                f"reward function {name!r} raised {type(error).__name__}: {error} (on a step's {len(prompts)} "
                f"completions; the first prompt: {str(prompts[0])[:80]!r}); fix it, or have it return None (no "
                "opinion) for a completion it cannot score"
            ) from None
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            given = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(
                f"reward function {name!r} returned {given} for {len(completions)} completions; return a list of "
                "one float (or None) per completion"
            )
        out = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
        bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(float(v))]
        if bad:
            raise RewardError(
                f"reward function {name!r} gave {values[bad[0]]} for completion {bad[0]} (prompt "
                f"{str(prompts[bad[0]])[:80]!r}); rewards must be finite (None: no opinion)"
            )
        return out


def import_user_module(module_name: str):
    """The module a config names (`module:object`: an objective, a reward function), found in the working
    directory too, as `python -m megatrain` finds it: the `megatrain` console script's path holds its own bin
    directory instead. The directory goes last on the path, so that no file there hides an installed package."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    return importlib.import_module(module_name)


def reward_function(name: str) -> Callable:
    """A reward function by its name in train.grpo.reward_funcs: a built-in, format:REGEX, or module:function (the
    user's code, found as `import_user_module` finds it)."""
    try:
        function = builtin_reward(name)
    except re.error as error:
        raise DataError(f"train.grpo.reward_funcs {name!r}: the regex does not compile ({error})") from None
    if function is not None:
        return function
    module_name, _, function_name = name.partition(":")
    try:
        function = getattr(import_user_module(module_name), function_name) if function_name else None
    except (ImportError, AttributeError) as error:
        function, reason = None, f"{type(error).__name__}: {error}"
    else:
        reason = "not a built-in, and no module:function" if function is None else "not callable"
    if not callable(function):
        raise DataError(
            f"train.grpo.reward_funcs {name!r} cannot be loaded ({reason}); name a built-in "
            f"({', '.join(BUILTIN)}, format:REGEX) or an importable module:function"
        )
    return function
