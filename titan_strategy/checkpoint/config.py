"""The checkpoint knobs of TitanStrategy: how checkpoints are written, what a run starts from, auto-resume."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from titan_strategy.checkpoint.io import CheckpointMode
from titan_strategy.checkpoint.weights import check_weights_source
from titan_strategy.knobs import check_choice, knob

__all__ = ["CheckpointConfig"]


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpoint writing and the run's starting point; a weights source that is not there fails here."""

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
        if self.initial_weights is not None:
            check_weights_source(Path(self.initial_weights))

    @property
    def initial_weights_path(self) -> Path | None:
        return Path(self.initial_weights) if self.initial_weights is not None else None
