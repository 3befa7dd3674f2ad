"""What a Flight Recorder dump holds, how it is written, and how dumps are read back.

torch's Flight Recorder (FR) keeps a ring buffer of every collective each process group issued. On
NCCL it records point-to-point ops too and dumps by itself on a timeout; on gloo it records
collectives only, never dumps by itself, leaves ``pg_config`` empty and captures no Python frames.
This module fills those gaps so that one analyzer reads both:

- ``configure_environment`` sets FR's variables before the first process group exists;
- ``GlooP2PLog`` records gloo sends/receives in FR's own entry schema;
- ``write_dump`` writes ``rank_N.json``: torch's trace with ``pg_config`` filled in, the gloo p2p
  entries added, and our metadata (reason, step, mesh coordinates, the main thread's Python stack);
- ``read_dumps`` reads those files and NCCL's own pickled dumps (``nccl_trace_rank_N``), the latter
  through an unpickler that only builds plain containers.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import json
import os
import pickle
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["NCCL_DUMP_PREFIX", "GlooP2PLog", "RankDump", "configure_environment", "dump_dirs", "main_thread_stack",
           "process_groups", "python_stack", "read_dumps", "write_dump"]

NCCL_DUMP_PREFIX = "nccl_trace_rank_"  # torch appends the global rank
_OUR_DUMP = "rank_{rank}.json"


def _set_env(name: str, value: str, also_fine: tuple[str, ...] = ()) -> None:
    """Set one FR/NCCL variable; a value the user set differently wins, with a warning naming both."""
    current = os.environ.get(name)
    if current in also_fine:
        return
    if current is not None and current != value:
        warnings.warn(f"FlightRecorder keeps {name}={current!r} from the environment (it would set {value!r}).",
                      stacklevel=3)
        return
    os.environ[name] = value


def configure_environment(buffer_size: int, dump_dir: Path) -> None:
    """FR settings torch reads when a process group is created, so this must run before the first one."""
    _set_env("TORCH_FR_BUFFER_SIZE", str(buffer_size))
    # NCCL: dump every rank's buffer when a collective times out (ranks signal each other through the
    # store), to files in our folder, then abort the process instead of hanging on a broken communicator.
    _set_env("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    _set_env("TORCH_FR_DUMP_TEMP_FILE", str(dump_dir / NCCL_DUMP_PREFIX))
    # torchrun sets 1 (abort, then tear down); 3 (abort, skip the clean-up) ends as surely. 0 would hang.
    _set_env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3", also_fine=("1", "2"))


def process_groups() -> dict[str, dict[str, Any]]:
    """Every process group this rank belongs to: FR's ``pg_config`` (name -> desc and global ranks)."""
    table = {}
    for group, name in c10d._world.pg_names.items():
        desc = getattr(group, "group_desc", "") or ""
        table[name] = {"name": name, "desc": desc, "ranks": json.dumps(dist.get_process_group_ranks(group))}
    return table


class _RecordedWork:
    """A gloo p2p Work that marks its FR-style entry completed when someone waits on it."""

    def __init__(self, work: dist.Work, entry: dict[str, Any]) -> None:
        self._work = work
        self._entry = entry

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        self._entry.update(state="completed", retired=True, time_discovered_completed_ns=time.time_ns())
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class GlooP2PLog:
    """Records ``isend``/``irecv`` on gloo groups (FR does not), in FR's entry schema, bounded.

    It wraps the two functions in ``torch.distributed`` while installed; pipeline schedules build
    their ``P2POp`` lists at each step from those names, so they pick the wrapped ones up.
    """

    def __init__(self, capacity: int) -> None:
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._seq: dict[str, int] = collections.defaultdict(int)
        self._ids = itertools.count()
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        for op in ("isend", "irecv"):
            original = getattr(c10d, op)
            self._originals[op] = original
            wrapped = self._wrap(op, original)
            # P2POp checks its op against distributed_c10d's names, schedules compare with dist's: patch both.
            setattr(c10d, op, wrapped)
            setattr(dist, op, wrapped)

    def uninstall(self) -> None:
        for op, original in self._originals.items():
            setattr(c10d, op, original)
            setattr(dist, op, original)
        self._originals.clear()

    def _wrap(self, op: str, original: Any) -> Any:
        signature = inspect.signature(original)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            work = original(*args, **kwargs)
            call = signature.bind(*args, **kwargs).arguments
            group = call.get("group") or c10d._get_default_group()
            if work is None or dist.get_backend(group) != "gloo":
                return work
            return _RecordedWork(work, self._record(op, call["tensor"], group, call))

        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        return recorded

    def _record(self, op: str, tensor: torch.Tensor, group: dist.ProcessGroup, call: dict[str, Any]) -> dict:
        # Group-local ranks in the title, as NCCL writes them ("send 0->1"): from group_dst/group_src, or
        # from the global dst/src.
        local, global_ = ("group_dst", "dst") if op == "isend" else ("group_src", "src")
        peer = call[local] if call.get(local) is not None else dist.get_group_rank(group, call[global_])
        name = c10d._world.pg_names[group]
        me = dist.get_rank(group)
        src, dst = (me, peer) if op == "isend" else (peer, me)
        with self._lock:
            self._seq[name] += 1
            entry = {"record_id": next(self._ids), "pg_id": name,
                     "process_group": [name, getattr(group, "group_desc", "") or ""],
                     "collective_seq_id": 0, "p2p_seq_id": self._seq[name], "op_id": self._seq[name],
                     "profiling_name": f"gloo:{op[1:]} {src}->{dst}", "time_created_ns": time.time_ns(),
                     "input_sizes": [list(tensor.shape)], "input_dtypes": [str(tensor.dtype)],
                     "output_sizes": [list(tensor.shape)], "output_dtypes": [str(tensor.dtype)],
                     "state": "started", "retired": False, "is_p2p": True,
                     "time_discovered_started_ns": time.time_ns(), "time_discovered_completed_ns": 0}
            self.entries.append(entry)
        return entry


def python_stack(frame: FrameType | TracebackType | None) -> list[str]:
    """``file:line in function`` lines, innermost last, from a frame or an exception's traceback."""
    if frame is None:
        return []
    summary = traceback.extract_tb(frame) if isinstance(frame, TracebackType) else traceback.extract_stack(frame)
    return [f"{entry.filename}:{entry.lineno} in {entry.name}" for entry in summary]


def main_thread_stack() -> list[str]:
    return python_stack(sys._current_frames().get(threading.main_thread().ident))


def _recorded_trace() -> dict[str, Any]:
    """torch's recorded entries of every backend, as one JSON trace."""
    c10d_ext = torch._C._distributed_c10d
    trace = json.loads(c10d_ext._dump_fr_trace_json())
    # torch 2.11 keeps NCCL's entries in a recorder of their own (2.13 has one for all backends).
    nccl_dump = getattr(c10d_ext, "_dump_nccl_trace_json", None)
    if nccl_dump is not None and dist.is_nccl_available():
        nccl = json.loads(nccl_dump())
        merged = [*trace.get("entries", []), *nccl.get("entries", [])]
        trace["entries"] = sorted(merged, key=lambda entry: entry.get("time_created_ns", 0))
        trace["pg_config"] = {**(nccl.get("pg_config") or {}), **(trace.get("pg_config") or {})}
    return trace


def write_dump(dump_dir: Path, reason: str, metadata: dict[str, Any], p2p: GlooP2PLog | None,
               stack: list[str] | None = None) -> Path:
    """Write this rank's trace to ``dump_dir/rank_N.json`` (via a temporary name, so readers never see half)."""
    trace = _recorded_trace()
    known = trace.get("pg_config") or {}
    trace["pg_config"] = {**{k: v for k, v in known.items() if k}, **process_groups()}
    if p2p is not None:
        trace["entries"] = [*trace.get("entries", []), *list(p2p.entries)]
    rank = dist.get_rank() if dist.is_initialized() else 0
    trace["titan"] = {**metadata, "rank": rank, "reason": reason, "time_ns": time.time_ns(),
                      "python_stack": main_thread_stack() if stack is None else stack}
    dump_dir.mkdir(parents=True, exist_ok=True)
    path = dump_dir / _OUR_DUMP.format(rank=rank)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(trace))
    os.replace(partial, path)
    return path


@dataclass
class RankDump:
    """One rank's dump, whichever backend wrote it."""

    rank: int
    entries: list[dict[str, Any]]
    pg_config: dict[str, dict[str, Any]]
    pg_status: dict[str, dict[str, Any]] = field(default_factory=dict)
    titan: dict[str, Any] = field(default_factory=dict)
    source: str = ""


class _PlainUnpickler(pickle.Unpickler):
    """FR's pickles hold dicts, lists, strings and numbers only; anything else is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a Flight Recorder dump")


def _from_trace(rank: int, trace: dict[str, Any], source: str) -> RankDump:
    return RankDump(rank=rank, entries=list(trace.get("entries") or []), pg_config=dict(trace.get("pg_config") or {}),
                    pg_status=dict(trace.get("pg_status") or {}), titan=dict(trace.get("titan") or {}), source=source)


def read_dumps(dump_dir: Path) -> dict[int, RankDump]:
    """Every rank's dump in ``dump_dir``; a rank with both ours and NCCL's keeps ours (it has more)."""
    dumps: dict[int, RankDump] = {}
    for path in sorted(dump_dir.glob(f"{NCCL_DUMP_PREFIX}*")):
        rank = path.name.removeprefix(NCCL_DUMP_PREFIX)
        if rank.isdigit():
            with path.open("rb") as file:
                dumps[int(rank)] = _from_trace(int(rank), _PlainUnpickler(file).load(), path.name)
    for path in sorted(dump_dir.glob("rank_*.json")):
        trace = json.loads(path.read_text())
        rank = int(trace["titan"]["rank"])
        dumps[rank] = _from_trace(rank, trace, path.name)
    return dumps


def dump_dirs(root: Path) -> Iterable[Path]:
    """Every folder at or under ``root``, at any depth, that holds dumps (one per run), oldest first: a run folder
    (``default_root_dir``) keeps them in ``flight_recorder/<run-id>/``."""
    def has_dumps(folder: Path) -> bool:
        return any(folder.glob("rank_*.json")) or any(folder.glob(f"{NCCL_DUMP_PREFIX}*"))

    folders = [root, *(folder for folder in root.rglob("*") if folder.is_dir())]
    return sorted((folder for folder in folders if has_dumps(folder)), key=lambda folder: folder.stat().st_mtime)
