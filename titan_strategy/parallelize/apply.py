"""Apply the parallelisms a model declares, in the order that keeps them composable."""

from __future__ import annotations

import functools
import types
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from titan_strategy.config.mesh import ParallelDims
from titan_strategy.distributed import is_rehearsal
from titan_strategy.mesh import TitanMesh
from titan_strategy.parallelize.activation_checkpoint import apply_ac
from titan_strategy.parallelize.compile import apply_compile
from titan_strategy.parallelize.context_parallel import SequenceSharder, apply_cp, check_cp_plan
from titan_strategy.parallelize.cuda_graph import apply_cuda_graphs
from titan_strategy.parallelize.float8 import apply_float8
from titan_strategy.parallelize.fsdp import apply_fsdp, fsdp_wraps
from titan_strategy.parallelize.materialize import broadcast_real_tensors, materialize
from titan_strategy.parallelize.tensor_parallel import apply_tp, check_tp_plan
from titan_strategy.pipeline.layout import PipelineLayout
from titan_strategy.pipeline.runner import BoundaryFn, LossFn, PipelineRunner, boundary_activation
from titan_strategy.pipeline.split import has_submodule, split_for_rank, stage_module_names
from titan_strategy.plan import ParallelPlan, PipelinePlan
from titan_strategy.runtime import ParallelRuntime
from titan_strategy.token_loss import TokenWeighting, token_cross_entropy

if TYPE_CHECKING:
    from titan_strategy.config import TitanConfig

__all__ = ["parallelize", "check_plan"]


def _resolve_units(plan: ParallelPlan, part: nn.Module) -> list[list[nn.Module]]:
    """The plan's FSDP units that ``part`` holds (a pipeline stage holds some of them)."""
    units = []
    for names in plan.fsdp_units:
        modules = [part.get_submodule(name) for name in names if has_submodule(part, name)]
        if modules:
            units.append(modules)
    return units


def check_plan(plan: ParallelPlan, dims: ParallelDims, config: TitanConfig) -> PipelineLayout | None:
    """Everything about the plan that can be wrong, checked before the model is touched.

    Returns:
        The pipeline layout under PP, else None.
    """
    if dims.tp > 1:
        check_tp_plan(plan.tensor_parallel, dims.tp, loss_parallel=config.tensor_parallel.loss_parallel)
    if dims.cp > 1:
        check_cp_plan(plan.context_parallel, dims.cp)
    config.cuda_graphs.check_layout(dims)
    if dims.pp == 1:
        return None
    if plan.pipeline is None:
        raise ValueError(f"pipeline_parallel_size={dims.pp}, but the module's parallel_plan() declares no "
                         "pipeline plan; set pipeline_parallel_size=1 or add one (see llama_module/plan.py).")
    if plan.pipeline.log_loss is None:
        raise ValueError(f"pipeline_parallel_size={dims.pp} runs the pipeline schedule in place of the module's "
                         "steps, which log the loss; give the module's PipelinePlan log_loss=(stage, loss) -> None "
                         "(see llama_module/plan.py), or set pipeline_parallel_size=1.")
    return config.pipeline.resolve(len(plan.blocks))


def parallelize(plan: ParallelPlan, mesh: TitanMesh, dims: ParallelDims, config: TitanConfig, device: torch.device,
                *, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                pipeline_loss: LossFn | None = None, host_group: dist.ProcessGroup | None = None) -> ParallelRuntime:
    """Parallelize ``plan.model`` in place, materialize it, and return its runtime. What it built on the meta device
is initialized by ``plan.init_weights``; tensors it arrived with keep their values (rank 0's).

    ``param_dtype``/``reduce_dtype`` are FSDP's mixed precision; ``pipeline_loss`` is the loss of one
    microbatch under PP (default: ``token_cross_entropy``, summed over the tokens not labelled -100);
    ``host_group`` (gloo, every rank) is where CUDA graphs agree on each call's input shapes.

    Order matters: the pipeline split first, on the meta model, so each stage keeps the full
    model's parameter names; float8 next, since it swaps the linear modules that every later step
    wraps; TP next, so every later wrapper sees the final parameter placements;
    CP after TP, since ring attention runs on the heads TP leaves each rank; activation
    checkpointing before compile, so compile captures the recomputation too; compile after the
    module structure is final and before FSDP, so FSDP's hooks stay outside the compiled graphs
    (and names stay free of ``_orig_mod``); FSDP last among the wrappers, with one root per stage,
    since each stage's forward is called on its own; materialization next, so that only
    shards are ever allocated; CUDA graphs last, around the finished model (they capture at a later
    training step).

    On a single device FSDP has nothing to shard, yet would still copy every weight into and out of its
    all-gather buffer and every gradient through its reduce-scatter (3.5% of the 1B step; benchmarks/RESULTS.md:
    'No FSDP on one device'): the model stays unwrapped, and mixed precision is left to ``configure_precision``
    (bf16 weights with fp32 masters under TritonAdamW, else autocast).
    """
    layout = check_plan(plan, dims, config)
    broadcast_real_tensors(plan.model, host_group)
    parts = [plan.model]
    if layout is not None:
        assert plan.pipeline is not None
        per_stage = stage_module_names(plan.blocks, plan.pipeline, layout)
        parts = split_for_rank(plan.model, per_stage, layout.stages_of(mesh["pp"].get_local_rank()))
        if plan.pipeline.stage_forward is not None:
            for part in parts:  # its hooks (FSDP's among them) stay the module's
                part.forward = types.MethodType(plan.pipeline.stage_forward, part)
    dp_mesh = mesh["dp_replicate", "dp_shard_cp"] if dims.hsdp_enabled else mesh["dp_shard_cp"]
    # Under PP every stage runs several microbatch forwards before their backwards; resharding after
    # each would all-gather the same weights once per microbatch, so "default" keeps them gathered.
    reshard = config.fsdp.reshard_after_forward
    reshard = "never" if layout is not None and reshard == "default" else reshard
    sharded = fsdp_wraps(dims.world_size)
    tp, ac, float8 = config.tensor_parallel, config.activation_checkpointing, config.float8.recipe
    for part in parts:
        apply_float8(part, float8, plan.float8_skip, fsdp_all_gather=sharded)
        if dims.tp > 1:
            assert plan.tensor_parallel is not None
            apply_tp(part, mesh["tp"], plan.tensor_parallel, sequence_parallel=tp.sequence_parallel,
                     loss_parallel=tp.loss_parallel, async_tp=tp.async_tp)
        if dims.cp > 1:
            assert plan.context_parallel is not None
            apply_cp(part, mesh["cp"], plan.context_parallel)
        blocks = {block: index for index, block in enumerate(plan.blocks) if has_submodule(part, block)}
        apply_ac(part, blocks, ac.mode, ac.every)
        if config.compile.blocks:
            apply_compile(part, tuple(blocks))
        if sharded:
            apply_fsdp(part, _resolve_units(plan, part), dp_mesh, param_dtype=param_dtype,
                       reduce_dtype=reduce_dtype, reshard_after_forward=reshard)
    # plan.model holds every part's parameters under their full-model names, so initialization
    # by (seed, name) gives each stage the weights of the unsplit model.
    materialize(plan.model, device, plan.init_weights)
    if config.cuda_graphs.enabled:
        apply_cuda_graphs(plan.model, host_group, short_batch_padding=plan.short_batch_padding)
    return _runtime(plan, parts, layout, sharded, mesh, dims, config, device, pipeline_loss, param_dtype)


def _runtime(plan: ParallelPlan, parts: list[nn.Module], layout: PipelineLayout | None, sharded: bool,
             mesh: TitanMesh, dims: ParallelDims, config: TitanConfig, device: torch.device,
             pipeline_loss: LossFn | None, param_dtype: torch.dtype | None) -> ParallelRuntime:
    """The per-step side of what was applied: sequence sharding under CP, the schedule under PP."""
    sharder = None
    if dims.cp > 1:
        assert plan.context_parallel is not None
        sharder = SequenceSharder(plan.model, mesh["cp"], plan.context_parallel, config.context_parallel.rotate_method)
    pipeline = None
    if layout is not None:
        assert plan.pipeline is not None
        pipeline = PipelineRunner(plan.model, parts, layout, config.pipeline, plan.pipeline,
                                  pipeline_loss or token_cross_entropy, mesh["pp"], device,
                                  rehearsal_boundary=_rehearsal_boundary(plan.pipeline, dims, config, param_dtype))
    tp = config.tensor_parallel
    # FSDP averages each gradient over the loss mesh's ranks (data-parallel x context-parallel).
    loss_mesh = mesh["loss"]
    weighting = TokenWeighting(loss_mesh.get_group() if loss_mesh.size() > 1 else None, loss_mesh.size())
    return ParallelRuntime(
        plan=plan, parts=parts, layout=layout, sharded=sharded, loss_parallel=dims.tp > 1 and tp.loss_parallel,
        sequence_parallel_tp=dims.tp if dims.tp > 1 and tp.sequence_parallel else 1, sharder=sharder,
        pipeline=pipeline, float8_all_gather=config.float8.recipe == "tensorwise" and sharded,
        token_weighting=weighting, averaged_over=_averaged_over(dims),
    )


def _rehearsal_boundary(plan: PipelinePlan, dims: ParallelDims, config: TitanConfig,
                        param_dtype: torch.dtype | None) -> BoundaryFn | None:
    """What a rehearsed rank's stages take their neighbours to send (None outside a rehearsal)."""
    if not is_rehearsal():
        return None
    if plan.boundary_width is None:
        raise ValueError("titan rehearse runs one pipeline rank with no neighbour stage to ask what it sends; give "
                         "the module's PipelinePlan boundary_width (the hidden size, see llama_module/plan.py).")
    shards = dims.tp if dims.tp > 1 and config.tensor_parallel.sequence_parallel else 1
    return functools.partial(boundary_activation, width=plan.boundary_width, sequence_shards=shards,
                             dtype=param_dtype or torch.float32)


def _averaged_over(dims: ParallelDims) -> str:
    parts = [f"{dims.batch_size} data-parallel ranks" if dims.batch_size > 1 else "",
             f"{dims.cp} context-parallel ranks" if dims.cp > 1 else "",
             "pipeline microbatches" if dims.pp > 1 else ""]
    return ", ".join(filter(None, parts))
