"""Writing checkpoints: synchronously, or staged and written in the background, never half-published.

``DistributedCheckpointIO`` is the Lightning ``CheckpointIO`` that TitanStrategy saves through.

* ``sync``: ``dcp.save`` in the training loop; it blocks for the whole write.
* ``async``: the state is copied to host memory in the loop, then written by a background thread.
* ``async_pinned`` (CUDA): the copy goes to pinned, shared host memory on a side stream while the
  loop goes on, and DCP's background process writes it (no GIL shared with the loop). The loop
  waits for the copy only just before the optimizer next changes the parameters
  (``wait_for_staging``).

Both async modes copy into one host buffer allocated at the first save and reused after. Allocating
it is slow (the first async_pinned save of the 1B benchmark held training for about a minute), but
it happens once per run, not at every save.

Every mode writes into ``NAME.partial``. Once all ranks are done, rank 0 adds the manifest (the
completion marker) and renames the directory to ``NAME``, so a checkpoint name always means a
complete checkpoint; Lightning's ``ckpt_path="last"`` and ``ModelCheckpoint`` therefore never see a
partial one. At most one save is in flight (a new one first waits for the last), removals that
``ModelCheckpoint`` asks for wait until the newer checkpoint is published, and ``flush`` (called
on train end, teardown and exceptions) finishes whatever is pending.
"""

from __future__ import annotations

import errno
import shutil
import time
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from threading import Lock
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from typing_extensions import override

from titan_strategy.checkpoint.dcp import (
    LIGHTNING_STATE_FILE,
    RankPlace,
    newest_complete_checkpoint,
    split_checkpoint,
    to_bytes,
)
from titan_strategy.checkpoint.manifest import checkpoint_bytes, file_checksums, write_manifest
from titan_strategy.checkpoint.rng import capture_rng_states
from titan_strategy.checkpoint.weights import check_weights_source, read_hyper_parameters, read_model_weights
from titan_strategy.checkpoint.writer_process import start_quiet_writer
from titan_strategy.config.checkpoint import CheckpointConfig, CheckpointMode
from titan_strategy.knobs import check_choice

__all__ = ["CheckpointDiskFullError", "DistributedCheckpointIO", "SaveTiming",
           "checked_checkpoint_io", "checkpoint_io_for", "partial_path"]

_WRITER_THREADS = 4  # files written (and checksummed) in parallel per rank: one thread leaves disks idle


@dataclass
class SaveTiming:
    """One save as this rank saw it: time the training loop was held, and time until it was published."""

    path: str
    blocking_s: float
    total_s: float | None = None
    step: int | None = None

    def summary(self, size_bytes: int) -> str:
        """The one line a save prints when it is published."""
        return (f"Checkpoint of step {self.step} published: {Path(self.path).name}, {size_bytes / 2**30:.2f} GiB, "
                f"{self.total_s:.1f} s until published, the training loop held {self.blocking_s:.1f} s.")


class _AlreadyStaged(AsyncStager):
    """Tells ``dcp.async_save`` that the state dict is in host memory already (our reused buffer)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class CheckpointDiskFullError(OSError):
    """A save that the disk cannot hold: before it started (checked against the last save's size) or while writing."""


_FIX = ("Free space there, keep fewer checkpoints (ModelCheckpoint(save_top_k=...)) or save elsewhere "
        "(ModelCheckpoint(dirpath=...)).")


def _ran_out_of_space(error: BaseException) -> bool:
    """Whether ``error`` comes from a full disk: torch's DCP wraps each rank's failure in a CheckpointException."""
    seen: list[BaseException | None] = [error]
    while seen:
        cause = seen.pop()
        if cause is None:
            continue
        if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
            return True
        if isinstance(cause, CheckpointException):
            seen += [failure for failure, _ in cause.failures.values()]
        seen += [cause.__cause__, cause.__context__]
    return False


def _existing_folder(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _tensor_layout(obj: Any, prefix: str = "") -> list[tuple]:
    """Every entry's path, with shape and dtype for tensors: the host buffer fits a state dict of the same layout."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, tuple(obj.shape), obj.dtype)]
    if isinstance(obj, dict):
        return [entry for key in sorted(obj, key=str) for entry in _tensor_layout(obj[key], f"{prefix}.{key}")]
    if isinstance(obj, (list, tuple)):
        return [entry for index, value in enumerate(obj) for entry in _tensor_layout(value, f"{prefix}.{index}")]
    return [(prefix,)]


def partial_path(path: Path) -> Path:
    """Where a checkpoint is written before it is complete."""
    return path.with_name(path.name + ".partial")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _publish(partial: Path, final: Path) -> None:
    """Put a complete checkpoint under its name, replacing an older one of that name (e.g. last.ckpt)."""
    if final.exists() or final.is_symlink():
        previous = final.with_name(final.name + ".previous")
        _remove(previous)
        final.rename(previous)
        partial.rename(final)
        _remove(previous)
    else:
        partial.rename(final)


class DistributedCheckpointIO(CheckpointIO):
    """Sharded checkpoints through ``torch.distributed.checkpoint``, in one of ``CHECKPOINT_MODES``.

    The strategy calls ``setup`` once its process groups exist. ``timings`` records each save.
    """

    def __init__(self, mode: CheckpointMode = "sync") -> None:
        check_choice("checkpoint_mode", mode, CheckpointMode)
        self.mode = mode
        self.timings: list[SaveTiming] = []
        self._group: dist.ProcessGroup | None = None
        self._place = RankPlace(0, 1, 0, 1)
        self._device = torch.device("cpu")
        self._finisher: ThreadPoolExecutor | None = None
        self._stager_thread: ThreadPoolExecutor | None = None
        self._host_copy: dict[str, Any] | None = None
        self._host_layout: list[tuple] = []
        self._copy_stream: torch.cuda.Stream | None = None
        self._pending: Future | None = None
        self._staging: Future | None = None
        self._removals: list[Path] = []
        self._removals_lock = Lock()
        self._last_save_bytes: int | None = None  # rank 0's: the last published checkpoint's files

    def check_device(self, device: torch.device) -> None:
        if self.mode == "async_pinned" and device.type != "cuda":
            raise ValueError(f"checkpoint_mode='async_pinned' stages into pinned memory from CUDA, not from "
                             f"{device.type!r}; use checkpoint_mode='async' (or 'sync').")

    def setup(self, group: dist.ProcessGroup, place: RankPlace, device: torch.device) -> None:
        """``group``: a gloo group of every rank, used for nothing else."""
        self._group, self._place, self._device = group, place, device

    # ---- saving -----------------------------------------------------------------------------------

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Every rank calls this with Lightning's checkpoint dict (model/optimizer states already sharded)."""
        if storage_options is not None:
            raise TypeError("DistributedCheckpointIO.save_checkpoint takes no storage_options: it writes DCP files.")
        if self._group is None:
            raise RuntimeError("DistributedCheckpointIO saves only inside a TitanStrategy run (setup was not called).")
        started = time.perf_counter()
        self.flush()  # at most one save in flight
        final = Path(path)
        partial = partial_path(final)
        if self._place.rank == 0:
            _remove(partial)  # left by a save that died
        # Every rank, before staging (a full disk fails now, not after the writes); its broadcast also keeps the
        # others from writing before rank 0 has removed the old partial folder.
        self._check_free_space(final)
        state = split_checkpoint(checkpoint, self._place, capture_rng_states(self._device))
        lightning_state = to_bytes(checkpoint) if self._place.rank == 0 else None
        writer = dcp.FileSystemWriter(partial, thread_count=_WRITER_THREADS)
        timing = SaveTiming(str(final), blocking_s=0.0, step=checkpoint.get("global_step"))
        self.timings.append(timing)
        if self.mode == "sync":
            with self._naming_a_full_disk(final):
                dcp.save(state, storage_writer=writer, process_group=self._group)
            self._finish(partial, final, lightning_state, timing, started)
            return
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-checkpoint")
        if self.mode == "async_pinned":
            staged = self._stage_on_side_stream(state)
            self._staging = staged
        else:
            staged = Future()
            staged.set_result(self._stage(state, non_blocking=False))
        self._pending = self._finisher.submit(self._upload_and_finish, staged, writer, partial, final, lightning_state,
                                              timing, started)
        timing.blocking_s = time.perf_counter() - started

    def _stage(self, state: dict[str, Any], non_blocking: bool) -> dict[str, Any]:
        """Copy ``state``'s tensors into the reused host buffer; non-tensor values (lr, RNG blobs) go as they are."""
        layout = _tensor_layout(state)
        if self._host_copy is None or layout != self._host_layout:  # first save, or e.g. another optimizer
            pinned = self.mode == "async_pinned"  # shared too: the writer process reads it without a copy
            self._host_copy = _create_cpu_state_dict(state, pin_memory=pinned, share_memory=pinned)
            self._host_layout = layout
        return _copy_state_dict(state, self._host_copy, non_blocking=non_blocking)

    def _stage_on_side_stream(self, state: dict[str, Any]) -> Future:
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self._device)
            self._stager_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-staging")
        assert self._stager_thread is not None
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))  # the parameters' last updates come first

        def copy() -> dict[str, Any]:
            with torch.cuda.stream(stream):
                staged = self._stage(state, non_blocking=True)
            stream.synchronize()
            return staged

        return self._stager_thread.submit(copy)

    def _upload_and_finish(self, staged: Future, writer: dcp.FileSystemWriter, partial: Path, final: Path,
                           lightning_state: bytes | None, timing: SaveTiming, started: float) -> None:
        host_state = staged.result()
        if self.mode == "async":
            dcp.save(host_state, storage_writer=writer, process_group=self._group)
        else:
            start_quiet_writer(self._group)
            dcp.async_save(host_state, storage_writer=writer, process_group=self._group, async_stager=_AlreadyStaged(),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        self._finish(partial, final, lightning_state, timing, started)

    def _finish(self, partial: Path, final: Path, lightning_state: bytes | None, timing: SaveTiming,
                started: float) -> None:
        """After this rank's shards are written: list them for rank 0, which marks and publishes."""
        rank = self._place.rank
        names = sorted(file.name for file in partial.glob(f"__{rank}_*.distcp"))
        if rank == 0:
            assert lightning_state is not None
            (partial / LIGHTNING_STATE_FILE).write_bytes(lightning_state)
            names += [".metadata", LIGHTNING_STATE_FILE]
        records = file_checksums(partial, names)
        every_rank: list[Any] | None = [None] * self._place.world_size if rank == 0 else None
        dist.gather_object(records, every_rank, dst=0, group=self._group)
        if rank == 0:
            assert every_rank is not None
            files = {name: record for ranks in every_rank for name, record in ranks.items()}
            write_manifest(partial, files, world_size=self._place.world_size)
            _publish(partial, final)
            self._last_save_bytes = sum(size for size, _ in files.values())
            self._run_removals()
        dist.barrier(group=self._group)  # when flush returns on any rank, the checkpoint is published
        timing.total_s = time.perf_counter() - started
        if self.mode == "sync":
            timing.blocking_s = timing.total_s
        if rank == 0:
            assert self._last_save_bytes is not None
            rank_zero_info(timing.summary(self._last_save_bytes))

    def wait_for_staging(self) -> None:
        """Block until the state of an ``async_pinned`` save is copied off the parameters (before they change)."""
        if self._staging is not None:
            started = time.perf_counter()
            self._staging.result()
            self._staging = None
            self.timings[-1].blocking_s += time.perf_counter() - started

    def flush(self) -> None:
        """Finish the save in flight, if any; raise if it failed."""
        pending, self._pending = self._pending, None
        self._staging = None
        if pending is not None:
            try:
                with self._naming_a_full_disk(Path(self.timings[-1].path)):
                    pending.result()
            except CheckpointDiskFullError:
                raise
            except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
                raise RuntimeError(f"Saving the checkpoint {self.timings[-1].path} failed on rank {self._place.rank}; "
                                   "it was not published and earlier checkpoints are intact.") from error
        self._run_removals()

    def _check_free_space(self, final: Path) -> None:
        """Rank 0 compares the free space where ``final`` goes with the last checkpoint's size (this run's, or the
        newest complete one beside it); every rank raises if it does not fit, before anything is written."""
        verdict: list[str | None] = [None]
        if self._place.rank == 0:
            needed = self._last_save_bytes
            if needed is None and (newest := newest_complete_checkpoint([final.parent])) is not None:
                needed = checkpoint_bytes(Path(newest))
            folder = _existing_folder(final.parent)
            free = shutil.disk_usage(folder).free
            if needed is not None and free < needed:
                verdict = [f"Not saving {final}: {folder} has {free:,} bytes free and the last checkpoint took "
                           f"{needed:,}. Nothing was written and earlier checkpoints are intact. {_FIX}"]
        dist.broadcast_object_list(verdict, src=0, group=self._group)
        if verdict[0] is not None:
            raise CheckpointDiskFullError(errno.ENOSPC, verdict[0])

    @contextmanager
    def _naming_a_full_disk(self, final: Path) -> Generator[None, None, None]:
        """A write that ran out of space raises with the folder and the numbers, not torch's bare errno 28."""
        try:
            yield
        except (Exception, CheckpointException) as error:
            if not _ran_out_of_space(error):
                raise
            folder = _existing_folder(final.parent)
            needed = f"{self._last_save_bytes:,}" if self._last_save_bytes is not None else "unknown (a first save)"
            raise CheckpointDiskFullError(
                errno.ENOSPC, f"Saving {final} failed on rank {self._place.rank}: the disk holding {folder} is full "
                f"({shutil.disk_usage(folder).free:,} bytes free; the last checkpoint took {needed} bytes). It was not "
                f"published and earlier checkpoints are intact; what was written is in {partial_path(final).name}, "
                f"removed by the next save. {_FIX}") from error

    # ---- removing and loading ---------------------------------------------------------------------

    @override
    def remove_checkpoint(self, path: Any) -> None:
        """Called on rank 0. While a save is in flight, the removal waits until it has been published."""
        with self._removals_lock:
            self._removals.append(Path(path))
            deferred = self._pending is not None and not self._pending.done()
        if not deferred:
            self._run_removals()

    def _run_removals(self) -> None:
        with self._removals_lock:
            removals, self._removals = self._removals, []
        for path in removals:
            _remove(path)

    @override
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """Read a checkpoint in one process: hyper-parameters and whole model tensors (``state_dict``).

        TitanStrategy itself loads sharded, in place (``dcp.load_checkpoint``); this serves tools.
        """
        return {"hyper_parameters": read_hyper_parameters(Path(path)), "state_dict": read_model_weights(Path(path))}

    @override
    def teardown(self) -> None:
        try:
            self.flush()
        finally:
            for pool in (self._finisher, self._stager_thread):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._finisher = self._stager_thread = self._copy_stream = None
            self._host_copy = None

    def flush_after_exception(self) -> None:
        """Finish a pending save while an exception unwinds the run; report a failure instead of raising."""
        try:
            self.flush()
        except RuntimeError as error:
            rank_zero_warn(f"{error} ({error.__cause__!r})")


def checked_checkpoint_io(io: CheckpointIO | None) -> DistributedCheckpointIO:
    """``io``, where it is one TitanStrategy can write through (a checkpoint-IO plugin given to the Trainer)."""
    if not isinstance(io, DistributedCheckpointIO):
        raise ValueError(f"TitanStrategy writes sharded checkpoints through DistributedCheckpointIO, not "
                         f"{type(io).__name__}; remove that plugin and choose TitanStrategy(checkpoint_mode=...).")
    return io


def checkpoint_io_for(config: CheckpointConfig, io: CheckpointIO | None) -> DistributedCheckpointIO:
    """The checkpoint IO of ``TitanStrategy``'s checkpoint knobs and its ``checkpoint_io``: ``io`` if given (its
    mode must agree), else a new one of ``checkpoint_mode``. A weights source that is not there fails here."""
    if config.initial_weights_path is not None:
        check_weights_source(config.initial_weights_path)
    mode = config.mode
    if io is None:
        return DistributedCheckpointIO(mode)
    if checked_checkpoint_io(io).mode != mode:
        raise ValueError(f"checkpoint_mode={mode!r} contradicts checkpoint_io (mode {io.mode!r}); pass one of them.")
    return io
