"""Token-weighted loss: the loss a step optimizes and logs is the mean over every labelled token of the
optimizer step, whatever the layout.

A mean of per-rank (or per-microbatch, or per-accumulated-batch) means weights a token by how many labelled
tokens its batch happened to hold; with padding or masked prompts (labels of -100) the parallel run then
trains another model than one process on the same global batch. Here the sums and counts are reduced over
the ``loss`` mesh (data-parallel and context-parallel ranks), and across the batches of an accumulation
window and the microbatches of a pipeline; the gradients are exactly those of that mean.

A module takes part by handing over the token sum and count:

- from ``training_step``/``validation_step``/``test_step``: ``token_mean(self, loss_sum, num_tokens)``
  (under any other strategy it is this batch's local mean);
- under pipeline parallelism: ``pipeline_loss(output, target)`` returns the pair ``(loss_sum, num_tokens)``
  (``token_cross_entropy`` is one, and the default).

A module that returns a plain mean keeps it; it is warned once when its labels hold -100 in a layout that
averages several means.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from titan_strategy.parallelize.tensor_parallel import as_local_loss
from titan_strategy.shards import local

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["IGNORE_INDEX", "TokenLoss", "TokenWeighting", "count_labelled", "is_token_weighted", "token_cross_entropy",
           "token_mean"]

IGNORE_INDEX = -100
TokenLoss = tuple[Tensor, Tensor]
"""``(loss_sum, num_tokens)``: a loss summed over the labelled tokens of a batch, and how many there were."""


def token_cross_entropy(output: Tensor, target: Tensor) -> TokenLoss:
    """Next-token cross-entropy of (batch, seq, vocab) logits, summed over the labelled tokens (labels of
    -100 are ignored), and their count."""
    loss_sum = F.cross_entropy(output.flatten(0, 1).float(), target.flatten(0, 1), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return loss_sum, count_labelled(target)


def count_labelled(labels: Tensor) -> Tensor:
    """How many tokens have a label (are not -100): the count a token sum is averaged over."""
    return (labels != IGNORE_INDEX).sum()


def token_mean(module: pl.LightningModule, loss_sum: Tensor, num_tokens: Tensor) -> Tensor:
    """The mean of a step's loss over its labelled tokens, for a module's training, validation or test step.

    Under ``TitanStrategy`` (a module with a ``parallel_plan``) the mean spans every data-parallel and
    context-parallel rank and, in training, every batch so far of the accumulation window: its value is the
    same on every rank, and at the window's last batch it is the optimizer step's loss. Backward through it
    gives the gradients of the window's mean. Under any other strategy it is this batch's own mean.
    """
    weighting = _weighting_of(module)
    if weighting is None:
        return as_local_loss(loss_sum) / num_tokens.clamp(min=1)
    trainer = module.trainer
    accumulate = trainer.accumulate_grad_batches if module.automatic_optimization else 1
    return weighting.mean(as_local_loss(loss_sum), num_tokens, training=trainer.training, accumulate=accumulate)


def is_token_weighted(module: pl.LightningModule) -> bool:
    """Whether ``token_mean`` gives this module the mean over every rank: its value then needs no ``sync_dist``
    (which would be one more all-reduce per step)."""
    return _weighting_of(module) is not None


def _weighting_of(module: pl.LightningModule) -> TokenWeighting | None:
    """The token weighting of the module's strategy, TitanStrategy's runtime's; None under any other strategy (or
    for a module that parallelized itself, which has no runtime)."""
    strategy = module._trainer.strategy if module._trainer is not None else None
    weighting = getattr(getattr(strategy, "runtime", None), "token_weighting", None)
    return weighting if isinstance(weighting, TokenWeighting) else None


class TokenWeighting:
    """Sums and counts of labelled tokens over the ``loss`` mesh, per batch and per accumulation window.

    Each batch's backward runs on its token sum times a scale fixed for the window (it cannot wait for the
    window's count); ``finish_window`` then multiplies the gradients by ``reference / count``, which makes
    them the gradients of the window's mean. Where the scale already is the count's (one batch per window,
    without a pipeline) nothing is multiplied.

    Args:
        group: the ``loss`` mesh's group; None in a single process.
        gradient_average: how many ranks FSDP averages each gradient over (the ``loss`` mesh's size).
    """

    def __init__(self, group: ProcessGroup | None, gradient_average: int) -> None:
        self._group = group
        self._gradient_average = gradient_average
        self._window: Tensor | None = None  # (sum, count) of the window so far, over the loss mesh
        self._reference: Tensor | None = None  # the token count the window's backward scale assumed
        self._rescale = False
        # Under torchft replica groups: sums a tensor over the groups of the step's quorum (training only; each
        # group evaluates every row itself).
        self.across_replicas: Callable[[Tensor], None] | None = None
        self.in_use = False  # the module's training steps hand over their token sums
        self.mean_warning = _MeanOfMeansWarning()

    def mean(self, loss_sum: Tensor, num_tokens: Tensor, *, training: bool, accumulate: int) -> Tensor:
        """``token_mean`` under TitanStrategy."""
        self.in_use = self.in_use or training
        if self._gradient_average == 1 and accumulate == 1 and self.across_replicas is None:
            return loss_sum / num_tokens.clamp(min=1)  # one batch of one rank: its mean is the mean
        totals = self._reduce(loss_sum, num_tokens)
        if training and self.across_replicas is not None:
            self.across_replicas(totals)
        if not training:
            return _mean(totals).to(loss_sum.dtype)
        if self._window is None:
            self._reference = accumulate * totals[1].clamp(min=1)
        window = self._add(totals, rescale=accumulate > 1)
        # Lightning divides the step's loss by ``accumulate`` and FSDP averages the gradients over the ranks:
        # the token sum's gradient comes out as 1 / reference per token.
        scale = (self._gradient_average * accumulate / self._reference).to(loss_sum.dtype)
        return _ValueWithScaledGradient.apply(loss_sum, _mean(window).to(loss_sum.dtype), scale)

    def pipeline_mean(self, loss_sum: Tensor, num_tokens: Tensor, *, training: bool, accumulate: int,
                      microbatches: int) -> Tensor:
        """The mean after a pipeline step, from this replica's sums over its microbatches.

        The schedule has already run backward with each microbatch's sum scaled by 1 / (microbatches x
        accumulate): with FSDP's average, that is a reference count of ``ranks x accumulate x microbatches``.
        """
        totals = self._reduce(loss_sum, num_tokens)
        if not training:
            return _mean(totals).float()
        if self._window is None:
            self._reference = torch.tensor(float(self._gradient_average * accumulate * microbatches),
                                           dtype=torch.float64, device=totals.device)
        return _mean(self._add(totals, rescale=True)).float()

    def finish_window(self, parameters: Iterable[nn.Parameter]) -> None:
        """After the window's last backward, before clipping: its gradients become those of its mean."""
        window, reference, self._window, self._reference = self._window, self._reference, None, None
        if window is None or not self._rescale:
            return
        factor = (reference / window[1].clamp(min=1)).float()
        with torch.no_grad():
            grads = [local(p.grad) for p in parameters if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)

    def _reduce(self, loss_sum: Tensor, num_tokens: Tensor) -> Tensor:
        # float64: counts stay exact far beyond float32's 2**24 tokens per step.
        totals = torch.stack([loss_sum.detach().double(), num_tokens.double()])
        if self._group is not None:
            dist.all_reduce(totals, group=self._group)
        return totals

    def _add(self, totals: Tensor, rescale: bool) -> Tensor:
        self._window = totals if self._window is None else self._window + totals
        self._rescale = rescale
        return self._window


def _mean(totals: Tensor) -> Tensor:
    return totals[0] / totals[1].clamp(min=1)


class _ValueWithScaledGradient(torch.autograd.Function):
    """Forward: ``value`` (the mean over every rank and batch so far). Backward: the incoming gradient times
    ``scale``, to ``loss_sum``, this rank's token sum."""

    @staticmethod
    def forward(ctx: Any, loss_sum: Tensor, value: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale, None, None


class _MeanOfMeansWarning:
    """Warns once when a module trains on a plain mean, its labels hold -100, and the layout averages means.

    The check costs a host sync, so it runs only where the progress bar syncs anyway.
    """

    def __init__(self) -> None:
        self._padded: Tensor | None = None
        self._warned = False

    def observe(self, batch: Any, averaged_over: str, check_now: bool) -> None:
        labels = batch.get("labels") if isinstance(batch, Mapping) else None
        if self._warned or not isinstance(labels, Tensor):
            return
        padded = (labels == IGNORE_INDEX).any()
        self._padded = padded if self._padded is None else self._padded | padded
        if check_now and bool(self._padded):
            self._warned = True
            warnings.warn(
                f"The module's training loss is a plain mean, and its labels hold {IGNORE_INDEX}: averaged over "
                f"{averaged_over}, such means weight each token by how many labelled tokens its batch had, so the "
                "loss and gradients depend on the layout. Return token_mean(self, loss_sum, num_tokens) from "
                "training_step (and (loss_sum, num_tokens) from pipeline_loss) to train on the mean over every "
                "token (titan_strategy.token_loss).", stacklevel=2)
