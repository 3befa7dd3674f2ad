"""Cut pipeline stages out of a meta-device model without renaming a single parameter.

The model is pruned in place to the stages this rank runs, so the LightningModule (its state dict,
its optimizer, its checkpoints) keeps the full model's names. Each stage is a *view*: a shallow copy
of the containers on the way to the removed parts, sharing every remaining submodule and parameter
with the pruned model. A rank with one stage uses the pruned model itself.
"""

from __future__ import annotations

import copy
from collections import defaultdict

from torch import nn

from titan_strategy.pipeline.layout import PipelineLayout
from titan_strategy.plan import PipelinePlan

__all__ = ["stage_module_names", "split_for_rank", "has_submodule"]


def stage_module_names(blocks: tuple[str, ...], plan: PipelinePlan, layout: PipelineLayout) -> list[set[str]]:
    """Per stage, the names of the cuttable modules it holds (its blocks, plus the first/last stage extras)."""
    names = []
    for stage, block_range in enumerate(layout.blocks):
        held = {blocks[i] for i in block_range}
        if stage == 0:
            held |= set(plan.first_stage)
        if stage == layout.num_stages - 1:
            held |= set(plan.last_stage)
        names.append(held)
    return names


def split_for_rank(model: nn.Module, per_stage: list[set[str]], local_stages: list[int]) -> list[nn.Module]:
    """Prune ``model`` in place to ``local_stages`` and return one module per local stage.

    Args:
        model: the full model, on the meta device.
        per_stage: what ``stage_module_names`` returns, for every stage of the pipeline.
        local_stages: the stage indices this rank runs.
    """
    cuttable = set().union(*per_stage)
    kept = set().union(*(per_stage[s] for s in local_stages))
    for name in sorted(cuttable - kept):
        _remove(model, name)
    return [_view(model, kept - per_stage[s]) for s in local_stages]


def has_submodule(model: nn.Module, name: str) -> bool:
    """Whether ``name`` resolves to a module (a stage lacks what other stages hold)."""
    module: nn.Module | None = model
    for part in name.split("."):
        module = module._modules.get(part) if module is not None else None
    return module is not None


def _remove(model: nn.Module, name: str) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if isinstance(parent, nn.ModuleDict):
        del parent[child]
    else:
        # Registered children may be None; the model's forward then skips them.
        setattr(parent, child, None)


def _view(module: nn.Module, drop: set[str]) -> nn.Module:
    """``module`` without the submodules named in ``drop``, sharing everything else."""
    if not drop:
        return module
    if module._parameters:
        raise ValueError(f"{type(module).__name__} holds parameters of its own ({sorted(module._parameters)}) "
                         "beside the modules that pipeline stages split; "
                         "move them into a submodule the plan assigns to a stage.")
    view = nn.Module.__new__(type(module))
    # Own child table and own hook tables (FSDP registers hooks on each stage root); shared parameters
    # and buffers, so the pruned model sees every change a wrapper makes.
    view.__dict__ = {key: (copy.copy(value) if isinstance(value, dict) and key not in ("_parameters", "_buffers")
                           else value) for key, value in module.__dict__.items()}
    by_child: dict[str, set[str]] = defaultdict(set)
    for name in drop:
        child, _, rest = name.partition(".")
        by_child[child].add(rest)
    for child, rests in by_child.items():
        if "" in rests and isinstance(module, nn.ModuleDict):
            del view._modules[child]
        elif "" in rests:
            view._modules[child] = None
        else:
            view._modules[child] = _view(module._modules[child], rests)
    return view
