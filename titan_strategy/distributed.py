"""The process groups of a TitanStrategy run: the default group, the mesh over it, and the checkpoint group."""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)

from titan_strategy.callbacks.flight_recorder import UNSHORTENED_GROUP_DESC
from titan_strategy.config.distributed import DistributedConfig
from titan_strategy.config.mesh import ParallelDims
from titan_strategy.mesh import TitanMesh, build_mesh

__all__ = ["ProcessGroups", "build_process_groups", "init_default_group", "is_rehearsal", "outside_simulated_ranks",
           "per_simulated_rank", "simulating_ranks"]

Fn = TypeVar("Fn", bound=Callable)

try:  # torch's local tensors, which simulate every rank in one process; a torch without them simulates nothing
    from torch.distributed import _local_tensor
except ImportError:
    _local_tensor = None


@dataclass(frozen=True)
class ProcessGroups:
    """What a run communicates over: the named mesh, a gloo group that only checkpoints use, so that background
    saves never interleave with the training loop's collectives, and a gloo group for the loop's own small
    agreements on the host (whether any rank got SIGTERM), which must not interleave with either."""

    mesh: TitanMesh
    checkpoint: dist.ProcessGroup
    host_control: dist.ProcessGroup


def is_rehearsal() -> bool:
    """Whether this process rehearses one rank of a larger run (``titan rehearse``): its default group is torch's
    fake backend, whose collectives move no data."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def per_simulated_rank(function: Fn) -> Fn:
    """``function`` (rank-dependent, no side effects, no collectives) runs once per rank when one process simulates
    every rank (``titan_strategy.simulated_ranks``); otherwise it is called as it is."""
    return function if _local_tensor is None else _local_tensor.maybe_run_for_local_tensor(function)


def simulating_ranks() -> bool:
    """Whether this process simulates every rank with local tensors (``titan_strategy.simulated_ranks``)."""
    return _local_tensor is not None and _local_tensor.enabled_local_tensor_mode() is not None


def outside_simulated_ranks() -> AbstractContextManager:
    """Plain tensors again while one process simulates every rank: for work every rank does identically
    (building a full tensor to slice shards from, reading data)."""
    mode = _local_tensor.local_tensor_mode() if _local_tensor is not None else None
    return mode.disable() if mode is not None else nullcontext()


def init_default_group(cluster_environment: ClusterEnvironment, device: torch.device,
                       config: DistributedConfig) -> None:
    """The default process group over every rank (a no-op where it exists already)."""
    backend = config.backend or _get_default_process_group_backend_for_device(device)
    device_id = device if device.type != "cpu" else None
    store = {"store": store} if (store := _store_of_this_attempt(config.timeout)) is not None else {}
    _init_dist_connection(cluster_environment, backend, timeout=config.timeout, device_id=device_id, **store)
    # Every group goes while the interpreter is whole. Lightning does this for NCCL only; a gloo group left to the
    # interpreter's own teardown aborts the process now and then ("terminate called without an active exception",
    # pytorch/pytorch#190489): 12 of 160 four-rank gloo processes on torch 2.13, none of 160 that destroyed theirs.
    atexit.unregister(_destroy_dist_connection)  # once, however many runs this process makes
    atexit.register(_destroy_dist_connection)


def _store_of_this_attempt(timeout: timedelta) -> dist.Store | None:
    """Under torchrun, workers meet in the agent's store, and a restarted attempt meets in the same one: it would
    read the dead attempt's keys (gloo's peer addresses) and time out connecting to them. Each attempt gets its own
    prefix; None outside torchrun."""
    if dist.is_initialized() or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"titan/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def build_process_groups(dims: ParallelDims, device: torch.device, config: DistributedConfig) -> ProcessGroups:
    """The mesh and the two host groups, over the default group (every rank calls this, in the same order)."""
    mesh = build_mesh(dims, device.type)
    # A rehearsal's fake default group has no peers for gloo to meet: its checkpoint group is fake too.
    backend = None if is_rehearsal() else "gloo"
    checkpoint = dist.new_group(backend=backend, timeout=config.timeout, group_desc=UNSHORTENED_GROUP_DESC)
    host_control = dist.new_group(backend=backend, timeout=config.timeout, group_desc="host_control")
    return ProcessGroups(mesh=mesh, checkpoint=checkpoint, host_control=host_control)
