"""The config reference (docs/config.md), rendered from the RunConfig classes themselves.

Every field of the run config with its dotted name, type, default, range or allowed values and
its one-line doc (the attribute docstring), one table per section. Regenerate the page with

    megatron-rl config --reference > docs/config.md

(tests/test_config_reference.py fails when the page and the classes disagree).
"""
from __future__ import annotations

import json
import typing
from typing import Any, Iterator, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from megatron_rl.config.base import describe_range

REGENERATE = "megatron-rl config --reference > docs/config.md"
"""The command that rewrites docs/config.md."""

MAX_DOC_CHARS = 300
"""The longest a field's docstring may be (what it does and its range; the why belongs in the docs)."""


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def walk_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted name, field) of every leaf field of `model`, sections expanded, in declaration order."""
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            yield from walk_fields(field.annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def _literals(annotation: Any) -> list[Any]:
    """The values of every Literal inside an annotation (through Optional, Union, Annotated, list)."""
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    out: list[Any] = []
    for arg in get_args(annotation):
        if not isinstance(arg, (FieldInfo,)) and arg is not type(None):
            out.extend(_literals(arg))
    return out


def type_text(annotation: Any) -> str:
    """A short readable type: int, float | None, list[int], dict[str, int], enum, bool | "auto"."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is type(None):
        return "None"
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin is Literal:
        return "enum"
    if origin is Union or (origin is not None and getattr(origin, "__name__", "") == "UnionType"):
        return " | ".join(dict.fromkeys(type_text(a) for a in args))
    if origin in (list, tuple, set):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if origin is dict:
        return f"dict[{', '.join(type_text(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _value_text(value: Any) -> str:
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def values_text(field: FieldInfo) -> str:
    """The declared range ('>= 1', '>= 0, <= 1') and/or the allowed Literal values of a field ('' when neither)."""
    parts = []
    literals = _literals(field.annotation)
    if literals:
        parts.append(", ".join(_value_text(v) for v in literals))
    bounds = describe_range(field)
    if bounds:
        parts.append(bounds)
    return "; ".join(parts)


def _default_text(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return _value_text(field.default_factory())
    return _value_text(field.default)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{_cell(text)}`" if text else ""


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    rows = ["| Field | Type | Default | Range / values | Description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            continue
        rows.append("| " + " | ".join([
            _code(prefix + name), _code(type_text(field.annotation)), _code(_default_text(field)),
            _code(values_text(field)), _cell(field.description or ""),
        ]) + " |")
    return rows


def _sections(model: type[BaseModel], prefix: str, doc: str, level: int) -> list[str]:
    """A heading and table for `model`'s own fields, then one per nested section."""
    out: list[str] = []
    leaves = [f for f in model.model_fields.values() if not _is_section(f.annotation)]
    if prefix:
        out += ["#" * level + f" `{prefix.rstrip('.')}`", ""]
        if doc:
            out += [_cell(doc), ""]
    if leaves:
        out += _table(model, prefix) + [""]
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            out += _sections(field.annotation, f"{prefix}{name}.", field.description or "", min(level + 1, 4) if prefix else level)
    return out


def render_reference() -> str:
    """docs/config.md: every RunConfig field by section (dotted name, type, default, range / values, doc)."""
    from megatron_rl.config.run import RunConfig

    head = [
        "# Config reference",
        "",
        f"<!-- Generated from megatron_rl/config/*.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every field of the run config (`megatron_rl.config.RunConfig`), one table per section. Set a field in a",
        "YAML config by its section (`train:` / `steps: 5`) or on the command line by its dotted name",
        "(`megatron-rl train CONFIG train.steps=5`). Range / values lists the allowed values of an enum and the",
        "declared bounds of a number; floats also reject NaN and infinities. Unknown keys are errors.",
        "",
        "## Top level",
        "",
    ]
    body = _sections(RunConfig, "", "", 2)
    return "\n".join(head + body).rstrip("\n") + "\n"
