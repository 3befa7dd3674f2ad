"""Per-step metrics for the loggers and the progress bar, without a host sync in every step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor

from titan_strategy.logging_steps import is_logging_step
from titan_strategy.parallelize.tensor_parallel import as_local_loss

__all__ = ["log_step_metric", "log_to_progress_bar"]


def log_to_progress_bar(module: pl.LightningModule, name: str, value: float | Tensor) -> None:
    """Show ``value`` in the progress bar, held on the CPU.

    After every batch Lightning turns each progress-bar value it holds into a Python number, the stale
    ones included; a value on the GPU makes that a host sync that idles the GPU while the host queues
    the next step. A CPU value costs nothing to read.
    """
    shown = value.detach().to("cpu") if isinstance(value, Tensor) else torch.tensor(value)
    module.log(name, shown, prog_bar=True, logger=False, on_step=True, on_epoch=False)


def log_step_metric(module: pl.LightningModule, name: str, value: Tensor, bar_name: str,
                    sync_dist: bool = False) -> None:
    """Log ``value`` to the loggers every step, and to the progress bar (as ``bar_name``) on the loggers' steps.

    The loggers read their values only every ``log_every_n_steps``; the bar's copy has to come to the CPU,
    which waits for the GPU, so it is taken then too.
    """
    trainer = module.trainer
    if trainer.barebones:  # Lightning refuses self.log there; nothing would read the value
        return
    module.log(name, value, on_step=True, on_epoch=False, sync_dist=sync_dist)
    if is_logging_step(trainer):
        shown = as_local_loss(value).detach().clone()
        log_to_progress_bar(module, bar_name, trainer.strategy.reduce(shown) if sync_dist else shown)
