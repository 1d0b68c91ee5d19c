"""Coercion of a frozen dataclass's enum fields from their string values (config files and
`ml_collections` hand over strings), with one error message for an unknown value."""

from __future__ import annotations

import enum
from typing import Any


def coerce_enum_fields(instance: Any, fields: dict[str, type[enum.Enum]]) -> None:
    """Replaces each `fields` attribute of a frozen dataclass `instance` by its enum member.

    Raises ValueError naming the class, the field, the value and the choices."""
    for name, kind in fields.items():
        value = getattr(instance, name)
        try:
            object.__setattr__(instance, name, kind(value))
        except ValueError:
            choices = ", ".join(repr(m.value) for m in kind)
            raise ValueError(f"{type(instance).__name__}.{name}: unknown value {value!r}; "
                             f"expected one of {choices}") from None
