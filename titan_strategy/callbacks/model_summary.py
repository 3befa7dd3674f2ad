"""Lightning's model summary with a true FLOPs figure.

Lightning counts FLOPs by running ``example_input_array`` through the model. A pre-training module
has none (and a sharded or pipelined model could not run it alone), so its summary says "Total
FLOPs: 0" above a column of zeros. Where the module knows its ``flops_per_token`` and the datamodule
its ``seq_len``, ``with_training_flops`` swaps Lightning's own summary callbacks for ones whose total
is the training FLOPs of one sequence (forward and backward, as MFU counts them); the per-layer
column, which nothing measured, reads ``n/a``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import NOT_APPLICABLE, get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info

__all__ = ["training_flops_per_sequence", "with_training_flops"]


def training_flops_per_sequence(trainer: pl.Trainer, module: pl.LightningModule) -> tuple[int, int] | None:
    """``(flops, seq_len)``: ``module.flops_per_token(seq_len) * seq_len`` for the datamodule's ``seq_len``; None
    where either is unknown."""
    flops_per_token = getattr(module, "flops_per_token", None)
    seq_len = getattr(trainer.datamodule, "seq_len", None)
    if not callable(flops_per_token) or not isinstance(seq_len, int):
        return None
    return int(flops_per_token(seq_len)) * seq_len, seq_len


class _WithTrainingFlops:
    """Lightning's summary on fit start, with ``flops`` as its total and ``n/a`` in the FLOPs column."""

    _max_depth: int
    _summarize_kwargs: dict[str, Any]

    def __init__(self, flops: int, seq_len: int, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth=max_depth, **summarize_kwargs)  # type: ignore[call-arg]
        self.flops, self.seq_len = flops, seq_len

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._max_depth or not trainer.is_global_zero:
            return
        summary = self._summary(trainer, pl_module)  # type: ignore[attr-defined]
        columns = [(name, [NOT_APPLICABLE] * len(values) if name == "FLOPs" else values)
                   for name, values in summary._get_summary_data()]
        self.summarize(columns, summary.total_parameters, summary.trainable_parameters,  # type: ignore[attr-defined]
                       summary.model_size, summary.total_training_modes, total_flops=self.flops,
                       **self._summarize_kwargs)
        rank_zero_info(f"Total FLOPs {get_human_readable_count(self.flops)}: training one {self.seq_len}-token "
                       "sequence (forward and backward, no recomputation), as MFU counts it.")


class TrainingFlopsSummary(_WithTrainingFlops, ModelSummary):
    pass


class RichTrainingFlopsSummary(_WithTrainingFlops, RichModelSummary):
    pass


def with_training_flops(callbacks: list[Callback], trainer: pl.Trainer, module: pl.LightningModule) -> list[Callback]:
    """``callbacks`` with Lightning's own ModelSummary / RichModelSummary given the training FLOPs (a user's
    subclass is kept as it is), where they are known."""
    known = training_flops_per_sequence(trainer, module)
    swapped = {ModelSummary: TrainingFlopsSummary, RichModelSummary: RichTrainingFlopsSummary}
    if known is None:
        return callbacks
    return [swapped[type(callback)](*known, max_depth=callback._max_depth, **callback._summarize_kwargs)
            if type(callback) in swapped else callback for callback in callbacks]
