"""Allocate a meta-device model on its device and initialize it identically for any layout."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_strategy.plan import ParamFiller

__all__ = ["materialize", "fill_sharded"]


def fill_sharded(param: nn.Parameter, initializer: Callable[[Tensor], None]) -> None:
    """Initialize the full tensor, then keep this rank's shard.

    DTensor's own random ops are layout-independent only on CUDA (on CPU every shard would get the
    same numbers), and differ from an unsharded run. Building the full tensor per parameter makes
    the weights identical to a single-process run for every mesh, at the cost of one parameter's
    worth of temporary memory.
    """
    if not isinstance(param, DTensor):
        initializer(param.data)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
    initializer(full)
    # src_data_rank=None: every rank built the same full tensor, so each slices its own shard locally.
    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    param.to_local().copy_(local)


def shared_seed(device: torch.device) -> int:
    """A seed equal on every rank (rank 0's), so shards of one parameter come from one tensor."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.broadcast(seed, src=0)
    return int(seed.item())


def materialize(model: nn.Module, device: torch.device, init_weights: Callable[[int, ParamFiller], None]) -> None:
    """``to_empty`` on ``device`` (only each rank's shards are allocated), then ``init_weights``."""
    model.to_empty(device=device)
    init_weights(shared_seed(device), fill_sharded)
