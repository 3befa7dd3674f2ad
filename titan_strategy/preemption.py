"""Preemption and restarts: SIGTERM saves the current step before the process exits; a restart says what it replays.

SLURM and Kubernetes preempt a job with SIGTERM to every process, and torchrun's agent forwards it to
its workers. ``PreemptionWatch`` (TitanStrategy's ``save_on_sigterm``, on by default when a
``ModelCheckpoint`` has a folder) replaces Lightning's SIGTERM handler, which runs a collective inside
the signal handler, with one that only notes the signal. After every optimizer step the ranks agree
(a MAX all-reduce of one number on a gloo group of their own, so a signal that reached any rank counts for
all); then each rank saves ``preempted-epoch=E-step=S.ckpt`` into the ``ModelCheckpoint`` folder,
waits until it is published and exits with ``PREEMPTED_EXIT_CODE`` (128 + SIGTERM, what a shell
reports for a process that SIGTERM ended), which torchrun ``--max-restarts``, SLURM ``--requeue`` and
Kubernetes restart policies treat as a failure to start again. ``auto_resume`` then continues from it.

Under ``auto_resume``, rank 0 also keeps ``.titan_progress.json`` in that folder: the last step any attempt
finished. On a restart, ``replay_report`` compares it with the checkpoint resumed from: the steps between are
trained again (after a ``kill -9``), none after a preemption save. Without ``auto_resume`` nothing reads it, and
the folder holds checkpoints alone.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from titan_strategy.run_state import RunState

__all__ = ["PREEMPTED_EXIT_CODE", "PROGRESS_FILE", "PreemptionWatch", "replay_report"]

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
PROGRESS_FILE = ".titan_progress.json"


def _checkpoint_folder(trainer: pl.Trainer) -> Path | None:
    """The first ``ModelCheckpoint``'s folder (what ``auto_resume`` searches), if any."""
    return next((Path(callback.dirpath) for callback in trainer.checkpoint_callbacks
                 if isinstance(callback, ModelCheckpoint) and callback.dirpath), None)


class _SaveOnPreemption(Callback):
    def __init__(self, group: dist.ProcessGroup, track_progress: bool) -> None:
        self._group = group
        self._track_progress = track_progress
        self._signalled = False
        self._folder: Path | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning registers its handlers right before training; its teardown restores the ones from before it.
        self._folder = _checkpoint_folder(trainer)
        if self._folder is not None:
            signal.signal(signal.SIGTERM, self._note_signal)

    def _note_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True  # nothing else in a signal handler: the loop may be inside a collective

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._folder is None or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return  # only after an optimizer step: a checkpoint holds no half-accumulated gradients
        step = trainer.global_step
        if self._track_progress and trainer.is_global_zero:
            _write_progress(self._folder, step)
        signalled = torch.tensor([int(self._signalled)])
        dist.all_reduce(signalled, op=dist.ReduceOp.MAX, group=self._group)
        if not signalled.item():
            return
        path = self._folder / f"preempted-epoch={trainer.current_epoch}-step={step}.ckpt"
        rank_zero_info(f"SIGTERM: saving step {step} to {path} before exiting.")
        trainer.save_checkpoint(path)
        trainer.strategy.checkpoint_io.flush()  # published on every rank when this returns
        rank_zero_info(f"SIGTERM: step {step} is saved; exiting with {PREEMPTED_EXIT_CODE} for the launcher to "
                       "restart the job (auto_resume continues from that checkpoint).")
        raise SIGTERMException(PREEMPTED_EXIT_CODE)


class PreemptionWatch(RunState):
    """``save_on_sigterm``: each ``fit`` gets the SIGTERM-saving callback (once; it does nothing without a
    ModelCheckpoint folder). ``track_progress`` (under ``auto_resume``) keeps the last finished step for
    ``replay_report``; ``group`` is a gloo group of every rank, for the loop's own small collectives."""

    def __init__(self, group: dist.ProcessGroup, track_progress: bool) -> None:
        self._group = group
        self._track_progress = track_progress

    @override
    def start_fit(self, trainer: pl.Trainer) -> None:
        if not any(isinstance(callback, _SaveOnPreemption) for callback in trainer.callbacks):
            trainer.callbacks.append(_SaveOnPreemption(self._group, self._track_progress))


def _write_progress(folder: Path, step: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f"{PROGRESS_FILE}.partial"
    partial.write_text(json.dumps({"step": step}))
    os.replace(partial, folder / PROGRESS_FILE)


def replay_report(folder: Path | None, checkpoint: str, resumed_step: int) -> str:
    """What a restart from ``checkpoint`` (saved at ``resumed_step``) replays, from the progress the last attempt
    left in ``folder``."""
    progress = folder / PROGRESS_FILE if folder is not None else None
    if progress is None or not progress.is_file():
        return f"auto_resume: resuming at step {resumed_step} from {checkpoint}."
    reached = json.loads(progress.read_text())["step"]
    replayed = max(reached - resumed_step, 0)
    return (f"auto_resume: resuming at step {resumed_step} from {checkpoint}; the previous attempt reached step "
            f"{reached}, so {replayed} step{'s' if replayed != 1 else ''} {'are' if replayed != 1 else 'is'} replayed.")
