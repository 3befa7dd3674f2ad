"""bf16 weights for compute, their fp32 masters kept by the optimizer: bf16-mixed without per-step casts.

Under autocast, a model with fp32 weights casts each weight to bf16 in every forward and each bf16 weight
gradient back to fp32 in every backward: at the Llama-3.2-1B shape, about 2% of the step (benchmarks/RESULTS.md:
'Master weights'). FSDP2's mixed precision hides its cast in the all-gather's copy, but a
module that FSDP does not shard (one device) pays it. Here the parameters themselves hold bf16 values, and
``TritonAdamW`` updates an fp32 master of each and writes the bf16 value back in the same kernel, so
nothing is cast. The model then computes as it does under FSDP2's ``MixedPrecisionPolicy``: bf16 weights,
activations and gradients, fp32 master weights and optimizer state.

Checkpoints do not change: the module's ``state_dict`` holds the fp32 masters under the parameters' names,
loading one fills the masters (and the bf16 parameters from them), and the optimizer's moments stay fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from titan_strategy.kernels.adamw import TritonAdamW

__all__ = ["MasterWeights", "hold_master_weights", "hold_master_weights_where_exact"]


class MasterWeights:
    """The fp32 masters of a module's parameters while they hold bf16 values; ``release()`` puts them back."""

    def __init__(self, module: nn.Module, optimizers: Sequence[TritonAdamW], dtype: torch.dtype) -> None:
        self.optimizers = list(optimizers)
        self.masters: dict[Tensor, Tensor] = {}
        for param in module.parameters():
            self.masters[param] = param.data
            param.data = param.data.to(dtype)
        for optimizer in self.optimizers:
            optimizer.master_weights = self.masters
        # On each module that holds parameters, so that its own state_dict() (not only the root's) shows them.
        self._hooks: list[RemovableHandle] = []
        for owner in module.modules():
            local = {name: self.masters[param] for name, param in owner._parameters.items() if param is not None}
            if local:
                self._hooks += [owner.register_state_dict_post_hook(functools.partial(_save_masters, local)),
                                owner.register_load_state_dict_pre_hook(functools.partial(_load_masters, local))]

    def release(self) -> None:
        """The parameters hold their fp32 masters again; the optimizers and checkpoints go back to plain AdamW's."""
        for hook in self._hooks:
            hook.remove()
        for optimizer in self.optimizers:
            optimizer.master_weights = {}
        for param, master in self.masters.items():
            param.data = master
        self.masters.clear()


def _save_masters(masters: dict[str, Tensor], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  *_: Any) -> None:
    for name, master in masters.items():
        if prefix + name in state_dict:
            state_dict[prefix + name] = master


@torch.no_grad()
def _load_masters(masters: dict[str, Tensor], module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  *_: Any) -> None:
    # Runs before the module's parameters load, which then take the same values rounded to bf16.
    for name, master in masters.items():
        value = state_dict.get(prefix + name)
        if isinstance(value, Tensor) and value is not master:
            master.copy_(value)


def hold_master_weights(module: nn.Module, optimizers: Sequence[Any],
                        dtype: torch.dtype | None) -> MasterWeights | None:
    """Give ``module``'s parameters ``dtype`` (bf16) values and their optimizers fp32 masters, where that can be:
    every parameter is an fp32 plain tensor updated by one of ``optimizers``, all ``TritonAdamW``. Otherwise
    nothing changes (autocast casts as before) and this returns None."""
    if dtype is None or not optimizers or not all(isinstance(o, TritonAdamW) for o in optimizers):
        return None
    params = list(module.parameters())
    updated = {param for optimizer in optimizers for group in optimizer.param_groups for param in group["params"]}
    if not params or not all(type(p.data) is Tensor and p.dtype == torch.float32 and p in updated for p in params):
        return None
    return MasterWeights(module, optimizers, dtype)


def hold_master_weights_where_exact(module: Any, optimizers: Sequence[Any], dtype: torch.dtype | None, *,
                                    pipelined: bool) -> MasterWeights | None:
    """``hold_master_weights`` for a LightningModule in training, where each step's gradients come from one
    backward pass: under gradient accumulation, pipeline microbatches or manual optimization they would add up
    in bf16, so autocast stays there (None)."""
    trainer = module.trainer
    if pipelined or trainer.accumulate_grad_batches != 1 or not module.automatic_optimization:
        return None
    return hold_master_weights(module, optimizers, dtype)
