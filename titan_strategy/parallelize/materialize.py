"""Give a model real tensors on its device: the weights it arrived with are kept, and what was built on the meta
device is initialized by the model's own initializer, identically for any layout."""

from __future__ import annotations

import functools
import itertools
import sys
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from titan_strategy.distributed import is_rehearsal, outside_simulated_ranks, simulating_ranks
from titan_strategy.plan import ParamFiller
from titan_strategy.shards import laid_out_like, local

__all__ = ["OwnInitializer", "broadcast_real_tensors", "fill_sharded", "materialize",
           "materialize_with_own_initializers", "own_initializers", "run_initializers"]


def fill_sharded(param: nn.Parameter, initializer: Callable[[Tensor], None]) -> None:
    """Initialize the full tensor, then keep this rank's shard.

    DTensor's own random ops are layout-independent only on CUDA (on CPU every shard would get the
    same numbers), and differ from an unsharded run. Building the full tensor per parameter makes
    the weights identical to a single-process run for every mesh, at the cost of one parameter's
    worth of temporary memory.
    """
    if not isinstance(param, DTensor):
        initializer(param.data)
        return
    with outside_simulated_ranks():  # one tensor for every simulated rank to slice its shard from
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        initializer(full)
    param.to_local().copy_(laid_out_like(full, param).to_local())  # every rank built the same full tensor


def shared_seed(device: torch.device) -> int:
    """A seed equal on every rank (rank 0's), so shards of one parameter come from one tensor."""
    seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _tensors(module: nn.Module, recurse: bool = True) -> Iterator[tuple[str, Tensor]]:
    return itertools.chain(module.named_parameters(recurse=recurse), module.named_buffers(recurse=recurse))


def materialize(model: nn.Module, device: torch.device, init_weights: Callable[[int, ParamFiller], None]) -> None:
    """``to_empty`` on ``device`` (only each rank's shards are allocated), then ``init_weights``.

    A tensor that was not on the meta device holds weights the user gave (``from_pretrained``, a module built in
    ``__init__`` or under ``init_module(empty_init=False)``): it keeps them, whatever ``init_weights`` writes. A
    model with no meta tensor is left as it is.
    """
    if not any(local(t).is_meta for _, t in _tensors(model)):
        return
    given = {name: local(t).detach().clone() for name, t in _tensors(model) if not local(t).is_meta}
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    for owners in shared:  # to_empty gives each owner a parameter of its own
        first_module, first_name = owners[0]
        for module, name in owners[1:]:
            module._parameters[name] = first_module._parameters[first_name]
    init_weights(shared_seed(device), fill_sharded)
    if given:
        kept = dict(_tensors(model))
        with torch.no_grad():
            for name, values in given.items():
                local(kept[name]).copy_(values)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, name) places of each parameter held in more than one (tied weights: a transformers model's
    output projection that is its token embedding)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                places.setdefault(id(param), []).append((module, name))
    return [owners for owners in places.values() if len(owners) > 1]


def broadcast_real_tensors(model: nn.Module, host_group: dist.ProcessGroup | None) -> None:
    """Rank 0's weights on every rank, for every tensor the model arrived with (as DDP does at its start).

    Sharding keeps each rank's slice of its own copy: ranks that built their weights from different random
    states would otherwise train a model no rank ever held. CPU tensors go over ``host_group`` (gloo), others over
    the default group.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1 or is_rehearsal() or simulating_ranks():
        return
    with torch.no_grad():
        for _, tensor in _tensors(model):
            part = local(tensor)
            if not part.is_meta:
                dist.broadcast(part, src=0, group=host_group if part.device.type == "cpu" else None)


def _pretrained_owners(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """Each submodule's nearest enclosing transformers ``PreTrainedModel`` (itself included), where it has one."""
    transformers = sys.modules.get("transformers")  # a model of transformers' has imported it already
    if transformers is None:
        return {}
    owners: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module | None) -> None:
        owner = module if isinstance(module, transformers.PreTrainedModel) else owner
        if owner is not None:
            owners[module] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return owners


@dataclass(frozen=True)
class OwnInitializer:
    """How one module initializes the tensors of its own that were built on the meta device (``names``): its
    ``reset_parameters()``, then its transformers model's ``_init_weights``, where it has them; the order an eager
    build runs them in (constructor, then ``post_init``). ``path`` is the module's name in the model."""

    path: str
    module: nn.Module
    names: tuple[str, ...]
    steps: tuple[Callable[[], None], ...]


def own_initializers(model: nn.Module) -> list[OwnInitializer]:
    """The initializer of every submodule that holds meta tensors of its own, in module order.

    Raises:
        TypeError: a submodule holds meta tensors and has neither; names each one, before any tensor is allocated.
    """
    owners = _pretrained_owners(model)
    chosen, missing = [], []
    for name, module in model.named_modules():
        names = tuple(own for own, t in _tensors(module, recurse=False) if local(t).is_meta)
        if not names:
            continue
        steps = [reset] if callable(reset := getattr(module, "reset_parameters", None)) else []
        if module in owners:
            steps.append(functools.partial(owners[module]._init_weights, module))
        if steps:
            chosen.append(OwnInitializer(name, module, names, tuple(steps)))
        else:
            missing.append(f"{name or '<root>'} ({type(module).__name__})")
    if missing:
        raise TypeError(
            f"Modules {missing} were built on the meta device (in configure_model() or under init_module()) but have "
            "no initializer: they define no reset_parameters() and are not part of a transformers PreTrainedModel. "
            "Give them a reset_parameters(), or build them in __init__ with their weights (which are kept)."
        )
    return chosen


def run_initializers(initializers: list[OwnInitializer], seed: int, fill: ParamFiller) -> None:
    """``init_weights`` of a model initialized by its own modules: each sees full-size parameters (``fill`` writes
    them into the shards), and its random numbers come from ``seed`` and its name alone, so every layout gets the
    same weights (a pipeline stage initializes only the modules it holds) and the training's random state is left
    as it was.

    Raises:
        TypeError: a floating-point tensor that no initializer wrote (a module of a transformers model whose
            ``_init_weights`` does not know it): it would train from uninitialized memory. Every rank sees the same
            full tensors, so every rank raises.
    """
    devices = sorted({p.device.index or 0 for init in initializers for p in init.module.parameters()
                      if p.device.type == "cuda"})
    unwritten = []
    with torch.random.fork_rng(devices=devices):
        for init in initializers:
            torch.manual_seed(seed + zlib.crc32(init.path.encode()))
            with _full_size_parameters(init.module, fill):
                own = {name: t for name, t in _tensors(init.module, recurse=False)
                       if name in init.names and t.is_floating_point()}
                with torch.no_grad():
                    for tensor in own.values():
                        tensor.fill_(float("nan"))
                for step in init.steps:
                    step()
                unwritten += [f"{type(init.module).__name__}.{name}" for name, t in own.items() if t.isnan().any()]
    if unwritten:
        raise TypeError(f"{sorted(set(unwritten))} were built on the meta device and no initializer wrote them "
                        "(neither a reset_parameters() nor the transformers model's _init_weights); give the module a "
                        "reset_parameters(), or build it in __init__ with its weights (which are kept).")


def materialize_with_own_initializers(model: nn.Module, device: torch.device) -> None:
    """``materialize`` for a module that parallelized itself (ModelParallelStrategy style): Lightning's contract
    for meta-device modules (``reset_parameters()``), with transformers models initialized as transformers does."""
    materialize(model, device, functools.partial(run_initializers, own_initializers(model)))


@contextmanager
def _full_size_parameters(module: nn.Module, fill: ParamFiller) -> Iterator[None]:
    """Temporarily replace the module's own DTensor parameters by full tensors; write the shards back."""
    sharded = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    for name, param in sharded.items():
        full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
        module._parameters[name] = nn.Parameter(full, requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for name, param in sharded.items():
            full = module._parameters[name]
            with torch.no_grad():
                fill(param, lambda t, full=full: t.copy_(full))
            module._parameters[name] = param
