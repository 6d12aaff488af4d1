"""Registry of reward functions: `get_reward_fn(name)(response_text, answer) -> (reward, correct)`."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

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


def _timeout_s(seconds: int) -> Optional[int]:
    """math-verify's timeouts use SIGALRM, which only the main thread may set: elsewhere run without one."""
    return seconds if threading.current_thread() is threading.main_thread() else None


@register_reward("math_answer")
def math_answer(response: str, answer: Any) -> tuple[float, bool]:
    """1.0 when math-verify finds the completion's final answer equal to the ground truth, else 0.0.

    math-verify (Hugging Face's checker, used by open-r1 and DAPO-style pipelines) extracts the
    answer from LaTeX (\\boxed{} first, then the last expression) or plain expressions, and
    compares symbolically: fractions, radicals, intervals, sets, percentages and units. The gold
    may be a bare answer ('3/4') or a worked solution whose \\boxed{} holds it (MATH layout).
    """
    from math_verify import parse, verify  # sympy behind it: ~0.4 CPU-s that processes without a math reward skip

    gold_text = str(answer).strip()
    if not gold_text:
        return 0.0, False
    # A bare gold ('1/2', '\\frac12', '[0, 1)') is wrapped in $..$ so the LaTeX extractor reads it too.
    gold = parse(gold_text if "$" in gold_text or "\\boxed" in gold_text else f"${gold_text}$",
                 parsing_timeout=_timeout_s(5))
    if not gold:
        gold = parse(gold_text, parsing_timeout=_timeout_s(5))
    pred = parse(response, parsing_timeout=_timeout_s(5))
    ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=_timeout_s(5))
    return (1.0 if ok else 0.0), ok
