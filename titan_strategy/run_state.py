"""What a run carries from one checkpoint to the next beside the model and the optimizers, behind one interface.

The data position (``sampler.TrainingPosition``), the RNG states (``checkpoint.rng.ResumedRngStates``), torchft's
replica groups (``fault_tolerance.ReplicaGroups``) and the preemption watch (``preemption.PreemptionWatch``) each
implement the hooks they need; the strategy calls every part at each hook, in order, and names none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from titan_strategy.checkpoint.dcp import LoadedCheckpoint

__all__ = ["RunState", "RunStates"]


class RunState:
    """One part of a run's state; every hook does nothing unless the part needs it."""

    def start_fit(self, trainer: pl.Trainer) -> None:
        """``fit`` is set up (model parallelized, optimizers built) and Lightning has restored nothing yet."""

    def resume_point(self) -> dict[str, Any] | None:
        """A Lightning checkpoint dict to resume from in place of any file (a live peer's state), asked once per
        ``fit`` after ``start_fit`` and auto-resume."""
        return None

    def batch_started(self) -> None:
        """A training batch is about to run."""

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Add this part to the checkpoint dict Lightning is about to write."""

    def load(self, checkpoint: dict[str, Any], sharded: LoadedCheckpoint | None) -> None:
        """Take this part back from a loaded checkpoint dict; ``sharded`` holds what a sharded (DCP) checkpoint
        keeps per rank, None for a single file or a peer's state."""

    def teardown(self) -> None:
        """The strategy is torn down."""


class RunStates(list[RunState]):
    """Every part of a run's state, in the order their hooks run; each hook calls every part."""

    def start_fit(self, trainer: pl.Trainer) -> None:
        """Set each part up for ``fit``; where one has a state to resume from in place of any file (a live peer's),
        Lightning restores the loop, schedules and callbacks from it, as on resume, and every part takes it back."""
        for state in self:
            state.start_fit(trainer)
        for state in self:
            point = state.resume_point()
            if point is not None:
                trainer._checkpoint_connector._loaded_checkpoint = point
                self.load(point, None)

    def batch_started(self) -> None:
        for state in self:
            state.batch_started()

    def save(self, checkpoint: dict[str, Any]) -> None:
        for state in self:
            state.save(checkpoint)

    def load(self, checkpoint: dict[str, Any], sharded: LoadedCheckpoint | None) -> None:
        for state in self:
            state.load(checkpoint, sharded)

    def teardown(self) -> None:
        for state in self:
            state.teardown()
