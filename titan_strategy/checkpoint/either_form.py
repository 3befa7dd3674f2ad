"""A checkpoint in either form: a sharded DCP folder, or one whole Lightning ``.ckpt`` file (this strategy's under
``save_distributed_checkpoint=False``, or any other strategy's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.optim import Optimizer

from titan_strategy.checkpoint.callback_tensors import shard_callback_tensors
from titan_strategy.checkpoint.dcp import LoadedCheckpoint, RankPlace, load_checkpoint, optimizer_state_dict
from titan_strategy.checkpoint.single_file import full_model_state, full_optimizer_state, load_single_file

__all__ = ["load_either_form", "model_state", "optimizer_state"]


def model_state(module: pl.LightningModule, whole: bool) -> dict[str, Any]:
    """The model's state to save: whole on rank 0 (one file), or each rank's shards keyed by name (DCP)."""
    return full_model_state(module) if whole else get_model_state_dict(module)


def optimizer_state(module: pl.LightningModule, optimizer: Optimizer, whole: bool) -> dict[str, Any]:
    """The optimizer's state to save: whole on rank 0, keyed by index as Lightning's files are, or each rank's
    shards keyed by parameter name (DCP)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # Lightning's LightningOptimizer wrapper
    return full_optimizer_state(module, optimizer) if whole else optimizer_state_dict(module, optimizer)


def load_either_form(path: Path, module: pl.LightningModule, optimizers: list[Optimizer], place: RankPlace, *,
                     weights_only: bool | None, group: dist.ProcessGroup) -> tuple[dict[str, Any],
                                                                                   LoadedCheckpoint | None]:
    """Load ``path`` into the sharded ``module`` and ``optimizers``, and the callbacks' tensors as the callbacks
    hold them now.

    Returns:
        Lightning's checkpoint dict, and what a sharded checkpoint keeps per rank (None for a file).
    """
    callback_states = {callback.state_key: callback.state_dict() for callback in module.trainer.callbacks}
    sharded = None
    if path.is_file():
        checkpoint = load_single_file(path, module, optimizers, strict=module.strict_loading, weights_only=weights_only)
    else:
        sharded = load_checkpoint(path, module, optimizers, place, strict=module.strict_loading,
                                  weights_only=weights_only, group=group)
        checkpoint = sharded.lightning
    shard_callback_tensors(checkpoint, callback_states)
    return checkpoint, sharded
