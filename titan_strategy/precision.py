"""Trainer precision mapped onto FSDP2 mixed precision, and DTensor-aware gradient clipping."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from typing_extensions import override

from titan_strategy.grad_norm import clip_grad_norm_, clip_scale, total_grad_norm
from titan_strategy.kernels.adamw import TritonAdamW

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TitanPrecision", "SUPPORTED_PRECISION", "to_titan_precision"]

SUPPORTED_PRECISION = ("32-true", "bf16-mixed")


class TitanPrecision(Precision):
    """``"bf16-mixed"`` keeps fp32 master weights, computes in bf16 and reduces gradients in fp32.

    For a module the strategy shards, FSDP2's ``MixedPrecisionPolicy`` does the casting, so no autocast
    runs. On a single device (no FSDP) the strategy may give the parameters bf16 values with fp32 masters in
    TritonAdamW instead (``master_weights.py``); otherwise there, and for a module that parallelized itself,
    autocast does, as Lightning would run it.
    """

    def __init__(self, precision: Literal["32-true", "bf16-mixed"], device_type: str) -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"TitanStrategy does not support precision={precision!r}; use one of {SUPPORTED_PRECISION}."
            )
        self.precision = precision
        self.device_type = device_type
        self.use_autocast = False
        self.on_grad_norm: Callable[[Tensor], None] | None = None
        # Set by the strategy: waits until an async checkpoint has copied the parameters the step will change.
        self.before_parameter_update: Callable[[], None] | None = None
        # Set by the strategy under pipeline parallelism: the norm spans every stage's parameters.
        self.grad_norm_group: ProcessGroup | None = None
        self._clip_scale_of: Optimizer | None = None  # the optimizer whose step divides by this step's clip scale
        self._norm_reported = False  # whether this step's clipping logged the norm it clipped by

    @property
    def param_dtype(self) -> torch.dtype | None:
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.precision == "bf16-mixed" else None

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        autocast = self.use_autocast and self.param_dtype is not None
        with torch.autocast(self.device_type, dtype=self.param_dtype) if autocast else nullcontext():
            yield

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if _divides_gradients_as_it_reads_them(optimizer):
            # Fused Adam(W) and TritonAdamW divide each gradient by `grad_scale` as they read it (what
            # GradScaler uses): clipping by that scale saves a read and write of every gradient.
            total_norm = total_grad_norm(_parameters(optimizer), group=self.grad_norm_group)
            optimizer.grad_scale = clip_scale(total_norm, clip_val)
            self._clip_scale_of = optimizer
        else:
            total_norm = clip_grad_norm_(_parameters(optimizer), max_norm=float(clip_val),
                                         group=self.grad_norm_group)
        self._norm_reported = True
        if self.on_grad_norm is not None:
            self.on_grad_norm(total_norm)

    @override
    def optimizer_step(self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        try:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        finally:
            if self._clip_scale_of is optimizer:  # the scale was this step's only
                del optimizer.grad_scale
                self._clip_scale_of = None

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Optimizer) -> None:
        self._norm_reported = False
        super()._after_closure(model, optimizer)  # hooks, then clipping (which reports the norm it used)
        if not self._norm_reported and self.on_grad_norm is not None:
            self.on_grad_norm(total_grad_norm(_parameters(optimizer), group=self.grad_norm_group))
        if self.before_parameter_update is not None:
            self.before_parameter_update()


def _divides_gradients_as_it_reads_them(optimizer: Optimizer) -> bool:
    fused = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and all(
        group.get("fused") for group in optimizer.param_groups)
    return (fused or isinstance(optimizer, TritonAdamW)) and getattr(optimizer, "grad_scale", None) is None


def _parameters(optimizer: Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def to_titan_precision(plugin: Precision | None) -> TitanPrecision | None:
    """Map the precision plugin Lightning picked from ``Trainer(precision=...)`` onto ours."""
    if plugin is None or isinstance(plugin, TitanPrecision):
        return plugin
    if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
        return TitanPrecision("bf16-mixed", plugin.device)
    if type(plugin) is Precision:
        return TitanPrecision("32-true", "cpu")
    raise ValueError(
        f"TitanStrategy does not support precision={getattr(plugin, 'precision', type(plugin).__name__)!r}; "
        f"use Trainer(precision=...) with one of {SUPPORTED_PRECISION}."
    )
