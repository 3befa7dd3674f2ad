"""How a knob is declared and checked: allowed values come from its ``Literal`` type, written once.

Every feature config (``FSDPConfig``, ``TensorParallelConfig``, ...) is a frozen dataclass whose fields
say which flat ``TitanStrategy`` knob they hold (``knob(...)``); ``TitanConfig.from_knobs`` reads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args, get_origin

__all__ = ["KNOB", "check_choice", "check_positive", "choices", "knob"]

KNOB = "knob"  # the field metadata key naming the flat TitanStrategy argument


def knob(name: str, default: Any) -> Any:
    """A feature-config field that holds the flat ``TitanStrategy`` argument ``name``."""
    return dataclasses.field(default=default, metadata={KNOB: name})


def choices(literal: Any) -> tuple[Any, ...]:
    """The values a ``Literal[...]`` type allows, in declaration order (those of its Literal members, for a union
    such as ``Literal[...] | None``); empty for any other type."""
    if get_origin(literal) is Literal:
        return get_args(literal)
    return tuple(value for arg in get_args(literal) for value in choices(arg))


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
