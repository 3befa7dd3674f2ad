"""Float8 training's knob (the recipes are ``parallelize.float8``'s)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from titan_strategy.gpu import check_gpu_capability
from titan_strategy.knobs import check_choice, knob

__all__ = ["Float8Config", "Float8Recipe"]


Float8Recipe = Literal["none", "tensorwise", "rowwise"]


# float8 tensor cores arrived with Ada/Hopper (SM 8.9).
_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Float8Config:
    """torchao float8 training of the linear layers (the plan's ``float8_skip`` stays bf16)."""

    recipe: Float8Recipe = knob("float8", "none")
    """torchao float8 linear layers (CUDA capability 8.9+): "none"; "tensorwise" (one scale per tensor, weights
    all-gathered in float8 under FSDP); "rowwise" (one scale per row: more accurate for outliers, slower)."""

    def __post_init__(self) -> None:
        check_choice("float8", self.recipe, Float8Recipe)

    def check_device(self, device: torch.device) -> None:
        """Refuse float8 where it cannot run: before the process builds anything."""
        if self.recipe != "none":
            check_gpu_capability(device, _MIN_CAPABILITY, f"float8={self.recipe!r}", "H100, H200, L40, B200...",
                                 "use float8='none'")
