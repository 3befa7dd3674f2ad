"""Apply the parallelisms a model declares, in the order that keeps them composable."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from titan_strategy.mesh import ParallelDims, TitanMesh
from titan_strategy.parallelize.activation_checkpoint import apply_ac
from titan_strategy.parallelize.compile import apply_compile
from titan_strategy.parallelize.context_parallel import apply_cp, check_cp_plan
from titan_strategy.parallelize.float8 import apply_float8
from titan_strategy.parallelize.fsdp import ReshardPolicy, apply_fsdp, fsdp_wraps
from titan_strategy.parallelize.materialize import materialize
from titan_strategy.parallelize.tensor_parallel import apply_tp, check_tp_plan
from titan_strategy.pipeline.layout import PipelineConfig, PipelineLayout
from titan_strategy.pipeline.split import has_submodule, split_for_rank, stage_module_names
from titan_strategy.plan import ParallelPlan

__all__ = ["ParallelizeConfig", "ParallelizedModel", "parallelize", "check_plan"]


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
    activation_checkpointing: str
    activation_checkpointing_every: int
    float8: str
    pipeline: PipelineConfig


@dataclass(frozen=True)
class ParallelizedModel:
    """What ``parallelize`` made: the modules this rank runs and, under PP, the pipeline layout.

    Attributes:
        parts: the pipeline stages this rank runs (in stage order), or the whole model without PP.
        layout: stage split and placement; None without PP.
        sharded: FSDP wraps the parts, and its mixed-precision policy casts their parameters. On a single
            device nothing is sharded and the caller runs the forward under autocast instead.
    """

    parts: list[nn.Module]
    layout: PipelineLayout | None
    sharded: bool


def _resolve_units(plan: ParallelPlan, part: nn.Module) -> list[list[nn.Module]]:
    """The plan's FSDP units that ``part`` holds (a pipeline stage holds some of them)."""
    units = []
    for names in plan.fsdp_units:
        modules = [part.get_submodule(name) for name in names if has_submodule(part, name)]
        if modules:
            units.append(modules)
    return units


def check_plan(plan: ParallelPlan, dims: ParallelDims, config: ParallelizeConfig) -> PipelineLayout | None:
    """Everything about the plan that can be wrong, checked before the model is touched.

    Returns:
        The pipeline layout under PP, else None.
    """
    if dims.tp > 1:
        check_tp_plan(plan.tensor_parallel, dims.tp, loss_parallel=config.loss_parallel)
    if dims.cp > 1:
        check_cp_plan(plan.context_parallel, dims.cp)
    if dims.pp == 1:
        return None
    if plan.pipeline is None:
        raise ValueError(f"pipeline_parallel_size={dims.pp}, but the module's parallel_plan() declares no pipeline plan; "
                         "set pipeline_parallel_size=1 or add one (see llama_module/plan.py).")
    return config.pipeline.resolve(len(plan.blocks))


def parallelize(plan: ParallelPlan, mesh: TitanMesh, dims: ParallelDims, config: ParallelizeConfig,
                device: torch.device) -> ParallelizedModel:
    """Parallelize ``plan.model`` in place (it is on the meta device), then materialize it.

    Order matters: the pipeline split first, on the meta model, so each stage keeps the full
    model's parameter names; float8 next, since it swaps the linear modules that every later step
    wraps; TP next, so every later wrapper sees the final parameter placements;
    CP after TP, since ring attention runs on the heads TP leaves each rank; activation
    checkpointing before compile, so compile captures the recomputation too; compile after the
    module structure is final and before FSDP, so FSDP's hooks stay outside the compiled graphs
    (and names stay free of ``_orig_mod``); FSDP last among the wrappers, with one root per stage,
    since each stage's forward is called on its own; materialization at the end, so that only
    shards are ever allocated.

    On a single device FSDP has nothing to shard, yet would still copy every weight into and out of its
    all-gather buffer and every gradient through its reduce-scatter (3.5% of the 1B step on an H200,
    benchmarks/RESULTS.md): the model stays unwrapped and mixed precision is left to autocast.
    """
    layout = check_plan(plan, dims, config)
    parts = [plan.model]
    if layout is not None:
        assert plan.pipeline is not None
        per_stage = stage_module_names(plan.blocks, plan.pipeline, layout)
        parts = split_for_rank(plan.model, per_stage, layout.stages_of(mesh["pp"].get_local_rank()))
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.hsdp_enabled else mesh["dp_shard_cp"]
    # Under PP every stage runs several microbatch forwards before their backwards; resharding after
    # each would all-gather the same weights once per microbatch, so "default" keeps them gathered.
    reshard = "never" if layout is not None and config.reshard_after_forward == "default" else \
        config.reshard_after_forward
    sharded = fsdp_wraps(dims.world_size)
    for part in parts:
        apply_float8(part, config.float8, plan.float8_skip, fsdp_all_gather=sharded)
        if dims.tp > 1:
            assert plan.tensor_parallel is not None
            apply_tp(part, mesh["tp"], plan.tensor_parallel, sequence_parallel=config.sequence_parallel,
                     loss_parallel=config.loss_parallel, async_tp=config.async_tp)
        if dims.cp > 1:
            assert plan.context_parallel is not None
            apply_cp(part, mesh["cp"], plan.context_parallel)
        blocks = {block: index for index, block in enumerate(plan.blocks) if has_submodule(part, block)}
        apply_ac(part, blocks, config.activation_checkpointing, config.activation_checkpointing_every)
        if config.compile:
            apply_compile(part, tuple(blocks))
        if sharded:
            apply_fsdp(part, _resolve_units(plan, part), dp_mesh, param_dtype=config.param_dtype,
                       reduce_dtype=config.reduce_dtype, reshard_after_forward=reshard)
    # plan.model holds every part's parameters under their full-model names, so initialization
    # by (seed, name) gives each stage the weights of the unsplit model.
    materialize(plan.model, device, plan.init_weights)
    return ParallelizedModel(parts=parts, layout=layout, sharded=sharded)
