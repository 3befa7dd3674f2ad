"""Activation checkpointing: keep each repeated block's input, recompute its activations in backward."""

from __future__ import annotations

import functools
import logging
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["AC_MODES", "apply_ac"]

log = logging.getLogger(__name__)

AC_MODES = ("none", "full")


def apply_ac(model: nn.Module, blocks: tuple[str, ...], mode: str) -> None:
    """Checkpoint every block's ``forward`` in place.

    No wrapper module, so parameter names (initialization seeds, checkpoints) stay those of the
    plain model. Hooks on the block (FSDP's all-gather) stay outside the checkpointed region and have
    gathered the weights again by the time backward recomputes it.
    """
    if mode == "none":
        return
    for name in blocks:
        block = model.get_submodule(name)
        block.forward = functools.partial(_checkpointed, block.forward)
    log.info("Activation checkpointing (%s) on %d blocks", mode, len(blocks))


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
