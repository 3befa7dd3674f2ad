"""A per-rank thread that dumps the Flight Recorder when a step overruns, when asked, or on a signal.

gloo never dumps by itself and a Python signal handler never runs while the main thread is blocked
inside a collective, so the work happens here, off the main thread:

- **overrun**: a step armed by the callback runs longer than ``timeout_s``: dump, ask every other rank
  to dump too (a key in the job's store, which each watchdog polls), and, if ``exit_on_hang``, end the
  process, because a rank stuck outside any collective would otherwise never time out;
- **request**: another rank set the store key: dump, keep running;
- **signal**: the C-level handler writes the signal number to a wakeup pipe even while the main thread
  is blocked; the thread reads it and dumps.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
import warnings
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["HANG_EXIT_CODE", "Watchdog"]

HANG_EXIT_CODE = 75  # EX_TEMPFAIL: the job may be restarted; the dumps say why it stopped


class Watchdog:
    """Watches the armed step; ``dump(reason)`` is called on this thread, never concurrently."""

    def __init__(self, dump: Callable[[str], None], timeout_s: float, store_key: str,
                 dump_signal: signal.Signals | None, exit_on_hang: bool, poll_s: float = 1.0) -> None:
        self._dump = dump
        self._timeout_s = timeout_s
        self._store_key = store_key
        self._dump_signal = dump_signal
        self._exit_on_hang = exit_on_hang
        self._poll_s = min(poll_s, timeout_s / 4)
        self._armed: tuple[str, float] | None = None  # (what is running, since when)
        self._stop = threading.Event()
        self._answered_request = False
        self._store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self._wakeup_read, self._wakeup_write = os.pipe()
        os.set_blocking(self._wakeup_write, False)
        self._previous_wakeup_fd: int | None = None
        self._previous_handler: object = None
        self._thread = threading.Thread(target=self._run, name="titan-flight-recorder", daemon=True)

    def start(self) -> None:
        """Start watching. Signal handlers can only be installed on the main thread; elsewhere (a Trainer run
        from a worker thread) the watchdog runs without one."""
        if self._dump_signal is not None and threading.current_thread() is not threading.main_thread():
            warnings.warn(f"FlightRecorder: not on the main thread, so {self._dump_signal.name} will not dump "
                          f"(overruns, exceptions and other ranks' requests still do).", stacklevel=2)
            self._dump_signal = None
        if self._dump_signal is not None:
            self._previous_handler = signal.signal(self._dump_signal, lambda *_: None)  # the pipe does the work
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._wakeup_write, warn_on_full_buffer=False)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the thread just as well
            os.write(self._wakeup_write, b"\0")
        self._thread.join(timeout=10)
        if self._dump_signal is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None else -1)
            signal.signal(self._dump_signal, self._previous_handler)  # type: ignore[arg-type]
        os.close(self._wakeup_read)
        os.close(self._wakeup_write)

    def arm(self, what: str) -> None:
        self._armed = (what, time.monotonic())

    def disarm(self) -> None:
        self._armed = None

    def request_all_ranks(self, reason: str) -> None:
        """Ask every rank's watchdog to dump (from any thread); a store that is gone already is fine."""
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(self._store_key, reason)

    def _run(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([self._wakeup_read], [], [], self._poll_s)
            if readable and self._dump_signal is not None and self._dump_signal in os.read(self._wakeup_read, 64):
                self._dump(f"signal {signal.Signals(self._dump_signal).name}")
            if self._stop.is_set():
                return
            armed = self._armed
            if armed is not None and time.monotonic() - armed[1] > self._timeout_s:
                self._on_overrun(f"{armed[0]} exceeded {self._timeout_s:g} s")
            elif not self._answered_request and (request := self._request()) is not None:
                self._answered_request = True
                self._dump(f"requested by {request}")

    def _request(self) -> str | None:
        """Another rank's reason for asking every rank to dump, or None."""
        with contextlib.suppress(Exception):  # the store's host may have exited
            if self._store is not None and self._store.check([self._store_key]):
                return self._store.get(self._store_key).decode()
        return None

    def _on_overrun(self, reason: str) -> None:
        self._armed = None
        self._answered_request = True
        self._dump(reason)
        self.request_all_ranks(f"rank {dist.get_rank() if dist.is_initialized() else 0}: {reason}")
        if self._exit_on_hang:
            print(f"FlightRecorder: {reason}; the trace is dumped, exiting with code {HANG_EXIT_CODE}.", flush=True)
            os._exit(HANG_EXIT_CODE)
