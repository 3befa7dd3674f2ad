"""Regional compile: each repeated block is compiled on its own, so one compiled graph serves them all."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_strategy.knobs import knob

__all__ = ["CompileConfig", "apply_compile", "apply_compile_loss"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileConfig:
    """What ``torch.compile`` compiles."""

    blocks: bool = knob("compile", False)
    """Each repeated block of the model, on its own."""
    loss: bool = knob("compile_loss", False)
    """The module's ``compute_loss(output, target)``: the fp32 upcast of the logits fuses into the cross-entropy
    instead of materializing full-vocabulary fp32 logits."""

    def check_module(self, module: Any) -> None:
        """Refuse a module this config cannot compile, before any process starts."""
        if self.loss and not callable(getattr(module, "compute_loss", None)):
            raise ValueError(f"compile_loss=True compiles the module's compute_loss(output, target), but "
                             f"{type(module).__name__} has none; define it (see LlamaModule) "
                             "or set compile_loss=False.")


def apply_compile(model: nn.Module, blocks: tuple[str, ...]) -> None:
    """Compile every block in place (``nn.Module.compile``), which keeps parameter names clean for DCP."""
    for name in blocks:
        model.get_submodule(name).compile()
    log.info("Compiled %d blocks with torch.compile", len(blocks))


def apply_compile_loss(module: Any) -> None:
    """Compile ``module.compute_loss`` in place; a module compiled by an earlier fit or validate keeps its graph."""
    loss = module.compute_loss
    if not hasattr(loss, "_torchdynamo_orig_callable"):
        module.compute_loss = torch.compile(loss)
