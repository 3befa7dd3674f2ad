"""The strategy's collectives for Lightning (``reduce``, ``barrier``, ``broadcast``), without host syncs where
Lightning's own would add them, over the group that holds distinct shares of the batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.distributed import ReduceOp
from typing_extensions import override

__all__ = ["MeshCollectives", "all_reduce", "barrier", "broadcast_object"]


def all_reduce(tensor: Tensor, group: dist.ProcessGroup | None, reduce_op: ReduceOp | str | None) -> Tensor:
    """Reduce in place, like Lightning's sync but without its barrier before every reduction.

    On NCCL that barrier blocks the host until the GPU catches up: every ``self.log(..., sync_dist=True)``
    would stall the step. Means are sums divided by the group size (gloo has no AVG).
    """
    if not dist.is_initialized():
        return tensor
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg")
    op = ReduceOp.SUM if mean or reduce_op is None else getattr(ReduceOp, name.upper()) if name else reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if not mean:
        return tensor
    size = dist.get_world_size(group)
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)


def barrier(device: torch.device) -> None:
    """Every rank waits for every other; NCCL is told this rank's device, so it creates no context on another."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src``, on every rank."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src)
    return holder[0]


class MeshCollectives(ParallelStrategy):
    """Lightning's collective hooks for a strategy whose ranks hold distinct shares of the batch only within
    ``_loss_group()`` (TitanStrategy's ``loss`` mesh: the data-parallel and context-parallel ranks)."""

    def _loss_group(self) -> dist.ProcessGroup | None:
        """The group a metric's ``reduce`` spans by default; None (the world) before the groups exist."""
        raise NotImplementedError

    @override
    def barrier(self, name: str | None = None) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: dist.ReduceOp | str | None = "mean") -> Tensor | Any:
        """Over the ``loss`` mesh by default (each rank a distinct share of the batch), not the world: that
        would count a sample once per TP/PP rank."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None:
            group = self._loss_group()
        return all_reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over *every* rank (ModelCheckpoint, EarlyStopping): ``reduce`` alone spans only the ``loss`` mesh."""
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), group=dist.group.WORLD,
                            reduce_op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)
