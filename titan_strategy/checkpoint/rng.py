"""Each rank's random-number generator states (Python, NumPy, torch CPU and CUDA).

Ranks draw different numbers (dropout differs per tensor-parallel rank), so every rank saves its
own. The states hold only tensors, ints and tuples, so they load with ``weights_only=True``.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from titan_strategy.run_state import RunState

if TYPE_CHECKING:
    from titan_strategy.checkpoint.dcp import LoadedCheckpoint

__all__ = ["ResumedRngStates", "capture_rng_states", "restore_rng_states"]


def capture_rng_states(device: torch.device) -> dict[str, Any]:
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict[str, Any], device: torch.device) -> None:
    random.setstate(states["python"])
    kind, keys, position, has_gauss, cached_gaussian = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


class ResumedRngStates(RunState):
    """The RNG states a loaded sharded checkpoint holds, restored where the uninterrupted run would have had them:
    at once when they were saved at an epoch's end (the next epoch's dataloader draws its seed next), else
    before the next training batch (saved mid-epoch, where no new iterator draws a seed). The checkpoint IO saves
    them with every rank's shards."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._for_next_batch: dict[str, Any] | None = None

    @override
    def load(self, checkpoint: dict[str, Any], sharded: LoadedCheckpoint | None) -> None:
        if sharded is None:
            return
        states = sharded.rng_states  # None: saved by another number of ranks
        if states is not None and sharded.rng_before_next_epoch:
            restore_rng_states(states, self._device)
        else:
            self._for_next_batch = states

    @override
    def batch_started(self) -> None:
        if self._for_next_batch is not None:
            restore_rng_states(self._for_next_batch, self._device)
            self._for_next_batch = None
