"""FlightRecorder: dump every rank's collective trace when training hangs or fails.

    Trainer(strategy=TitanStrategy(...), callbacks=[FlightRecorder(timeout_s=120)])
    TitanStrategy(flight_recorder=True)               # the same with defaults
    titan-fr analyze flight_recorder                  # <default_root_dir>/flight_recorder: which rank, which op

What it does, in the order of a run:

1. before the first process group exists (TitanStrategy calls ``configure``): FR buffer size, NCCL
   dump-on-timeout into our folder, NCCL async error handling;
2. at setup: start the per-rank watchdog (see ``watchdog.py``), record gloo p2p ops;
3. after the first successful training step: shorten every process group's timeout to ``timeout_s``
   (start-up and compilation are slow, a steady-state step should fail fast) and arm the watchdog for
   each training and validation batch;
4. on an exception, a batch that overruns ``timeout_s``, another rank's request, or ``dump_signal``:
   write ``rank_N.json`` into ``<dump_dir>/<run id>/``. A clean run writes nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from titan_strategy.flight_recorder.dump import GlooP2PLog, configure_environment, python_stack, write_dump
from titan_strategy.flight_recorder.watchdog import Watchdog

__all__ = ["RUN_ID_ENV", "UNSHORTENED_GROUP_DESC", "FlightRecorder", "attach_flight_recorder", "run_id"]

RUN_ID_ENV = "TITAN_RUN_ID"  # set by TitanStrategy's own launcher so every rank names the same folder
UNSHORTENED_GROUP_DESC = "titan_checkpoint"  # background saves legitimately take long: keep their timeout


def run_id() -> str:
    """A name every rank of one job agrees on without talking: the launcher's job id."""
    elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        return elastic
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm-{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return os.environ.get(RUN_ID_ENV, "run")


class FlightRecorder(Callback):
    """Collective traces on hang or crash, for ``titan-fr analyze``.

    Args:
        dump_dir: where run folders go; default ``<trainer.default_root_dir>/flight_recorder``.
        buffer_size: collectives kept per rank (FR's ring buffer).
        timeout_s: steady-state process-group timeout and the longest a training or validation
            batch may run once the first step has succeeded.
        dump_signal: signal name that dumps on demand (``kill -USR2 PID``); None installs no handler.
            Not SIGUSR1, which Lightning uses for SLURM requeueing.
        exit_on_hang: end the process (exit code 75) after a batch overran and the trace is dumped;
            a rank stuck outside any collective would otherwise never stop.
    """

    def __init__(self, dump_dir: str | Path | None = None, buffer_size: int = 20000, timeout_s: float = 300.0,
                 dump_signal: str | None = "SIGUSR2", exit_on_hang: bool = True) -> None:
        if not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"FlightRecorder(buffer_size={buffer_size!r}) must be a positive number of entries.")
        if not timeout_s > 0:
            raise ValueError(f"FlightRecorder(timeout_s={timeout_s!r}) must be a positive number of seconds.")
        if dump_signal is not None and dump_signal not in signal.Signals.__members__:
            raise ValueError(f"FlightRecorder(dump_signal={dump_signal!r}) is not a signal name; use e.g. 'SIGUSR2'.")
        self.buffer_size = buffer_size
        self.timeout_s = float(timeout_s)
        self.exit_on_hang = exit_on_hang
        self._dump_signal = signal.Signals[dump_signal] if dump_signal is not None else None
        self._dump_root = Path(dump_dir) if dump_dir is not None else None
        self.dump_dir: Path | None = None  # the run's folder, known once configured
        self._steady = False
        self._watchdog: Watchdog | None = None
        self._p2p: GlooP2PLog | None = None
        self._metadata: dict[str, Any] = {}
        self._dump_lock = threading.Lock()

    # ---- set-up ---------------------------------------------------------------------------------

    def configure(self, trainer: pl.Trainer) -> None:
        """Point FR at this run's folder; TitanStrategy calls it before creating the process group."""
        root = self._dump_root if self._dump_root is not None else Path(trainer.default_root_dir) / "flight_recorder"
        self.dump_dir = root.resolve() / run_id()
        configure_environment(self.buffer_size, self.dump_dir)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._watchdog is not None:  # already watching (fit, then validate on the same trainer)
            return
        if self.dump_dir is None:
            rank_zero_warn("FlightRecorder was set up after the process group existed (not under TitanStrategy): "
                           "FR's buffer size and NCCL's dump-on-timeout come from the environment as it was.")
            self.configure(trainer)
        self._metadata = {"world_size": trainer.world_size, "run_id": run_id(), "coordinates": _coordinates(pl_module)}
        assert self.dump_dir is not None
        if dist.is_initialized() and dist.get_backend() == "gloo":
            self._p2p = GlooP2PLog(capacity=min(self.buffer_size, 4096))
            self._p2p.install()
        elif dist.is_initialized():  # NCCL writes its own timeout dumps there and does not create the folder
            self.dump_dir.mkdir(parents=True, exist_ok=True)
        self._watchdog = Watchdog(self.dump, self.timeout_s, store_key=f"titan_flight_recorder/{run_id()}/dump",
                                  dump_signal=self._dump_signal, exit_on_hang=self.exit_on_hang)
        self._watchdog.start()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._p2p is not None:
            self._p2p.uninstall()
            self._p2p = None
        # A clean run leaves nothing behind, not even the folders made for NCCL (a user's dump_dir stays).
        # Another rank may remove the same empty folder first: losing that race is fine.
        assert self.dump_dir is not None
        for folder in (self.dump_dir, self.dump_dir.parent) if self._dump_root is None else (self.dump_dir,):
            with contextlib.suppress(OSError):
                folder.rmdir()

    # ---- dumping --------------------------------------------------------------------------------

    def dump(self, reason: str, stack: list[str] | None = None) -> Path:
        """Write this rank's trace now (any thread); ``stack`` defaults to the main thread's."""
        assert self.dump_dir is not None, "FlightRecorder.dump before setup"
        with self._dump_lock:
            path = write_dump(self.dump_dir, reason, self._metadata, self._p2p, stack)
        print(f"FlightRecorder: {reason}; trace dumped to {path}", flush=True)
        return path

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._watchdog is None or isinstance(exception, SystemExit):  # e.g. a preempted run that saved and left
            return
        reason = f"{type(exception).__name__}: {str(exception).splitlines()[0] if str(exception) else ''}"
        self.dump(reason, python_stack(exception.__traceback__))
        self._watchdog.request_all_ranks(f"rank {trainer.global_rank}: {reason}")

    # ---- steps ----------------------------------------------------------------------------------

    def _arm(self, what: str) -> None:
        if self._steady and self._watchdog is not None:
            self._watchdog.arm(what)

    def _disarm(self) -> None:
        if self._watchdog is not None:
            self._watchdog.disarm()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._arm(f"training batch {batch_idx} (after step {trainer.global_step})")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._disarm()
        if not self._steady:
            self._steady = True
            _shorten_timeouts(timedelta(seconds=self.timeout_s))

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        self._arm(f"validation batch {batch_idx} (after step {trainer.global_step})")

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._disarm()


def _shorten_timeouts(timeout: timedelta) -> None:
    """Every process group of this rank fails after ``timeout`` from now on, except the checkpoint group."""
    for group in list(c10d._world.pg_map):
        if getattr(group, "group_desc", "") != UNSHORTENED_GROUP_DESC:
            c10d._set_pg_timeout(timeout, group)


def _coordinates(pl_module: pl.LightningModule) -> dict[str, int]:
    """This rank's place on the mesh's parallel dims (``{"pp": 0, "tp": 1}``; size-1 dims left out), if any."""
    mesh = getattr(pl_module, "_device_mesh", None)
    if mesh is None or mesh.mesh_dim_names is None or mesh.get_coordinate() is None:
        return {}
    return {dim: index for dim, size, index in zip(mesh.mesh_dim_names, mesh.shape, mesh.get_coordinate(), strict=True)
            if size > 1}


def attach_flight_recorder(trainer: pl.Trainer, enabled: bool) -> FlightRecorder | None:
    """The trainer's FlightRecorder; with ``enabled`` and none among the callbacks, a default one is added."""
    for callback in trainer.callbacks:
        if isinstance(callback, FlightRecorder):
            return callback
    if not enabled:
        return None
    recorder = FlightRecorder()
    trainer.callbacks.append(recorder)
    return recorder
