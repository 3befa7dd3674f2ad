"""Regional compile: each repeated block is compiled on its own, so one compiled graph serves them all."""

from __future__ import annotations

import logging

from torch import nn

__all__ = ["apply_compile"]

log = logging.getLogger(__name__)


def apply_compile(model: nn.Module, blocks: tuple[str, ...]) -> None:
    """Compile every block in place (``nn.Module.compile``), which keeps parameter names clean for DCP."""
    for name in blocks:
        model.get_submodule(name).compile()
    log.info("Compiled %d blocks with torch.compile", len(blocks))
