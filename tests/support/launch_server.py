"""One process per test session that imports the training worker once and starts every launch from a fork.

    python tests/support/launch_server.py SOCKET_PATH

tests/support/fork_launch.py shares one import among a launch's ranks, but each launch still starts a fresh
interpreter, and importing torch and Lightning takes about 6 s of one core on CI's 2 cores: over a hundred
launches made that a third of the suite. Here the import happens once: for each request (one JSON line on
the Unix socket: nproc, spec file, output folder, working folder, the files for stdout and stderr), the
server forks a launcher that takes the request's environment, runs ``fork_launch.launch_ranks`` and exits
with its code. The server answers with the launcher's pid at once (a caller that times out kills it, and its
ranks die with it), then with its exit code when it ends. The server dies with the process that started it.

Environment variables read at import time are the server's own, so tests/conftest.py sends only launches
whose environment is the one the server started with.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import traceback
from pathlib import Path

from fork_launch import die_with_parent, launch_ranks  # imports the training worker, once

_POLL_S = 0.05  # how often finished launchers are reaped


def _launcher(request: dict) -> int:
    """In the forked launcher: become the process the request describes, then launch."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    return launch_ranks(request["nproc"], Path(request["spec_file"]), Path(request["out_dir"]))


def _start(request: dict, server_sockets: list[socket.socket]) -> int:
    """Fork the launcher of ``request``; return its pid. The launcher closes its copies of the server's sockets."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    for server_socket in server_sockets:
        server_socket.close()
    die_with_parent()
    code = 1
    try:
        code = _launcher(request)
    except BaseException:  # noqa: BLE001 - reported as a fresh process would, on its stderr
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(socket_path: str) -> None:
    """Launches may overlap (a test runs two replica groups at once): one thread accepts requests and reaps
    launchers in turn, so nothing but this thread exists when it forks."""
    die_with_parent()
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(socket_path)
    listening.listen(8)
    listening.settimeout(_POLL_S)
    print("ready", flush=True)
    running: dict[int, socket.socket] = {}  # launcher pid -> the connection waiting for its exit code
    while True:
        try:
            connection, _ = listening.accept()
        except TimeoutError:
            pass
        else:
            connection.settimeout(None)
            pid = _start(json.loads(connection.makefile().readline()), [listening, connection, *running.values()])
            connection.sendall(f"{pid}\n".encode())
            running[pid] = connection
        while running and (ended := os.waitpid(-1, os.WNOHANG))[0]:
            pid, status = ended
            with running.pop(pid) as connection, contextlib.suppress(OSError):  # a caller that timed out is gone
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    serve(sys.argv[1])
