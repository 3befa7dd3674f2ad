"""Run tests/support/train_worker.py on N ranks, forked from one process that imported it once.

    python tests/support/fork_launch.py NPROC SPEC.json OUT_DIR

torchrun starts every rank as a fresh interpreter, and on CI's 2 cores each spends about 12 s
importing torch, Lightning and the strategy: most of a small test's time, and 16 x that in the 4-D
test. Forked ranks share one import. Each rank gets the environment torchrun would give it, so
Lightning sees a TorchElastic launch and starts no processes of its own. As under torchrun, the first
rank to fail stops the others, and a rank never outlives the launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import NoReturn

import train_worker  # the heavy imports, once, before any fork

# How long the other ranks get to leave after one failed (a rank stuck in a collective never would).
STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """This process is killed when its parent dies (Linux; elsewhere a timed-out test's ranks end at their
    process-group timeout)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "prctl"):
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _run_rank(rank: int, world_size: int, port: int, spec_file: Path, out_dir: Path) -> NoReturn:
    die_with_parent()  # a test's timeout kills only the launcher, which must not leave ranks behind
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_RUN_ID=f"fork-launch-{os.getppid()}")  # one id per job
    code = 0
    try:
        train_worker.run(spec_file, out_dir)
    except SystemExit as exited:  # a run that chose its exit code (a preempted one exits 143)
        code = exited.code if isinstance(exited.code, int) else 1
    except BaseException:  # noqa: BLE001 - every failure must become an exit code, as in a fresh process
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit handlers or finalizers of the parent's state


def _stop(pids: dict[int, int]) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.pop(pid, None)
        else:
            time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    pids.clear()


def launch_ranks(world_size: int, spec_file: Path, out_dir: Path) -> int:
    """Fork the ranks, wait for them, and return the job's exit code (1 if a rank failed)."""
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank, world_size, port, spec_file, out_dir)
        pids[pid] = rank
    failed = []
    while pids:
        pid, status = os.wait()
        rank, code = pids.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0:
            failed.append(f"rank {rank} (exitcode {code})")
            _stop(pids)
    if failed:
        print(f"fork_launch: {', '.join(failed)} failed; the other ranks were stopped", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(launch_ranks(int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])))
