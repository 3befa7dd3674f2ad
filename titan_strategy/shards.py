"""A tensor and its shards: this rank's local part of a DTensor, and a whole tensor cut as a DTensor is. A leaf
module (torch only): initialization, checkpoint loading and fault tolerance all need these."""

from __future__ import annotations

from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["laid_out_like", "local"]


def local(value: Any) -> Any:
    """This rank's part of a DTensor; anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value


def laid_out_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` on ``like``'s device and dtype, and sharded as ``like`` is where it is a DTensor.

    Every rank holds the same ``full`` (``src_data_rank=None``), so each slices its own shard: no collective, and
    FSDP-over-TP's strided shards come out right."""
    full = full.to(device=local(like).device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full
