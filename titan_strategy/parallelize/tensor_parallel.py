"""Tensor and sequence parallelism (+ loss parallel, AsyncTP) from a model's TensorParallelPlan."""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

from titan_strategy.plan import TensorParallelPlan

__all__ = ["VocabularyParallelOutput", "apply_tp", "as_local_loss", "check_sequence_length", "check_tp_plan",
           "logging_local_values", "loss_parallel_context"]

log = logging.getLogger(__name__)


class VocabularyParallelOutput(ColwiseParallel):
    """``ColwiseParallel`` for an output projection that may return its own loss instead of logits (as
    ``linear_cross_entropy`` does): the weight is split on the vocabulary as ColwiseParallel splits it; logits leave
    as ColwiseParallel's would, a loss (a plain tensor, already whole on every rank) as it is."""

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any,
                           device_mesh: DeviceMesh) -> Any:
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


def check_tp_plan(plan: TensorParallelPlan | None, tp: int, *, loss_parallel: bool) -> None:
    """Raise before any model work if the model cannot be split ``tp`` ways."""
    if plan is None:
        raise ValueError(f"tensor_parallel_size={tp}, but the module's parallel_plan() declares no tensor_parallel "
                         "plan; set tensor_parallel_size=1 or add one (see llama_module/plan.py).")
    sizes = dict(plan.split_sizes)
    if loss_parallel:
        sizes["vocab_size"] = plan.vocab_size
    for name, size in sizes.items():
        if size % tp:
            fix = "loss_parallel=False or " if name == "vocab_size" else ""
            divisors = [d for d in range(1, min(size, 64) + 1) if size % d == 0]
            raise ValueError(f"tensor_parallel_size={tp} does not divide {name}={size}; "
                             f"use {fix}a tensor_parallel_size that divides it ({divisors}).")


def check_sequence_length(seq_len: int, tp: int) -> None:
    if seq_len % tp:
        raise ValueError(f"Sequence parallelism splits the sequence across tensor_parallel_size={tp} ranks, but the "
                         f"batch has seq_len={seq_len}; use a seq_len divisible by {tp}, or sequence_parallel=False.")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TensorParallelPlan, *, sequence_parallel: bool,
             loss_parallel: bool, async_tp: bool) -> None:
    """Shard ``model`` over ``tp_mesh`` following the plan's styles (the model is still on meta).

    Patterns that match nothing (a pipeline stage lacks the embedding, say) are skipped.
    """
    styles = {pattern: style for pattern, style in plan.styles(sequence_parallel, loss_parallel).items()
              if _matches_a_submodule(model, pattern.split("."))}
    parallelize_module(model, tp_mesh, styles)
    if async_tp:
        # Inductor's micro-pipeline pass rewrites all-gather+matmul and matmul+reduce-scatter into
        # overlapped kernels; they exchange data through symmetric memory of the TP group.
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        torch._inductor.config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    log.info("Applied %s tensor parallelism over %d ranks (loss parallel %s%s)",
             "sequence +" if sequence_parallel else "", tp_mesh.size(), loss_parallel, ", async" if async_tp else "")


def _matches_a_submodule(module: nn.Module, parts: list[str]) -> bool:
    if not parts:
        return True
    return any(_matches_a_submodule(child, parts[1:]) for name, child in module.named_children()
               if fnmatch.fnmatch(name, parts[0]))


@contextmanager
def loss_parallel_context(enabled: bool) -> Generator[None, None, None]:
    """``loss_parallel()`` when enabled: cross-entropy on vocab-sharded logits, forward and backward."""
    with loss_parallel() if enabled else nullcontext():
        yield


def as_local_loss(value: Any) -> Any:
    """A loss computed under loss parallel is a replicated DTensor; hand Lightning the plain tensor.

    ``full_tensor()`` of a replicated DTensor is differentiable, so backward still runs through the
    vocab-parallel cross-entropy.
    """
    return value.full_tensor() if isinstance(value, DTensor) else value


@contextmanager
def logging_local_values(module: Any) -> Generator[None, None, None]:
    """Let the LightningModule's ``self.log`` take the replicated DTensor loss that loss parallel produces."""
    log_value = module.log

    def log_local(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log_value(name, as_local_loss(value), *args, **kwargs)

    module.log = log_local
    try:
        yield
    finally:
        del module.log
