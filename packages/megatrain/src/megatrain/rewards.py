"""GRPO's reward functions, with TRL's signature: `f(prompts, completions, **columns) -> list[float | None]`, the
completions as text (or, for conversational prompts, as [{"role": "assistant", "content": text}]), every other
column of the prompt dataset by name, one value per completion; None where the function has no opinion (it is then
left out of the weighted sum, as TRL's nansum does). Built in: `exact_match` (the completion, stripped, is the
`answer` column), `numeric_answer` (the completion's last number, or its \\boxed{} one, equals `answer`'s), and
`format:REGEX` (the completion matches REGEX from its start, as TRL's format rewards do)."""

import math
import re
from collections.abc import Callable

import torch

from .config import ConfigError, import_user_module


class RewardError(Exception):
    """A reward function failed on a step's completions (raised, or gave no finite reward per completion): the
    user's code, not the config; the run saves its trained steps before it stops (loop.py)."""


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


def load_reward(name: str) -> Callable:
    """A reward function by its config name: a built-in, format:REGEX, or module:function."""
    if name in BUILTIN:
        return BUILTIN[name]
    if name.startswith("format:"):
        try:
            return format_reward(name.removeprefix("format:"))
        except re.error as error:
            raise ConfigError(f"train.grpo.reward_funcs {name!r}: the regex does not compile ({error})") from None
    module_name, _, function_name = name.partition(":")
    try:
        function = getattr(import_user_module(module_name), function_name) if function_name else None
    except (ImportError, AttributeError) as error:
        function, reason = None, f"{type(error).__name__}: {error}"
    else:
        reason = "not a built-in, and no module:function" if function is None else "not callable"
    if not callable(function):
        raise ConfigError(
            f"train.grpo.reward_funcs {name!r} cannot be loaded ({reason}); name a built-in "
            f"({', '.join(BUILTIN)}, format:REGEX) or an importable module:function"
        )
    return function


class Rewards:
    """The weighted sum of a run's reward functions over a step's completions, with each function's values."""

    def __init__(self, names: tuple[str, ...], weights: tuple[float, ...] | None):
        if not names:
            raise ConfigError(
                "train.objective grpo needs train.grpo.reward_funcs: a built-in (exact_match, numeric_answer, "
                "format:REGEX) or module:function, or train.grpo.rollouts with given rewards"
            )
        self.names = names
        self.functions = [load_reward(name) for name in names]
        self.weights = torch.tensor(weights or [1.0] * len(names), dtype=torch.float64)

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
        total = (values * self.weights).nansum(1)
        metrics = {}
        for index, name in enumerate(self.names):
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
