"""Float8 training (torchao) of a model's linear layers: matmuls in float8 with bf16 master weights kept.

Recipes:
- ``tensorwise``: one scale per tensor. Under FSDP the weights are cast to float8 *before* its all-gather
  (half the bytes of bf16), and their scales are computed once per step, for all weights together,
  right after the optimizer changed them. On a single device each matmul casts its weight.
- ``rowwise``: one scale per row, more accurate for outliers and slower; weights are all-gathered
  in bf16.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from titan_strategy.config.float8 import Float8Recipe

__all__ = ["apply_float8", "precompute_float8_scales"]

log = logging.getLogger(__name__)

# torch's float8 matmul needs both dims of every operand divisible by 16.
_ALIGNMENT = 16


def apply_float8(model: nn.Module, recipe: Float8Recipe, skip: tuple[str, ...], fsdp_all_gather: bool) -> int:
    """Swap the eligible ``nn.Linear`` layers of ``model`` for torchao's ``Float8Linear``, in place.

    Eligible: not named in ``skip`` (the output projection: its logits need the precision), and with
    both dims divisible by 16. Parameter names do not change, so checkpoints stay interchangeable
    with bf16 runs. ``fsdp_all_gather``: FSDP will wrap the model, so tensorwise weights are cast to
    float8 before its all-gather.

    Returns:
        How many layers were converted.
    """
    if recipe == "none":
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise" and fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    converted = []

    def eligible(module: nn.Module, name: str) -> bool:
        ok = (isinstance(module, nn.Linear) and name not in skip and module.in_features % _ALIGNMENT == 0
              and module.out_features % _ALIGNMENT == 0)
        if ok:
            converted.append(name)
        return ok

    convert_to_float8_training(model, config=config, module_filter_fn=eligible)
    log.info("Float8 (%s) on %d linear layers%s", recipe, len(converted),
             ", float8 all-gather" if config.enable_fsdp_float8_all_gather else "")
    return len(converted)


def precompute_float8_scales(model: nn.Module) -> None:
    """After each optimizer step under tensorwise float8: every weight's scale for the next all-gather, at once.

    torchao hands each weight a new scale tensor every time; the new values go into the tensor the weight held
    before, so that whatever captured it stays valid (a CUDA graph's all-gather reads it where it was)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    shards = [param._local_tensor for param in model.parameters() if isinstance(param, DTensor)]
    held = [getattr(shard, "_precomputed_scale", None) for shard in shards]
    precompute_float8_dynamic_scale_for_fsdp(model)
    with torch.no_grad():
        for shard, scale in zip(shards, held):
            if scale is not None:
                scale.copy_(shard._precomputed_scale)
                shard._precomputed_scale = scale
