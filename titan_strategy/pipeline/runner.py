"""Run a torch pipeline schedule as one step of Lightning's loop.

Lightning's closure runs ``training_step -> zero_grad -> backward``. The schedule does forward and
backward inside ``training_step``, so the runner sets this batch's gradients aside before Lightning's
``zero_grad`` and hands them back in ``backward``; Lightning's hooks, accumulation, clipping and
optimizer step then run as they would without a pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from titan_strategy.parallelize.tensor_parallel import as_local_loss
from titan_strategy.pipeline.layout import PipelineConfig, PipelineLayout
from titan_strategy.plan import PipelinePlan

__all__ = ["PipelineRunner", "LossFn", "token_cross_entropy"]

log = logging.getLogger(__name__)

LossFn = Callable[[Tensor, Tensor], Tensor]


def token_cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """The default ``pipeline_loss``: mean next-token cross-entropy over (batch, seq) logits, ignoring -100."""
    return F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1), ignore_index=-100)


class _Stage(PipelineStage):
    """A PipelineStage whose start-up handshake never sends to its own rank.

    torch 2.11 greets both neighbour stages with a dummy send/recv; under a V-schedule two adjacent
    stages share a rank, and gloo cannot send to itself ("Pair is not connected"). torch 2.13 replaced
    that handshake, so this changes nothing there.
    """

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]


class PipelineRunner:
    """The pipeline schedules of this rank's stages, for training and for forward-only evaluation.

    Args:
        stage_modules: this rank's stage modules, in the order of ``layout.stages_of(pp rank)``.
        layout: the resolved pipeline layout.
        config: the pipeline knobs (the schedule name).
        plan: the model's pipeline plan (how a batch splits into stage input and loss target).
        loss_fn: mean loss of one microbatch, ``(last stage output, target) -> scalar``.
        pp_mesh: the ``pp`` mesh dim; its group carries the stage-to-stage traffic.
        device: where activations live.
    """

    def __init__(self, stage_modules: list[nn.Module], layout: PipelineLayout, config: PipelineConfig,
                 plan: PipelinePlan, loss_fn: LossFn, pp_mesh: DeviceMesh, device: torch.device) -> None:
        self.stage_modules = stage_modules
        self.layout = layout
        self._plan = plan
        self._loss_fn = loss_fn
        self._group = pp_mesh.get_group()
        self._device = device
        stage_ids = layout.stages_of(pp_mesh.get_local_rank())
        self._holds_first = 0 in stage_ids
        self._holds_last = layout.num_stages - 1 in stage_ids
        self._parameters = list({id(p): p for m in stage_modules for p in m.parameters()}.values())
        self._loss_scale = 1.0
        self._set_aside: list[tuple[nn.Parameter, Tensor]] = []
        # Evaluation gets its own stages: its forward-only buffers never mix with training's.
        self._train_schedule = self._build_schedule(config.schedule, stage_ids)
        self._eval_schedule = self._build_schedule(config.schedule, stage_ids)
        log.info("Pipeline stages %s of %d on this rank (%s, %d microbatches)", stage_ids, layout.num_stages,
                 config.schedule, layout.microbatches)

    def _build_schedule(self, name: str, stage_ids: list[int]) -> Any:
        stages = [_Stage(module, index, self.layout.num_stages, self._device, group=self._group)
                  for index, module in zip(stage_ids, self.stage_modules)]
        schedule_cls = get_schedule_class(name)
        # scale_grads=False: torch would divide *all* gradients by the microbatch count after every
        # step, accumulated ones included; the runner scales each microbatch loss instead.
        first = stages[0] if issubclass(schedule_cls, PipelineScheduleSingle) else stages
        return schedule_cls(first, n_microbatches=self.layout.microbatches, loss_fn=self._scaled_loss,
                            scale_grads=False)

    def _scaled_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return as_local_loss(self._loss_fn(output, target)) * self._loss_scale

    # ---- steps ------------------------------------------------------------------------------------

    def train_step(self, batch: Any, *, starts_accumulation: bool, accumulate: int) -> Tensor:
        """Forward and backward of one Lightning batch; returns its mean loss, equal on every pp rank.

        Gradients come out as ``accumulate`` Lightning batches of the unpipelined model would make
        them: each microbatch loss is divided by (microbatches x accumulate).
        """
        if starts_accumulation:  # Lightning zeroes only after training_step: drop the last window's gradients now
            for param in self._parameters:
                param.grad = None
        self._set_mode(training=True)
        self._loss_scale = 1.0 / (self.layout.microbatches * accumulate)
        losses = self._run(self._train_schedule, batch)
        self._set_aside = [(p, p.grad) for p in self._parameters if p.grad is not None]
        for param, _ in self._set_aside:
            param.grad = None
        return losses * accumulate

    def restore_gradients(self) -> None:
        """Give back the gradients ``train_step`` set aside (called from the strategy's backward)."""
        for param, grad in self._set_aside:
            param.grad = grad
        self._set_aside = []

    @torch.no_grad()
    def eval_step(self, batch: Any) -> Tensor:
        """Forward-only schedule; returns the batch's mean loss, equal on every pp rank."""
        self._set_mode(training=False)
        self._loss_scale = 1.0 / self.layout.microbatches
        return self._run(self._eval_schedule, batch)

    @torch.no_grad()
    def predict_step(self, batch: Any) -> Tensor:
        """Forward-only schedule without loss; returns the last stage's output on every pp rank."""
        self._set_mode(training=False)
        inputs, _ = self._plan.split_batch(batch)
        self._check_divisible(inputs)
        output = self._eval_schedule.eval(inputs) if self._holds_first else self._eval_schedule.eval()
        return self._broadcast_output(as_local_loss(output) if self._holds_last else None)

    def _run(self, schedule: Any, batch: Any) -> Tensor:
        inputs, target = self._plan.split_batch(batch)
        self._check_divisible(inputs)
        args = (inputs,) if self._holds_first else ()
        losses: list[Tensor] = []
        kwargs = {"target": target, "losses": losses} if self._holds_last else {}
        if schedule is self._eval_schedule:
            schedule.eval(*args, **kwargs)
        else:
            schedule.step(*args, **kwargs)
        total = torch.stack([loss.detach() for loss in losses]).sum() if self._holds_last else \
            torch.zeros((), device=self._device)
        dist.broadcast(total, group=self._group, group_src=self.layout.ranks[-1])
        return total

    def _check_divisible(self, inputs: Tensor) -> None:
        batch_size, microbatches = inputs.shape[0], self.layout.microbatches
        if batch_size % microbatches:
            raise ValueError(f"A batch of {batch_size} samples cannot be split into pipeline_microbatches={microbatches} "
                             "equal microbatches; use a per-rank batch size divisible by it (and drop_last=True), or "
                             "change pipeline_microbatches.")

    def _set_mode(self, training: bool) -> None:
        # Stage views are not registered in the LightningModule, so its train()/eval() misses them.
        for module in self.stage_modules:
            module.train(training)

    def _broadcast_output(self, output: Tensor | None) -> Tensor:
        source = self.layout.ranks[-1]
        meta = [(output.shape, output.dtype) if output is not None else None]
        dist.broadcast_object_list(meta, group=self._group, group_src=source)
        shape, dtype = meta[0]
        buffer = output.contiguous() if output is not None else torch.empty(shape, dtype=dtype, device=self._device)
        dist.broadcast(buffer, group=self._group, group_src=source)
        return buffer
