"""Which plan a LightningModule is parallelized from (``plan_of``), and the plan of a module that declares none and
parallelizes nothing itself (a DDP-style LightningModule, or one holding more than a transformers causal LM, which
gets its own: ``hf_causal_lm``): FSDP2/HSDP over its repeated blocks and then the whole module, initialized by its
own initializers. Such a module can take data parallelism only; the last guard checks that no layout trains
unsynchronized replicas."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_strategy.config.mesh import ParallelDims
from titan_strategy.parallelize.blocks import repeated_blocks
from titan_strategy.parallelize.hf_causal_lm import causal_lm_in, hf_causal_lm_plan
from titan_strategy.parallelize.materialize import materialize_with_own_initializers, own_initializers, run_initializers
from titan_strategy.plan import ParallelPlan, PlannedModule

__all__ = ["check_gradients_are_synchronized", "is_self_parallelized", "plain_plan", "plan_of"]


def is_self_parallelized(module: nn.Module) -> bool:
    """Whether ``configure_model`` parallelized the module itself (ModelParallelStrategy style): it holds FSDP
    modules or DTensor parameters."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters())


def _refuse_unplanned_degrees(module: nn.Module, dims: ParallelDims) -> None:
    asked = {knob: size for knob, size in dims.knobs().items()
             if size > 1 and knob in ("pipeline_parallel_size", "context_parallel_size", "tensor_parallel_size")}
    if asked:
        degrees = ", ".join(f"{knob}={size}" for knob, size in asked.items())
        raise ValueError(
            f"TitanStrategy({degrees}) cannot split {type(module).__name__}: it declares no parallel_plan() and "
            "parallelized nothing itself in configure_model(), so the strategy can only shard it with FSDP over the "
            "data-parallel "
            f"ranks. Set {' and '.join(f'{knob}=1' for knob in asked)}, or give the module a parallel_plan() (see "
            "llama_module/plan.py), or parallelize it in configure_model() with self.device_mesh."
        )


def plain_plan(module: nn.Module, dims: ParallelDims) -> ParallelPlan:
    """The plan the strategy derives for a module that brings none.

    Raises:
        ValueError: a tensor-, context- or pipeline-parallel degree was asked for.
        TypeError: a submodule built on the meta device has no initializer (``own_initializers``).
    """
    _refuse_unplanned_degrees(module, dims)
    blocks = repeated_blocks(module)
    return ParallelPlan(model=module, fsdp_units=tuple((block,) for block in blocks),
                        init_weights=functools.partial(run_initializers, own_initializers(module)), blocks=blocks)


def plan_of(module: nn.Module, dims: ParallelDims, device: torch.device, *,
            sequence_parallel: bool) -> ParallelPlan | None:
    """The plan a LightningModule is parallelized from: its own ``parallel_plan()``; the one derived for the
    transformers causal LM it holds (``hf_causal_lm``); or the one derived for a plain module. A module that
    parallelized itself gets none: it is only materialized, by its own initializers, as Lightning does."""
    if isinstance(module, PlannedModule):
        return module.parallel_plan()
    if is_self_parallelized(module):
        materialize_with_own_initializers(module, device)
        return None
    if (found := causal_lm_in(module)) is not None:
        return hf_causal_lm_plan(module, found[1], dims, sequence_parallel=sequence_parallel)
    return plain_plan(module, dims)


def check_gradients_are_synchronized(module: nn.Module, batch_mesh: DeviceMesh) -> None:
    """The last guard, whatever set the module up: with several data-parallel ranks, every trainable parameter
    must be a DTensor (FSDP's, or a user's) whose mesh spans this rank's data-parallel peers, so that its gradient
    is reduced over them. Anything else would train unsynchronized replicas that log normal-looking losses.

    Raises:
        RuntimeError: names the parameters that no gradient reduction covers.
    """
    if batch_mesh.size() == 1:
        return
    peers = set(dist.get_process_group_ranks(batch_mesh.get_group()))
    unsynchronized = [name for name, param in module.named_parameters() if param.requires_grad and not (
        isinstance(param, DTensor) and peers <= set(param.device_mesh.mesh.flatten().tolist()))]
    if unsynchronized:
        shown = ", ".join(unsynchronized[:5]) + (f" and {len(unsynchronized) - 5} more" if len(unsynchronized) > 5
                                                 else "")
        raise RuntimeError(
            f"{len(unsynchronized)} trainable parameters ({shown}) would train as unsynchronized replicas on the "
            f"{batch_mesh.size()} data-parallel ranks: nothing reduces their gradients over them. A module that "
            "parallelizes itself in configure_model() must shard every parameter over self.device_mesh"
            "['data_parallel'] (fully_shard), or leave configure_model() to build layers only, for the strategy to "
            "shard them."
        )
