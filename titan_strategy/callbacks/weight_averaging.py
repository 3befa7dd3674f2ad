"""Lightning's StochasticWeightAveraging under TitanStrategy. The callback averages a copy of the module that it
makes before the strategy shards the module; the strategy shards that copy alike, so the averaging runs shard by
shard. Checkpoints carry the average whole (``checkpoint.callback_tensors``)."""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
from lightning.pytorch.callbacks import StochasticWeightAveraging
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["shard_weight_averages"]


def shard_weight_averages(trainer: pl.Trainer, module: pl.LightningModule,
                          shard: Callable[[nn.Module], None] | None) -> None:
    """Shard each StochasticWeightAveraging copy of ``module`` with ``shard``, where ``module`` is sharded.

    Args:
        shard: parallelizes a copy as the module was; None where the strategy cannot (a module with its own plan,
            or one that parallelized itself, whose copy was made before ``configure_model``).

    Raises:
        ValueError: the copy cannot be sharded like the module, so averaging it would fail halfway through training.
    """
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return
    for callback in trainer.callbacks:
        average = getattr(callback, "_average_model", None) if isinstance(callback, StochasticWeightAveraging) \
            else None
        if average is None:
            continue
        names = [name for name, _ in module.named_parameters()]
        if shard is None or [name for name, _ in average.named_parameters()] != names:
            raise ValueError(
                "StochasticWeightAveraging copied the module in its setup hook, before the strategy sharded it over "
                f"{trainer.world_size} processes, and that copy cannot be sharded alike: it holds "
                f"{len(list(average.parameters()))} of the module's {len(names)} parameters (layers built in "
                "configure_model() come later), or the module has its own plan or parallelizes itself. Build the "
                "layers in __init__ and leave the parallelization to the strategy, or train with devices=1."
            )
        shard(average)
