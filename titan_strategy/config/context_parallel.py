"""Context parallelism's knob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_strategy.knobs import check_choice, knob

__all__ = ["ContextParallelConfig", "RotateMethod"]


RotateMethod = Literal["allgather", "alltoall"]


@dataclass(frozen=True)
class ContextParallelConfig:
    """How the ring passes key/value shards; the degree is the mesh's (``MeshConfig.cp``)."""

    rotate_method: RotateMethod = knob("context_parallel_rotate_method", "allgather")
    """"allgather" (gathered once per attention call) or "alltoall" (passed to the next rank at each ring step)."""

    def __post_init__(self) -> None:
        check_choice("context_parallel_rotate_method", self.rotate_method, RotateMethod)
