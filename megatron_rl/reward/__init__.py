"""Registry of reward functions: `get_reward_fn(name)(response_text, answer) -> (reward, correct)`."""
from __future__ import annotations

import re
from typing import Any, Callable

RewardFn = Callable[[str, Any], tuple[float, bool]]
_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under `name`."""

    def wrap(fn: RewardFn) -> RewardFn:
        _REWARDS[name] = fn
        return fn

    return wrap


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered under `name` (error lists the valid names)."""
    if name not in _REWARDS:
        raise KeyError(f"unknown reward '{name}'; valid rewards: {sorted(_REWARDS)}")
    return _REWARDS[name]


@register_reward("exact_match")
def exact_match(response: str, answer: Any) -> tuple[float, bool]:
    """1.0 when the stripped completion equals str(answer), else 0.0."""
    ok = response.strip() == str(answer).strip()
    return (1.0 if ok else 0.0), ok


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@register_reward("math_answer")
def math_answer(response: str, answer: Any) -> tuple[float, bool]:
    """1.0 when the last number in the completion (or a \\boxed{} value) equals the answer numerically."""
    boxed = re.findall(r"\\boxed\{([^}]*)\}", response)
    candidates = boxed or _NUMBER.findall(response)
    if not candidates:
        return 0.0, False
    try:
        ok = abs(float(candidates[-1].replace(",", "")) - float(str(answer).replace(",", ""))) < 1e-6
    except ValueError:
        ok = candidates[-1].strip() == str(answer).strip()
    return (1.0 if ok else 0.0), ok
