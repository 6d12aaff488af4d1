"""Base class of every typed config: unknown keys are errors, every field documents itself and its range.

Fields are documented with an attribute docstring (the string literal under the field);
pydantic turns it into the field's description, which `megatron-rl config --fields` prints.
Every numeric field carries a declarative range (the annotated types below, or `Field(ge=...)`);
floats also reject NaN and +-inf. Violations are reported by pydantic with the field's dotted
name at load time (tests/test_config.py walks every field to keep it so).
"""
from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo

PositiveInt = Annotated[int, Field(ge=1)]
"""An int >= 1 (counts, sizes, steps)."""
NonNegativeInt = Annotated[int, Field(ge=0)]
"""An int >= 0 (0 usually means 'off')."""
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
"""A random seed: an int in [0, 2**63)."""
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
"""A finite float > 0."""
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
"""A finite float >= 0."""
UnitFloat = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
"""A finite float in [0, 1]."""


class StrictConfig(BaseModel):
    """A config section: rejects unknown keys by name and validates on assignment."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        frozen=False,
        protected_namespaces=(),
    )


_BOUND_TEXT = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _metadata_bounds(metadata: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, FieldInfo):
            out.update(_metadata_bounds(item.metadata))
        for key in _BOUND_TEXT:
            value = getattr(item, key, None)
            if value is not None:
                out[key] = value
    return out


def _annotation_bounds(annotation: Any) -> dict[str, Any]:
    """Bounds declared inside an annotation (Annotated[...], also within Optional[...] or list[...])."""
    if get_origin(annotation) is Annotated:
        args = get_args(annotation)
        return {**_annotation_bounds(args[0]), **_metadata_bounds(list(args[1:]))}
    out: dict[str, Any] = {}
    for arg in get_args(annotation):
        out.update(_annotation_bounds(arg))
    return out


def field_range(field: FieldInfo) -> dict[str, Any]:
    """{'gt'|'ge'|'lt'|'le': bound} declared for a config field (on the field or inside its annotation)."""
    return {**_annotation_bounds(field.annotation), **_metadata_bounds(field.metadata)}


def describe_range(field: FieldInfo) -> str:
    """A field's declared range as text, e.g. '> 0' or '>= 0, < 1' ('' when it declares none)."""
    return ", ".join(f"{_BOUND_TEXT[k]} {v}" for k, v in field_range(field).items())
