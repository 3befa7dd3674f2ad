"""The strategy's collectives for Lightning (``reduce``, ``barrier``, ``broadcast``), without host syncs where
Lightning's own would add them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

__all__ = ["all_reduce", "barrier", "broadcast_object"]


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
