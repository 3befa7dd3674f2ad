"""Activation checkpointing: keep less of each repeated block's activations, recompute the rest in backward.

Modes:
- ``full``: every block keeps only its input and reruns its whole forward in backward.
- ``selective_op``: every block keeps the outputs of attention and of every other matmul, the costly ops,
  and recomputes the cheap rest (norms, RoPE, activations) and the other matmuls.
- ``selective_layer``: every ``every``-th block is fully checkpointed, the others keep everything.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import titan_strategy.kernels.flash_attention4  # noqa: F401 -- registers torch.ops.titan.flash_attention4
from titan_strategy.config.activation_checkpoint import ACMode

__all__ = ["apply_ac"]

log = logging.getLogger(__name__)


_aten = torch.ops.aten
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default}
# Attention outputs are always kept. One name per SDPA backend (CPU, flash, memory-efficient, cuDNN),
# FlashAttention-4's op and FlexAttention's.
_ATTENTION = {getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
) if hasattr(_aten, name)} | {torch.ops.titan.flash_attention4.default, torch.ops.higher_order.flex_attention}
# Float8 matmuls count as matmuls when torchao's float8 training is on.
if hasattr(_aten, "_scaled_mm"):
    _MATMULS.add(_aten._scaled_mm.default)


def apply_ac(model: nn.Module, blocks: dict[str, int], mode: ACMode, every: int = 2) -> None:
    """Checkpoint the ``forward`` of the blocks in place.

    Args:
        blocks: the blocks of ``model``, each with its index among all the model's blocks (under
            pipeline parallelism a stage holds some of them; ``selective_layer`` counts on the whole model,
            so the same blocks are checkpointed however the model is split).
        every: ``selective_layer`` checkpoints the blocks whose index + 1 divides by it.

    No wrapper module, so parameter names (initialization seeds, checkpoints) stay those of the
    plain model. Hooks on the block (FSDP's all-gather) stay outside the checkpointed region and have
    gathered the weights again by the time backward recomputes it.
    """
    if mode == "none":
        return
    chosen = [name for name, index in blocks.items() if mode != "selective_layer" or (index + 1) % every == 0]
    context_fn = _keep_attention_and_every_other_matmul if mode == "selective_op" else None
    for name in chosen:
        block = model.get_submodule(name)
        block.forward = functools.partial(_checkpointed, block.forward, context_fn)
    log.info("Activation checkpointing (%s) on %d of %d blocks", mode, len(chosen), len(blocks))


def _checkpointed(forward: Any, context_fn: Callable[[], Any] | None, *args: Any, **kwargs: Any) -> Any:
    if context_fn is None:  # torch 2.11's compile refuses checkpoint(context_fn=noop_context_fn) inside a block
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _keep_attention_and_every_other_matmul() -> tuple[Any, Any]:
    """The contexts of one checkpointed call; its forward and its recomputation count matmuls separately.

    Both passes see the same ops in the same order, so the n-th matmul gets the same decision in each.
    """
    matmuls_seen = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op in _MATMULS:
            matmuls_seen[ctx.is_recompute] += 1
            if matmuls_seen[ctx.is_recompute] % 2 == 1:
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
