"""Auto-resume: a restarted job picks up from the newest complete checkpoint its ``ModelCheckpoint`` wrote, and says
how many steps it trains again."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from titan_strategy.checkpoint.dcp import newest_complete_checkpoint
from titan_strategy.preemption import replay_report
from titan_strategy.run_state import RunState

__all__ = ["AutoResume", "resume_from_newest"]


class AutoResume(RunState):
    """``auto_resume``: a ``fit`` without a ``ckpt_path`` starts from the newest complete checkpoint."""

    @override
    def start_fit(self, trainer: pl.Trainer) -> None:
        if trainer.ckpt_path is None:
            resume_from_newest(trainer)


def resume_from_newest(trainer: pl.Trainer) -> None:
    """Load the newest complete checkpoint of the trainer's ``ModelCheckpoint`` folders, if there is one.

    Called in the strategy's ``setup`` of a ``fit`` that got no ``ckpt_path``: Lightning chose ``ckpt_path``
    before the strategy could see the trainer, and loading here, before Lightning restores modules, callbacks
    and loops from the loaded dict, is the same as ``fit(ckpt_path=newest)``.
    """
    folders = [Path(callback.dirpath) for callback in trainer.checkpoint_callbacks
               if isinstance(callback, ModelCheckpoint) and callback.dirpath]
    strategy = trainer.strategy
    newest = strategy.broadcast(newest_complete_checkpoint(folders) if strategy.is_global_zero else None)
    if newest is None:
        rank_zero_info(f"auto_resume: no complete checkpoint in {[str(f) for f in folders]}; training from the start.")
        return
    trainer._checkpoint_connector.resume_start(newest)
    resumed_step = trainer._checkpoint_connector._loaded_checkpoint.get("global_step", 0)
    rank_zero_info(replay_report(Path(newest).parent, Path(newest).name, resumed_step))
