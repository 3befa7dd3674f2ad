"""Regional compile: each repeated block is compiled on its own, so one compiled graph serves them all."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

__all__ = ["apply_compile", "apply_compile_loss"]

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module, blocks: tuple[str, ...]) -> None:
    """Compile every block in place (``nn.Module.compile``), which keeps parameter names clean for DCP."""
    options = _block_inductor_options()
    for name in blocks:
        model.get_submodule(name).compile(options=options)
    log.info("Compiled %d blocks with torch.compile%s", len(blocks), f", inductor options {options}" if options else "")


def _block_inductor_options() -> dict[str, Any]:
    """Inductor settings of the compiled blocks that differ from torch's defaults.

    Mix-order reduction off: inductor (torch 2.10+) fuses a norm's backward, whose two reductions run along the
    rows (the input's gradient) and along the columns (the weight's), into one persistent kernel. Under float8
    that kernel also takes the next matmul's scaling, and at the 8B width it took ten times the block's other norm
    backward, 10% of the step. Off, the 8B width x 16 layers with float8 trains 6.5-7.5% faster, and the 1B shape
    in bf16 stays within noise (benchmarks/RESULTS.md: 'Mix-order reduction').
    ``TORCHINDUCTOR_MIX_ORDER_REDUCTION`` set in the environment keeps the user's choice; a torch without the
    option compiles with its own."""
    from torch._inductor import config

    if "TORCHINDUCTOR_MIX_ORDER_REDUCTION" in os.environ or not hasattr(config.triton, "mix_order_reduction"):
        return {}
    return {"triton.mix_order_reduction": False}


def apply_compile_loss(module: Any) -> None:
    """Compile ``module.compute_loss`` in place; a module compiled by an earlier fit or validate keeps its graph."""
    loss = module.compute_loss
    if not hasattr(loss, "_torchdynamo_orig_callable"):
        module.compute_loss = torch.compile(loss)
