"""Prompt datasets from JSONL or Parquet with a field map, and the tokenizer's chat template.

    rows = load_prompts("dapo-math-17k.parquet", cfg.data, tokenizer)    # data.layout: dapo_math_17k

Reading: `.jsonl` / `.json` lines or `.parquet` (pyarrow, streamed by record batch). The field map
(`data.prompt_key`, `data.answer_key`, or a `data.layout` preset) names where prompt and answer sit:
dotted paths walk nested objects and lists (`reward_model.ground_truth`, `prompt.0.content`). A prompt
may be a string or a chat-message list ([{"role", "content"}, ...], as in DAPO-Math-17k). Every
record then goes through the same validation as a plain JSONL row (data/jsonl.py `parse_row`, errors
as file:line or file:row).

Rendering: with `data.apply_chat_template` auto (the default) the tokenizer's chat template, when it
has one, turns each prompt (a string becomes one user message) into the text the policy continues
(`add_generation_prompt=True`); true requires a template, false joins message contents. The original
prompt stays in `PromptRow.meta["raw_prompt"]`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator, Optional

from megatron_rl.data.jsonl import DataFileNotFoundError, DataFormatError, PromptRow, iter_json_lines, parse_row

LAYOUTS: dict[str, dict[str, str]] = {
    # BytedTsinghua-SIA/DAPO-Math-17k: prompt is a one-message chat list, the answer is reward_model.ground_truth.
    "dapo_math_17k": {"prompt_key": "prompt", "answer_key": "reward_model.ground_truth"},
    # hendrycks MATH (and its lighteval copy): the answer is the \boxed{} of `solution`, which math-verify extracts.
    "math": {"prompt_key": "problem", "answer_key": "solution"},
}
"""Field maps of known dataset layouts (data.layout)."""
_MISSING = object()


def field_map(data_cfg) -> tuple[str, str]:
    """(prompt_key, answer_key) of the config: its layout preset, or its explicit keys."""
    layout = getattr(data_cfg, "layout", None)
    if layout:
        keys = LAYOUTS[layout]
        return keys["prompt_key"], keys["answer_key"]
    return data_cfg.prompt_key, data_cfg.answer_key


def get_path(obj: Any, path: str) -> Any:
    """obj[a][b][0]... for the dotted `path` 'a.b.0' (list indexes are integers); _MISSING when absent."""
    for part in path.split("."):
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, (list, tuple)) and part.lstrip("-").isdigit() and -len(obj) <= int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return _MISSING
    return obj


def iter_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """('file:line' or 'file:row N', decoded record) of a JSONL or Parquet file; blank JSONL lines skipped."""
    p = Path(path)
    if not p.is_file():
        raise DataFileNotFoundError(f"dataset file not found: {p}")
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        row = 0
        for batch in pq.ParquetFile(str(p)).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                yield f"{p}:row {row}", record
                row += 1
        return
    yield from iter_json_lines(p)


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    """A validated chat-message list."""
    if not value or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
                            for m in value):
        raise DataFormatError(f"{where}: '{key}' must be a string or a non-empty list of {{role, content}} messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def record_to_row(record: Any, where: str, prompt_key: str, answer_key: str) -> PromptRow:
    """One mapped record -> PromptRow through the shared JSONL validation (chat lists kept in meta['messages'])."""
    if not isinstance(record, dict):
        raise DataFormatError(f"{where}: expected an object, got {type(record).__name__}")
    mapped: dict[str, Any] = {k: v for k, v in record.items() if k not in ("prompt", "answer")}
    for name, key in (("prompt", prompt_key), ("answer", answer_key)):
        value = get_path(record, key)
        if value is _MISSING:
            raise DataFormatError(f"{where}: no field '{key}' (data.{name}_key; top-level keys: {sorted(record)})")
        mapped[name] = value
    if isinstance(mapped["prompt"], (list, tuple)):
        messages = _messages(mapped["prompt"], where, prompt_key)
        mapped["messages"] = messages
        mapped["prompt"] = "\n".join(m["content"] for m in messages)
    return parse_row(mapped, where)


def read_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[PromptRow]:
    """Every row of a JSONL or Parquet prompt file under the field map (DataFormatError naming file:line/row)."""
    rows = [record_to_row(rec, where, prompt_key, answer_key) for where, rec in iter_records(path)]
    if not rows:
        raise DataFormatError(f"{path}: no rows")
    return rows


def has_chat_template(tokenizer) -> bool:
    """True when the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat_template(rows: list[PromptRow], tokenizer, mode: Any = "auto", source: str = "") -> list[PromptRow]:
    """Rows whose prompt is the chat-templated text (mode auto | True | False, see the module docstring)."""
    if mode is False or mode == "false" or (mode == "auto" and not has_chat_template(tokenizer)):
        return rows
    if not has_chat_template(tokenizer):
        raise DataFormatError(f"data.apply_chat_template=true but the tokenizer{(' of ' + source) if source else ''} has no chat template")
    out = []
    for row in rows:
        messages = row.meta.get("messages") or [{"role": "user", "content": row.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(dataclasses.replace(row, prompt=text, meta={**row.meta, "raw_prompt": row.prompt}))
    return out


def load_prompts(path: str | Path, data_cfg, tokenizer, source: Optional[str] = None, generated: bool = False) -> list[PromptRow]:
    """Read `path` under data_cfg's field map (the plain keys for `generated` task files) and render prompts with
    the chat template per data.apply_chat_template."""
    prompt_key, answer_key = ("prompt", "answer") if generated else field_map(data_cfg)
    rows = read_prompts(path, prompt_key, answer_key)
    return apply_chat_template(rows, tokenizer, getattr(data_cfg, "apply_chat_template", "auto"), source or "")
