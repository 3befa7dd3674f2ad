"""CUDA graphs' knob: where the model's training forward and backward may be replayed as graphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan_strategy.config.mesh import ParallelDims
from titan_strategy.knobs import knob
from titan_strategy.plan import PlannedModule

__all__ = ["CudaGraphsConfig"]


@dataclass(frozen=True)
class CudaGraphsConfig:
    """Whether the model runs as CUDA graphs once warm (``parallelize.cuda_graph``)."""

    enabled: bool = knob("cuda_graphs", False)
    """The model's training forward and backward replayed as CUDA graphs once warm: CUDA only, on one device or
    under FSDP2/HSDP; pipeline, tensor and context parallelism are refused."""

    def check_device(self, device: torch.device) -> None:
        if self.enabled and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True replays CUDA graphs, but this run is on {device.type!r}; train on "
                             "a GPU, or set cuda_graphs=False.")

    def check_layout(self, dims: ParallelDims) -> None:
        """CUDA graphs are captured for a model on one device or data-parallel under FSDP2/HSDP."""
        if not self.enabled:
            return
        layout = {"pipeline_parallel_size": dims.pp, "tensor_parallel_size": dims.tp,
                  "context_parallel_size": dims.cp}
        beyond_one = {name: size for name, size in layout.items() if size > 1}
        if beyond_one:
            raise ValueError(f"cuda_graphs=True graphs a model on one device or under FSDP2/HSDP, but this layout "
                             f"has {beyond_one}: TP's and CP's collectives are not captured yet, and pipeline "
                             "schedules are exempt. Set cuda_graphs=False, or parallelize with data parallelism only.")

    def check_module(self, module: Any) -> None:
        if self.enabled and not isinstance(module, PlannedModule):
            raise ValueError(f"cuda_graphs=True graphs the model a parallel_plan() names, but {type(module).__name__} "
                             "declares none (it builds its own model in configure_model); add a parallel_plan() "
                             "(see LlamaModule), or set cuda_graphs=False.")
