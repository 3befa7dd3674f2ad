"""What a TitanStrategy checkpoint holds, and how it loads into any mesh layout.

A checkpoint is a directory. DCP's shard files hold the model, every optimizer, each data-parallel
rank's dataloader position and each rank's RNG states; ``lightning_state.pt`` (rank 0) holds the
rest of Lightning's checkpoint dict (loops, callbacks, LR schedulers, hyper-parameters); the
manifest (``manifest.py``) marks it complete. DCP stores parameters by name with their global
shapes, so a checkpoint loads into another layout. Writing is ``io.py``'s part.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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

from titan_strategy.checkpoint.manifest import MANIFEST_FILE, is_complete, verify_files

__all__ = ["ELASTIC_POSITION_KEY", "LAYOUT_KEY", "LIGHTNING_STATE_FILE", "LoadedCheckpoint", "RankPlace",
           "is_titan_checkpoint", "load_checkpoint", "newest_complete_checkpoint", "optimizer_state_dict",
           "split_checkpoint", "to_bytes"]

LIGHTNING_STATE_FILE = "lightning_state.pt"
# A training loader whose state_dict() holds this key set to True keeps a global position (llama_module's
# GlobalWindows does): on resume, under any data-parallel degree, each rank's loader is handed every saved
# rank's state, load_state_dict({ELASTIC_POSITION_KEY: True, "saved_ranks": [batch rank 0's, 1's, ...]}),
# and derives its own share. Any other stateful loader gets its own rank's state, on the same degree only.
ELASTIC_POSITION_KEY = "titan_elastic_position"
LAYOUT_KEY = "titan_layout"
_DATALOADER_PREFIX = "dataloader.batch_rank_"
_RNG_PREFIX = "rng.rank_"
# One entry per parameter name, hyper-parameters included: pipeline ranks hold different parameters,
# and a nested param_groups list (saved once, by rank 0) would name only rank 0's.
_OPTIMIZER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True)
class RankPlace:
    """Where this process sits: its rank in the world and among the data-parallel (batch) ranks."""

    rank: int
    world_size: int
    batch_rank: int
    batch_world_size: int


@dataclass
class LoadedCheckpoint:
    lightning: dict[str, Any]
    rng_states: dict[str, Any] | None  # None when the checkpoint came from another number of ranks
    # Whether the RNG states belong before the next epoch's dataloader is created (saved at an epoch's
    # last batch) or at the next training batch (saved mid-epoch, where no new iterator draws a seed).
    rng_before_next_epoch: bool


def optimizer_state_dict(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, as saved and loaded here."""
    return get_optimizer_state_dict(module, optimizer, options=_OPTIMIZER_OPTIONS)


def is_titan_checkpoint(path: Path) -> bool:
    return is_complete(path) and (path / LIGHTNING_STATE_FILE).is_file()


def newest_complete_checkpoint(folders: list[Path]) -> str | None:
    """The complete checkpoint in ``folders`` whose marker was written last (partial saves carry no ``.ckpt`` name)."""
    complete = [path for folder in folders if folder.is_dir() for path in folder.glob("*.ckpt")
                if is_titan_checkpoint(path)]
    if not complete:
        return None
    return str(max(complete, key=lambda path: ((path / MANIFEST_FILE).stat().st_mtime_ns, path.name)))


def _fit_loop_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    return checkpoint.get("loops", {}).get("fit_loop", {})


def _dataloader_key(batch_rank: int) -> str:
    return f"{_DATALOADER_PREFIX}{batch_rank}"


def to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def split_checkpoint(checkpoint: dict[str, Any], place: RankPlace, rng_states: dict[str, Any]) -> dict[str, Any]:
    """Move the sharded and per-rank entries of Lightning's checkpoint dict into a DCP state dict.

    ``checkpoint`` keeps the rest, plus the layout it was saved under. The dataloader position is
    per batch rank (ranks of one replica hold identical positions and DCP writes one copy); it and
    the RNG states are opaque blobs, so DCP needs no knowledge of their structure and they load
    back with ``weights_only=True``.
    """
    state: dict[str, Any] = {"model": checkpoint.pop("state_dict"),
                             f"{_RNG_PREFIX}{place.rank}": to_bytes(rng_states)}
    for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{index}"] = optimizer_state
    fit_loop = _fit_loop_state(checkpoint)
    loop_state = fit_loop.get("state_dict", {})
    if "combined_loader" in loop_state:
        state[_dataloader_key(place.batch_rank)] = to_bytes(loop_state.pop("combined_loader"))
    checkpoint[LAYOUT_KEY] = {
        "world_size": place.world_size, "batch_world_size": place.batch_world_size,
        "saved_at_last_batch": bool(fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch", True)),
    }
    return state


def load_checkpoint(path: Path, module: nn.Module, optimizers: list[Optimizer], place: RankPlace, *,
                    strict: bool, weights_only: bool | None, group: dist.ProcessGroup) -> LoadedCheckpoint:
    """Verify ``path``, then load model and optimizer states into ``module``/``optimizers`` in place.

    Raises:
        FileNotFoundError: ``path`` is not a complete TitanStrategy checkpoint.
        CorruptCheckpointError: a file differs from what was written.
        ValueError: a dataloader position without ``ELASTIC_POSITION_KEY`` was saved under another
            data-parallel degree.
    """
    if not is_titan_checkpoint(path):
        found = "does not exist" if not path.exists() else (
            f"is a folder of {sorted(p.name for p in path.iterdir())[:6]} with no {MANIFEST_FILE}")
        raise FileNotFoundError(
            f"{path} is not a complete TitanStrategy checkpoint (it {found}: the save never finished, or "
            "this is not such a directory); pass a checkpoint that Trainer.save_checkpoint or ModelCheckpoint wrote "
            "under TitanStrategy, a single-file .ckpt of any strategy, or ckpt_path='last' to take the newest "
            "complete one."
        )
    verify_files(path, group)
    checkpoint = torch.load(path / LIGHTNING_STATE_FILE, map_location="cpu",
                            weights_only=True if weights_only is None else weights_only)
    layout = checkpoint.pop(LAYOUT_KEY)
    state: dict[str, Any] = {"model": get_model_state_dict(module)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = optimizer_state_dict(module, optimizer)
    loop_state = _fit_loop_state(checkpoint).get("state_dict")
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    # Every saved rank's position is read on every rank, so that all of them decide alike whether it can
    # be handed over (a rank that raised alone would leave the others waiting in a collective).
    restore_loader = loop_state is not None and any(key.startswith(_DATALOADER_PREFIX) for key in saved_keys)
    saved_loaders = [_dataloader_key(rank) for rank in range(layout["batch_world_size"])] if restore_loader else []
    state.update(dict.fromkeys(saved_loaders, b""))
    same_ranks = layout["world_size"] == place.world_size
    rng_key = f"{_RNG_PREFIX}{place.rank}"
    if same_ranks:
        state[rng_key] = b""
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_model_state_dict(module, state["model"], options=StateDictOptions(strict=strict))
    for index, optimizer in enumerate(optimizers):
        set_optimizer_state_dict(module, optimizer, state[f"optimizer_{index}"], options=_OPTIMIZER_OPTIONS)
    if restore_loader:
        loop_state["combined_loader"] = _loader_states([_from_bytes(state[key]) for key in saved_loaders], place,
                                                       path)
    if not same_ranks and place.rank == 0:
        warnings.warn(f"{path} was saved by {layout['world_size']} ranks and this run has {place.world_size}: "
                      "random-number streams start from the seed instead of where they were.", stacklevel=2)
    return LoadedCheckpoint(checkpoint, _from_bytes(state[rng_key]) if same_ranks else None,
                            layout["saved_at_last_batch"])


def _loader_states(saved: list[list[dict[str, Any]]], place: RankPlace, path: Path) -> list[dict[str, Any]]:
    """This rank's state for each stateful training loader, from every saved batch rank's list of them."""
    states = []
    for per_rank in zip(*saved, strict=True):
        if all(isinstance(state, dict) and state.get(ELASTIC_POSITION_KEY) for state in per_rank):
            states.append({ELASTIC_POSITION_KEY: True, "saved_ranks": list(per_rank)})
        elif len(per_rank) == place.batch_world_size:
            states.append(per_rank[place.batch_rank])
        else:
            raise ValueError(
                f"{path} holds dataloader positions for {len(per_rank)} data-parallel ranks, but this run has "
                f"{place.batch_world_size}, and the loader's position is per rank. Resume with the same "
                "data_parallel_replicate_size x data_parallel_shard_size, use a map-style Dataset (the strategy "
                f"positions its sampler) or a loader whose state_dict() holds a global position "
                f"({ELASTIC_POSITION_KEY!r}, see titan_strategy/checkpoint/dcp.py)."
            )
    return states
