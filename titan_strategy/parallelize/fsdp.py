"""FSDP2 / HSDP: shard each declared unit, then the root."""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_strategy.config.fsdp import ReshardPolicy

__all__ = ["apply_fsdp", "fsdp_wraps", "no_gradient_sync"]

log = logging.getLogger(__name__)


def fsdp_wraps(world_size: int) -> bool:
    """Whether a run of ``world_size`` ranks is wrapped in FSDP: a single device has nothing to shard, and FSDP
    would still copy every weight and gradient through its collective buffers."""
    return world_size > 1


def apply_fsdp(
    model: nn.Module,
    units: list[list[nn.Module]],
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reshard_after_forward: ReshardPolicy,
) -> None:
    """Wrap every unit with ``fully_shard`` in forward order, then ``model`` itself.

    Args:
        model: the root module; it picks up any parameter no unit owns.
        units: groups of submodules, each sharded (and all-gathered) as one.
        dp_mesh: 1-D mesh for FSDP, or 2-D (replicate, shard) for HSDP.
        param_dtype: compute dtype of the all-gathered parameters (None: keep fp32).
        reduce_dtype: dtype of the gradient reduce-scatter (None: the param dtype).
        reshard_after_forward: "default" frees gathered parameters after forward except in the last
            unit, whose parameters backward needs at once; "always"/"never" apply to every unit.
    """
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for index, unit in enumerate(units):
        is_last = index == len(units) - 1
        reshard = reshard_after_forward == "always" or (reshard_after_forward == "default" and not is_last)
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=dp_mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard)
    # The root holds no parameters of its own in a well-declared plan; wrapping it still lets FSDP
    # overlap the first unit's all-gather and run the root's pre/post-backward bookkeeping.
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward != "never")
    kind = "HSDP" if dp_mesh.ndim == 2 else "FSDP"
    log.info("Applied %s to the model over %s (%d units, param dtype %s)", kind, dp_mesh.shape, len(units), param_dtype)


@contextmanager
def no_gradient_sync(module: nn.Module) -> Generator[None, None, None]:
    """Within, backward accumulates local gradients: no FSDP module of ``module`` reduce-scatters them."""
    fsdp_modules = [m for m in module.modules() if isinstance(m, FSDPModule)]
    for fsdp_module in fsdp_modules:
        fsdp_module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for fsdp_module in fsdp_modules:
            fsdp_module.set_requires_gradient_sync(True, recurse=False)
