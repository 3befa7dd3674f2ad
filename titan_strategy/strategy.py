"""TitanStrategy: Lightning lifecycle glue. Knobs, meshes, parallelization, per-step work and checkpoints live
elsewhere (``config``, ``distributed``, ``parallelize``, ``runtime``, ``precision``, ``checkpoint``)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from typing_extensions import override

from titan_strategy.callbacks.flight_recorder import attach_flight_recorder
from titan_strategy.callbacks.model_summary import with_training_flops
from titan_strategy.callbacks.weight_averaging import shard_weight_averages
from titan_strategy.checkpoint import DistributedCheckpointIO, RankPlace, load_model_weights, optimizer_state_dict
from titan_strategy.checkpoint import load_checkpoint as load_dcp_checkpoint
from titan_strategy.checkpoint.callback_tensors import shard_callback_tensors, whole_callback_tensors
from titan_strategy.checkpoint.io import CheckpointMode, checked_checkpoint_io, checkpoint_io_for
from titan_strategy.checkpoint.resume import resume_from_newest
from titan_strategy.checkpoint.rng import ResumedRngStates
from titan_strategy.checkpoint.single_file import full_model_state, full_optimizer_state, load_single_file
from titan_strategy.collectives import all_reduce, barrier, broadcast_object
from titan_strategy.config import PLUGIN_ARGUMENTS, TitanConfig
from titan_strategy.distributed import ProcessGroups, build_process_groups, init_default_group
from titan_strategy.fault_tolerance import FaultTolerance, ReplicaGroups
from titan_strategy.launcher import ModuleCheckingLauncher
from titan_strategy.master_weights import MasterWeights
from titan_strategy.mesh import ParallelDims, TitanMesh
from titan_strategy.parallelize import parallelize
from titan_strategy.parallelize.activation_checkpoint import ACMode
from titan_strategy.parallelize.compile import apply_compile_loss
from titan_strategy.parallelize.context_parallel import RotateMethod
from titan_strategy.parallelize.cuda_graph import graphed_call
from titan_strategy.parallelize.float8 import Float8Recipe
from titan_strategy.parallelize.fsdp import ReshardPolicy, no_gradient_sync
from titan_strategy.parallelize.materialize import materialize_with_own_initializers
from titan_strategy.parallelize.plain import check_gradients_are_synchronized, is_self_parallelized, plain_plan
from titan_strategy.pipeline.layout import PipelineConfig, ScheduleName
from titan_strategy.pipeline.runner import LossFn
from titan_strategy.plan import ParallelPlan, PlannedModule
from titan_strategy.precision import TitanPrecision, configure_precision, drop_lightnings_amp_line, to_titan_precision
from titan_strategy.preemption import watch_for_preemption
from titan_strategy.runtime import ParallelRuntime, Stage
from titan_strategy.sampler import TrainingPosition
from titan_strategy.step_metrics import log_step_metric

__all__ = ["TitanStrategy"]

_NOT_KNOBS = ("self", "__class__", *PLUGIN_ARGUMENTS)
_STEP_METHODS = {"train": "training_step", "val": "validation_step", "test": "test_step"}
_STEP_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
                  "test_step": "test_step_context", "predict_step": "predict_step_context"}


class TitanStrategy(ParallelStrategy):
    """Train a LightningModule under FSDP2/HSDP on a named 5-D DeviceMesh ``(pp, dp_replicate, dp_shard, cp, tp)``.

    A module that declares a ``parallel_plan()`` is parallelized by the strategy from it; one that parallelizes
    itself in ``configure_model`` (ModelParallelStrategy style) is left alone; any other is sharded with FSDP2/HSDP
    over its repeated blocks (``parallelize.plain``). All see the mesh as ``self.device_mesh``. How ``"bf16-mixed"``
    runs is ``precision.configure_precision``'s choice.

    Args:
        data_parallel_replicate_size: HSDP replicas (parameters replicated across them).
        data_parallel_shard_size: FSDP shard degree; -1 takes what the other degrees leave of the world.
        tensor_parallel_size: tensor-parallel degree.
        context_parallel_size: context-parallel degree: each rank holds 1/cp of every sequence (ring attention).
        context_parallel_rotate_method: how key/value shards go round the CP ring: "allgather" or "alltoall".
        pipeline_parallel_size: pipeline stages.
        pipeline_schedule: one of ``PIPELINE_SCHEDULES``.
        pipeline_microbatches: microbatches per Lightning batch under PP (None: one per stage).
        pipeline_stages_per_rank: virtual stages per pipeline rank (None: 1 for GPipe/1F1B, else 2).
        pipeline_layers_per_stage: blocks per stage (first and last stages may take fewer); None splits evenly.
        pipeline_split_points: explicit split, the block indices where stages 1, 2, ... begin.
        fsdp_reshard_after_forward: "default" (reshard all but the last unit), "always" or "never".
        sequence_parallel: under TP, shard norms and residuals on the sequence dim (less memory).
        loss_parallel: under TP, keep logits sharded on the vocabulary and compute the loss that way.
        async_tensor_parallel: overlap TP communication with matmuls (AsyncTP); CUDA and compile only.
        compile: ``torch.compile`` each repeated block of the model.
        compile_loss: ``torch.compile`` the module's ``compute_loss(output, target)`` (no fp32 logits in memory).
        cuda_graphs: replay the model's training forward and backward as CUDA graphs once warm (one device,
            FSDP2 or HSDP).
        activation_checkpointing: what backward recomputes instead of keeping: "none"; "full" (each block keeps
            its input); "selective_op" (keeps attention and every other matmul output); "selective_layer"
            (every ``activation_checkpointing_every``-th block is fully checkpointed).
        activation_checkpointing_every: the k of "selective_layer".
        float8: torchao float8 linear layers, "none", "tensorwise" or "rowwise" (CUDA capability >= 8.9 only).
        process_group_backend: "gloo", "nccl", ...; None picks by device.
        timeout_seconds: process-group timeout; a collective that waits longer fails instead of hanging.
        flight_recorder: add a ``FlightRecorder`` callback with its defaults (collective traces on a hang or a
            crash, for ``titan-fr analyze``) unless the trainer has one; pass the callback to change its settings.
        initial_weights: a checkpoint whose model weights replace the initialization (a TitanStrategy checkpoint
            of any layout, or a ``titan-hf import`` weights checkpoint); optimizer and loop state start fresh. A
            ``ckpt_path`` given to ``fit`` still takes precedence.
        checkpoint_mode: how checkpoints are written: "sync"; "async" (host copy in the loop, background thread);
            "async_pinned" (CUDA: pinned copy on a side stream, background process).
        auto_resume: ``fit`` without a ``ckpt_path`` resumes from the newest complete ``ModelCheckpoint`` save.
        save_distributed_checkpoint: True: sharded DCP folders; False: one whole ``.ckpt`` file that any Lightning
            Trainer loads. ``ckpt_path`` takes either form (and a file from any other strategy).
        save_on_sigterm: on SIGTERM (preemption) every rank saves the current step into the ``ModelCheckpoint``
            folder, waits until it is published and exits with 143, for the launcher to restart the job.
        fault_tolerance: "torchft" runs each of the ``data_parallel_replicate_size`` replicas as a torchft replica
            group, a job of its own that trains on when another dies and takes a live peer's state when it rejoins
            (``titan_strategy.fault_tolerance``); "none" (default).
        torchft_lighthouse: the torchft lighthouse's address ("http://host:29510"); None reads TORCHFT_LIGHTHOUSE.
        replica_group_id: this job's replica group (0 .. data_parallel_replicate_size - 1); None reads
            TITAN_REPLICA_GROUP_ID.
        min_replica_groups: replica groups that must be alive for a step to commit.
    """

    strategy_name = "titan"
    num_nodes = 1  # the Trainer sets its own where the attribute exists

    def __init__(  # about one line per feature; the docstring above documents each knob
        self,
        data_parallel_replicate_size: int = 1, data_parallel_shard_size: int = -1, tensor_parallel_size: int = 1,
        context_parallel_size: int = 1, context_parallel_rotate_method: RotateMethod = "allgather",
        pipeline_parallel_size: int = 1, pipeline_schedule: ScheduleName = "1F1B",
        pipeline_microbatches: int | None = None, pipeline_stages_per_rank: int | None = None,
        pipeline_layers_per_stage: int | None = None, pipeline_split_points: list[int] | None = None,
        fsdp_reshard_after_forward: ReshardPolicy = "default",
        sequence_parallel: bool = True, loss_parallel: bool = True, async_tensor_parallel: bool = False,
        compile: bool = False, compile_loss: bool = False, cuda_graphs: bool = False, float8: Float8Recipe = "none",
        activation_checkpointing: ACMode = "none", activation_checkpointing_every: int = 2,
        process_group_backend: str | None = None, timeout_seconds: float = 1800.0, flight_recorder: bool = False,
        initial_weights: str | None = None, checkpoint_mode: CheckpointMode = "sync", auto_resume: bool = False,
        save_distributed_checkpoint: bool = True,
        save_on_sigterm: bool = True, fault_tolerance: FaultTolerance = "none", torchft_lighthouse: str | None = None,
        replica_group_id: int | None = None, min_replica_groups: int = 1,
        cluster_environment: ClusterEnvironment | None = None, checkpoint_io: DistributedCheckpointIO | None = None,
    ) -> None:
        # The flat knobs are the public contract (YAML, CLI); here they become one validated object per feature.
        self.config = TitanConfig.from_knobs(**{name: value for name, value in locals().items()
                                                if name not in _NOT_KNOBS})
        self.config.check_torch()
        self.config.fault_tolerance.check_job(self.config.mesh.dp_replicate)
        drop_lightnings_amp_line()  # the Trainer announces AMP next; configure_precision says what really runs
        # Lightning 2.6 asks torch 2.13's pytree in a deprecated way, twice a run; nothing a user can act on.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        # Unset in Strategy until first read: a Trainer's checkpoint-IO plugin then reaches the setter's check.
        self._titan_checkpoint_io = checkpoint_io_for(checkpoint_mode, checkpoint_io)
        super().__init__(cluster_environment=cluster_environment)
        self.runtime: ParallelRuntime | None = None
        self._set_up_module: pl.LightningModule | None = None  # parallelized or materialized: later setups keep it
        self._master_weights: MasterWeights | None = None
        self._groups: ProcessGroups | None = None
        self._replicas: ReplicaGroups | None = None
        self._resumed_rng = ResumedRngStates()
        self._training_position = TrainingPosition()

    # ---- degrees, mesh and processes -------------------------------------------------------------

    @property
    def pipeline(self) -> PipelineConfig:
        return self.config.pipeline

    @functools.cached_property
    def parallel_dims(self) -> ParallelDims:
        """The validated degrees; resolving them needs the world size, known once devices are set."""
        return self.config.fault_tolerance.process_mesh(self.config.mesh).resolve(self.num_nodes * self.num_processes)

    @property
    def device_mesh(self) -> TitanMesh:
        if self._groups is None:
            raise RuntimeError("The device mesh exists only after the processes have been set up.")
        return self._groups.mesh

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def is_distributed(self) -> bool:
        # Without this Lightning skips sync_dist reductions and sampler injection for custom strategies.
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.device_mesh["batch"].size(), "rank": self.device_mesh["batch"].get_local_rank()}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self.config.compile.check_layout(self.parallel_dims)  # bad degrees fail here, before any process starts
        self.config.check_device(self.root_device)
        self.checkpoint_io.check_device(self.root_device)
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = ModuleCheckingLauncher(self.config.check_module, self.cluster_environment,
                                                    self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        trainer = self.lightning_module.trainer
        recorder = attach_flight_recorder(trainer, self.config.distributed.flight_recorder)
        if recorder is not None:  # FR reads its settings when the first process group is created
            recorder.configure(trainer)
        init_default_group(self.cluster_environment, self.root_device, self.config.distributed)
        if self._groups is None:  # a later trainer.validate/test/predict keeps the mesh the model is sharded on
            self._groups = build_process_groups(self.parallel_dims, self.root_device, self.config.distributed)
        self.checkpoint_io.setup(self._groups.checkpoint, self._rank_place(), self.root_device)
        if self.config.fault_tolerance.enabled and self._replicas is None and trainer.state.fn == TrainerFn.FITTING:
            self._replicas = ReplicaGroups(self.config.fault_tolerance, self.config.mesh.dp_replicate,
                                           self.root_device, self.config.distributed.timeout)
        self.lightning_module._device_mesh = self._groups.mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @property
    @override
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = TitanPrecision("32-true", "cpu")
        return self._precision_plugin

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = to_titan_precision(precision_plugin)

    # ---- model set-up -----------------------------------------------------------------------------

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # Meta (configure_model, init_module()): no rank ever allocates the full model, and setup initializes the
        # shards. init_module(empty_init=False) asks for real weights instead; setup keeps them.
        device = torch.device("meta") if empty_init is not False else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module, precision = self.lightning_module, self.precision_plugin
        assert isinstance(precision, TitanPrecision)
        self._parallelize_or_materialize(module, precision)
        plain = self.runtime is not None and self.runtime.plan.model is module
        shard_weight_averages(trainer, module, self._shard_like_a_plain_module if plain else None)
        if self.config.compile.loss:
            apply_compile_loss(module)
        precision.on_grad_norm = functools.partial(log_step_metric, module, "grad_norm", bar_name="gnorm")
        precision.before_parameter_update = self.checkpoint_io.wait_for_staging
        self.model_to_device()
        trainer.callbacks = with_training_flops(trainer.callbacks, trainer, module)  # Lightning's says 0 FLOPs
        if self.config.checkpoint.initial_weights_path is not None:
            load_model_weights(self.config.checkpoint.initial_weights_path, module, self._groups.checkpoint)
        self.barrier()
        if fitting := trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            if self.config.checkpoint.save_on_sigterm:
                watch_for_preemption(trainer, self._groups.host_control,
                                     track_progress=self.config.checkpoint.auto_resume)
        self._master_weights = configure_precision(precision, module, self.runtime, self.optimizers)
        self.setup_precision_plugin()
        replicas = self._replicas if fitting else None
        if replicas is not None:  # before auto-resume, which sets ckpt_path: attach refuses a path of the user's
            replicas.attach(trainer, self.model, self.runtime, add_strategy_state=self._training_position.save)
        if self.config.checkpoint.auto_resume and fitting and trainer.ckpt_path is None:
            resume_from_newest(trainer)
        if replicas is not None:
            peer_state = replicas.first_quorum()
            if peer_state is not None:  # Lightning restores the loop, schedules and callbacks from it, as on resume
                trainer._checkpoint_connector._loaded_checkpoint = peer_state
                self._training_position.load(peer_state)

    def _parallelize_or_materialize(self, module: pl.LightningModule, precision: TitanPrecision) -> None:
        """Parallelize a module once (a later validate/test keeps it): from its own plan, or from the plan derived
        for a plain module (``parallelize.plain``). One that parallelized itself is left alone and materialized by
        its own initializers, as Lightning does. Either way no parameter may be left out of the gradient reduction
        (checked once: an evaluation forward leaves FSDP's last unit unsharded, as plain tensors)."""
        if self._set_up_module is module:
            return
        precision.convert_module(module)
        if isinstance(module, PlannedModule):
            plan = module.parallel_plan()
        elif is_self_parallelized(module):
            plan = None
            materialize_with_own_initializers(module, self.root_device)
        else:
            plan = plain_plan(module, self.parallel_dims)
        if plan is not None:
            self.runtime = self._parallelize(plan, pipeline_loss=getattr(module, "pipeline_loss", None))
        check_gradients_are_synchronized(module, self.device_mesh["batch"])
        self._set_up_module = module

    def _parallelize(self, plan: ParallelPlan, pipeline_loss: LossFn | None = None) -> ParallelRuntime:
        precision = self.precision_plugin
        assert isinstance(precision, TitanPrecision)
        return parallelize(plan, self.device_mesh, self.parallel_dims, self.config, self.root_device,
                           param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
                           pipeline_loss=pipeline_loss, host_group=self._groups.host_control)

    def _shard_like_a_plain_module(self, copy: torch.nn.Module) -> None:
        """Shard a copy of the plain module (StochasticWeightAveraging's) as the module was, on the same mesh."""
        self._parallelize(plain_plan(copy, self.parallel_dims))

    @override
    def connect(self, model: pl.LightningModule) -> None:
        self.config.check_module(model)  # under torchrun; Lightning's own launcher checks before starting processes
        super().connect(model)

    # ---- steps: each delegates to the runtime of the parallelized model ---------------------------

    def _step(self, stage: Stage, args: tuple, kwargs: dict) -> STEP_OUTPUT:
        module_step = self._module_step(_STEP_METHODS[stage])
        if self.runtime is None:
            return module_step(*args, **kwargs)
        return self.runtime.step(self.lightning_module, stage, module_step, args, kwargs)

    def _module_step(self, name: str) -> Callable[..., STEP_OUTPUT]:
        """Lightning's step ``name``; where FSDP's root is the LightningModule itself (a plain module's plan), the
        step runs as that root's forward, so FSDP gathers the parameters it holds outside its blocks."""
        lightning_step = getattr(super(), name)
        runtime = self.runtime
        if runtime is None or not runtime.sharded or runtime.plan.model is not self.lightning_module:
            return lightning_step
        step_context = getattr(self.precision_plugin, _STEP_CONTEXTS[name])

        def step(*args: Any, **kwargs: Any) -> STEP_OUTPUT:
            with step_context():
                return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

        return step

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        if self._replicas is not None:  # this replica group's rows of the batch
            args = (self._replicas.share(args[0]), *args[1:])
        return self._step("train", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("val", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step("test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        module_step = self._module_step("predict_step")
        if self.runtime is None:
            return module_step(*args, **kwargs)
        return self.runtime.predict_step(module_step, args, kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: torch.optim.Optimizer | None, *args: Any,
                 **kwargs: Any) -> Tensor:
        with self.runtime.backward_context() if self.runtime is not None else nullcontext():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def on_validation_end(self) -> None:
        if self.runtime is not None:
            self.runtime.end_evaluation()

    on_test_end = on_predict_end = on_validation_end

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        module = self.lightning_module
        if module.automatic_optimization and batch_idx % module.trainer.accumulate_grad_batches == 0:
            # Lightning zeroes gradients only after training_step: the last window's would stay allocated through
            # this forward (about 17 GiB of fp32 gradients at 8B width x 16 layers). Released here.
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        self._resumed_rng.before_batch(self.root_device)
        self._training_position.batch_started()

    @override
    def on_train_end(self) -> None:
        self.checkpoint_io.flush()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.checkpoint_io.flush_after_exception()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self.runtime is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        closure = self.runtime.weighted_closure(closure, optimizer)
        if self._replicas is not None:
            closure = self._replicas.committed(closure, functools.partial(optimizer.zero_grad, set_to_none=True))
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.runtime.after_optimizer_step()
        return output

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._training_position.process(dataloader, self.lightning_module.trainer.training,
                                               data_parallel=self.device_mesh["batch"].size())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip FSDP2's gradient reduce-scatter on all but the last micro-batch of an accumulation window.

        Not under CUDA graphs: a replayed backward reduce-scatters as it did when captured, and gradients an eager
        warm-up held back would wait for an eager backward that may never come."""
        if self.config.compile.cuda_graphs:
            yield
            return
        with no_gradient_sync(self.lightning_module):
            yield

    # ---- collectives ------------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: dist.ReduceOp | str | None = "mean") -> Tensor | Any:
        """Over the ``loss`` mesh by default (each rank a distinct share of the batch), not the world: that
        would count a sample once per TP/PP rank."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._groups is not None:
            group = self._groups.mesh["loss"].get_group()
        return all_reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over *every* rank (ModelCheckpoint, EarlyStopping): ``reduce`` alone spans only the ``loss`` mesh."""
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), group=dist.group.WORLD,
                            reduce_op=dist.ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    # ---- checkpoints ------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if not self.config.checkpoint.distributed:
            return full_model_state(self.lightning_module)
        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if not self.config.checkpoint.distributed:
            return full_optimizer_state(self.lightning_module, optimizer)
        return optimizer_state_dict(self.lightning_module, optimizer)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # loaded in load_checkpoint, straight into the sharded parameters

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # loaded in load_checkpoint

    @property
    @override
    def checkpoint_io(self) -> DistributedCheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = self._titan_checkpoint_io
        assert isinstance(self._checkpoint_io, DistributedCheckpointIO)
        return self._checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = checked_checkpoint_io(io)

    def _rank_place(self) -> RankPlace:
        batch = self.device_mesh["batch"]
        return RankPlace(rank=self.global_rank, world_size=self.world_size, batch_rank=batch.get_local_rank(),
                         batch_world_size=batch.size())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        self._training_position.save(checkpoint)
        if self._replicas is not None:
            self._replicas.save(checkpoint)
        whole_callback_tensors(checkpoint)
        if not self.config.checkpoint.distributed:  # rank 0 holds the whole state (full_model_state)
            if self.is_global_zero:
                TorchCheckpointIO().save_checkpoint(checkpoint, filepath, storage_options)
            self.barrier()
            return
        self.checkpoint_io.save_checkpoint(checkpoint, self.broadcast(str(filepath)), storage_options)
        if self.lightning_module.trainer.state.status != TrainerStatus.RUNNING:  # else nothing flushes it at the end
            self.checkpoint_io.flush()

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        self.checkpoint_io.flush()
        path, module = Path(self.broadcast(str(checkpoint_path))), self.lightning_module
        callback_states = {callback.state_key: callback.state_dict() for callback in module.trainer.callbacks}
        if path.is_file():  # a whole Lightning checkpoint, of this strategy's or another's
            checkpoint = load_single_file(path, module, self.optimizers, strict=module.strict_loading,
                                          weights_only=weights_only)
            shard_callback_tensors(checkpoint, callback_states)
            self._training_position.load(checkpoint)
            return checkpoint
        loaded = load_dcp_checkpoint(path, module, self.optimizers, self._rank_place(), strict=module.strict_loading,
                                     weights_only=weights_only, group=self._groups.checkpoint)
        shard_callback_tensors(loaded.lightning, callback_states)
        self._resumed_rng.loaded(loaded.rng_states, loaded.rng_before_next_epoch, self.root_device)
        self._training_position.load(loaded.lightning)
        if self._replicas is not None:
            self._replicas.load(loaded.lightning)
        return loaded.lightning

    @override
    def teardown(self) -> None:
        # Not Strategy.teardown, which moves the sharded model to the CPU; but every plugin is torn down (saves flush).
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        if self._replicas is not None:
            self._replicas.shutdown()
            self._replicas = None
        if self._master_weights is not None:  # the parameters hold their fp32 masters again
            self._master_weights.release()
            self._master_weights = None
        if self.runtime is not None and (graphed := graphed_call(self.runtime.plan.model)) is not None:
            graphed.release()  # before the process group goes: captured collectives hold its communicators

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="4-D parallelism (FSDP2/HSDP, TP, CP, PP)")

