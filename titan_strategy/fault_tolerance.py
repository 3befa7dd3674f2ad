"""Training on through a dead replica group, with no restart: HSDP's replicate dimension run as torchft replica groups.

With ``fault_tolerance="torchft"``, each of the ``data_parallel_replicate_size`` replicas is a job of its own
(its own launcher, processes and process groups: FSDP, TP and CP stay inside it). The groups meet through a
torchft lighthouse. Every optimizer step:

1. the group asks the lighthouse for the step's quorum (which groups are alive), through torchft's ``Manager``;
2. it trains its share of the step's batch: every group's loader yields the same rows (the batch of one
   in-group data rank for all groups together), and participant ``p`` of ``n`` trains rows ``p::n``. When a
   group is gone the survivors cover its rows: the global batch stays the same samples, none skipped or
   repeated, and the loss stays the mean over all of them (token counts are summed across groups);
3. FSDP's reduce-scattered gradients are summed across the participating groups (an all-reduce hook);
4. the optimizer steps only if every group's collectives succeeded (``should_commit``); otherwise the same batch
   is trained again under a new quorum, inside the same Lightning step (the step count, the learning-rate
   schedule and the data position never see the failed attempt).

A group that (re)joins asks for a quorum once during ``setup``, before Lightning's loop starts. If it is behind,
torchft fetches the live peer's state: each rank the same in-group rank's parameter and optimizer shards, and the
loop, learning-rate schedule, callbacks and data position as they were when that step began. Lightning then
restores those as from a checkpoint, and the group trains the peer's current step with it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map
from typing_extensions import override

from titan_strategy.config.fault_tolerance import LIGHTHOUSE_ENV, FaultToleranceConfig
from titan_strategy.run_state import RunState
from titan_strategy.shards import local

if TYPE_CHECKING:
    from titan_strategy.checkpoint.dcp import LoadedCheckpoint
    from titan_strategy.runtime import ParallelRuntime

__all__ = ["ReplicaGroups", "check_lighthouse_answers"]

# Consecutive uncommitted attempts of one step before the run fails: one for the failure itself, one more for a
# quorum that formed while a dead group's heartbeat had not yet timed out.
MAX_UNCOMMITTED_ATTEMPTS = 3
_LIGHTHOUSE_PROBE_S = 5.0
_MANAGER_KEY = "titan_torchft_manager"


def check_lighthouse_answers(address: str) -> None:
    """Fail fast, naming the fix, when nothing listens at the lighthouse's address (torchft would wait for it)."""
    url = urlparse(address if "://" in address else f"http://{address}")
    try:
        with socket.create_connection((url.hostname, url.port or 80), timeout=_LIGHTHOUSE_PROBE_S):
            pass
    except OSError as error:
        raise ConnectionError(f"No torchft lighthouse answers at {address} ({error}). Start one there with "
                              f"`torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 --bind [::]:{url.port}`, "
                              f"or point torchft_lighthouse / {LIGHTHOUSE_ENV} at the one that runs.") from None


class ReplicaGroups(RunState):
    """This job's side of torchft: the quorum and commit of every step, the gradient all-reduce across groups, the
    batch share, and the state a rejoining group receives.

    Args:
        config: the knobs (validated).
        replicas: ``data_parallel_replicate_size``, the number of groups the run was planned with.
        device: this rank's device (its torchft process group is NCCL on CUDA, gloo otherwise).
        timeout: how long a collective, a quorum or a state transfer may take.
        add_strategy_state: adds what the strategy keeps in a checkpoint dict (the data position) to the state a
            rejoining group receives.
    """

    def __init__(self, config: FaultToleranceConfig, replicas: int, device: torch.device, timeout: timedelta,
                 add_strategy_state: Callable[[dict[str, Any]], None]) -> None:
        # torchft's Rust side logs 9 INFO lines per step and group; warnings and errors still show (a user's own
        # RUST_LOG wins). Read when torchft is first imported, which is here.
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.group = config.group_id(replicas)
        lighthouse = config.lighthouse_address()
        check_lighthouse_answers(lighthouse)
        process_group = (ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=timeout)
        self._replicas = replicas
        self._add_strategy_state = add_strategy_state
        self._trainer: pl.Trainer | None = None
        self._step_start: dict[str, Any] | None = None  # the Lightning state after the last step (``_StepBoundary``)
        self._received: dict[str, Any] | None = None
        self._quorum_started = False
        self.manager = Manager(
            pg=process_group, load_state_dict=self._receive, state_dict=self._send,
            min_replica_size=config.min_replica_groups,
            use_async_quorum=False,  # the batch share depends on the quorum: it must be known before the forward
            init_sync=False,  # initialization is a function of (seed, name): every group starts with equal weights
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, lighthouse_addr=lighthouse,
            replica_id=f"titan_replica_group_{self.group}", max_retries=MAX_UNCOMMITTED_ATTEMPTS - 1,
            rank=dist.get_rank(), world_size=dist.get_world_size())

    # ---- set-up ---------------------------------------------------------------------------------

    @override
    def start_fit(self, trainer: pl.Trainer) -> None:
        """Hook the parallelized model and its runtime in (after ``parallelize``); refuse what cannot run."""
        runtime: ParallelRuntime | None = trainer.strategy.runtime
        module = trainer.lightning_module
        if runtime is None:
            raise ValueError("fault_tolerance='torchft' needs a module that declares a parallel_plan(): the strategy "
                             "adds the all-reduce across replica groups to the FSDP units it applies.")
        if not module.automatic_optimization or trainer.accumulate_grad_batches != 1:
            raise ValueError("fault_tolerance='torchft' commits each optimizer step as one quorum: it needs automatic "
                             f"optimization and accumulate_grad_batches=1 (got {trainer.accumulate_grad_batches}); "
                             "use a larger batch instead of accumulation.")
        if trainer.ckpt_path is not None:
            raise ValueError(f"fault_tolerance='torchft' with fit(ckpt_path={trainer.ckpt_path!r}): Lightning loads it "
                             "after the group has joined the live ones and taken their state, and would undo that. "
                             "Use TitanStrategy(auto_resume=True), which loads the newest checkpoint of the "
                             "ModelCheckpoint folder before the group joins.")
        units = [unit for unit in trainer.strategy.model.modules() if isinstance(unit, FSDPModule)]
        if not units:
            raise ValueError("fault_tolerance='torchft' sums gradients across replica groups in FSDP2's all-reduce "
                             "hook, and this model has no FSDP unit.")
        weighting = runtime.token_weighting
        weighting.across_replicas = self._sum_across_groups

        def reduce_gradient(gradient: Tensor) -> None:
            # A module that hands over its token sums (token_mean) gets gradients normalized by every group's token
            # count: they add up. A plain mean's gradients are averaged over the step's groups instead.
            operation = dist.ReduceOp.SUM if weighting.in_use else dist.ReduceOp.AVG
            self.manager.allreduce(gradient, reduce_op=operation).wait()

        for unit in units:
            unit.set_all_reduce_hook(reduce_gradient)
        runtime.replicas = self  # the steps share the batch and commit through this group
        self._trainer = trainer
        if not any(isinstance(callback, _StepBoundary) for callback in trainer.callbacks):
            trainer.callbacks.append(_StepBoundary(self, self._add_strategy_state))

    @override
    def resume_point(self) -> dict[str, Any] | None:
        """Join the first quorum; the Lightning state of a live peer this group was behind, if any."""
        """Join the groups before Lightning's loop starts. Returns the Lightning checkpoint dict of a live peer when
        this group was behind and took the peer's state (parameters and optimizer are already in place)."""
        # What a group behind this one would take now: the checkpoint this group resumed from, if any (its
        # parameters and optimizer state are loaded already; Lightning restores the rest after this set-up).
        self._step_start = self._trainer._checkpoint_connector._loaded_checkpoint or None
        started = time.monotonic()
        self.manager.start_quorum()
        self._quorum_started = True  # the first step trains under this quorum
        received, self._received = self._received, None
        participants = self.manager.num_participants()
        if received is not None:
            rank_zero_info(f"torchft: replica group {self.group} rejoined {participants - 1} live group(s) at step "
                           f"{received['global_step']} with a peer's state ({time.monotonic() - started:.1f} s).")
        else:
            rank_zero_info(f"torchft: replica group {self.group} of {self._replicas} joined a quorum of "
                           f"{participants} group(s) at step {self.manager.current_step()}.")
        return received

    # ---- every step -----------------------------------------------------------------------------

    def share(self, batch: Any) -> Any:
        """This group's rows of the batch every group loaded: participant ``p`` of ``n`` trains rows ``p::n``."""
        rank, participants = self.manager.participating_rank(), self.manager.num_participants()
        if rank is None:
            raise RuntimeError("torchft: this replica group is not a participant of the step's quorum.")
        rows = _rows(batch)
        if rows is not None and rows < participants:
            raise ValueError(f"torchft: the batch has {rows} rows for {participants} replica groups; give every "
                             f"in-group data rank at least {self._replicas} rows (data_parallel_replicate_size).")
        return tree_map(lambda value: value[rank::participants] if _is_batch_tensor(value, rows) else value, batch)

    def committed(self, closure: Callable[[], Any], zero_grad: Callable[[], None]) -> Callable[[], Any]:
        """``closure`` (forward and backward of the step's batch) under a quorum, retried until the groups commit."""

        def run() -> Any:
            while True:
                if self._quorum_started:
                    self._quorum_started = False
                else:
                    self.manager.start_quorum()
                started = time.monotonic()
                output = closure()
                if self.manager.should_commit():  # raises after MAX_UNCOMMITTED_ATTEMPTS
                    return output
                rank_zero_warn(f"torchft: step {self.manager.current_step() + 1} did not commit in every replica "
                               f"group ({self.manager.errored() or 'a group left'}); training it again under a new "
                               f"quorum ({time.monotonic() - started:.1f} s lost).")
                zero_grad()

        return run

    @override
    def save(self, checkpoint: dict[str, Any]) -> None:
        """torchft's step count goes into every checkpoint: a group resumed from one is then behind or level with
        the live groups by the steps it really lacks, and takes their state when behind."""
        checkpoint[_MANAGER_KEY] = self.manager.state_dict()

    @override
    def load(self, checkpoint: dict[str, Any], sharded: LoadedCheckpoint | None) -> None:
        if _MANAGER_KEY in checkpoint:
            self.manager.load_state_dict(checkpoint[_MANAGER_KEY])

    @override
    def teardown(self) -> None:
        self.manager.shutdown(wait=False)

    # ---- across groups --------------------------------------------------------------------------

    def _sum_across_groups(self, tensor: Tensor) -> None:
        self.manager.allreduce(tensor, reduce_op=dist.ReduceOp.SUM).wait()

    def _send(self) -> dict[str, Any]:
        # torchft's quorum thread, while the loop's thread waits for the quorum before this step's forward: the
        # parameters and optimizer state are those after the previous step, and stay so until this step commits.
        # A group level with this one takes nothing (torchft heals only one that is behind).
        trainer = self._trainer
        assert trainer is not None and self._step_start is not None, "a group behind a fresh one cannot exist"
        return {"model": {name: local(value) for name, value in trainer.lightning_module.state_dict().items()},
                "optimizers": [tree_map(local, optimizer.state_dict()) for optimizer in trainer.strategy.optimizers],
                "lightning": self._step_start}

    def _receive(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
        assert trainer is not None
        module = trainer.lightning_module
        with torch.no_grad():
            for name, value in module.state_dict().items():
                local(value).copy_(state["model"][name])
        for optimizer, optimizer_state in zip(trainer.strategy.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(_as_parameter_shards(optimizer, optimizer_state))
        self._received = state["lightning"]


class _StepBoundary(Callback):
    """Keeps the Lightning state after each step, where ModelCheckpoint would save it, for a group that joins while
    the next step's quorum forms: a checkpoint dict without the model and optimizers (this group sends its own
    shards of those)."""

    def __init__(self, replicas: ReplicaGroups, add_strategy_state: Callable[[dict[str, Any]], None]) -> None:
        self._replicas = replicas
        self._add_strategy_state = add_strategy_state

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._replicas._step_start = self._lightning_state(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._replicas._step_start = self._lightning_state(trainer)

    def _lightning_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        state = {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                 "pytorch-lightning_version": pl.__version__,
                 "loops": trainer._checkpoint_connector._get_loops_state_dict(),
                 "callbacks": call._call_callbacks_state_dict(trainer),
                 "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs]}
        if trainer.datamodule is not None:
            state[type(trainer.datamodule).__qualname__] = trainer.datamodule.state_dict()
        self._add_strategy_state(state)
        return state


def _as_parameter_shards(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """A peer's optimizer state (local tensors) with each parameter-shaped tensor a DTensor like its parameter."""
    parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]

    def like(parameter: Tensor, value: Any) -> Any:
        if isinstance(parameter, DTensor) and isinstance(value, Tensor) and value.shape == parameter.to_local().shape:
            return DTensor.from_local(value, parameter.device_mesh, parameter.placements, run_check=False,
                                      shape=parameter.shape, stride=parameter.stride())
        return value

    per_parameter = {index: {key: like(parameters[index], value) for key, value in entry.items()}
                     for index, entry in state["state"].items()}
    return {**state, "state": per_parameter}


def _rows(batch: Any) -> int | None:
    leaves = [value for value in _tensors(batch) if value.dim() > 0]
    return leaves[0].shape[0] if leaves else None


def _tensors(batch: Any) -> list[Tensor]:
    found: list[Tensor] = []
    tree_map(lambda value: found.append(value) if isinstance(value, Tensor) else None, batch)
    return found


def _is_batch_tensor(value: Any, rows: int | None) -> bool:
    return isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == rows
