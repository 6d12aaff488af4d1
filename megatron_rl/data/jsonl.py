"""Prompt datasets in JSONL: one object per line with at least `prompt` (str) and `answer` (a scalar).

Extra keys are kept in `PromptRow.meta` (e.g. the task name for a reward function). Every row is
checked when the file is read (UTF-8, JSON, required keys, a non-empty prompt, a string or finite
number answer); a bad line is reported with its file and line number, nothing is silently dropped.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator


class DataFormatError(ValueError):
    """A dataset line (or file) that cannot be used, reported with file and line number."""


class DataFileNotFoundError(DataFormatError, FileNotFoundError):
    """A dataset file that does not exist."""


@dataclass
class PromptRow:
    """One dataset row."""

    prompt: str
    """Prompt text given to the policy."""
    answer: Any
    """Ground truth the reward function checks against (a string, number or bool)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Any other keys of the row."""
    source: str = ""
    """'file:line' the row was read from ('' for generated rows), named by later checks."""


def check_answer(answer: Any, where: str) -> None:
    """Raise DataFormatError unless `answer` is a scalar a reward function can compare (str, bool, finite number)."""
    if answer is None:
        raise DataFormatError(f"{where}: 'answer' is null (expected a string or a number)")
    if isinstance(answer, float) and not math.isfinite(answer):
        raise DataFormatError(f"{where}: 'answer' is {answer} (expected a string or a finite number)")
    if not isinstance(answer, (str, int, float)):
        raise DataFormatError(f"{where}: 'answer' must be a string or a number, got a JSON {_json_kind(answer)}")


def _json_kind(value: Any) -> str:
    return {dict: "object", list: "array"}.get(type(value), type(value).__name__)


def parse_row(obj: Any, where: str) -> PromptRow:
    """Validate one decoded JSON object; `where` ('file:line') prefixes every error."""
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {_json_kind(obj)}")
    for key in ("prompt", "answer"):
        if key not in obj:
            raise DataFormatError(f"{where}: missing required key '{key}' (keys: {sorted(obj)})")
    if not isinstance(obj["prompt"], str) or not obj["prompt"]:
        raise DataFormatError(f"{where}: 'prompt' must be a non-empty string")
    check_answer(obj["answer"], where)
    meta = {k: v for k, v in obj.items() if k not in ("prompt", "answer")}
    return PromptRow(prompt=obj["prompt"], answer=obj["answer"], meta=meta, source=where)


def iter_json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    """('file:line', decoded object) of each non-blank line of a JSONL file; bad UTF-8 or JSON raises DataFormatError."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataFormatError(f"{where}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte offset {exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            yield where, obj


def read_jsonl(path: str | Path) -> list[PromptRow]:
    """Read and check every row of a JSONL prompt file; blank lines are skipped, bad lines raise DataFormatError."""
    path = Path(path)
    if not path.is_file():
        raise DataFileNotFoundError(f"dataset file not found: {path}")
    rows = [parse_row(obj, where) for where, obj in iter_json_lines(path)]
    if not rows:
        raise DataFormatError(f"{path}: no rows")
    return rows


def write_jsonl(path: str | Path, rows: Iterable[PromptRow]) -> int:
    """Write rows as JSONL (atomically) and return how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps({"prompt": row.prompt, "answer": row.answer, **row.meta}) + "\n")
            n += 1
    tmp.replace(path)
    return n
