"""What happens at every step for the techniques ``parallelize`` applied.

The runtime owns the step and backward contexts (loss parallel, ring attention, sequence sharding), the
pipeline's train, eval and predict steps, the token-weighted loss (``token_loss``), torchft's batch share and
commit, the gradient sync held back during accumulation (not under CUDA graphs), the work after each optimizer
step (float8 scales), and the loss handed back to Lightning. ``TitanStrategy``'s hooks only delegate here, so a new
technique touches its own module, its plan entry and this file, never the strategy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from titan_strategy.logging_steps import is_logging_step
from titan_strategy.parallelize.context_parallel import SequenceSharder, check_cp_sequence_length, ring_attention
from titan_strategy.parallelize.cuda_graph import graphed_call
from titan_strategy.parallelize.float8 import precompute_float8_scales
from titan_strategy.parallelize.fsdp import no_gradient_sync
from titan_strategy.parallelize.tensor_parallel import (
    as_local_loss,
    check_sequence_length,
    logging_local_values,
    loss_parallel_context,
)
from titan_strategy.pipeline.layout import PipelineLayout
from titan_strategy.pipeline.runner import PipelineRunner
from titan_strategy.plan import ParallelPlan
from titan_strategy.token_loss import TokenWeighting

if TYPE_CHECKING:
    from titan_strategy.fault_tolerance import ReplicaGroups

__all__ = ["ParallelRuntime", "Stage"]

Stage = Literal["train", "val", "test"]
StepFn = Callable[..., Any]


@dataclass
class ParallelRuntime:
    """The per-step side of a parallelized model.

    Attributes:
        plan: the plan the model was parallelized from.
        parts: the modules this rank runs (its pipeline stages in order, or the whole model).
        layout: stage split and placement; None without PP.
        sharded: FSDP wraps the parts, and its mixed-precision policy casts their parameters.
        loss_parallel: the loss is computed on vocabulary-sharded logits (TP with loss parallel).
        sequence_parallel_tp: the TP degree the sequence is split by (1 without sequence parallelism).
        sharder: cuts each batch to this rank's tokens under CP; None without.
        pipeline: runs the schedule under PP; None without.
        float8_all_gather: tensorwise float8 weights are all-gathered, so their scales are precomputed.
        token_weighting: sums and counts of labelled tokens over the ``loss`` mesh (``token_mean``).
        averaged_over: what a step's loss averages over besides accumulated batches (ranks, microbatches; ""
            for nothing), for the warning about plain means.
        replicas: torchft's replica groups, which share each training batch and commit each step; None without
            (``ReplicaGroups.start_fit`` sets it).
    """

    plan: ParallelPlan
    parts: list[nn.Module]
    layout: PipelineLayout | None
    sharded: bool
    loss_parallel: bool
    sequence_parallel_tp: int
    sharder: SequenceSharder | None
    pipeline: PipelineRunner | None
    float8_all_gather: bool
    token_weighting: TokenWeighting
    averaged_over: str
    replicas: ReplicaGroups | None = None

    @property
    def grad_norm_group(self) -> ProcessGroup | None:
        """Under PP every stage holds other parameters: the gradient norm spans the ``pp`` group."""
        return self.pipeline.group if self.pipeline is not None else None

    # ---- steps ------------------------------------------------------------------------------------

    def step(self, module: pl.LightningModule, stage: Stage, module_step: StepFn, args: tuple, kwargs: dict) -> Any:
        """One training, validation or test step: the module's own, or under PP the schedule's. Under torchft a
        training step takes this replica group's rows of the batch."""
        if stage == "train" and self.replicas is not None and args:
            args = (self.replicas.share(args[0]), *args[1:])
        step = self._pipeline_step(module, stage) if self.pipeline is not None else module_step
        with self._sequence_shards(args) as local_args, ExitStack() as contexts:
            if self.loss_parallel:
                contexts.enter_context(loss_parallel_context(True))
                contexts.enter_context(logging_local_values(module))
            output = step(*local_args, **kwargs)
        if stage == "train" and self.pipeline is None:
            self._warn_about_plain_means(module, args)
        if not self.loss_parallel:
            return output
        if isinstance(output, Mapping) and "loss" in output:
            return {**output, "loss": as_local_loss(output["loss"])}
        return as_local_loss(output)

    def predict_step(self, module_step: StepFn, args: tuple, kwargs: dict) -> Any:
        """The module's prediction (the last stage's under PP), whole on every rank."""
        with self._sequence_shards(args) as args:
            if self.pipeline is None:
                prediction = module_step(*args, **kwargs)
            else:
                with loss_parallel_context(self.loss_parallel):
                    prediction = self.pipeline.predict_step(args[0])
        if self.sharder is None or not isinstance(prediction, Tensor):
            return prediction
        # Each CP rank predicted its own tokens; every rank returns the whole sequence, in order.
        if isinstance(prediction, DTensor):
            prediction = prediction.full_tensor()
        return self.sharder.gather(prediction, self.sharder.plan.prediction_seq_dim)

    def _pipeline_step(self, module: pl.LightningModule, stage: Stage) -> StepFn:
        pipeline, plan = self.pipeline, self.plan.pipeline
        assert pipeline is not None and plan is not None

        def step(batch: Any, *args: Any, **kwargs: Any) -> Tensor:
            accumulate = module.trainer.accumulate_grad_batches if stage == "train" else 1
            loss = pipeline.train_step(batch, accumulate=accumulate) if stage == "train" else pipeline.eval_step(batch)
            if loss.num_tokens is None:  # a pipeline_loss of plain means
                mean = (loss.total * accumulate).float()
                if stage == "train":
                    self.token_weighting.mean_warning.observe(batch, self.averaged_over,
                                                              is_logging_step(module.trainer))
            else:
                mean = self.token_weighting.pipeline_mean(loss.total, loss.num_tokens, training=stage == "train",
                                                          accumulate=accumulate,
                                                          microbatches=pipeline.layout.microbatches)
            plan.log_loss(stage, mean)
            if stage != "train":
                return mean
            return _GradientsOnBackward.apply(mean, torch.ones((), device=mean.device, requires_grad=True), pipeline)

        return step

    def _warn_about_plain_means(self, module: pl.LightningModule, args: tuple) -> None:
        """A module that does not hand over its token sums (``token_mean``) is watched for padded labels where
        several means are averaged."""
        accumulate = module.trainer.accumulate_grad_batches
        averaged_over = ", ".join(filter(None, [self.averaged_over, f"{accumulate} accumulated batches"
                                                if accumulate > 1 else ""]))
        if args and averaged_over and not self.token_weighting.in_use:
            self.token_weighting.mean_warning.observe(args[0], averaged_over, is_logging_step(module.trainer))

    @contextmanager
    def _sequence_shards(self, args: tuple) -> Generator[tuple, None, None]:
        """Check the batch's sequence length against SP and CP; under CP the step gets this rank's tokens."""
        if not args:
            yield args
            return
        if self.sharder is None:
            if self.sequence_parallel_tp > 1:
                assert self.plan.tensor_parallel is not None
                check_sequence_length(self.plan.tensor_parallel.sequence_length(args[0]), self.sequence_parallel_tp)
            yield args
            return
        seq_len = self.sharder.sequence_length(args[0])
        check_cp_sequence_length(seq_len, self.sharder.mesh.size(), self.sequence_parallel_tp)
        with self.sharder.step(args[0], seq_len) as local_batch:
            yield (local_batch, *args[1:])

    # ---- around the steps -------------------------------------------------------------------------

    @contextmanager
    def backward_context(self) -> Generator[None, None, None]:
        """Lightning calls backward outside the training step; the vocab-parallel cross-entropy and the ring
        attention backward need the contexts of their forward."""
        with ExitStack() as stack:
            stack.enter_context(loss_parallel_context(self.loss_parallel))
            if self.sharder is not None:
                stack.enter_context(ring_attention(self.sharder.rotate_method))
            yield

    def step_closure(self, closure: Callable[[], Any], optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        """Lightning's closure for the step's last batch, then the window's gradients made those of its token
        mean; clipping and ``on_before_optimizer_step`` come after. Under torchft the whole is retried until
        every replica group commits."""

        def run() -> Any:
            output = closure()
            self.token_weighting.finish_window(p for group in optimizer.param_groups for p in group["params"])
            return output

        if self.replicas is None:
            return run
        return self.replicas.committed(run, functools.partial(optimizer.zero_grad, set_to_none=True))

    @contextmanager
    def gradient_sync_held_back(self, module: nn.Module) -> Generator[None, None, None]:
        """Skip FSDP2's gradient reduce-scatter on all but the last micro-batch of an accumulation window.

        Not under CUDA graphs: a replayed backward reduce-scatters as it did when captured, and gradients an eager
        warm-up held back would wait for an eager backward that may never come."""
        if graphed_call(self.plan.model) is not None:
            yield
            return
        with no_gradient_sync(module):
            yield

    def after_optimizer_step(self) -> None:
        if self.float8_all_gather:
            # The float8 all-gather reads each weight's scale; computing them all at once here is one
            # reduction instead of one per weight in the next forward.
            precompute_float8_scales(self.plan.model)

    def end_evaluation(self) -> None:
        """After validation, test or predict: the pipeline's stage copies go back to the mode they had."""
        if self.pipeline is not None:
            self.pipeline.end_evaluation()

    def release(self) -> None:
        """Before the process groups go: captured CUDA graphs hold their communicators."""
        if (graphed := graphed_call(self.plan.model)) is not None:
            graphed.release()


class _GradientsOnBackward(torch.autograd.Function):
    """The loss Lightning gets under PP. The schedule already ran backward inside the training step and set
    the gradients aside (Lightning zeroes gradients between its training step and its backward); this loss's
    backward gives them back, so Lightning's backward, its hooks, accumulation and clipping run unchanged."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, anchor: Tensor, pipeline: PipelineRunner) -> Tensor:
        # ``anchor`` requires grad, so the output does and Lightning's backward reaches ``backward`` below.
        ctx.pipeline = pipeline
        return loss.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        ctx.pipeline.restore_gradients()
        return None, None, None
