"""Single-file Lightning checkpoints, the form DDP, one device and ``save_distributed_checkpoint=False`` write:
loaded into any TitanStrategy layout, and written whole from one. The optimizer state is keyed by parameter index
in the file (what a plain Trainer reads) and by parameter name in the sharded model."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from titan_strategy.shards import laid_out_like, local

__all__ = ["full_model_state", "full_optimizer_state", "load_single_file"]

_WHOLE_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _parameter_names(module: nn.Module, optimizer: Optimizer) -> list[str]:
    """The names of ``optimizer``'s parameters in the order a plain optimizer's ``state_dict`` numbers them."""
    names = {param: name for name, param in module.named_parameters()}
    return [names[param] for group in optimizer.param_groups for param in group["params"]]


def _rekeyed(state: dict[str, Any], mapping: dict[Any, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict`` with each parameter key replaced by ``mapping[key]``."""
    return {"state": {mapping[key]: value for key, value in state["state"].items()},
            "param_groups": [{**group, "params": [mapping[key] for key in group["params"]]}
                             for group in state["param_groups"]]}


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """The whole model's tensors on rank 0's CPU (empty on the other ranks); a collective."""
    return get_model_state_dict(module, options=_WHOLE_ON_RANK_0)


def full_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``optimizer``'s whole state on rank 0's CPU, keyed by parameter index as ``Optimizer.state_dict`` is (empty
    on the other ranks); a collective."""
    state = get_optimizer_state_dict(module, optimizer, options=_WHOLE_ON_RANK_0)
    if not state:
        return state
    return _rekeyed(state, {name: index for index, name in enumerate(_parameter_names(module, optimizer))})


def _read(path: Path, weights_only: bool | None) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True if weights_only is None else weights_only)
    except pickle.UnpicklingError as error:
        raise ValueError(
            f"{path} holds more than tensors and plain containers (its hyper-parameters, say), which "
            "weights_only=True refuses to unpickle: unpickling runs code. If you trust the file, pass "
            f"weights_only=False to fit/validate/test/predict. ({str(error).splitlines()[0]})"
        ) from error
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(f"{path} is a file but not a Lightning checkpoint: it has no 'state_dict' (found {found}).")
    return checkpoint


def _load_weights(path: Path, module: nn.Module, saved: dict[str, Tensor], strict: bool) -> None:
    own = module.state_dict()
    missing, unexpected = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    if strict and (missing or unexpected):
        raise KeyError(f"{path} does not fit {type(module).__name__}: missing {missing[:5]}, unexpected "
                       f"{unexpected[:5]}. Pass the module's own checkpoint, or set module.strict_loading = False.")
    with torch.no_grad():
        for name, tensor in own.items():
            if name in saved:
                local(tensor).copy_(local(laid_out_like(saved[name], tensor)))


def _sharded_optimizer_state(module: nn.Module, saved: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A plain optimizer's index-keyed state as the sharded model's optimizer holds it: keyed by parameter name, each
    tensor of a parameter's shape laid out like that parameter."""
    params = dict(module.named_parameters())
    by_name = _rekeyed(saved, dict(enumerate(names)))
    by_name["state"] = {
        name: {key: laid_out_like(value, params[name])
               if isinstance(value, Tensor) and value.shape == params[name].shape else value
               for key, value in state.items()}
        for name, state in by_name["state"].items()}
    return by_name


def load_single_file(path: Path, module: nn.Module, optimizers: list[Optimizer], *, strict: bool,
                     weights_only: bool | None) -> dict[str, Any]:
    """Load a single-file Lightning checkpoint's model weights, and its optimizer states where they hold the same
    parameter groups, into ``module`` and ``optimizers`` as they are sharded; every rank reads the file.

    Returns:
        The checkpoint, for Lightning to restore its loops, schedulers and callbacks from.
    """
    checkpoint = _read(path, weights_only)
    _load_weights(path, module, checkpoint["state_dict"], strict)
    saved_states = checkpoint.get("optimizer_states", [])
    for index, (optimizer, saved) in enumerate(zip(optimizers, saved_states)):
        names = _parameter_names(module, optimizer)
        saved_sizes = [len(group["params"]) for group in saved["param_groups"]]
        sizes = [len(group["params"]) for group in optimizer.param_groups]
        if saved_sizes != sizes:
            warnings.warn(f"{path}: optimizer {index} was saved with parameter groups of {saved_sizes} parameters "
                          f"and this one has {sizes}; its state starts fresh (the weights are loaded).",
                          stacklevel=2)
            continue
        set_optimizer_state_dict(module, optimizer, _sharded_optimizer_state(module, saved, names))
    return checkpoint
