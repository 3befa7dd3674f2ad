"""Model weights alone: read a checkpoint's full tensors in one process, write a weights checkpoint, and
load either kind into a sharded model (``TitanStrategy(initial_weights=...)``).

A weights checkpoint is a DCP directory holding only the ``model`` entries, as a full checkpoint
stores them, plus ``titan_weights.json`` (written last: its presence means the directory is complete)
with the hyper-parameters that rebuild the module. Because DCP stores tensors by name and global
shape, either kind loads into any mesh layout.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from titan_strategy.checkpoint.dcp import LIGHTNING_STATE_FILE, is_titan_checkpoint
from titan_strategy.checkpoint.manifest import MANIFEST_FILE, verify_files

__all__ = ["WEIGHTS_FILE", "check_weights_source", "load_model_weights", "read_hyper_parameters",
           "read_model_weights", "write_model_weights"]

WEIGHTS_FILE = "titan_weights.json"
_MODEL = "model"


def check_weights_source(path: Path) -> None:
    """Raise unless ``path`` is a complete checkpoint of either kind."""
    if not (is_titan_checkpoint(path) or (path / WEIGHTS_FILE).is_file()):
        raise FileNotFoundError(f"{path} is neither a complete TitanStrategy checkpoint (no {MANIFEST_FILE}: a save "
                                f"that never finished has none) "
                                f"nor a weights checkpoint (no {WEIGHTS_FILE}, as `titan-hf import` writes).")


def _check_source(path: Path, group: dist.ProcessGroup | None = None) -> None:
    check_weights_source(path)
    if is_titan_checkpoint(path):
        verify_files(path, group)


def read_hyper_parameters(path: Path) -> dict[str, Any]:
    """The module hyper-parameters saved with a checkpoint of either kind."""
    check_weights_source(path)
    if is_titan_checkpoint(path):
        return dict(torch.load(path / LIGHTNING_STATE_FILE, map_location="cpu", weights_only=True)["hyper_parameters"])
    return json.loads((path / WEIGHTS_FILE).read_text())["hyper_parameters"]


def read_model_weights(path: Path) -> dict[str, Tensor]:
    """Every model tensor of a checkpoint, whole, on the CPU of this process (no process group needed)."""
    _check_source(path)
    prefix = _MODEL + "."
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    weights = {key.removeprefix(prefix): torch.empty(entry.size, dtype=entry.properties.dtype)
               for key, entry in metadata.items()
               if key.startswith(prefix) and isinstance(entry, TensorStorageMetadata)}
    state = {_MODEL: weights}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state[_MODEL]


def write_model_weights(weights: dict[str, Tensor], path: Path, *, hyper_parameters: dict[str, Any]) -> None:
    """Write a weights checkpoint from whole tensors, in this process."""
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not empty; choose a new directory for the weights checkpoint.")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process is the intent
        dcp.save({_MODEL: weights}, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    (path / WEIGHTS_FILE).write_text(json.dumps({"hyper_parameters": hyper_parameters}, indent=2) + "\n")


def load_model_weights(path: Path, module: nn.Module, group: dist.ProcessGroup) -> None:
    """Load a checkpoint's model weights into ``module`` (sharded in any layout); every rank of ``group`` calls this.

    Raises:
        RuntimeError: a parameter of ``module`` is missing from the checkpoint, or has another shape.
    """
    _check_source(path, group)
    state = {_MODEL: get_model_state_dict(module)}
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = sorted(name for name in state[_MODEL] if f"{_MODEL}.{name}" not in saved)
    if missing:
        raise RuntimeError(f"{path} lacks {len(missing)} of the module's parameters ({missing[:3]} ...); it was saved "
                           "from another model.")
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_model_state_dict(module, state[_MODEL], options=StateDictOptions(strict=True))
