"""How a knob is declared and checked: allowed values come from its ``Literal`` type, written once.

Every feature config (``FSDPConfig``, ``TensorParallelConfig``, ...) is a frozen dataclass whose fields
say which flat ``TitanStrategy`` knob they hold (``knob(...)``); ``TitanConfig.from_knobs`` reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_args

__all__ = ["KNOB", "check_choice", "check_positive", "choices", "knob"]

KNOB = "knob"  # the field metadata key naming the flat TitanStrategy argument


def knob(name: str, default: Any) -> Any:
    """A feature-config field that holds the flat ``TitanStrategy`` argument ``name``."""
    return dataclasses.field(default=default, metadata={KNOB: name})


def choices(literal: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` type (or a union of them) allows, in declaration order."""
    values: list[Any] = []
    for arg in get_args(literal):
        values += choices(arg) if get_args(arg) else [arg]
    return tuple(values)


def check_choice(name: str, value: Any, literal: Any) -> None:
    """Raise ``ValueError`` naming ``name``, ``value`` and the values its ``literal`` type allows."""
    allowed = choices(literal)
    if value not in allowed:
        raise ValueError(f"{name}={value!r} must be one of {list(allowed)}.")


def check_positive(name: str, value: Any, *, optional: bool = False) -> None:
    """Raise unless ``value`` is an integer >= 1 (or None where ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        kind = "a positive integer or None" if optional else "an integer >= 1"
        raise ValueError(f"{name}={value!r} must be {kind}.")
