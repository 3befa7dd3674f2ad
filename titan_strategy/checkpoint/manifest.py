"""The completion marker of a checkpoint: the size and CRC-32 of every file, written last.

A checkpoint directory counts as complete only when ``titan_checkpoint.json`` exists, and rank 0
writes it only after every rank has finished its shards. Loading checks every listed file against
it first, so a truncated or bit-flipped shard fails with its name instead of loading wrong values.
"""

from __future__ import annotations

import json
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist

__all__ = ["MANIFEST_FILE", "CorruptCheckpointError", "checkpoint_bytes", "file_checksums", "is_complete",
           "verify_files", "write_manifest"]

MANIFEST_FILE = "titan_checkpoint.json"
_CHUNK_BYTES = 16 << 20
FileRecords = dict[str, list[int]]  # file name -> [size in bytes, CRC-32]


class CorruptCheckpointError(ValueError):
    """A checkpoint file is missing, truncated or altered since it was written."""


def is_complete(path: Path) -> bool:
    return (path / MANIFEST_FILE).is_file()


def _crc32(file: Path) -> int:
    checksum = 0
    with file.open("rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            checksum = zlib.crc32(chunk, checksum)
    return checksum


def file_checksums(directory: Path, names: list[str], threads: int = 4) -> FileRecords:
    with ThreadPoolExecutor(threads) as pool:  # zlib releases the GIL
        checksums = list(pool.map(_crc32, [directory / name for name in names]))
    return {name: [(directory / name).stat().st_size, checksum] for name, checksum in zip(names, checksums)}


def write_manifest(directory: Path, files: FileRecords, *, world_size: int) -> None:
    """Write the marker (rank 0, once every rank's files are listed), durably, through a temporary name."""
    temporary = directory / (MANIFEST_FILE + ".tmp")
    with temporary.open("w") as stream:
        json.dump({"format": 1, "world_size": world_size, "files": files}, stream, indent=1, sort_keys=True)
        stream.flush()
        os.fsync(stream.fileno())
    os.replace(temporary, directory / MANIFEST_FILE)


def checkpoint_bytes(directory: Path) -> int:
    """What a complete checkpoint's files take, from its manifest."""
    files: FileRecords = json.loads((directory / MANIFEST_FILE).read_text())["files"]
    return sum(size for size, _ in files.values())


def _file_errors(expected: FileRecords, actual: FileRecords) -> list[str]:
    errors = []
    for name, (size, checksum) in expected.items():
        if name not in actual:
            errors.append(f"{name} is missing")
        elif actual[name][0] != size:
            errors.append(f"{name} has {actual[name][0]} bytes, {size} were written")
        elif actual[name][1] != checksum:
            errors.append(f"{name} fails its CRC-32 check")
    return errors


def verify_files(directory: Path, group: dist.ProcessGroup | None = None) -> None:
    """Check every file the marker lists; with ``group``, its ranks share the reading and all raise alike.

    Raises:
        CorruptCheckpointError: naming each bad file.
    """
    files: FileRecords = json.loads((directory / MANIFEST_FILE).read_text())["files"]
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
    mine = {name: files[name] for name in sorted(files)[rank::world]}
    actual = file_checksums(directory, [name for name in mine if (directory / name).is_file()])
    errors = _file_errors(mine, actual)
    if group is not None:
        every_rank: list[list[str]] = [[] for _ in range(world)]
        dist.all_gather_object(every_rank, errors, group=group)
        errors = sorted(error for rank_errors in every_rank for error in rank_errors)
    if errors:
        raise CorruptCheckpointError(
            f"{directory} is damaged: {'; '.join(errors)}. Nothing was loaded. Resume from another checkpoint "
            "(e.g. the previous one that ModelCheckpoint kept), or restore this one from a copy."
        )
