"""Base class of every typed config: unknown keys are errors, every field documents itself.

Fields are documented with an attribute docstring (the string literal under the field);
pydantic turns it into the field's description, which `megatron-rl config --help` prints.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictConfig(BaseModel):
    """A config section: rejects unknown keys by name and validates on assignment."""

    model_config = ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        frozen=False,
        protected_namespaces=(),
    )
