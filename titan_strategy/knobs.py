"""Construction-time checks of TitanStrategy's knobs: a bad combination fails in ``Trainer(...)``."""

from __future__ import annotations

import torch

from titan_strategy.parallelize.activation_checkpoint import check_ac
from titan_strategy.parallelize.context_parallel import ROTATE_METHODS
from titan_strategy.parallelize.float8 import FLOAT8_RECIPES
from titan_strategy.pipeline.layout import ZERO_BUBBLE_SCHEDULES, PipelineConfig

__all__ = ["check_knobs", "compiled_zero_bubble_problem"]

_RESHARD_POLICIES = ("default", "always", "never")
# Measured on CPU/gloo: compiled tensor-parallel blocks get gradients ~1% off the eager ones on torch
# 2.13 (grad norm 0.8004 vs 0.8064 for the test model), and are exact on 2.11.
_COMPILED_TP_IS_BROKEN = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


def check_knobs(*, reshard: str, timeout_seconds: float, compile: bool, compile_loss: bool,
                tensor_parallel_size: int, async_tensor_parallel: bool, rotate_method: str,
                activation_checkpointing: str, activation_checkpointing_every: int, float8: str,
                pipeline: PipelineConfig) -> None:
    """Raise ``ValueError`` naming the knob to change; the pipeline knobs check themselves."""
    if reshard not in _RESHARD_POLICIES:
        raise ValueError(f"fsdp_reshard_after_forward={reshard!r} must be one of {list(_RESHARD_POLICIES)}.")
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"context_parallel_rotate_method={rotate_method!r} must be one of {list(ROTATE_METHODS)}.")
    check_ac(activation_checkpointing, activation_checkpointing_every)
    if float8 not in FLOAT8_RECIPES:
        raise ValueError(f"float8={float8!r} must be one of {list(FLOAT8_RECIPES)}.")
    problem = compiled_zero_bubble_problem(compile, pipeline.size, pipeline.schedule)
    if problem:
        raise ValueError(problem)
    if timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds={timeout_seconds!r} must be > 0.")
    for name, on in (("compile", compile), ("compile_loss", compile_loss)):
        if on and tensor_parallel_size > 1 and _COMPILED_TP_IS_BROKEN:
            raise ValueError(
                f"{name}=True with tensor_parallel_size={tensor_parallel_size} gives wrong gradients on torch "
                f"{torch.__version__} (a DTensor backward regression; torch 2.11 is correct). Use {name}=False, "
                "or torch 2.11."
            )
    if async_tensor_parallel and not compile:
        raise ValueError("async_tensor_parallel=True needs compile=True: AsyncTP is an inductor pass over "
                         "compiled blocks. Set compile=True, or async_tensor_parallel=False.")


# Also the capacity planner's rule (a layout it proposes must be one the strategy runs).
def compiled_zero_bubble_problem(compile: bool, pipeline_parallel_size: int, schedule: str | None) -> str | None:
    if compile and pipeline_parallel_size > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        return (f"pipeline_schedule={schedule!r} splits backward into input- and weight-gradient passes, which torch "
                "refuses for compiled stages; use compile=False, or a schedule such as 'Interleaved1F1B'.")
    return None
