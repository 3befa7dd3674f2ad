"""What a model declares so the strategy can parallelize it (the model itself stays parallelism-free)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

__all__ = ["ParallelPlan", "ParamFiller", "PlannedModule"]

ParamFiller = Callable[[nn.Parameter, Callable[[Tensor], None]], None]
"""Writes an initializer's output into a parameter; the initializer always sees the full tensor."""


@dataclass(frozen=True)
class ParallelPlan:
    """A model's declaration of how it may be parallelized.

    Attributes:
        model: the ``nn.Module`` to parallelize (a submodule of the LightningModule).
        fsdp_units: groups of submodule names (relative to ``model``), in forward order; each group
            becomes one FSDP unit whose parameters are all-gathered together.
        init_weights: re-initializes every parameter and buffer of ``model`` after ``to_empty``;
            it receives a seed shared by all ranks and the ``ParamFiller`` to write through.
    """

    model: nn.Module
    fsdp_units: tuple[tuple[str, ...], ...]
    init_weights: Callable[[int, ParamFiller], None]


@runtime_checkable
class PlannedModule(Protocol):
    """A LightningModule that lets TitanStrategy parallelize it (see ``llama_module.LlamaModule``)."""

    def parallel_plan(self) -> ParallelPlan: ...
