"""TitanStrategy: Lightning lifecycle glue. Meshes, parallelization and checkpoints live elsewhere."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from typing_extensions import override

from titan_strategy.callbacks.flight_recorder import RUN_ID_ENV, UNSHORTENED_GROUP_DESC, attach_flight_recorder
from titan_strategy.checkpoint import (
    DistributedCheckpointIO,
    RankPlace,
    check_weights_source,
    load_model_weights,
    newest_complete_checkpoint,
    optimizer_state_dict,
    restore_rng_states,
)
from titan_strategy.checkpoint import load_checkpoint as load_dcp_checkpoint
from titan_strategy.knobs import check_knobs
from titan_strategy.master_weights import MasterWeights, hold_master_weights
from titan_strategy.mesh import ParallelDims, TitanMesh, build_mesh
from titan_strategy.parallelize import ParallelizeConfig, parallelize
from titan_strategy.parallelize.context_parallel import SequenceSharder, check_cp_sequence_length, ring_attention
from titan_strategy.parallelize.float8 import check_float8_device, precompute_float8_scales
from titan_strategy.parallelize.fsdp import ReshardPolicy
from titan_strategy.parallelize.materialize import materialize_with_reset_parameters
from titan_strategy.parallelize.tensor_parallel import as_local_loss, check_sequence_length, loss_parallel_context
from titan_strategy.pipeline.layout import PIPELINE_SCHEDULES, PipelineConfig, PipelineLayout
from titan_strategy.pipeline.runner import PipelineRunner, token_cross_entropy
from titan_strategy.plan import ParallelPlan, PlannedModule
from titan_strategy.precision import TitanPrecision, to_titan_precision
from titan_strategy.step_metrics import log_step_metric

__all__ = ["TitanStrategy", "PIPELINE_SCHEDULES"]

log = logging.getLogger(__name__)



class TitanStrategy(ParallelStrategy):
    """Train a LightningModule under FSDP2/HSDP on a named 5-D DeviceMesh ``(pp, dp_replicate, dp_shard, cp, tp)``.

    A module that declares a ``parallel_plan()`` is built on the meta device and parallelized by the
    strategy; a module that parallelizes itself in ``configure_model`` (ModelParallelStrategy style)
    is left alone. Both see the mesh as ``self.device_mesh``. On a single device the planned module is
    not wrapped in FSDP (there is nothing to shard); ``"bf16-mixed"`` then gives it bf16 weights whose fp32
    masters TritonAdamW keeps (``master_weights.py``), or, with another optimizer, runs it under autocast.

    Args:
        data_parallel_replicate_size: HSDP replicas (parameters replicated across them).
        data_parallel_shard_size: FSDP shard degree; -1 takes what the other degrees leave of the world.
        tensor_parallel_size: tensor-parallel degree.
        context_parallel_size: context-parallel degree: each rank holds 1/cp of every sequence (load-balanced)
            and attention runs as ring attention.
        context_parallel_rotate_method: how key/value shards travel round the CP ring: "allgather" (gathered
            once per attention call) or "alltoall" (passed to the next rank at each step of the ring).
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
        compile_loss: ``torch.compile`` the module's ``compute_loss(output, target)`` (the fp32 upcast of the
            logits fuses into the cross-entropy instead of materializing full-vocabulary fp32 logits).
        activation_checkpointing: how much of each block's activations backward recomputes instead of keeping:
            "none"; "full" (keep only the block's input: least memory, about one more forward);
            "selective_op" (keep attention and every other matmul output, recompute the cheap rest);
            "selective_layer" (fully checkpoint every ``activation_checkpointing_every``-th block).
        activation_checkpointing_every: the k of "selective_layer".
        float8: torchao float8 training of the linear layers (the plan's ``float8_skip`` stays bf16): "none",
            "tensorwise" (float8 FSDP all-gather when sharded) or "rowwise". CUDA compute capability >= 8.9 only.
        process_group_backend: "gloo", "nccl", ...; None picks by device.
        timeout_seconds: process-group timeout; a collective that waits longer fails instead of hanging.
        initial_weights: a checkpoint whose model weights replace the initialization (a TitanStrategy
            checkpoint of any layout, or a weights checkpoint from ``titan-hf import``); optimizer and
            loop state start fresh. A ``ckpt_path`` given to ``fit`` still takes precedence.
        checkpoint_mode: how checkpoints are written (``DistributedCheckpointIO``): "sync"; "async" (copied to
            host memory in the loop, written by a background thread); or "async_pinned" (CUDA: copied to pinned
            memory on a side stream while training goes on, written by a background process).
        auto_resume: ``fit`` without a ``ckpt_path`` resumes from the newest complete checkpoint that a
            ``ModelCheckpoint`` of the trainer wrote, if there is one (a restarted job picks up where it left off).
        flight_recorder: add a ``FlightRecorder`` callback with its defaults (collective traces on a hang or a
            crash, for ``titan-fr analyze``), unless the trainer has one already; pass the callback itself to
            change its settings.
    """

    strategy_name = "titan"

    def __init__(
        self,
        data_parallel_replicate_size: int = 1,
        data_parallel_shard_size: int = -1,
        tensor_parallel_size: int = 1,
        context_parallel_size: int = 1,
        context_parallel_rotate_method: Literal["allgather", "alltoall"] = "allgather",
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_stages_per_rank: int | None = None,
        pipeline_layers_per_stage: int | None = None,
        pipeline_split_points: list[int] | None = None,
        fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default",
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        async_tensor_parallel: bool = False,
        compile: bool = False,
        compile_loss: bool = False,
        activation_checkpointing: Literal["none", "full", "selective_op", "selective_layer"] = "none",
        activation_checkpointing_every: int = 2,
        float8: Literal["none", "tensorwise", "rowwise"] = "none",
        process_group_backend: str | None = None,
        timeout_seconds: float = 1800.0,
        initial_weights: str | None = None,
        checkpoint_mode: Literal["sync", "async", "async_pinned"] = "sync",
        auto_resume: bool = False,
        flight_recorder: bool = False,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: DistributedCheckpointIO | None = None,
    ) -> None:
        if checkpoint_io is not None and checkpoint_mode != _checked_checkpoint_io(checkpoint_io).mode:
            raise ValueError(f"checkpoint_mode={checkpoint_mode!r} contradicts checkpoint_io (mode "
                             f"{checkpoint_io.mode!r}); pass one of them.")
        # Left unset in Strategy until first read, so that a checkpoint-IO plugin of the Trainer reaches the
        # setter's check instead of Lightning's "set through both" error.
        self._titan_checkpoint_io = checkpoint_io or DistributedCheckpointIO(checkpoint_mode)
        super().__init__(cluster_environment=cluster_environment)
        self.pipeline = PipelineConfig(
            size=pipeline_parallel_size, schedule=pipeline_schedule, microbatches=pipeline_microbatches,
            stages_per_rank=pipeline_stages_per_rank, layers_per_stage=pipeline_layers_per_stage,
            split_points=tuple(pipeline_split_points) if pipeline_split_points is not None else None,
        )
        check_knobs(reshard=fsdp_reshard_after_forward, timeout_seconds=timeout_seconds, compile=compile,
                    compile_loss=compile_loss, tensor_parallel_size=tensor_parallel_size,
                    async_tensor_parallel=async_tensor_parallel, rotate_method=context_parallel_rotate_method,
                    activation_checkpointing=activation_checkpointing,
                    activation_checkpointing_every=activation_checkpointing_every, float8=float8,
                    pipeline=self.pipeline)
        self._degrees = {"dp_replicate": data_parallel_replicate_size, "dp_shard": data_parallel_shard_size,
                         "cp": context_parallel_size, "tp": tensor_parallel_size, "pp": pipeline_parallel_size}
        self.fsdp_reshard_after_forward: ReshardPolicy = fsdp_reshard_after_forward
        self.sequence_parallel = sequence_parallel
        self.loss_parallel = loss_parallel
        self.async_tensor_parallel = async_tensor_parallel
        self.compile = compile
        self.compile_loss = compile_loss
        self.activation_checkpointing = activation_checkpointing
        self.activation_checkpointing_every = activation_checkpointing_every
        self.float8 = float8
        self.context_parallel_rotate_method = context_parallel_rotate_method
        self._plan: ParallelPlan | None = None
        self._float8_all_gather = False
        self._sequence_sharder: SequenceSharder | None = None
        self._pipeline: PipelineRunner | None = None
        self._master_weights: MasterWeights | None = None
        self._process_group_backend = process_group_backend
        self._timeout = timedelta(seconds=timeout_seconds)
        self.initial_weights = Path(initial_weights) if initial_weights is not None else None
        if self.initial_weights is not None:
            check_weights_source(self.initial_weights)
        self.auto_resume = auto_resume
        self.flight_recorder = flight_recorder
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._fitting = False
        self._rng_states_for_next_batch: dict[str, Any] | None = None
        self._dims: ParallelDims | None = None
        self._mesh: TitanMesh | None = None
        self.num_nodes = 1

    # ---- degrees, mesh and processes -------------------------------------------------------------

    @property
    def parallel_dims(self) -> ParallelDims:
        """The validated degrees; resolving them needs the world size, known once devices are set."""
        if self._dims is None:
            self._dims = ParallelDims.from_world_size(self.num_nodes * self.num_processes, **self._degrees)
        return self._dims

    @property
    def device_mesh(self) -> TitanMesh:
        if self._mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have been set up.")
        return self._mesh

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
        batch = self.device_mesh["batch"]
        return {"num_replicas": batch.size(), "rank": batch.get_local_rank()}

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
        self.parallel_dims  # noqa: B018 -- bad degrees fail here, before any process is launched
        if self.async_tensor_parallel and self.root_device.type != "cuda":
            raise ValueError(f"async_tensor_parallel=True runs on CUDA only (symmetric memory), not on "
                             f"{self.root_device.type!r}; set async_tensor_parallel=False.")
        self.checkpoint_io.check_device(self.root_device)
        check_float8_device(self.float8, self.root_device)
        if not self.cluster_environment.creates_processes_externally:
            # The processes it starts inherit this, so their Flight Recorder dumps share one run folder.
            os.environ.setdefault(RUN_ID_ENV, time.strftime("%Y%m%d-%H%M%S"))
            self._launcher = _ModuleCheckingLauncher(self._check_module, self.cluster_environment, self.num_processes,
                                                     self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.lightning_module is not None
        recorder = attach_flight_recorder(self.lightning_module.trainer, self.flight_recorder)
        if recorder is not None:  # FR reads its settings when the first process group is created
            recorder.configure(self.lightning_module.trainer)
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        if self._mesh is None:  # a later trainer.validate/test/predict keeps the mesh the model is sharded on
            self._mesh = build_mesh(self.parallel_dims, self.root_device.type)
            # Checkpoints coordinate over a gloo group of their own, so background saves never interleave with
            # the training loop's collectives.
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=self._timeout,
                                                    group_desc=UNSHORTENED_GROUP_DESC)
        self.checkpoint_io.setup(self._checkpoint_group, self._rank_place(), self.root_device)
        self.lightning_module._device_mesh = self._mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ---- precision --------------------------------------------------------------------------------

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
        # Always meta: configure_model must never allocate the full model on any rank.
        with torch.device("meta"):
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        precision = self.precision_plugin
        assert isinstance(precision, TitanPrecision)
        if isinstance(module, PlannedModule):
            if self._plan is None or self._plan.model not in module.modules():  # not parallelized by an earlier run
                self._parallelize(module, precision)
        else:
            # A module that parallelized itself keeps Lightning's semantics: reset_parameters() and autocast.
            precision.use_autocast = True
            materialize_with_reset_parameters(self.model, self.root_device)
        if self.compile_loss:
            self._compile_loss(module)
        precision.on_grad_norm = self._log_grad_norm
        precision.before_parameter_update = self.checkpoint_io.wait_for_staging
        self.model_to_device()
        if self.initial_weights is not None:
            load_model_weights(self.initial_weights, module, self._checkpoint_group)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._hold_master_weights(trainer, precision)
        self.setup_precision_plugin()
        if self.auto_resume and trainer.state.fn == TrainerFn.FITTING and trainer.ckpt_path is None:
            self._resume_from_newest(trainer)

    def _hold_master_weights(self, trainer: pl.Trainer, precision: TitanPrecision) -> None:
        """Unsharded bf16-mixed training with TritonAdamW: bf16 weights and fp32 masters instead of autocast's casts.

        Not where gradients accumulate over several backward passes (they would add up in bf16): under gradient
        accumulation, pipeline microbatches or manual optimization, autocast stays.
        """
        module = self.lightning_module
        if (self._plan is None or self._pipeline is not None or not precision.use_autocast
                or trainer.accumulate_grad_batches != 1 or not module.automatic_optimization):
            return
        self._master_weights = hold_master_weights(module, self.optimizers, precision.param_dtype)
        if self._master_weights is not None:
            precision.use_autocast = False
            rank_zero_info("TitanStrategy: bf16-mixed on an unsharded model with TritonAdamW: the parameters hold "
                           "bf16 values and TritonAdamW their fp32 masters (no casts in the step).")

    def _release_master_weights(self) -> None:
        if self._master_weights is not None:
            self._master_weights.release()
            self._master_weights = None
            assert isinstance(self.precision_plugin, TitanPrecision)
            self.precision_plugin.use_autocast = True

    def _resume_from_newest(self, trainer: pl.Trainer) -> None:
        folders = [Path(callback.dirpath) for callback in trainer.checkpoint_callbacks
                   if isinstance(callback, ModelCheckpoint) and callback.dirpath]
        newest = self.broadcast(newest_complete_checkpoint(folders) if self.is_global_zero else None)
        if newest is None:
            rank_zero_info(f"auto_resume: no complete checkpoint in {[str(f) for f in folders]}; "
                           "training from the start.")
            return
        # Lightning chose ckpt_path before the strategy could see the trainer; loading here, before Lightning
        # restores modules, callbacks and loops from the loaded dict, is the same as fit(ckpt_path=newest).
        trainer._checkpoint_connector.resume_start(newest)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        self._check_module(model)  # under torchrun; Lightning's own launcher checks before starting processes
        super().connect(model)

    def _check_module(self, model: pl.LightningModule) -> None:
        if self.compile_loss and not callable(getattr(model, "compute_loss", None)):
            raise ValueError(f"compile_loss=True compiles the module's compute_loss(output, target), but "
                             f"{type(model).__name__} has none; define it (see LlamaModule) or set compile_loss=False.")

    @staticmethod
    def _compile_loss(module: pl.LightningModule) -> None:
        loss = module.compute_loss
        if not hasattr(loss, "_torchdynamo_orig_callable"):  # a later fit/validate keeps the compiled one
            module.compute_loss = torch.compile(loss)

    def _check_plan_support(self) -> None:
        if self.parallel_dims.pp > 1 and not self.lightning_module.automatic_optimization:
            raise ValueError(f"pipeline_parallel_size={self.parallel_dims.pp} runs forward and backward inside the "
                             "pipeline schedule, which needs Lightning's automatic optimization; remove "
                             "`self.automatic_optimization = False` or set pipeline_parallel_size=1.")

    def _parallelize(self, module: PlannedModule, precision: TitanPrecision) -> None:
        self._check_plan_support()
        config = ParallelizeConfig(
            param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
            reshard_after_forward=self.fsdp_reshard_after_forward, sequence_parallel=self.sequence_parallel,
            loss_parallel=self.loss_parallel, async_tp=self.async_tensor_parallel, compile=self.compile,
            activation_checkpointing=self.activation_checkpointing,
            activation_checkpointing_every=self.activation_checkpointing_every, float8=self.float8,
            pipeline=self.pipeline,
        )
        self._plan = module.parallel_plan()
        parallelized = parallelize(self._plan, self.device_mesh, self.parallel_dims, config, self.root_device)
        precision.use_autocast = not parallelized.sharded  # one device: no FSDP to cast the parameters
        self._float8_all_gather = self.float8 == "tensorwise" and parallelized.sharded
        if self.parallel_dims.cp > 1:
            assert self._plan.context_parallel is not None
            self._sequence_sharder = SequenceSharder(self._plan.model, self.device_mesh["cp"],
                                                     self._plan.context_parallel, self.context_parallel_rotate_method)
        if parallelized.layout is not None:
            self._setup_pipeline(parallelized.parts, parallelized.layout, precision)

    def _setup_pipeline(self, stage_modules: list[torch.nn.Module], layout: PipelineLayout,
                        precision: TitanPrecision) -> None:
        assert self._plan is not None and self._plan.pipeline is not None
        module = self.lightning_module
        loss_fn = getattr(module, "pipeline_loss", None) or token_cross_entropy
        self._pipeline = PipelineRunner(self._plan.model, stage_modules, layout, self.pipeline, self._plan.pipeline,
                                        loss_fn, self.device_mesh["pp"], self.root_device)
        precision.grad_norm_group = self.device_mesh["pp"].get_group()

    # ---- steps: loss parallel around forward+loss and around backward -----------------------------

    @property
    def _loss_parallel_active(self) -> bool:
        return self._plan is not None and self.parallel_dims.tp > 1 and self.loss_parallel

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step(self._pipeline_training_step if self._pipeline else super().training_step, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step(self._pipeline_eval_step("val") if self._pipeline else super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._step(self._pipeline_eval_step("test") if self._pipeline else super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        predict = self._pipeline_predict_step if self._pipeline else super().predict_step
        with self._sequence_shards(args) as args:
            prediction = predict(*args, **kwargs)
        sharder = self._sequence_sharder
        if sharder is None or not isinstance(prediction, Tensor):
            return prediction
        # Each CP rank predicted its own tokens; every rank returns the whole sequence, in order.
        if isinstance(prediction, DTensor):
            prediction = prediction.full_tensor()
        return sharder.gather(prediction, sharder.plan.prediction_seq_dim)

    def _pipeline_predict_step(self, batch: Any, *args: Any) -> Tensor:
        assert self._pipeline is not None
        with loss_parallel_context(self._loss_parallel_active):
            return self._pipeline.predict_step(batch)

    # Under PP the schedule replaces the module's *_step: it runs the stages on microbatches, with the
    # module's pipeline_loss, and the strategy logs the loss under the names LlamaModule uses.

    def _pipeline_training_step(self, batch: Any, batch_idx: int, *args: Any) -> Tensor:
        assert self._pipeline is not None
        accumulate = self.lightning_module.trainer.accumulate_grad_batches
        loss = self._pipeline.train_step(batch, accumulate=accumulate)
        log_step_metric(self.lightning_module, "train_loss", loss, bar_name="loss", sync_dist=True)
        return loss

    @override
    def on_validation_end(self) -> None:
        if self._pipeline is not None:
            self._pipeline.end_evaluation()

    @override
    def on_test_end(self) -> None:
        self.on_validation_end()

    @override
    def on_predict_end(self) -> None:
        self.on_validation_end()

    def _pipeline_eval_step(self, stage: Literal["val", "test"]) -> Callable[..., Tensor]:
        def step(batch: Any, *args: Any) -> Tensor:
            assert self._pipeline is not None
            loss = self._pipeline.eval_step(batch)
            self.lightning_module.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)
            return loss

        return step

    def _step(self, step: Callable[..., STEP_OUTPUT], args: tuple, kwargs: dict) -> STEP_OUTPUT:
        with self._sequence_shards(args) as args:
            if not self._loss_parallel_active:
                return step(*args, **kwargs)
            with loss_parallel_context(True), _logging_local_values(self.lightning_module):
                output = step(*args, **kwargs)
        if isinstance(output, Mapping) and "loss" in output:
            return {**output, "loss": as_local_loss(output["loss"])}
        return as_local_loss(output)

    @contextmanager
    def _sequence_shards(self, args: tuple) -> Generator[tuple, None, None]:
        """Check the batch's sequence length against SP and CP; under CP the step gets this rank's tokens."""
        if self._plan is None or not args:
            yield args
            return
        dims = self.parallel_dims
        sequence_parallel_tp = dims.tp if dims.tp > 1 and self.sequence_parallel else 1
        sharder = self._sequence_sharder
        if sharder is None:
            if sequence_parallel_tp > 1:
                assert self._plan.tensor_parallel is not None
                check_sequence_length(self._plan.tensor_parallel.sequence_length(args[0]), sequence_parallel_tp)
            yield args
            return
        seq_len = sharder.sequence_length(args[0])
        check_cp_sequence_length(seq_len, dims.cp, sequence_parallel_tp)
        with sharder.step(args[0], seq_len) as local_batch:
            yield (local_batch, *args[1:])

    @override
    def backward(self, closure_loss: Tensor, optimizer: torch.optim.Optimizer | None, *args: Any,
                 **kwargs: Any) -> Tensor:
        if self._pipeline is not None:
            # The schedule already ran backward in training_step; keep Lightning's hooks around
            # handing its gradients back.
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
            self._pipeline.restore_gradients()
            closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
            self.post_backward(closure_loss)
            return closure_loss
        # Lightning calls backward outside training_step; the vocab-parallel cross-entropy and the
        # ring attention backward need the same contexts as their forward.
        sharder = self._sequence_sharder
        ring = ring_attention(sharder.rotate_method) if sharder else nullcontext()
        with loss_parallel_context(self._loss_parallel_active), ring:
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def on_train_start(self) -> None:
        self._fitting = True

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        module = self.lightning_module
        if module.automatic_optimization and batch_idx % module.trainer.accumulate_grad_batches == 0:
            # Lightning zeroes gradients only after training_step, so the last window's would stay
            # allocated through this forward (the fp32 gradients of the whole model: about 17 GiB at
            # 8B width x 16 layers). Released here, before the window's first forward.
            for optimizer in self.optimizers:
                optimizer.zero_grad(set_to_none=True)
        if self._rng_states_for_next_batch is not None:
            restore_rng_states(self._rng_states_for_next_batch, self.root_device)
            self._rng_states_for_next_batch = None

    @override
    def on_train_end(self) -> None:
        self._fitting = False
        self.checkpoint_io.flush()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._fitting = False
        self.checkpoint_io.flush_after_exception()

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._float8_all_gather:
            # The float8 all-gather reads each weight's scale; computing them all at once here is one
            # reduction instead of one per weight in the next forward.
            precompute_float8_scales(self._plan.model)
        return output

    def _log_grad_norm(self, norm: Tensor) -> None:
        log_step_metric(self.lightning_module, "grad_norm", norm, bar_name="gnorm")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip FSDP2's gradient reduce-scatter on all but the last micro-batch of an accumulation window."""
        fsdp_modules = [m for m in self.lightning_module.modules() if isinstance(m, FSDPModule)]
        for fsdp_module in fsdp_modules:
            fsdp_module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for fsdp_module in fsdp_modules:
                fsdp_module.set_requires_gradient_sync(True, recurse=False)

    # ---- collectives ------------------------------------------------------------------------------

    @override
    def barrier(self, name: str | None = None) -> None:
        if not dist.is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: ReduceOp | str | None = "mean") -> Tensor | Any:
        """Reduce over the ``loss`` mesh by default: every rank that holds a distinct share of the batch.

        Reducing over the whole world would count a sample once per TP/PP rank.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._mesh is not None:
            group = self._mesh["loss"].get_group()
        return _all_reduce(tensor, group, reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree over *every* rank (ModelCheckpoint, EarlyStopping): ``reduce`` alone spans only the ``loss`` mesh."""
        votes = self.reduce(torch.tensor(int(decision), device=self.root_device), group=dist.group.WORLD,
                            reduce_op=ReduceOp.SUM)
        return bool(votes == self.world_size) if all else bool(votes)

    # ---- checkpoints ------------------------------------------------------------------------------

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.lightning_module)

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer_state_dict(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

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
        self._checkpoint_io = _checked_checkpoint_io(io)

    def _rank_place(self) -> RankPlace:
        batch = self.device_mesh["batch"]
        return RankPlace(rank=self.global_rank, world_size=self.world_size, batch_rank=batch.get_local_rank(),
                         batch_world_size=batch.size())

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path,
                        storage_options: Any | None = None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, self.broadcast(str(filepath)), storage_options)
        if not self._fitting:  # outside fit nothing would flush it before the process ends
            self.checkpoint_io.flush()

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        self.checkpoint_io.flush()
        assert self._checkpoint_group is not None
        loaded = load_dcp_checkpoint(
            Path(self.broadcast(str(checkpoint_path))), self.lightning_module, self.optimizers, self._rank_place(),
            strict=self.lightning_module.strict_loading, weights_only=weights_only, group=self._checkpoint_group,
        )
        if loaded.rng_states is not None:
            if loaded.rng_before_next_epoch:
                restore_rng_states(loaded.rng_states, self.root_device)
            else:
                self._rng_states_for_next_batch = loaded.rng_states
        return loaded.lightning

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def teardown(self) -> None:
        # Not Strategy.teardown: moving a sharded model to the CPU is wasted work, but every plugin
        # (checkpoint IO included, so pending saves flush) is torn down.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self._release_master_weights()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="4-D parallelism (FSDP2/HSDP, TP, CP, PP)")


def _all_reduce(tensor: Tensor, group: dist.ProcessGroup | None, reduce_op: ReduceOp | str | None) -> Tensor:
    """Reduce in place, like Lightning's sync but without its barrier before every reduction.

    On NCCL that barrier blocks the host until the GPU catches up: every ``self.log(..., sync_dist=True)``
    would stall the step. Means are sums divided by the group size (gloo has no AVG).
    """
    if not dist.is_initialized():
        return tensor
    name = reduce_op.lower() if isinstance(reduce_op, str) else None
    mean = name in ("mean", "avg")
    op = ReduceOp.SUM if mean or reduce_op is None else getattr(ReduceOp, name.upper()) if name else reduce_op
    dist.all_reduce(tensor, op=op, group=group)
    if not mean:
        return tensor
    size = dist.get_world_size(group)
    return tensor.div_(size) if torch.is_floating_point(tensor) else tensor.copy_(tensor / size)


def _checked_checkpoint_io(io: CheckpointIO | None) -> DistributedCheckpointIO:
    if not isinstance(io, DistributedCheckpointIO):
        raise ValueError(f"TitanStrategy writes sharded checkpoints through DistributedCheckpointIO, not "
                         f"{type(io).__name__}; remove that plugin and choose TitanStrategy(checkpoint_mode=...).")
    return io


@contextmanager
def _logging_local_values(module: pl.LightningModule) -> Generator[None, None, None]:
    """Let ``self.log`` take the replicated DTensor loss that loss parallel produces."""
    log_value = module.log

    def log_local(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log_value(name, as_local_loss(value), *args, **kwargs)

    module.log = log_local  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log


class _ModuleCheckingLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher, which first checks the module: it starts the other ranks (re-running the
    script's command line) before the trainer hands the module to the strategy, so an error raised later
    would leave those processes running."""

    def __init__(self, check_module: Callable[[pl.LightningModule], None], *args: Any) -> None:
        super().__init__(*args)
        self._check_module = check_module

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if args and isinstance(args[0], pl.LightningModule):  # fit, validate, test and predict pass it first
            self._check_module(args[0])
        return super().launch(function, *args, trainer=trainer, **kwargs)
