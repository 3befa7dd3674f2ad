"""Llama's parallel plan: what TitanStrategy may shard, and in which units."""

from __future__ import annotations

from titan_strategy.plan import ParallelPlan

from llama_module.model import Llama

__all__ = ["llama_plan"]


def llama_plan(model: Llama) -> ParallelPlan:
    """FSDP units in forward order: the embedding, each block, then final norm and output together.

    Norm and output form one unit because they run back to back and the norm alone is tiny. Parts a
    pipeline stage does not hold (``None``) are left out, so the plan fits any stage.
    """
    units: list[tuple[str, ...]] = []
    if model.tok_embeddings is not None:
        units.append(("tok_embeddings",))
    units.extend((f"layers.{name}",) for name in model.layers)
    head = tuple(name for name in ("norm", "output") if getattr(model, name) is not None)
    if head:
        units.append(head)
    return ParallelPlan(model=model, fsdp_units=tuple(units), init_weights=model.init_weights)
