"""Rehearse one rank of a multi-GPU run on one device: its real shards, buffers, activations and kernels.

Every collective goes to torch's fake process-group backend, which returns at once and moves no data.
The rank still allocates exactly what it would in the full run (its FSDP shard and gathered units, its
TP slices, its pipeline stages' in-flight microbatches, its optimizer state), and runs the same
parallelize path, AC, compile, float8 and schedule through Lightning's loop. What a rehearsal cannot say:
how long communication takes, and how NCCL behaves. The values it computes are meaningless (collectives
return whatever their buffers held), so losses and gradient norms are not reported.
"""

from __future__ import annotations

import re
import statistics
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from titan_strategy.config.mesh import ParallelDims
from titan_strategy.strategy import TitanStrategy

__all__ = ["LiveStorageBytes", "RankRehearsal", "RehearsalMeter", "RehearsalStrategy", "rank_coordinates",
           "required_gib"]

GIB = 2**30


class _OneRankOfMany(LightningEnvironment):
    """One process that plays rank ``rank`` of ``world_size``; nothing launches the others."""

    def __init__(self, world_size: int, rank: int) -> None:
        super().__init__()
        self._rehearsed = (world_size, rank)

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @override
    def world_size(self) -> int:
        return self._rehearsed[0]

    @override
    def global_rank(self) -> int:
        return self._rehearsed[1]

    @override
    def set_world_size(self, size: int) -> None:
        pass  # fixed at construction: the rehearsed run's, not this process's

    @override
    def set_global_rank(self, rank: int) -> None:
        pass


class RehearsalStrategy(TitanStrategy):
    """``TitanStrategy`` as rank ``rank`` of a ``world_size``-rank run, in this one process (``titan rehearse``).

    Takes every TitanStrategy knob. The default process group is torch's fake backend, so the mesh, FSDP, TP,
    CP and PP are built for the full world; Lightning's own object collectives (broadcast, decisions) answer
    locally, as every rank of an SPMD run would agree with this one.
    """

    def __init__(self, world_size: int, rank: int, **knobs: Any) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not a rank of a {world_size}-rank run; choose 0..{world_size - 1}.")
        # It saves nothing and loads nothing: no checkpoint writer, resume or initial weights.
        knobs |= {"process_group_backend": "fake", "cluster_environment": _OneRankOfMany(world_size, rank),
                  "auto_resume": False, "initial_weights": None, "checkpoint_mode": "sync", "flight_recorder": False}
        super().__init__(**knobs)
        self.rehearsed_world_size = world_size

    @property
    @override
    def parallel_dims(self) -> ParallelDims:
        return self.config.mesh.resolve(self.rehearsed_world_size)

    @override
    def setup_environment(self) -> None:
        if not dist.is_initialized():  # the strategy's own init is a no-op once a default group exists
            from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

            dist.init_process_group("fake", store=FakeStore(), rank=self.global_rank,
                                    world_size=self.rehearsed_world_size)
        super().setup_environment()

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        rank_zero_only.rank = 0  # Lightning's messages are this process's, whichever rank it plays

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision


def rank_coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Where ``rank`` sits on the mesh (pp outermost, tp innermost, as the strategy builds it)."""
    coordinates = {}
    for name in ("tp", "cp", "dp_shard", "dp_replicate", "pp"):
        size = getattr(dims, name)
        coordinates[name], rank = rank % size, rank // size
    return dict(reversed(coordinates.items()))


@dataclass
class RankRehearsal:
    """What one rehearsed rank held and how long it computed.

    ``step_s``: each optimizer step's wall time with every collective a no-op (the first includes compile
    and warm-up). ``peak_*_gib``: over the steps after the first (CUDA allocator statistics; on CPU, every
    live tensor storage counted by torch's MemTracker, and reserved = allocated).
    """

    rank: int
    world_size: int
    coordinates: dict[str, int]
    device: str
    device_memory_gib: float | None
    parameters: int
    peak_allocated_gib: float
    peak_reserved_gib: float
    step_s: list[float] = field(default_factory=list)

    @property
    def compute_s(self) -> float:
        """The median step after the first."""
        return statistics.median(self.step_s[1:] or self.step_s)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"compute_s": self.compute_s}


def local_parameter_count(module: torch.nn.Module) -> int:
    """Elements of the parameters this rank holds (its FSDP shards and TP slices)."""
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())


class LiveStorageBytes(TorchDispatchMode):
    """Bytes held by live tensor storages, and their peak, followed op by op: on CPU the allocator keeps no
    statistics. Storages resized in place (FSDP frees its gathered parameters that way) are followed too.
    (torch's MemTracker, which tests/support/train_worker.py uses on one device, refuses a root module run twice in a
    step, as every pipeline stage is once per microbatch.)"""

    def __init__(self, *held: torch.Tensor) -> None:
        super().__init__()
        self._sizes = WeakIdKeyDictionary()  # storage -> [bytes], shared with its finalizer
        self.current = self.peak = 0
        self._resize = torch.UntypedStorage.resize_
        for tensor in held:
            self._follow(tensor)

    def _follow(self, tensor: torch.Tensor) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        if local.device.type == "meta":
            return
        storage = local.untyped_storage()
        if storage not in self._sizes:
            self._sizes[storage] = size = [0]
            weakref.finalize(storage, self._count, size, 0)
            self._count(size, storage.nbytes())

    def _count(self, size: list[int], nbytes: int) -> None:
        self.current += nbytes - size[0]
        size[0] = nbytes
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._follow, out)
        return out

    def __enter__(self) -> LiveStorageBytes:
        follower = self

        def resize_(storage: torch.UntypedStorage, nbytes: int) -> Any:
            result = follower._resize(storage, nbytes)
            if storage in follower._sizes:
                follower._count(follower._sizes[storage], nbytes)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*exc)


class RehearsalMeter(Callback):
    """Times every training step and takes the peak memory of the steps after the first."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self._started = 0.0
        self._storages: LiveStorageBytes | None = None

    def _sync(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        device = trainer.strategy.root_device
        if len(self.step_s) == 1:  # AdamW's state exists from here on: the steady state's peak
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            else:
                held = [*pl_module.parameters(), *(p.grad for p in pl_module.parameters() if p.grad is not None),
                        *(value for optimizer in trainer.optimizers for state in optimizer.state.values()
                          for value in state.values() if isinstance(value, torch.Tensor))]
                self._storages = LiveStorageBytes(*held).__enter__()
        self._sync(device)
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._sync(trainer.strategy.root_device)
        self.step_s.append(time.perf_counter() - self._started)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._storages is not None:
            self._storages.__exit__(None, None, None)

    def result(self, trainer: pl.Trainer) -> RankRehearsal:
        """What the run measured (a real TitanStrategy run too, to check a rehearsal against)."""
        strategy = trainer.strategy
        assert isinstance(strategy, TitanStrategy)
        device = strategy.root_device
        if device.type == "cuda":
            allocated = torch.cuda.max_memory_allocated(device) / GIB
            reserved = torch.cuda.max_memory_reserved(device) / GIB
            capacity = torch.cuda.get_device_properties(device).total_memory / GIB
            name = torch.cuda.get_device_name(device)
        else:
            allocated = reserved = (self._storages.peak if self._storages is not None else 0) / GIB
            capacity, name = None, "cpu"
        return RankRehearsal(rank=strategy.global_rank, world_size=strategy.world_size,
                             coordinates=rank_coordinates(strategy.parallel_dims, strategy.global_rank), device=name,
                             device_memory_gib=capacity, parameters=local_parameter_count(strategy.lightning_module),
                             peak_allocated_gib=allocated, peak_reserved_gib=reserved, step_s=self.step_s)


def required_gib(error: BaseException, reserved_bytes: int) -> float | None:
    """What a rank that ran out of memory needed at least: what the allocator held (``reserved_bytes``) plus the
    request it refused. None if ``error`` did not come from running out of memory (the pipeline schedule raises
    its own error from the allocator's)."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, torch.OutOfMemoryError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    match = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB)", str(cause))
    requested = float(match.group(1)) / (1024 if match.group(2) == "MiB" else 1) if match else 0.0
    return reserved_bytes / GIB + requested
