"""When the loggers read a step's values: a leaf module, so the runtime and the metrics share the rule without an
import cycle."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["is_logging_step"]


def is_logging_step(trainer: pl.Trainer) -> bool:
    """Whether the loggers read this step's values: every ``log_every_n_steps`` steps; never with 0, nor under
    ``barebones=True`` (where Lightning refuses ``self.log``)."""
    every = trainer.log_every_n_steps
    return not trainer.barebones and every > 0 and trainer.global_step % every == 0
