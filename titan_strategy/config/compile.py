"""What ``torch.compile`` compiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_strategy.knobs import knob

__all__ = ["CompileConfig"]


@dataclass(frozen=True)
class CompileConfig:
    """What ``torch.compile`` compiles (``parallelize.compile``)."""

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
