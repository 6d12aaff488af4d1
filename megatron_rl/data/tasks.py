"""Synthetic verifiable tasks: generators of (prompt, answer) rows with exact answers.

Run `megatron-rl data --task addition --out DIR` to write train/eval JSONL files and the
character tokenizer the tiny model uses.
"""
from __future__ import annotations

import random
from typing import Callable

from megatron_rl.data.jsonl import PromptRow

TaskGenerator = Callable[[random.Random, dict], PromptRow]
_TASKS: dict[str, TaskGenerator] = {}


def register_task(name: str) -> Callable[[TaskGenerator], TaskGenerator]:
    """Decorator registering a task generator under `name`."""

    def wrap(fn: TaskGenerator) -> TaskGenerator:
        _TASKS[name] = fn
        return fn

    return wrap


def get_task(name: str) -> TaskGenerator:
    """The generator registered under `name` (error lists the valid names)."""
    if name not in _TASKS:
        raise KeyError(f"unknown task '{name}'; valid tasks: {sorted(_TASKS)}")
    return _TASKS[name]


@register_task("addition")
def addition(rng: random.Random, opts: dict) -> PromptRow:
    """'a+b=' with a, b uniform over the integers of min_digits..max_digits digits; answer is the decimal sum.

    Values (not digit counts) are uniform, so a held-out set and a de-duplicated training set
    drawn from the same generator follow the same distribution.
    """
    lo, hi = int(opts.get("min_digits", 1)), int(opts.get("max_digits", 3))
    if not 1 <= lo <= hi:
        raise ValueError(f"addition: need 1 <= min_digits <= max_digits, got {lo}, {hi}")
    smallest = 10 ** (lo - 1) if lo > 1 else 0
    a, b = rng.randint(smallest, 10**hi - 1), rng.randint(smallest, 10**hi - 1)
    return PromptRow(prompt=f"{a}+{b}=", answer=str(a + b), meta={"task": "addition"})


@register_task("subtraction")
def subtraction(rng: random.Random, opts: dict) -> PromptRow:
    """'a-b=' with a >= b; answer is the decimal difference."""
    hi = int(opts.get("max_digits", 3))
    a, b = sorted((rng.randint(0, 10**hi - 1), rng.randint(0, 10**hi - 1)), reverse=True)
    return PromptRow(prompt=f"{a}-{b}=", answer=str(a - b), meta={"task": "subtraction"})


def generate(task: str, n: int, seed: int, exclude: set[str] | None = None, **opts) -> list[PromptRow]:
    """`n` distinct rows of `task` from `seed`, skipping prompts in `exclude` (keeps eval held out)."""
    gen = get_task(task)
    rng = random.Random(seed)
    seen = set(exclude or ())
    rows: list[PromptRow] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"task '{task}' cannot produce {n} distinct prompts with options {opts}")
        row = gen(rng, opts)
        if row.prompt in seen:
            continue
        seen.add(row.prompt)
        rows.append(row)
    return rows
