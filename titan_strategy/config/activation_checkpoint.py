"""Activation checkpointing's knobs (the modes are ``parallelize.activation_checkpoint``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from titan_strategy.knobs import check_choice, knob

__all__ = ["ACMode", "ActivationCheckpointConfig"]


ACMode = Literal["none", "full", "selective_op", "selective_layer"]


@dataclass(frozen=True)
class ActivationCheckpointConfig:
    """How much of each block's activations backward recomputes instead of keeping (the module docstring's modes)."""

    mode: ACMode = knob("activation_checkpointing", "none")
    """What backward recomputes instead of keeping: "none"; "full" (each block keeps only its input);
    "selective_op" (each block keeps attention and every other matmul output); "selective_layer" (every
    ``activation_checkpointing_every``-th block is fully checkpointed, the others keep everything)."""
    every: int = knob("activation_checkpointing_every", 2)
    """The k of "selective_layer": every k-th block is checkpointed."""

    def __post_init__(self) -> None:
        check_choice("activation_checkpointing", self.mode, ACMode)
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"activation_checkpointing_every={self.every} must be >= 1 (selective_layer checkpoints "
                             "every that many-th block).")
