"""TitanStrategy: Lightning lifecycle glue. Knobs (``config``), process groups (``distributed``), parallelization
(``parallelize``), per-step work (``runtime``), precision (``precision``), checkpoints (``checkpoint``) and what a run
carries between checkpoints (``run_state``) live elsewhere."""

from __future__ import annotations

import functools
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
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from typing_extensions import override

from titan_strategy.callbacks.flight_recorder import attach_flight_recorder
from titan_strategy.callbacks.model_summary import with_training_flops
from titan_strategy.callbacks.weight_averaging import shard_weight_averages
from titan_strategy.checkpoint import DistributedCheckpointIO, RankPlace, load_model_weights
from titan_strategy.checkpoint.callback_tensors import whole_callback_tensors
from titan_strategy.checkpoint.either_form import load_either_form, model_state, optimizer_state
from titan_strategy.checkpoint.io import checked_checkpoint_io, checkpoint_io_for
from titan_strategy.checkpoint.resume import AutoResume
from titan_strategy.checkpoint.rng import ResumedRngStates
from titan_strategy.collectives import MeshCollectives
from titan_strategy.config import (
    PLUGIN_ARGUMENTS,
    ACMode,
    CheckpointMode,
    FaultTolerance,
    Float8Recipe,
    ParallelDims,
    ReshardPolicy,
    RotateMethod,
    ScheduleName,
    TitanConfig,
)
from titan_strategy.distributed import ProcessGroups, build_process_groups, init_default_group
from titan_strategy.fault_tolerance import ReplicaGroups
from titan_strategy.launcher import ModuleCheckingLauncher
from titan_strategy.master_weights import MasterWeights
from titan_strategy.mesh import TitanMesh
from titan_strategy.parallelize.apply import parallelize
from titan_strategy.parallelize.compile import apply_compile_loss
from titan_strategy.parallelize.fsdp import no_gradient_sync
from titan_strategy.parallelize.plain import check_gradients_are_synchronized, plain_plan, plan_of
from titan_strategy.pipeline.runner import LossFn
from titan_strategy.plan import ParallelPlan
from titan_strategy.precision import TitanPrecision, configure_precision, quiet_lightning_lines, to_titan_precision
from titan_strategy.preemption import PreemptionWatch
from titan_strategy.run_state import RunStates
from titan_strategy.runtime import ParallelRuntime, Stage
from titan_strategy.sampler import TrainingPosition
from titan_strategy.step_metrics import log_step_metric

__all__ = ["TitanStrategy"]

_NOT_KNOBS = ("self", "__class__", *PLUGIN_ARGUMENTS)
_STEP_METHODS = {"train": "training_step", "val": "validation_step", "test": "test_step"}
_STEP_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
                  "test_step": "test_step_context", "predict_step": "predict_step_context"}


class TitanStrategy(MeshCollectives):
    """Train a LightningModule on a named 5-D DeviceMesh ``(pp, dp_replicate, dp_shard, cp, tp)``: parallelized
    from its ``parallel_plan()``, or from the plan derived for a plain module, or left as it parallelized itself
    (``parallelize.plain.plan_of``). All see the mesh as ``self.device_mesh``.

    Every argument but the two Lightning plugins (``cluster_environment``, ``checkpoint_io``) is a knob, described
    once, by its field in ``titan_strategy.config``: see docs/knobs.md.
    """

    strategy_name = "titan"
    num_nodes = 1  # the Trainer sets its own where the attribute exists

    def __init__(
        self, data_parallel_replicate_size: int = 1, data_parallel_shard_size: int = -1,
        tensor_parallel_size: int = 1, context_parallel_size: int = 1,
        context_parallel_rotate_method: RotateMethod = "allgather", pipeline_parallel_size: int = 1,
        pipeline_schedule: ScheduleName = "1F1B", pipeline_microbatches: int | None = None,
        pipeline_stages_per_rank: int | None = None, pipeline_layers_per_stage: int | None = None,
        pipeline_split_points: list[int] | None = None, fsdp_reshard_after_forward: ReshardPolicy = "default",
        sequence_parallel: bool = True, loss_parallel: bool = True, async_tensor_parallel: bool = False,
        compile: bool = False, compile_loss: bool = False, cuda_graphs: bool = False, float8: Float8Recipe = "none",
        activation_checkpointing: ACMode = "none", activation_checkpointing_every: int = 2,
        process_group_backend: str | None = None, timeout_seconds: float = 1800.0, flight_recorder: bool = False,
        initial_weights: str | None = None, checkpoint_mode: CheckpointMode = "sync", auto_resume: bool = False,
        save_distributed_checkpoint: bool = True, save_on_sigterm: bool = True,
        fault_tolerance: FaultTolerance = "none", torchft_lighthouse: str | None = None,
        replica_group_id: int | None = None, min_replica_groups: int = 1,
        cluster_environment: ClusterEnvironment | None = None, checkpoint_io: DistributedCheckpointIO | None = None,
    ) -> None:
        # The flat knobs are the public contract (YAML, CLI); here they become one validated object per feature.
        self.config = TitanConfig.for_this_job(**{k: v for k, v in locals().items() if k not in _NOT_KNOBS})
        quiet_lightning_lines()
        # Unset in Strategy until first read: a Trainer's checkpoint-IO plugin then reaches the setter's check.
        self._titan_checkpoint_io = checkpoint_io_for(self.config.checkpoint, checkpoint_io)
        super().__init__(cluster_environment=cluster_environment)
        self.runtime: ParallelRuntime | None = None
        self._set_up_module: pl.LightningModule | None = None  # parallelized or materialized: later setups keep it
        self._master_weights: MasterWeights | None = None
        self._groups: ProcessGroups | None = None
        self._position = TrainingPosition()  # also the training loader's sampler
        self._run_state = RunStates([self._position])  # the rest once the process groups exist

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
        self.config.cuda_graphs.check_layout(self.parallel_dims)  # bad degrees fail here, before any process starts
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
        self._run_state = self._build_run_state(fitting=trainer.state.fn == TrainerFn.FITTING)
        self.lightning_module._device_mesh = self._groups.mesh

    def _build_run_state(self, fitting: bool) -> RunStates:
        """What this run carries between checkpoints (``run_state``), in the order its hooks run."""
        checkpoint, fault_tolerance = self.config.checkpoint, self.config.fault_tolerance
        parts = RunStates([self._position, ResumedRngStates(self.root_device)])
        if checkpoint.save_on_sigterm:
            parts.append(PreemptionWatch(self._groups.host_control, track_progress=checkpoint.auto_resume))
        if fault_tolerance.enabled and fitting:  # joins before auto-resume, which sets ckpt_path
            parts.append(ReplicaGroups(fault_tolerance, self.config.mesh.dp_replicate, self.root_device,
                                       self.config.distributed.timeout, add_strategy_state=self._position.save))
        if checkpoint.auto_resume:
            parts.append(AutoResume())
        return parts

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
        self._hook_into(trainer, module, precision)
        if self.config.checkpoint.initial_weights_path is not None:
            load_model_weights(self.config.checkpoint.initial_weights_path, module, self._groups.checkpoint)
        self.barrier()
        if fitting := trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self._master_weights = configure_precision(precision, module, self.optimizers, self.runtime)
        self.setup_precision_plugin()
        if fitting:
            self._run_state.start_fit(trainer)

    def _hook_into(self, trainer: pl.Trainer, module: pl.LightningModule, precision: TitanPrecision) -> None:
        """What hooks into the set-up module: SWA's average, the compiled loss, the grad-norm metric, the wait for
        checkpoint staging, the training FLOPs (Lightning's summary says 0)."""
        plain = self.runtime is not None and self.runtime.plan.model is module
        shard_weight_averages(trainer, module, self._shard_like_a_plain_module if plain else None)
        if self.config.compile.loss:
            apply_compile_loss(module)
        precision.on_grad_norm = functools.partial(log_step_metric, module, "grad_norm", bar_name="gnorm")
        precision.before_parameter_update = self.checkpoint_io.wait_for_staging
        self.model_to_device()
        trainer.callbacks = with_training_flops(trainer.callbacks, trainer, module)

    def _parallelize_or_materialize(self, module: pl.LightningModule, precision: TitanPrecision) -> None:
        """Parallelize a module once (a later validate/test keeps it) from its plan (``parallelize.plain.plan_of``).
        No parameter may be left out of the gradient reduction (checked once: an evaluation forward leaves FSDP's
        last unit unsharded, as plain tensors)."""
        if self._set_up_module is module:
            return
        precision.convert_module(module)
        plan = plan_of(module, self.parallel_dims, self.root_device,
                       sequence_parallel=self.config.tensor_parallel.sequence_parallel)
        if plan is not None:
            self.runtime = self._parallelize(plan, pipeline_loss=getattr(module, "pipeline_loss", None))
        check_gradients_are_synchronized(module, self.device_mesh["batch"])
        self._set_up_module = module

    def _parallelize(self, plan: ParallelPlan, pipeline_loss: LossFn | None = None) -> ParallelRuntime:
        precision = self.precision_plugin
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

    def _step(self, stage: Stage, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
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

    training_step = functools.partialmethod(_step, "train")
    validation_step = functools.partialmethod(_step, "val")
    test_step = functools.partialmethod(_step, "test")

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
        self._run_state.batch_started()

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
        output = super().optimizer_step(optimizer, self.runtime.step_closure(closure, optimizer), model, **kwargs)
        self.runtime.after_optimizer_step()
        return output

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self._position.process(dataloader, self.lightning_module.trainer.training,
                                      data_parallel=self.device_mesh["batch"].size())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        held_back = self.runtime.gradient_sync_held_back if self.runtime is not None else no_gradient_sync
        with held_back(self.lightning_module):
            yield

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return model_state(self.lightning_module, whole=not self.config.checkpoint.distributed)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer_state(self.lightning_module, optimizer, whole=not self.config.checkpoint.distributed)

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
        self._run_state.save(checkpoint)
        whole_callback_tensors(checkpoint)
        if not self.config.checkpoint.distributed:  # rank 0 holds the whole state (either_form.model_state)
            if self.is_global_zero:
                TorchCheckpointIO().save_checkpoint(checkpoint, filepath, storage_options)
            self.barrier()
            return
        self.checkpoint_io.save_checkpoint(checkpoint, self.broadcast(str(filepath)), storage_options)
        if self.lightning_module.trainer.state.status != TrainerStatus.RUNNING:  # else nothing flushes it at the end
            self.checkpoint_io.flush()

    def _loss_group(self) -> dist.ProcessGroup | None:
        return self._groups.mesh["loss"].get_group() if self._groups is not None else None

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        self.checkpoint_io.flush()
        checkpoint, sharded = load_either_form(Path(self.broadcast(str(checkpoint_path))), self.lightning_module,
                                               self.optimizers, self._rank_place(), weights_only=weights_only,
                                               group=self._groups.checkpoint)
        self._run_state.load(checkpoint, sharded)
        return checkpoint

    @override
    def teardown(self) -> None:
        # Not Strategy.teardown, which moves the sharded model to the CPU; but every plugin is torn down (saves flush).
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self._run_state.teardown()
        self._run_state = RunStates([self._position])
        if self._master_weights is not None:  # the parameters hold their fp32 masters again
            self._master_weights.release()
            self._master_weights = None
        if self.runtime is not None:
            self.runtime.release()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="4-D parallelism (FSDP2/HSDP, TP, CP, PP)")
