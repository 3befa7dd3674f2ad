"""How the processes talk."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from titan_strategy.knobs import knob

__all__ = ["DistributedConfig"]


@dataclass(frozen=True)
class DistributedConfig:
    """How the processes talk, and what records their collectives."""

    backend: str | None = knob("process_group_backend", None)
    """"gloo", "nccl", ...; None picks by device."""
    timeout_seconds: float = knob("timeout_seconds", 1800.0)
    """A collective that waits longer fails instead of hanging."""
    flight_recorder: bool = knob("flight_recorder", False)
    """Add a ``FlightRecorder`` callback with its defaults, unless the trainer has one."""

    def __post_init__(self) -> None:
        if not isinstance(self.timeout_seconds, int | float) or self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds={self.timeout_seconds!r} must be > 0.")

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.timeout_seconds)
