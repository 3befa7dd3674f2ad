"""FSDP2's knob."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_strategy.knobs import check_choice, knob

__all__ = ["FSDPConfig", "ReshardPolicy"]


ReshardPolicy = Literal["default", "always", "never"]


@dataclass(frozen=True)
class FSDPConfig:
    """FSDP2's knob; the shard and replicate degrees are the mesh's (``MeshConfig``)."""

    reshard_after_forward: ReshardPolicy = knob("fsdp_reshard_after_forward", "default")
    """"default" frees gathered parameters after forward but in the last unit; "always" or "never"."""

    def __post_init__(self) -> None:
        check_choice("fsdp_reshard_after_forward", self.reshard_after_forward, ReshardPolicy)
