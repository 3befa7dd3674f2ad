"""Sharded checkpoints through torch.distributed.checkpoint (DCP), laid out for Lightning.

A checkpoint is a directory: DCP's shard files hold the model, every optimizer and each
data-parallel rank's dataloader position; ``lightning_state.pt`` (written by rank 0, last) holds
the rest of Lightning's checkpoint dict (loops, callbacks, LR schedulers, hyper-parameters).
Because DCP stores parameters by name with their global shapes, a checkpoint loads into another
mesh layout.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

__all__ = ["LIGHTNING_STATE_FILE", "is_titan_checkpoint", "optimizer_state_dict", "save_checkpoint", "load_checkpoint"]

LIGHTNING_STATE_FILE = "lightning_state.pt"
_DATA_WORLD_KEY = "titan_batch_world_size"
# One entry per parameter name, hyper-parameters included: pipeline ranks hold different parameters,
# and a nested param_groups list (saved once, by rank 0) would name only rank 0's.
_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, as saved and loaded here."""
    return get_optimizer_state_dict(module, optimizer, options=_OPTIMIZER_OPTIONS)


def is_titan_checkpoint(path: Path) -> bool:
    return (path / LIGHTNING_STATE_FILE).is_file()


def _loader_state_slot(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The fit loop's state dict, where Lightning keeps a stateful dataloader's position."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")


_DATALOADER_PREFIX = "dataloader.batch_rank_"


def _dataloader_key(batch_rank: int) -> str:
    return f"{_DATALOADER_PREFIX}{batch_rank}"


def save_checkpoint(checkpoint: dict[str, Any], path: Path, *, batch_rank: int, batch_world_size: int,
                    is_global_zero: bool) -> None:
    """Write Lightning's checkpoint dict (model/optimizer states already sharded) to ``path``.

    Every rank calls this. The dataloader position is per rank: each batch rank stores its own
    under its own key (ranks of one replica hold identical positions; DCP writes one copy).
    """
    if is_global_zero:
        if path.is_file():
            path.unlink()
        # Overwriting (e.g. last.ckpt): drop the completion marker first, so a save that dies midway
        # leaves a directory that no loader takes for complete.
        (path / LIGHTNING_STATE_FILE).unlink(missing_ok=True)
    state: dict[str, Any] = {"model": checkpoint.pop("state_dict")}
    for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{index}"] = optimizer_state
    loop_state = _loader_state_slot(checkpoint)
    if loop_state is not None and "combined_loader" in loop_state:
        state[_dataloader_key(batch_rank)] = _to_bytes(loop_state.pop("combined_loader"))
    with warnings.catch_warnings():
        # Overwriting last.ckpt is intended; its completion marker was removed above.
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
    if is_global_zero:
        # Written after every shard, so its presence means DCP finished on all ranks.
        checkpoint[_DATA_WORLD_KEY] = batch_world_size
        torch.save(checkpoint, path / LIGHTNING_STATE_FILE)


def load_checkpoint(path: Path, module: nn.Module, optimizers: list[Optimizer], *, batch_rank: int,
                    batch_world_size: int, strict: bool, weights_only: bool | None) -> dict[str, Any]:
    """Load model and optimizer states into ``module``/``optimizers`` in place; return Lightning's dict.

    Raises:
        FileNotFoundError: ``path`` is not a complete TitanStrategy checkpoint.
        ValueError: the dataloader position was saved under another data-parallel degree.
    """
    if not is_titan_checkpoint(path):
        raise FileNotFoundError(
            f"{path} is not a complete TitanStrategy checkpoint (no {LIGHTNING_STATE_FILE}); pass the directory "
            "that Trainer.save_checkpoint or ModelCheckpoint wrote under TitanStrategy."
        )
    checkpoint = torch.load(path / LIGHTNING_STATE_FILE, map_location="cpu",
                            weights_only=True if weights_only is None else weights_only)
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = optimizer_state_dict(module, optimizer)
    loop_state = _loader_state_slot(checkpoint)
    saved_world = checkpoint.pop(_DATA_WORLD_KEY)
    # Decided from what the checkpoint holds, not from this rank's key, so that every rank takes the
    # same branch (a rank that raised alone would leave the others waiting in dcp.load).
    restore_loader = loop_state is not None and _has_dataloader_state(path)
    if restore_loader:
        if saved_world != batch_world_size:
            raise ValueError(
                f"{path} holds dataloader positions for {saved_world} data-parallel ranks, but this run has "
                f"{batch_world_size}. Resume with the same data_parallel_replicate_size x data_parallel_shard_size, "
                "or use a dataloader without saved state."
            )
        state[_dataloader_key(batch_rank)] = b""
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{index}"], options=_OPTIMIZER_OPTIONS)
    if restore_loader:
        loop_state["combined_loader"] = torch.load(io.BytesIO(state[_dataloader_key(batch_rank)]), weights_only=True)
    return checkpoint


def _has_dataloader_state(path: Path) -> bool:
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return any(key.startswith(_DATALOADER_PREFIX) for key in keys)


def _to_bytes(obj: Any) -> bytes:
    # One opaque blob per rank: DCP then needs no knowledge of the loader state's structure to load
    # it, and it is read back with weights_only=True (plain containers and numbers only).
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


