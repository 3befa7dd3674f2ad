"""DTensors inside callbacks' states (StochasticWeightAveraging's average, sharded alike with the module) travel
whole in checkpoints: gathered when saved, sliced like the callback's own tensors when loaded. So the Lightning state
file stays plain tensors (``weights_only`` loads it), and a single-file checkpoint is any Trainer's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_strategy.shards import laid_out_like

__all__ = ["shard_callback_tensors", "whole_callback_tensors"]


def _mapped(obj: Any, like: Any, fn: Callable[[Tensor, Any], Tensor]) -> Any:
    """``obj`` with each tensor ``t`` replaced by ``fn(t, the value at the same place in like)``."""
    if isinstance(obj, Tensor):
        return fn(obj, like)
    if isinstance(obj, dict):
        return {key: _mapped(value, like.get(key) if isinstance(like, dict) else None, fn)
                for key, value in obj.items()}
    if type(obj) in (list, tuple):
        likes = like if type(like) is type(obj) and len(like) == len(obj) else [None] * len(obj)
        return type(obj)(_mapped(value, other, fn) for value, other in zip(obj, likes))
    return obj


def whole_callback_tensors(checkpoint: dict[str, Any]) -> None:
    """Gather every DTensor of ``checkpoint["callbacks"]`` to a whole CPU tensor; a collective (every rank saves
    the same callbacks, in the same order)."""
    if checkpoint.get("callbacks"):
        checkpoint["callbacks"] = _mapped(
            checkpoint["callbacks"], None,
            lambda tensor, _: tensor.full_tensor().cpu() if isinstance(tensor, DTensor) else tensor)


def shard_callback_tensors(checkpoint: dict[str, Any], callback_states: dict[str, Any]) -> None:
    """Cut each whole tensor of ``checkpoint["callbacks"]`` like the DTensor at its place in the callbacks' current
    states (``callback_states``, by state key)."""
    if checkpoint.get("callbacks"):
        checkpoint["callbacks"] = _mapped(
            checkpoint["callbacks"], callback_states,
            lambda tensor, like: laid_out_like(tensor, like) if isinstance(like, DTensor) else tensor)
