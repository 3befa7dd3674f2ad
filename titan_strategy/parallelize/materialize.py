"""Allocate a meta-device model on its device and initialize it identically for any layout."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_strategy.distributed import outside_simulated_ranks
from titan_strategy.plan import ParamFiller

__all__ = ["materialize", "materialize_with_reset_parameters", "fill_sharded"]


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
    with outside_simulated_ranks():  # one tensor for every simulated rank to slice its shard from
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


def materialize_with_reset_parameters(module: nn.Module, device: torch.device) -> None:
    """For a module that parallelized itself: ``to_empty``, then every submodule's ``reset_parameters()``.

    This is Lightning's contract for meta-device modules, with one fix: each ``reset_parameters`` sees
    full-size tensors and its output is then sliced into the shards, so the weights do not depend on
    the layout (on CPU, DTensor's random ops would give every shard the same numbers).
    """
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return
    module.to_empty(device=device)
    uninitialized = set()
    for submodule in module.modules():
        if not any(True for _ in itertools.chain(submodule.parameters(recurse=False),
                                                 submodule.buffers(recurse=False))):
            continue
        reset = getattr(submodule, "reset_parameters", None)
        if not callable(reset):
            uninitialized.add(type(submodule).__name__)
            continue
        with _full_size_parameters(submodule):
            reset()
    if uninitialized:
        raise TypeError(
            f"Modules {sorted(uninitialized)} hold parameters or buffers but define no reset_parameters(), so they "
            "would keep uninitialized memory after leaving the meta device; give them a reset_parameters()."
        )


@contextmanager
def _full_size_parameters(module: nn.Module) -> Iterator[None]:
    """Temporarily replace the module's own DTensor parameters by full tensors; write the shards back."""
    sharded = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, param in sharded.items():
        full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for name, param in sharded.items():
            full = module._parameters[name]
            with torch.no_grad():
                fill_sharded(param, lambda t, full=full: t.copy_(full))
            module._parameters[name] = param
