"""GRPO's reward functions: the built-ins against plain Python on fresh random completions, the weighted sum and its
metrics against torch's nansum and the scored values' statistics, and a failing function named in a RewardError."""

import math
import random
import re
import statistics

import pytest
import torch

from megatrain_data.rewards import RewardError, Rewards, builtin_reward, completion_text


def random_completions(rng: random.Random, n: int) -> tuple[list, list[str]]:
    """(completions: text or TRL's conversational form, with a number plain, boxed or absent; answers)."""
    completions, answers = [], []
    for _ in range(n):
        answer = rng.randint(-50, 50)
        given = rng.choice([answer, answer + 1, None])
        text = rng.choice(["so {} ", "is \\boxed{{{}}}", " {}"]).format(given) if given is not None else "no idea"
        completions.append([{"role": "assistant", "content": text}] if rng.random() < 0.5 else text)
        answers.append(str(answer))
    return completions, answers


def test_builtins_equal_plain_python():
    rng = random.Random(0)
    completions, answers = random_completions(rng, 64)
    texts = [completion_text(c) for c in completions]
    exact = builtin_reward("exact_match")(None, completions, answers)
    assert exact == [float(t.strip() == a) for t, a in zip(texts, answers)]
    numeric = builtin_reward("numeric_answer")(None, completions, answers)
    numbers = [re.findall(r"-?\d+", t) for t in texts]
    assert numeric == [float(bool(n) and int(n[-1]) == int(a)) for n, a in zip(numbers, answers)]
    assert builtin_reward("format:^ ")(None, completions) == [float(t.startswith(" ")) for t in texts]
    assert builtin_reward("module:function") is None
    with pytest.raises(re.error):
        builtin_reward("format:(")


def test_weighted_sum_and_metrics_equal_nansum():
    rng, n = random.Random(1), 12
    scores = [rng.random() for _ in range(n)]
    opinions = [None if rng.random() < 0.3 else rng.random() for _ in range(n)]
    rewards = Rewards(("a", "b"), [lambda **_: scores, lambda **_: opinions], (0.5, 2.0))
    total, metrics = rewards(["p"] * n, ["c"] * n, {})
    values = torch.tensor([[s, math.nan if o is None else o] for s, o in zip(scores, opinions)], dtype=torch.float64)
    torch.testing.assert_close(total, (values * torch.tensor([0.5, 2.0], dtype=torch.float64)).nansum(1))
    given = [o for o in opinions if o is not None]
    assert metrics["rewards/b/mean"] == pytest.approx(statistics.mean(given))
    assert metrics["rewards/b/std"] == pytest.approx(statistics.stdev(given))
    assert metrics["rewards/a/std"] == pytest.approx(statistics.stdev(scores))


@pytest.mark.parametrize(
    "function, message",
    [
        (lambda **_: 1 / 0, "reward function 'f' raised ZeroDivisionError"),
        (lambda completions, **_: [1.0] * (len(completions) - 1), "returned 2 values for 3 completions"),
        (lambda completions, **_: [0.0, math.inf, 0.0], "gave inf for completion 1"),
        (lambda completions, **_: [None] * 3, "no reward function scored completion 0 of the step (3 of its 3"),
    ],
)
def test_a_failing_function_is_named(function, message):
    with pytest.raises(RewardError, match=re.escape(message)):
        Rewards(("f",), [function], None)(["p"] * 3, ["c"] * 3, {})


def test_metrics_name_each_function_as_trl_does():
    """`module:function` is `rewards/function/...` (TRL's name: the function's own), a built-in as written; where two
    functions share a name, each keeps its full one. A completion one function scores and another has no opinion
    of counts (TRL's nansum)."""

    def length_penalty(completions, **_):
        return [-1.0, None]

    def exact(completions, **_):
        return [None, 1.0]

    _, metrics = Rewards(("mine:length_penalty", "exact_match", "theirs:exact"), [length_penalty, exact, exact], None)(
        ["p"] * 2, ["c"] * 2, {}
    )
    assert {"rewards/length_penalty/mean", "rewards/exact_match/mean", "rewards/exact/mean"} <= set(metrics)
    both = Rewards(("a:exact", "b:exact"), [exact, exact], None)
    with pytest.raises(RewardError, match="no reward function scored completion 0"):
        both(["p"] * 2, ["c"] * 2, {})
    assert both.metric_names == ["a:exact", "b:exact"]
