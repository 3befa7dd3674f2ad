"""Shared test settings: a quiet, offline, single-threaded environment, a bounded multi-process launcher,
one cached single-process reference run per spec, and the test tiers (``unit``, ``multiprocess``, ``gpu``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tests.support.run_spec import RunSpec

pytest.register_assert_rewrite("tests.support.parity")  # its asserts explain their failures, as a test file's do

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
FORK_LAUNCH = REPO / "tests" / "support" / "fork_launch.py"
LAUNCH_SERVER = REPO / "tests" / "support" / "launch_server.py"
LAUNCH_TIMEOUT_S = 360  # a hung collective fails the test instead of stalling CI (2 loaded cores are slow)

# Every test has exactly one (pyproject.toml registers them): `pytest -m unit` is the quick tier.
TIERS = ("unit", "multiprocess", "gpu")
# A test parametrized over these runs as a unit test on the CPU and as a gpu test on CUDA (skipped without it).
DEVICES = [pytest.param("cpu", marks=pytest.mark.unit),
           pytest.param("cuda", marks=[pytest.mark.gpu,
                                       pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    wrong = [f"{item.nodeid} has {sorted(tiers) or 'none'}" for item in items
             if len(tiers := {mark.name for mark in item.iter_markers()} & set(TIERS)) != 1]
    if wrong:
        raise pytest.UsageError(f"Every test needs exactly one tier marker of {list(TIERS)} (a module's pytestmark "
                                "or the test's own mark; see tests/conftest.py):\n  " + "\n  ".join(wrong))


def _test_environment(hf_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(hf_home), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(hf_home.parent / "inductor-cache"))
    return env


@pytest.fixture(scope="session")
def test_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return _test_environment(tmp_path_factory.mktemp("hf_home"))


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path_factory.getbasetemp() / "hf_home_inproc"))


_TELLING = ("Error", "error:", "terminate called", "what():", "Abort", "Fatal", "Signal ", "exitcode")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_command(command: list[str], env: dict[str, str], cwd: Path,
                timeout_s: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    return _succeeded(subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s),
                      cwd)


def _succeeded(result: subprocess.CompletedProcess, cwd: Path) -> subprocess.CompletedProcess:
    """``result``, if its command succeeded; else an AssertionError that starts with the lines that tell why."""
    command = result.args
    if result.returncode != 0:
        # The whole output goes to a file; the message starts with the lines that usually say what went
        # wrong (a C++ abort's "what():" sits among thousands of warning lines), then the tails.
        (cwd / "launch.log").write_text(result.stdout + "\n" + result.stderr)
        telling = [line for line in (result.stdout + result.stderr).splitlines()
                   if any(word in line for word in _TELLING)][-40:]
        raise AssertionError(f"{' '.join(command)} failed ({result.returncode}); the lines that tell:\n"
                             + "\n".join(telling) + f"\n--- stdout tail:\n{result.stdout[-3000:]}\n"
                             f"--- stderr tail:\n{result.stderr[-8000:]}")
    return result


@contextmanager
def one_rank_mesh(device_type: str, dim_name: str) -> Iterator[DeviceMesh]:
    """A one-rank process group (gloo on CPU, NCCL on CUDA) and its 1-D mesh in this process: enough to run a
    parallel code path without launching ranks."""
    backend, device_id = ("nccl", torch.device("cuda:0")) if device_type == "cuda" else ("gloo", None)
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore(), device_id=device_id,
                            timeout=timedelta(seconds=60))
    try:
        yield init_device_mesh(device_type, (1,), mesh_dim_names=(dim_name,))
    finally:
        dist.destroy_process_group()


def launch(nproc: int, spec: RunSpec, out_dir: Path, env: dict[str, str],
           timeout_s: float = LAUNCH_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run ``spec`` (its ``devices`` set to ``nproc``) on ``nproc`` forked ranks of tests/support/train_worker.py
    (tests/support/fork_launch.py); return each rank's record."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file = out_dir / "spec.json"
    spec_file.write_text(spec.with_(devices=nproc, stacks_after_s=max(timeout_s - 20, 1)).to_json())
    command = [sys.executable, str(FORK_LAUNCH), str(nproc), str(spec_file), str(out_dir)]
    try:
        if _launch_server is not None and env == _launch_server.env:
            _succeeded(_launch_server.run(command, nproc, spec_file, out_dir, timeout_s), out_dir)
        else:
            run_command(command, env, out_dir, timeout_s)
    except subprocess.TimeoutExpired:
        stacks = "".join(f"\n--- {path.stem}:\n{path.read_text()}" for path in sorted(out_dir.glob("rank*.stacks")))
        raise AssertionError(f"the launch ran past {timeout_s} s; where each rank was:{stacks}") from None
    except AssertionError as failure:
        # Each failed rank's error (the worker writes them), one line each: "rank1: ValueError: ...".
        errors = "".join(f"\n{path.stem}: {path.read_text()}" for path in sorted(out_dir.glob("rank*.error")))
        raise AssertionError(f"{failure}\nRank errors:{errors}") from None
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(nproc)]


class _LaunchServer:
    """tests/support/launch_server.py: the session's launches forked from one process that imported the worker once
    (a fresh interpreter per launch spent about 6 s importing). Started under ``env``, it takes only launches
    with that environment (variables read at import time are its own)."""

    def __init__(self, env: dict[str, str], folder: Path) -> None:
        self.env = env
        self.socket_path = str(folder / "launch.sock")
        with (folder / "launch_server.log").open("w") as log:
            self.process = subprocess.Popen([sys.executable, str(LAUNCH_SERVER), self.socket_path], env=env,
                                            cwd=folder, stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.process.stdout is not None
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests/support/launch_server.py did not start; see {folder / 'launch_server.log'}")

    def run(self, command: list[str], nproc: int, spec_file: Path, out_dir: Path,
            timeout_s: float) -> subprocess.CompletedProcess:
        """What ``subprocess.run(command, ...)`` of tests/support/fork_launch.py would give, without its imports."""
        stdout, stderr = out_dir / "launch.stdout", out_dir / "launch.stderr"
        request = {"nproc": nproc, "spec_file": str(spec_file), "out_dir": str(out_dir), "cwd": str(out_dir),
                   "env": self.env, "stdout": str(stdout), "stderr": str(stderr)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(self.socket_path)
            client.sendall((json.dumps(request) + "\n").encode())
            client.settimeout(timeout_s)
            replies = client.makefile()
            launcher = int(replies.readline())
            try:
                code = int(replies.readline())
            except TimeoutError:
                os.kill(launcher, signal.SIGKILL)  # its ranks die with it
                raise subprocess.TimeoutExpired(command, timeout_s) from None
        return subprocess.CompletedProcess(command, code, stdout.read_text(), stderr.read_text())

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


_launch_server: _LaunchServer | None = None


@pytest.fixture(scope="session", autouse=True)
def _launches_share_one_import(test_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    global _launch_server
    _launch_server = _LaunchServer(test_env, tmp_path_factory.mktemp("launch_server"))
    yield
    _launch_server.stop()
    _launch_server = None


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory,
                  test_env: dict[str, str]) -> Callable[[RunSpec], dict[str, Any]]:
    """``reference_run(spec)``: the record of ``spec`` run in one process, launched once per distinct spec
    (its canonical JSON) in the session, however many tests compare with it. Its loss is the plain one (the
    logits, then the cross-entropy), so every parallel run of the chunked loss is checked against that too."""
    records: dict[str, dict[str, Any]] = {}

    def run(spec: RunSpec) -> dict[str, Any]:
        spec = spec.with_(devices=1, model={"cross_entropy": "logits"})
        key = spec.to_json()
        if key not in records:
            records[key] = launch(1, spec, tmp_path_factory.mktemp("reference"), test_env)[0]
        return records[key]

    return run


@pytest.fixture()
def fixtures_dir() -> Path:
    if not FIXTURES.is_dir():
        pytest.skip(f"shared fixtures not found at {FIXTURES}")
    return FIXTURES


@pytest.fixture
def pretrained(tmp_path: Path) -> Path:
    """A tiny transformers LlamaForCausalLM (``tests.support.user_modules.hf_config``) saved with non-unit norms, so
    any re-initialization shows."""
    import transformers

    from tests.support.user_modules import hf_config

    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(hf_config("llama"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "pretrained")
    return tmp_path / "pretrained"
