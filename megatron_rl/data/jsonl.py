"""Prompt datasets in JSONL: one object per line with at least `prompt` (str) and `answer`.

Extra keys are kept in `PromptRow.meta` (e.g. the task name for a reward function). A bad line
is reported with its file and line number; nothing is silently dropped.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable


class DataFormatError(ValueError):
    """A dataset line that cannot be used, reported with file and line number."""


@dataclass
class PromptRow:
    """One dataset row."""

    prompt: str
    """Prompt text given to the policy."""
    answer: Any
    """Ground truth the reward function checks against."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Any other keys of the row."""


def parse_row(obj: Any, where: str) -> PromptRow:
    """Validate one decoded JSON object; `where` ('file:line') prefixes every error."""
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("prompt", "answer"):
        if key not in obj:
            raise DataFormatError(f"{where}: missing required key '{key}' (keys: {sorted(obj)})")
    if not isinstance(obj["prompt"], str) or not obj["prompt"]:
        raise DataFormatError(f"{where}: 'prompt' must be a non-empty string")
    meta = {k: v for k, v in obj.items() if k not in ("prompt", "answer")}
    return PromptRow(prompt=obj["prompt"], answer=obj["answer"], meta=meta)


def read_jsonl(path: str | Path) -> list[PromptRow]:
    """Read every row of a JSONL prompt file; blank lines are skipped, bad lines raise DataFormatError."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"dataset file not found: {path}")
    rows: list[PromptRow] = []
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataFormatError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            rows.append(parse_row(obj, where))
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
