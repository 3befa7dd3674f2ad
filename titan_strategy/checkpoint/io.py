"""Writing checkpoints: synchronously, or staged and written in the background, never half-published.

``DistributedCheckpointIO`` is the Lightning ``CheckpointIO`` that TitanStrategy saves through.

* ``sync``: ``dcp.save`` in the training loop; it blocks for the whole write.
* ``async``: the state is copied to host memory in the loop, then written by a background thread.
* ``async_pinned`` (CUDA): the copy goes to reused pinned, shared host memory on a side stream,
  and a background process writes it. The loop blocks only until the copy has finished, and waits
  for that just before the optimizer next changes the parameters (``wait_for_staging``).

Every mode writes into ``NAME.partial``. Once all ranks are done, rank 0 adds the manifest (the
completion marker) and renames the directory to ``NAME``, so a checkpoint name always means a
complete checkpoint; Lightning's ``ckpt_path="last"`` and ``ModelCheckpoint`` therefore never see a
partial one. At most one save is in flight (a new one first waits for the last), removals that
``ModelCheckpoint`` asks for wait until the newer checkpoint is published, and ``flush`` (called
on train end, teardown and exceptions) finishes whatever is pending.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from threading import Lock
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from typing_extensions import override

from titan_strategy.checkpoint.dcp import LIGHTNING_STATE_FILE, RankPlace, split_checkpoint, to_bytes
from titan_strategy.checkpoint.manifest import file_checksums, write_manifest
from titan_strategy.checkpoint.rng import capture_rng_states
from titan_strategy.checkpoint.weights import read_hyper_parameters, read_model_weights

__all__ = ["CHECKPOINT_MODES", "DistributedCheckpointIO", "SaveTiming", "partial_path"]

CHECKPOINT_MODES = ("sync", "async", "async_pinned")
_WRITER_THREADS = 4  # files written (and checksummed) in parallel per rank: one thread leaves disks idle


@dataclass
class SaveTiming:
    """One save as this rank saw it: time the training loop was held, and time until it was published."""

    path: str
    blocking_s: float
    total_s: float | None = None


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

    def __init__(self, mode: str = "sync") -> None:
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint_mode={mode!r} must be one of {list(CHECKPOINT_MODES)}.")
        self.mode = mode
        self.timings: list[SaveTiming] = []
        self._group: dist.ProcessGroup | None = None
        self._place = RankPlace(0, 1, 0, 1)
        self._device = torch.device("cpu")
        self._finisher: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._staging: Future | None = None
        self._removals: list[Path] = []
        self._removals_lock = Lock()

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
        dist.barrier(group=self._group)
        state = split_checkpoint(checkpoint, self._place, capture_rng_states(self._device))
        lightning_state = to_bytes(checkpoint) if self._place.rank == 0 else None
        writer = dcp.FileSystemWriter(partial, thread_count=_WRITER_THREADS)
        timing = SaveTiming(str(final), blocking_s=0.0)
        self.timings.append(timing)
        if self.mode == "sync":
            dcp.save(state, storage_writer=writer, process_group=self._group)
            self._finish(None, partial, final, lightning_state, timing, started)
            timing.blocking_s = time.perf_counter() - started
            return
        if self._finisher is None:
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-checkpoint")
        options = self._async_options()
        response = dcp.async_save(state, storage_writer=writer, process_group=self._group, **options)
        upload = getattr(response, "upload_completion", response)
        self._staging = getattr(response, "staging_completion", None)
        self._pending = self._finisher.submit(self._finish, upload, partial, final, lightning_state, timing, started,
                                              options.get("async_stager"))
        timing.blocking_s = time.perf_counter() - started

    def _async_options(self) -> dict[str, Any]:
        if self.mode == "async":  # DCP's default staging: a blocking copy into host memory
            return {"async_checkpointer_type": AsyncCheckpointerType.THREAD}
        # One stager per save: torch 2.11 clears a stager's copy tables once its save is done, so a reused
        # one fails on the next save.
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=True,
                                              use_async_staging=True, use_non_blocking_copy=True))
        return {"async_checkpointer_type": AsyncCheckpointerType.PROCESS, "async_stager": stager}

    def _finish(self, upload: Future | None, partial: Path, final: Path, lightning_state: bytes | None,
                timing: SaveTiming, started: float, stager: DefaultStager | None = None) -> None:
        """After this rank's shards are written: list them for rank 0, which marks and publishes."""
        if upload is not None:
            try:
                upload.result()
            finally:
                if stager is not None:
                    stager.close()
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
            write_manifest(partial, {name: record for ranks in every_rank for name, record in ranks.items()},
                           world_size=self._place.world_size)
            _publish(partial, final)
            self._run_removals()
        dist.barrier(group=self._group)  # when flush returns on any rank, the checkpoint is published
        timing.total_s = time.perf_counter() - started

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
                pending.result()
            except Exception as error:
                raise RuntimeError(f"Saving the checkpoint {self.timings[-1].path} failed on rank {self._place.rank}; "
                                   "it was not published and earlier checkpoints are intact.") from error
        self._run_removals()

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
            if self._finisher is not None:
                self._finisher.shutdown(wait=True)
                self._finisher = None

    def flush_after_exception(self) -> None:
        """Finish a pending save while an exception unwinds the run; report a failure instead of raising."""
        try:
            self.flush()
        except RuntimeError as error:
            rank_zero_warn(f"{error} ({error.__cause__!r})")
