"""Run a torch pipeline schedule as one step of Lightning's loop.

Lightning's closure runs ``training_step -> zero_grad -> backward``. The schedule does forward and
backward inside ``training_step``, so the runner sets this batch's gradients aside before Lightning's
``zero_grad`` and hands them back in ``backward``; Lightning's hooks, accumulation, clipping and
optimizer step then run as they would without a pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from inspect import signature
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from titan_strategy.config.pipeline import PipelineConfig
from titan_strategy.parallelize.tensor_parallel import as_local_loss
from titan_strategy.pipeline.layout import PipelineLayout, check_microbatch_split
from titan_strategy.plan import PipelinePlan
from titan_strategy.token_loss import TokenLoss

__all__ = ["BoundaryFn", "PipelineLoss", "PipelineRunner", "LossFn", "boundary_activation"]

log = logging.getLogger(__name__)

LossFn = Callable[[Tensor, Tensor], "Tensor | TokenLoss"]


class PipelineLoss(NamedTuple):
    """A Lightning batch's loss, equal on every pp rank: the sum of its microbatches' token loss sums and their
    token count; or, from a ``pipeline_loss`` of plain means, their scaled sum and None."""

    total: Tensor
    num_tokens: Tensor | None


# Maps a first-stage input microbatch to a meta tensor like the activation one stage hands the next.
BoundaryFn = Callable[[Tensor], Tensor]


def boundary_activation(inputs: Tensor, *, width: int, sequence_shards: int, dtype: torch.dtype) -> Tensor:
    """The hidden state a stage sends for a ``(batch, seq)`` microbatch: ``(batch, seq / sequence_shards, width)``
    (sequence parallelism hands each TP rank its share of the sequence)."""
    batch, seq = inputs.shape[:2]
    return torch.empty(batch, seq // sequence_shards, width, dtype=dtype, device="meta")


class _Stage(PipelineStage):
    """A PipelineStage whose start-up handshake never sends to its own rank, and that can be rehearsed.

    torch 2.11 greets both neighbour stages with a dummy send/recv; under a V-schedule two adjacent
    stages share a rank, and gloo cannot send to itself ("Pair is not connected"). torch 2.13 replaced
    that handshake, so this changes nothing there.

    Before its first step a stage asks its neighbours for the shapes of what they send. A rehearsal's fake
    group has no neighbours, so there ``rehearsal_input()`` answers for them: the previous stage sends the
    boundary activation, and the next one sends back gradients shaped like this stage's outputs.
    """

    def __init__(self, *args: Any, rehearsal_input: Callable[[], Tensor] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rehearsal_input = rehearsal_input

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def _recv_meta(self, src_stage: int) -> Any:  # torch 2.13's metadata exchange
        if self._rehearsal_input is None:
            return super()._recv_meta(src_stage)
        from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas

        if src_stage < self.stage_index:
            return _StageForwardMeta(extract_tensor_metas((self._rehearsal_input(),)))
        return _StageBackwardMeta(self._stage_meta.outputs)

    def _shape_inference(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:  # torch 2.11's
        previous = self.stage_index - 1
        local = self.is_first or self.stage_index_to_group_rank[previous] == self.group_rank
        if self._rehearsal_input is None or local:
            return super()._shape_inference(args, kwargs)
        # torch 2.11 takes the input shapes as arguments only from a previous stage on this rank: pose as one.
        peer = self.stage_index_to_group_rank[previous]
        self.stage_index_to_group_rank[previous] = self.group_rank
        try:
            return super()._shape_inference((self._rehearsal_input(),), kwargs)
        finally:
            self.stage_index_to_group_rank[previous] = peer


# Wire format of an activation header: ndim, then the shape padded to _MAX_DIMS, then a dtype code.
_MAX_DIMS = 6
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)


class _ForwardPipeline:
    """Forward-only evaluation: each local stage runs every microbatch in turn, in stage order.

    torch's ``schedule.eval()`` still runs the backward actions of V-schedules and fails, and its
    runtime refuses a forward-only order; this needs only point-to-point sends, so it behaves the
    same for every schedule, placement (loop or V) and torch version.
    """

    def __init__(self, stage_modules: list[nn.Module], stage_ids: list[int], layout: PipelineLayout,
                 group: dist.ProcessGroup, device: torch.device) -> None:
        self._stages = list(zip(stage_ids, stage_modules))
        self._layout = layout
        self.group = group
        self._device = device
        self._rank = dist.get_rank(group)

    def run(self, inputs: Tensor | None, stage_inputs: dict[str, Tensor]) -> list[Any]:
        """Outputs of the last stage per microbatch (empty on ranks without it); every stage's forward also gets
        its microbatch's share of ``stage_inputs``."""
        microbatches = self._layout.microbatches
        carried: list[Any] = list(inputs.tensor_split(microbatches)) if inputs is not None else []
        split_inputs = {key: value.tensor_split(microbatches) for key, value in stage_inputs.items()}
        extra = [{key: pieces[i] for key, pieces in split_inputs.items()} for i in range(microbatches)]
        sends: list[tuple[dist.Work, Tensor]] = []  # each send's buffer lives until its wait
        previous = -1
        for stage, module in self._stages:
            local_input = stage == 0 or previous == stage - 1
            outputs = [module(carried[i] if local_input else self._recv(self._layout.ranks[stage - 1]), **extra[i])
                       for i in range(microbatches)]
            next_rank = self._layout.ranks[stage + 1] if stage + 1 < self._layout.num_stages else self._rank
            if next_rank != self._rank:
                for output in outputs:
                    sends.extend(self._send(output, next_rank))
            carried, previous = outputs, stage
        for work, _ in sends:
            work.wait()
        return carried if previous == self._layout.num_stages - 1 else []

    def _send(self, tensor: Tensor, rank: int) -> list[tuple[dist.Work, Tensor]]:
        header = torch.zeros(_MAX_DIMS + 2, dtype=torch.int64)
        header[0], header[1 : 1 + tensor.ndim] = tensor.ndim, torch.tensor(tensor.shape)
        header[-1] = _DTYPES.index(tensor.dtype)
        buffers = (header.to(self._device), tensor.contiguous())
        return [(dist.isend(buffer, group=self.group, group_dst=rank), buffer) for buffer in buffers]

    def _recv(self, rank: int) -> Tensor:
        header = torch.empty(_MAX_DIMS + 2, dtype=torch.int64, device=self._device)
        dist.recv(header, group=self.group, group_src=rank)
        ndim, shape = int(header[0]), header[1:-1].tolist()
        tensor = torch.empty(shape[:ndim], dtype=_DTYPES[int(header[-1])], device=self._device)
        dist.recv(tensor, group=self.group, group_src=rank)
        return tensor


class PipelineRunner:
    """The pipeline schedules of this rank's stages, for training and for forward-only evaluation.

    Args:
        model: the pruned model that owns every stage's parameters (registered in the LightningModule).
        stage_modules: this rank's stage modules, in the order of ``layout.stages_of(pp rank)``.
        layout: the resolved pipeline layout.
        config: the pipeline knobs (the schedule name).
        plan: the model's pipeline plan (how a batch splits into stage input and loss target).
        loss_fn: the loss of one microbatch, ``(last stage output, target) -> (loss_sum, num_tokens)``
            (``token_loss``), or its mean.
        pp_mesh: the ``pp`` mesh dim; its group carries the stage-to-stage traffic.
        device: where activations live.
        rehearsal_boundary: only on a rehearsal's fake group, what the neighbour stages would say they send.
    """

    def __init__(self, model: nn.Module, stage_modules: list[nn.Module], layout: PipelineLayout,
                 config: PipelineConfig, plan: PipelinePlan, loss_fn: LossFn, pp_mesh: DeviceMesh,
                 device: torch.device, rehearsal_boundary: BoundaryFn | None = None) -> None:
        self.stage_modules = stage_modules
        self.layout = layout
        self.group = pp_mesh.get_group()
        self._plan = plan
        self._loss_fn = loss_fn
        self._device = device
        stage_ids = layout.stages_of(pp_mesh.get_local_rank())
        self._holds_first = 0 in stage_ids
        self._holds_last = layout.num_stages - 1 in stage_ids
        self._parameters = list(model.parameters())
        # The containers that stage views copied: Lightning's train()/eval() of the LightningModule
        # reaches every shared submodule but not these, so the runner sets their mode.
        registered = {id(m) for m in model.modules()}
        self._view_containers = [m for part in stage_modules for m in part.modules() if id(m) not in registered]
        self._mode_before_eval: list[bool] | None = None
        self._loss_scale = 1.0
        # Per loss call on the last stage: (what backward ran on, the unscaled sum and count, or the scaled mean).
        self._loss_calls: list[tuple[Tensor, tuple[Tensor, Tensor | None]]] = []
        self._token_sums: bool | None = None  # whether loss_fn returns token sums, known after the first batch
        self._set_aside: list[tuple[nn.Parameter, Tensor]] = []
        self._rehearsal_boundary = rehearsal_boundary
        self._boundary: Tensor | None = None  # the rehearsal's boundary activation of the current microbatches
        self._schedule = self._build_schedule(config.schedule, stage_ids)
        # By default the last stage keeps every microbatch's output (the logits) until the step ends, to return them
        # merged: 64 x 0.24 GiB on a rehearsed 405B PP16 last stage. Only the losses are read here.
        self._keep_no_outputs = {"return_outputs": False} \
            if "return_outputs" in signature(self._schedule.step).parameters else {}
        self._forward_only = _ForwardPipeline(stage_modules, stage_ids, layout, self.group, device)
        log.info("Pipeline stages %s of %d on this rank (%s, %d microbatches)", stage_ids, layout.num_stages,
                 config.schedule, layout.microbatches)

    def _build_schedule(self, name: str, stage_ids: list[int]) -> Any:
        rehearsal_input = (lambda: self._boundary) if self._rehearsal_boundary is not None else None
        stages = [_Stage(module, index, self.layout.num_stages, self._device, group=self.group,
                         rehearsal_input=rehearsal_input)
                  for index, module in zip(stage_ids, self.stage_modules)]
        schedule_cls = get_schedule_class(name)
        # scale_grads=False: torch would divide *all* gradients by the microbatch count after every
        # step, accumulated ones included; the runner scales each microbatch loss instead.
        first = stages[0] if issubclass(schedule_cls, PipelineScheduleSingle) else stages
        return schedule_cls(first, n_microbatches=self.layout.microbatches, loss_fn=self._scaled_loss,
                            scale_grads=False)

    def _scaled_loss(self, output: Tensor, target: Tensor) -> Tensor:
        """What the schedule runs backward on: the microbatch's loss (its token sum, or its mean) scaled by
        ``_loss_scale``; the unscaled sum and count, or the scaled mean, are kept for the batch's loss."""
        loss = self._loss_fn(output, target)
        if isinstance(loss, tuple):
            loss_sum, num_tokens = as_local_loss(loss[0]), loss[1]
            scaled = loss_sum * self._loss_scale
            self._loss_calls.append((scaled, (loss_sum.detach(), num_tokens)))
        else:
            scaled = as_local_loss(loss) * self._loss_scale
            self._loss_calls.append((scaled, (scaled.detach(), None)))
        return scaled

    # ---- steps ------------------------------------------------------------------------------------

    def train_step(self, batch: Any, *, accumulate: int) -> PipelineLoss:
        """Forward and backward of one Lightning batch.

        Each microbatch loss is divided by (microbatches x accumulate): for means, gradients come out as
        ``accumulate`` Lightning batches of the unpipelined model would make them; for token sums, the
        runtime's ``TokenWeighting`` rescales them to the window's token mean. The strategy has released the
        last window's gradients before the window's first batch.
        """
        self._set_view_mode(training=True)
        inputs, target = self._split(batch)
        self._loss_scale = 1.0 / (self.layout.microbatches * accumulate)
        if self._rehearsal_boundary is not None:
            self._boundary = self._rehearsal_boundary(inputs.tensor_split(self.layout.microbatches)[0])
        args = (inputs,) if self._holds_first else ()
        losses: list[Tensor] = []
        # The schedule splits keyword inputs into microbatches and hands them to every stage's forward.
        self._schedule.step(*args, **self._stage_inputs(batch, loss=True), **self._keep_no_outputs,
                            **({"target": target, "losses": losses} if self._holds_last else {}))
        self._set_aside = [(p, p.grad) for p in self._parameters if p.grad is not None]
        for param, _ in self._set_aside:
            param.grad = None
        # torch 2.13 also calls the loss function on its first step, on placeholder outputs, to infer gradient
        # shapes: only the calls whose losses the schedule returns count.
        returned = [kept for scaled, kept in self._loss_calls if any(scaled is loss for loss in losses)]
        return self._broadcast_loss(returned)

    def restore_gradients(self) -> None:
        """Give back the gradients ``train_step`` set aside (called from the strategy's backward)."""
        for param, grad in self._set_aside:
            param.grad = grad
        self._set_aside = []

    @torch.no_grad()
    def eval_step(self, batch: Any) -> PipelineLoss:
        """Forward only: the batch's loss."""
        self._enter_evaluation()
        inputs, target = self._split(batch)
        self._loss_scale = 1.0 / self.layout.microbatches
        outputs = self._forward_only.run(inputs if self._holds_first else None, self._stage_inputs(batch, loss=True))
        targets = target.tensor_split(self.layout.microbatches) if self._holds_last else []
        for output, microbatch_target in zip(outputs, targets):
            self._scaled_loss(output, microbatch_target)
        return self._broadcast_loss([kept for _, kept in self._loss_calls])

    @torch.no_grad()
    def predict_step(self, batch: Any) -> Tensor:
        """Forward only; returns the last stage's output for the batch, on every pp rank."""
        self._enter_evaluation()
        inputs, _ = self._split(batch)
        outputs = self._forward_only.run(inputs if self._holds_first else None, self._stage_inputs(batch, loss=False))
        merged = torch.cat([as_local_loss(out) for out in outputs]) if self._holds_last else None
        return self._broadcast_output(merged)

    def _stage_inputs(self, batch: Any, *, loss: bool) -> dict[str, Tensor]:
        return {**self._plan.stage_inputs(batch), **(self._plan.loss_inputs(batch) if loss else {})}

    def _split(self, batch: Any) -> tuple[Tensor, Tensor | None]:
        inputs, target = self._plan.split_batch(batch)
        check_microbatch_split(inputs.shape[0], self.layout.microbatches)
        return inputs, target

    def _broadcast_loss(self, losses: list[tuple[Tensor, Tensor | None]]) -> PipelineLoss:
        """The batch's microbatch losses summed on the last stage, sent to every pp rank."""
        # (total, tokens, whether they are token sums) in float64 on every rank, whatever dtype the module's
        # loss has: the broadcast needs one buffer layout, and counts stay exact.
        buffer = torch.zeros(3, dtype=torch.float64, device=self._device)
        if self._holds_last:
            token_sums = losses[0][1] is not None
            buffer[0] = torch.stack([total.double() for total, _ in losses]).sum()
            if token_sums:
                buffer[1] = torch.stack([count.double() for _, count in losses]).sum()
            buffer[2] = float(token_sums)
        self._loss_calls = []
        dist.broadcast(buffer, group=self.group, group_src=self.layout.ranks[-1])
        if self._token_sums is None:  # one host read per run: the loss function returns one kind
            self._token_sums = bool(buffer[2])
        return PipelineLoss(buffer[0], buffer[1] if self._token_sums else None)

    def _broadcast_output(self, output: Tensor | None) -> Tensor:
        source = self.layout.ranks[-1]
        meta = [(output.shape, output.dtype) if output is not None else None]
        dist.broadcast_object_list(meta, group=self.group, group_src=source)
        shape, dtype = meta[0]
        buffer = output.contiguous() if output is not None else torch.empty(shape, dtype=dtype, device=self._device)
        dist.broadcast(buffer, group=self.group, group_src=source)
        return buffer

    # ---- train/eval mode of the stage views -------------------------------------------------------

    def end_evaluation(self) -> None:
        """Put the stage views back in the mode they had before validation, test or predict."""
        if self._mode_before_eval is not None:
            for module, training in zip(self._view_containers, self._mode_before_eval):
                module.training = training
            self._mode_before_eval = None

    def _enter_evaluation(self) -> None:
        if self._mode_before_eval is None:
            self._mode_before_eval = [m.training for m in self._view_containers]
        self._set_view_mode(training=False)

    def _set_view_mode(self, training: bool) -> None:
        for module in self._view_containers:
            module.training = training
