"""Tensor parallelism's knobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_strategy.knobs import knob

__all__ = ["TensorParallelConfig"]


@dataclass(frozen=True)
class TensorParallelConfig:
    """How tensor parallelism splits the model; its degree is the mesh's (``MeshConfig.tp``)."""

    sequence_parallel: bool = knob("sequence_parallel", True)
    """Shard norms and residuals on the sequence dim too (less memory)."""
    loss_parallel: bool = knob("loss_parallel", True)
    """Keep the logits sharded on the vocabulary and compute the loss that way."""
    async_tp: bool = knob("async_tensor_parallel", False)
    """Overlap TP communication with the matmuls (AsyncTP: an inductor pass, CUDA symmetric memory)."""

    def check_device(self, device: torch.device) -> None:
        if self.async_tp and device.type != "cuda":
            raise ValueError(f"async_tensor_parallel=True runs on CUDA only (symmetric memory), not on "
                             f"{device.type!r}; set async_tensor_parallel=False.")
