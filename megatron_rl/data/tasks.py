"""Synthetic verifiable tasks: generators of (prompt, answer) rows with exact answers.

Run `megatron-rl data --task addition --out DIR` to write train/eval JSONL files and the
character tokenizer the tiny model uses.

Every generated row records its task (`meta["task"]`), and a task may register its answer format (a
regular expression a well-formed completion matches in full): `malformed_checker(rows)` turns that into
the check behind the `malformed/*` metrics (the fraction of answers that do not parse in the task's
format, the paper's "garbled outputs"), for prompt sets that all come from one such task.
"""
from __future__ import annotations

import random
import re
from typing import Callable, Optional, Sequence

from megatron_rl.data.jsonl import DataFormatError, PromptRow

TaskGenerator = Callable[[random.Random, dict], PromptRow]
_TASKS: dict[str, TaskGenerator] = {}
_FORMATS: dict[str, re.Pattern] = {}


def register_task(name: str, answer_format: Optional[str] = None) -> Callable[[TaskGenerator], TaskGenerator]:
    """Decorator registering a task generator under `name`, with the regex a well-formed answer fully matches."""

    def wrap(fn: TaskGenerator) -> TaskGenerator:
        _TASKS[name] = fn
        if answer_format is not None:
            _FORMATS[name] = re.compile(answer_format)
        return fn

    return wrap


def answer_format(name: str) -> Optional[re.Pattern]:
    """The answer-format regex registered for task `name` (None when it has none)."""
    return _FORMATS.get(name)


def malformed_checker(rows: Sequence[PromptRow]) -> Optional[Callable[[str], bool]]:
    """`is_malformed(completion) -> bool` for prompt rows that all record one task with an answer format, else None.

    A completion is malformed when its stripped text does not fully match the format: it does not parse as an
    answer of the task at all, whether or not it would be correct. Rows read from user files without a `task`
    key (or mixing tasks) get no check, so the metric is absent rather than wrong.
    """
    tasks = {r.meta.get("task") for r in rows}
    if len(tasks) != 1:
        return None
    pattern = _FORMATS.get(next(iter(tasks)))  # type: ignore[arg-type]
    if pattern is None:
        return None
    return lambda completion: pattern.fullmatch(completion.strip()) is None


def get_task(name: str) -> TaskGenerator:
    """The generator registered under `name` (error lists the valid names)."""
    if name not in _TASKS:
        raise KeyError(f"unknown task '{name}'; valid tasks: {sorted(_TASKS)}")
    return _TASKS[name]


@register_task("addition", answer_format=r"\d+")
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


@register_task("subtraction", answer_format=r"\d+")
def subtraction(rng: random.Random, opts: dict) -> PromptRow:
    """'a-b=' with a >= b; answer is the decimal difference."""
    hi = int(opts.get("max_digits", 3))
    a, b = sorted((rng.randint(0, 10**hi - 1), rng.randint(0, 10**hi - 1)), reverse=True)
    return PromptRow(prompt=f"{a}-{b}=", answer=str(a - b), meta={"task": "subtraction"})


TRACE_COLUMN = r"\d\+\d\+[01]=\d\d"
"""One column of the written carry trace: digit of a + digit of b + carry in = two-digit column sum."""


@register_task("addition_trace", answer_format=rf"{TRACE_COLUMN}(,{TRACE_COLUMN})*:\d+")
def addition_trace(rng: random.Random, opts: dict) -> PromptRow:
    """'a+b=' with a, b of exactly `digits` digits (default 4); the answer is a written carry trace and the sum.

    One column per digit, least significant first, 'x+y+c=ss' (the two digits, the carry in, the column sum
    as two digits, whose tens digit is the next column's carry), comma-separated, then ':' and the sum:

        4738+9265=  ->  8+5+0=13,3+6+1=10,7+2+1=10,4+9+1=14:14003

    The whole trace is the answer (exact match), so every generated token counts: 4 digits give 40-41
    characters (+ EOS), each column depending on the previous one through its carry, and a wrong digit
    anywhere is a wrong answer while a broken pattern is a malformed one.
    """
    d = int(opts.get("digits", 4))
    if d < 1:
        raise ValueError(f"addition_trace: need digits >= 1, got {d}")
    a, b = rng.randint(10 ** (d - 1), 10**d - 1), rng.randint(10 ** (d - 1), 10**d - 1)
    return PromptRow(prompt=f"{a}+{b}=", answer=carry_trace(a, b), meta={"task": "addition_trace"})


def carry_trace(a: int, b: int) -> str:
    """The addition_trace answer of a + b (operands of equal digit count)."""
    da, db = str(a)[::-1], str(b)[::-1]
    if len(da) != len(db):
        raise ValueError(f"carry_trace needs operands of equal length, got {a} and {b}")
    cols, carry = [], 0
    for x, y in zip(da, db):
        s = int(x) + int(y) + carry
        cols.append(f"{x}+{y}+{carry}={s:02d}")
        carry = s // 10
    return ",".join(cols) + f":{a + b}"


def teacher_drops_units_carry(row: PromptRow, p: float, seed: int) -> PromptRow:
    """`row` as an imperfect teacher demonstrates it: an 'a+b=' sum whose units carry, with probability `p` (fixed
    per prompt and seed), is left out of the tens (57+38= -> 85 instead of 95); other sums unchanged. Raises
    DataFormatError, naming the row's file:line, for a row that is not such a sum.

    The warm start learns from such demonstrations (`sft.teacher_carry_drop`) while RL's reward checks the true
    sum: with p > 0.5 the supervised model's most likely answer to a carrying sum is the teacher's mistake, a
    plateau SFT cannot leave, and the right answer is still sampled often enough for RL to find and keep.
    """
    left, plus, right = row.prompt.rstrip("=").partition("+")
    if not (plus and left.isdigit() and right.isdigit() and str(row.answer) == str(int(left) + int(right))):
        where = f"{row.source}: " if row.source else ""
        raise DataFormatError(f"{where}sft.teacher_carry_drop needs addition rows 'a+b=' -> a+b, got {row.prompt!r} -> {row.answer!r}")
    a, b = int(left), int(right)
    if a % 10 + b % 10 < 10 or random.Random(f"{seed}:{row.prompt}").random() >= p:
        return row
    return PromptRow(prompt=row.prompt, answer=str(a + b - 10), meta=row.meta, source=row.source)


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
