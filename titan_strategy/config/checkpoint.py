"""The checkpoint knobs: how checkpoints are written, what a run starts from, auto-resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from titan_strategy.knobs import check_choice, choices, knob

__all__ = ["CHECKPOINT_MODES", "CheckpointConfig", "CheckpointMode"]

CheckpointMode = Literal["sync", "async", "async_pinned"]
CHECKPOINT_MODES: tuple[str, ...] = choices(CheckpointMode)


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint writing and the run's starting point (the weights source is checked by ``checkpoint_io_for``)."""

    mode: CheckpointMode = knob("checkpoint_mode", "sync")
    """"sync"; "async" (host copy in the loop, background thread); "async_pinned" (CUDA pinned memory on a side
    stream, background process). See ``DistributedCheckpointIO``."""
    initial_weights: str | None = knob("initial_weights", None)
    """A checkpoint whose model weights replace the initialization (optimizer and loop state start fresh)."""
    auto_resume: bool = knob("auto_resume", False)
    """``fit`` without a ``ckpt_path`` resumes from the newest complete checkpoint a ``ModelCheckpoint`` wrote."""
    distributed: bool = knob("save_distributed_checkpoint", True)
    """Each save a sharded DCP folder, written by every rank in parallel; False: one whole ``.ckpt`` file that
    rank 0 writes and any Lightning Trainer (DDP, one device) loads, as ``ModelParallelStrategy`` offers."""
    save_on_sigterm: bool = knob("save_on_sigterm", True)
    """On SIGTERM (preemption), save the current step into the ``ModelCheckpoint`` folder, wait until it is
    published and exit with 143 (``titan_strategy.preemption``)."""

    def __post_init__(self) -> None:
        check_choice("checkpoint_mode", self.mode, CheckpointMode)
        if not isinstance(self.distributed, bool):  # the string "false" would be true, and save folders silently
            raise ValueError(f"save_distributed_checkpoint={self.distributed!r} must be True (sharded folders) or "
                             "False (one whole .ckpt file).")

    @property
    def initial_weights_path(self) -> Path | None:
        return Path(self.initial_weights) if self.initial_weights is not None else None
