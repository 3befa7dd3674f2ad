"""Apply the parallelisms a model declares, in the order that keeps them composable."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_strategy.mesh import ParallelDims, TitanMesh
from titan_strategy.parallelize.fsdp import ReshardPolicy, apply_fsdp
from titan_strategy.parallelize.materialize import materialize
from titan_strategy.plan import ParallelPlan

__all__ = ["ParallelizeConfig", "parallelize"]


@dataclass(frozen=True)
class ParallelizeConfig:
    """The strategy knobs that shape parallelization."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: ReshardPolicy


def _resolve_units(plan: ParallelPlan) -> list[list[nn.Module]]:
    units = []
    for names in plan.fsdp_units:
        modules = [plan.model.get_submodule(name) for name in names]
        if modules:
            units.append(modules)
    return units


def parallelize(plan: ParallelPlan, mesh: TitanMesh, dims: ParallelDims, config: ParallelizeConfig,
                device: torch.device) -> None:
    """Parallelize ``plan.model`` in place (it is on the meta device), then materialize it.

    Order: FSDP comes last among the wrappers because it must see the final module structure and
    parameter placements; materialization comes after it so that only shards are ever allocated.
    """
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.hsdp_enabled else mesh["dp_shard_cp"]
    apply_fsdp(plan.model, _resolve_units(plan), dp_mesh, param_dtype=config.param_dtype,
               reduce_dtype=config.reduce_dtype, reshard_after_forward=config.reshard_after_forward)
    materialize(plan.model, device, plan.init_weights)
