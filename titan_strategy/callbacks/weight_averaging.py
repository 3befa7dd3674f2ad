"""Lightning's StochasticWeightAveraging under TitanStrategy: it runs where the parameters are plain tensors, and is
refused before the first step where they are sharded."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch.distributed.tensor import DTensor

__all__ = ["check_weight_averaging"]


def check_weight_averaging(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    """Refuse StochasticWeightAveraging over sharded parameters.

    The callback deep-copies the module before the strategy shards it and then mixes that copy's plain tensors
    with the module's DTensor shards, which fails halfway through training.

    Raises:
        ValueError: the trainer has the callback and the module holds DTensor parameters.
    """
    averaging = any(isinstance(callback, StochasticWeightAveraging) for callback in trainer.callbacks)
    if averaging and any(isinstance(p, DTensor) for p in module.parameters()):
        raise ValueError(
            "StochasticWeightAveraging averages an unsharded copy of the module, but TitanStrategy shards its "
            f"parameters over {trainer.world_size} processes; train with devices=1 (where the parameters stay "
            "plain tensors), or keep the average in a callback of your own as copies of the sharded parameters "
            "(p.detach().clone() of each, made in on_train_start), which stay sharded alike."
        )
