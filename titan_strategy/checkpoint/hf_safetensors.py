"""Hugging Face safetensors directories in and out of a sharded transformers model: each rank reads only the
regions of its own shards, and a save writes every tensor of the model once, wherever pipeline stages put it."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["load_safetensors", "save_safetensors"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The names safetensors gives dtypes in a file's header.
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
                torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_HEADER_ALIGNMENT = 8  # the data starts 8-byte aligned; the header is padded with spaces to get there


def _checkpoint_tensors(model: nn.Module) -> list[tuple[list[str], Tensor]]:
    """Each distinct parameter and persistent buffer of ``model`` with every name it has, in module order (a tied
    weight has several: transformers' ``lm_head.weight`` is ``model.embed_tokens.weight``). Modules set to None
    (a pipeline stage's missing layers) have none."""
    tensors: dict[int, tuple[list[str], Tensor]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        own = list(module._parameters.items()) + [(name, buffer) for name, buffer in module._buffers.items()
                                                  if name not in module._non_persistent_buffers_set]
        for name, tensor in own:
            if tensor is not None:
                tensors.setdefault(id(tensor), ([], tensor))[0].append(f"{prefix}.{name}" if prefix else name)
    return list(tensors.values())


def _files_by_key(directory: Path) -> dict[str, Path]:
    """The file that holds each key of a safetensors directory: its index's ``weight_map``, or ``model.safetensors``.

    Raises:
        FileNotFoundError: the directory has neither.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        return {key: directory / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    single = directory / SINGLE_FILE
    if single.is_file():
        with safe_open(single, "pt") as weights:
            return dict.fromkeys(weights.keys(), single)
    raise FileNotFoundError(f"{directory} holds no safetensors weights: neither {INDEX_FILE} nor {SINGLE_FILE}.")


@dataclass(frozen=True)
class _Load:
    """One tensor of the model and the key in ``file`` that fills it."""

    key: str
    file: Path
    tensor: Tensor


def _plan_load(model: nn.Module, directory: Path) -> list[_Load]:
    """Where each tensor of ``model`` comes from, checked against the files' keys and shapes (headers only).

    Raises:
        ValueError: a tensor is under none of its names in the files, or its shape differs from the file's.
    """
    files = _files_by_key(directory)
    loads, missing = [], []
    for names, tensor in _checkpoint_tensors(model):
        key = next((name for name in names if name in files), None)
        if key is None:
            missing.append(" or ".join(names))
        else:
            loads.append(_Load(key, files[key], tensor))
    if missing:
        raise ValueError(f"{directory} lacks {len(missing)} tensors of the model: {missing}; it holds the weights of "
                         "another model.")
    wrong = []
    for file in sorted({load.file for load in loads}):
        with safe_open(file, "pt") as weights:
            wrong += [f"{load.key}: {shape} in the files, {tuple(load.tensor.shape)} in the model"
                      for load in loads if load.file == file
                      and (shape := tuple(weights.get_slice(load.key).get_shape())) != tuple(load.tensor.shape)]
    if wrong:
        raise ValueError(f"{directory} holds tensors of other shapes than the model's: {wrong}.")
    return loads


def _local_region(key: str, tensor: Tensor) -> tuple[slice, ...]:
    """The region of the whole tensor that this rank holds, as slices.

    ``compute_local_shape_and_global_offset`` gives the region's shape and first corner. That is the rank's data
    for plain shards, even or not, and for the ``_StridedShard`` that FSDP2 over TP gives a dim both shard (TP
    cuts the dim, then FSDP2 cuts this rank's TP piece: one contiguous run); tests/test_hf_safetensors.py checks
    both. A strided shard that no later mesh dim undoes would hold runs scattered through the dim.

    Raises:
        NotImplementedError: a ``_StridedShard`` of another form than FSDP2 over TP gives.
    """
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, size) for size in tensor.shape)
    mesh_sizes, placements = tensor.device_mesh.shape, tensor.placements
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, _StridedShard):
            undone_by = math.prod(mesh_sizes[later] for later in range(mesh_dim + 1, len(placements))
                                  if not isinstance(placements[later], _StridedShard)
                                  and isinstance(placements[later], Shard) and placements[later].dim == placement.dim)
            if undone_by != placement.split_factor:
                raise NotImplementedError(f"{key} is laid out as {placements} on a mesh of {tuple(mesh_sizes)}: a "
                                          "strided shard whose rows are not one run; only FSDP2 over TP's are read.")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def load_safetensors(model: nn.Module, directory: Path) -> None:
    """Fill ``model``'s parameters and persistent buffers from a Hugging Face safetensors directory, reading only
    this rank's region of each, one tensor at a time (no rank builds a whole sharded tensor).

    Names are the model's own (a transformers ``PreTrainedModel``'s match its files). A tied weight is read once,
    under whichever of its names the files hold. A pipeline stage's model, lacking modules, reads what it holds;
    the files' other keys are ignored. Everything is checked before the model is written. No collective: each rank
    may call this on its own.

    Args:
        model: the model to fill; its tensors plain or DTensors (FSDP2, TP or both, even or uneven shards).
        directory: holds ``model.safetensors``, or ``model.safetensors.index.json`` and the files it names.

    Raises:
        FileNotFoundError: ``directory`` holds no safetensors weights.
        ValueError: a tensor of the model is missing from the files, or has another shape there.
        NotImplementedError: a tensor is laid out in a strided shard of another form than FSDP2 over TP gives.
    """
    loads = _plan_load(model, directory)
    regions = [_local_region(load.key, load.tensor) for load in loads]
    with torch.no_grad():
        for load, region in zip(loads, regions):
            target = load.tensor.to_local() if isinstance(load.tensor, DTensor) else load.tensor
            # A slice is a view of the mapped file, and each page it reads counts as this process's memory for as
            # long as the file stays open: one open per tensor keeps that to one region (benchmarks/
            # hf_load_memory.py --layers 2: each of 4 ranks grows by 0.36 of the model; with one open per file, 0.53).
            with safe_open(load.file, "pt") as weights:
                target.copy_(weights.get_slice(load.key)[region])


@dataclass(frozen=True)
class _Entry:
    """A tensor to save: its name, which rank writes it, and its header fields."""

    name: str
    rank: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _to_write(model: nn.Module) -> dict[str, Tensor]:
    """The tensors this rank holds, each under its first name (a tied output projection is written as the
    embedding, as ``save_pretrained`` does).

    Raises:
        TypeError: a tensor of a dtype safetensors has no name for.
    """
    tensors = {names[0]: tensor for names, tensor in _checkpoint_tensors(model)}
    unnamed = [f"{name} ({tensor.dtype})" for name, tensor in tensors.items() if tensor.dtype not in _DTYPE_NAMES]
    if unnamed:
        raise TypeError(f"safetensors stores none of the dtypes of {unnamed}.")
    return tensors


def _entries(tensors: dict[str, Tensor], rank: int, world_size: int) -> list[_Entry]:
    """Every rank's tensors, each once, written by the lowest rank that holds it (pipeline stages hold
    different ones; the data-parallel copies of a stage hold the same)."""
    held = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    every_rank_held = [held]
    if world_size > 1:
        every_rank_held = [[] for _ in range(world_size)]
        dist.all_gather_object(every_rank_held, held)
    entries: dict[str, _Entry] = {}
    for holder, described in enumerate(every_rank_held):
        for name, dtype, shape in described:
            entries.setdefault(name, _Entry(name, holder, dtype, shape))
    return list(entries.values())


def _pack_files(entries: list[_Entry], max_shard_bytes: int) -> dict[str, list[_Entry]]:
    """The files to write and what each holds: each rank's tensors in files of at most ``max_shard_bytes`` of data
    (a larger tensor alone in one), named as ``save_pretrained`` names them."""
    files: list[list[_Entry]] = []
    for entry in entries:  # by rank, each rank's in module order
        last = files[-1] if files else None
        if last is None or last[0].rank != entry.rank or sum(e.nbytes for e in last) + entry.nbytes > max_shard_bytes:
            files.append([entry])
        else:
            last.append(entry)
    if len(files) == 1:
        return {SINGLE_FILE: files[0]}
    return {f"model-{number:05d}-of-{len(files):05d}.safetensors": held for number, held in enumerate(files, 1)}


def _header(entries: list[_Entry]) -> tuple[bytes, dict[str, int]]:
    """A safetensors header for ``entries`` (padded to the data's alignment), and where each tensor's data starts
    after it. Larger items go first: the format allows no padding between tensors, and this keeps each aligned
    to its item size."""
    fields: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offsets, begin = {}, 0
    for entry in sorted(entries, key=lambda entry: -entry.dtype.itemsize):
        fields[entry.name] = {"dtype": _DTYPE_NAMES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [begin, begin + entry.nbytes]}
        offsets[entry.name] = begin
        begin += entry.nbytes
    header = json.dumps(fields, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % _HEADER_ALIGNMENT), offsets


class _FileWriter:
    """Writes safetensors files whose headers are known before their tensors come, each tensor in place as it
    arrives, so a rank holds one whole tensor at a time rather than a file's worth."""

    def __init__(self, files: dict[Path, list[_Entry]]) -> None:
        self._handles: list[BinaryIO] = []
        self._places: dict[str, tuple[BinaryIO, int]] = {}
        for path, entries in files.items():
            handle = path.open("wb")
            self._handles.append(handle)
            header, offsets = _header(entries)
            handle.write(len(header).to_bytes(8, "little") + header)
            self._places.update({name: (handle, handle.tell() + offset) for name, offset in offsets.items()})

    def wants(self, name: str) -> bool:
        return name in self._places

    def write(self, name: str, tensor: Tensor) -> None:
        handle, position = self._places[name]
        handle.seek(position)
        handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    def close(self) -> None:
        """Flush every file to disk: the directory is published only after this."""
        for handle in self._handles:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()


def _write_index(staging: Path, files: dict[str, list[_Entry]]) -> None:
    if list(files) == [SINGLE_FILE]:
        return
    weight_map = {entry.name: name for name, entries in files.items() for entry in entries}
    total_size = sum(entry.nbytes for entries in files.values() for entry in entries)
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_safetensors(model: nn.Module, directory: Path, *, max_shard_bytes: int = 2**31) -> None:
    """Write ``model`` as a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads: its config,
    and its tensors in safetensors files (plus the index when there are several).

    Collective when a process group is up: every rank calls it, and each DTensor is gathered whole on the ranks of
    its mesh, one at a time; the lowest rank holding a tensor writes it, into files of its own, so pipeline stages
    each write theirs and every tensor is written once. Everything goes to a sibling ``.NAME.incomplete``
    directory that rank 0 renames to ``directory`` once all files are on disk: a crash leaves nothing at
    ``directory``.

    Args:
        model: a transformers ``PreTrainedModel`` (its tensors plain or DTensors; a pipeline stage's part).
        directory: where to write; must not exist, or be empty.
        max_shard_bytes: the most tensor data a file holds; a larger tensor gets a file alone.

    Raises:
        FileExistsError: ``directory`` exists and is not an empty directory (checked before any work).
        TypeError: a tensor's dtype has no safetensors name.
    """
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} exists and is not empty; choose a new directory to save the model to.")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    tensors = _to_write(model)
    files = _pack_files(_entries(tensors, rank, world_size), max_shard_bytes)
    staging = directory.with_name(f".{directory.name}.incomplete")
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # a crashed save's
        staging.mkdir(parents=True)
        model.config.save_pretrained(staging)
        _write_index(staging, files)
    _barrier()
    writer = _FileWriter({staging / name: entries for name, entries in files.items()
                          if entries[0].rank == rank})
    try:
        with torch.no_grad():
            for name, tensor in tensors.items():
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                if writer.wants(name):
                    writer.write(name, whole)
    finally:
        writer.close()
    _barrier()
    if rank == 0:
        staging.replace(directory)  # an empty ``directory`` is replaced
    _barrier()
