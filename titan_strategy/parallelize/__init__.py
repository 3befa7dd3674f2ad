"""Apply the parallelisms a model declares, in the order that keeps them composable."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_strategy.mesh import ParallelDims, TitanMesh
from titan_strategy.parallelize.compile import apply_compile
from titan_strategy.parallelize.fsdp import ReshardPolicy, apply_fsdp
from titan_strategy.parallelize.materialize import materialize
from titan_strategy.parallelize.tensor_parallel import apply_tp, check_tp_plan
from titan_strategy.plan import ParallelPlan

__all__ = ["ParallelizeConfig", "parallelize", "check_plan"]


@dataclass(frozen=True)
class ParallelizeConfig:
    """The strategy knobs that shape parallelization."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: ReshardPolicy
    sequence_parallel: bool
    loss_parallel: bool
    async_tp: bool
    compile: bool


def _resolve_units(plan: ParallelPlan) -> list[list[nn.Module]]:
    units = []
    for names in plan.fsdp_units:
        modules = [plan.model.get_submodule(name) for name in names]
        if modules:
            units.append(modules)
    return units


def check_plan(plan: ParallelPlan, dims: ParallelDims, config: ParallelizeConfig) -> None:
    """Everything about the plan that can be wrong, checked before the model is touched."""
    if dims.tp > 1:
        check_tp_plan(plan.tensor_parallel, dims.tp, loss_parallel=config.loss_parallel)


def parallelize(plan: ParallelPlan, mesh: TitanMesh, dims: ParallelDims, config: ParallelizeConfig,
                device: torch.device) -> None:
    """Parallelize ``plan.model`` in place (it is on the meta device), then materialize it.

    Order matters: TP first, so every later wrapper sees the final parameter placements; compile
    after the module structure is final and before FSDP, so FSDP's hooks stay outside the compiled
    graphs (and names stay free of ``_orig_mod``); FSDP last among the wrappers; materialization at
    the end, so that only shards are ever allocated.
    """
    check_plan(plan, dims, config)
    if dims.tp > 1:
        assert plan.tensor_parallel is not None
        apply_tp(plan.model, mesh["tp"], plan.tensor_parallel, sequence_parallel=config.sequence_parallel,
                 loss_parallel=config.loss_parallel, async_tp=config.async_tp)
    if config.compile:
        apply_compile(plan.model, plan.blocks)
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.hsdp_enabled else mesh["dp_shard_cp"]
    apply_fsdp(plan.model, _resolve_units(plan), dp_mesh, param_dtype=config.param_dtype,
               reduce_dtype=config.reduce_dtype, reshard_after_forward=config.reshard_after_forward)
    materialize(plan.model, device, plan.init_weights)
