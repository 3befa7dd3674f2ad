"""Trainer precision, decided once per setup (FSDP2 mixed precision, master weights or autocast), and
DTensor-aware gradient clipping."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer
from typing_extensions import override

from titan_strategy.grad_norm import clip_grad_norm_, clip_scale, total_grad_norm
from titan_strategy.kernels.adamw import TritonAdamW
from titan_strategy.knobs import choices
from titan_strategy.master_weights import MasterWeights, hold_master_weights_where_exact

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ParallelizedAs", "PrecisionMode", "SUPPORTED_PRECISION", "TitanPrecision", "configure_precision",
           "quiet_lightning_lines", "to_titan_precision"]

TrainerPrecision = Literal["32-true", "bf16-mixed", "bf16-true", "16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = choices(TrainerPrecision)
PrecisionMode = Literal["fsdp_mixed", "autocast", "master_weights"]
"""What gives the step its compute dtype: FSDP2's MixedPrecisionPolicy (sharded); bf16 parameters with fp32
masters in TritonAdamW (``master_weights.py``); or autocast over fp32 parameters. Under "32-true" there is no
lower dtype, so each of them computes in fp32 (autocast, then, is not entered). Under "bf16-true" and "16-true"
the parameters themselves hold the low dtype: nothing casts them, and FSDP reduces gradients in fp32."""
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


class ParallelizedAs(Protocol):
    """What the choice of precision needs to know of how the strategy parallelized the model (its runtime)."""

    @property
    def sharded(self) -> bool:
        """FSDP wraps the model, and its mixed-precision policy casts the parameters."""

    @property
    def pipeline(self) -> object | None:
        """The pipeline schedule's runner under PP, else None."""

    @property
    def grad_norm_group(self) -> ProcessGroup | None:
        """The group the gradient norm spans beyond the parameters' own meshes."""


class TitanPrecision(Precision):
    """``"bf16-mixed"`` keeps fp32 master weights, computes in bf16 and reduces gradients in fp32. ``"bf16-true"``
    and ``"16-true"`` hold the parameters in that dtype (as Lightning's ``HalfPrecision`` does); FSDP still reduces
    their gradients in fp32.

    Which ``PrecisionMode`` does it is ``mode``, set by ``configure_precision`` once the model and its optimizers
    exist.
    """

    def __init__(self, precision: TrainerPrecision, device_type: str) -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"TitanStrategy does not support precision={precision!r}; use one of {SUPPORTED_PRECISION}."
            )
        self.precision = precision
        self.device_type = device_type
        self.mode: PrecisionMode = "autocast"
        self.on_grad_norm: Callable[[Tensor], None] | None = None
        # Set by the strategy: waits until an async checkpoint has copied the parameters the step will change.
        self.before_parameter_update: Callable[[], None] | None = None
        # Under pipeline parallelism: the norm spans every stage's parameters.
        self.grad_norm_group: ProcessGroup | None = None
        self._clip_scale_of: Optimizer | None = None  # the optimizer whose step divides by this step's clip scale
        self._norm_reported = False  # whether this step's clipping logged the norm it clipped by

    @property
    def use_autocast(self) -> bool:
        return self.mode == "autocast"

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The dtype FSDP (or autocast) computes in, where the parameters hold another; None: theirs."""
        return torch.bfloat16 if self.precision == "bf16-mixed" else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.precision != "32-true" else None

    @property
    def true_dtype(self) -> torch.dtype | None:
        """The dtype the parameters themselves hold under "bf16-true"/"16-true"; None otherwise."""
        return _TRUE_DTYPES.get(self.precision)

    @contextmanager
    def _default_dtype(self) -> Generator[None, None, None]:
        """Under a true half precision, tensors made without a dtype take it (Lightning's ``HalfPrecision``)."""
        previous = torch.get_default_dtype()
        if self.true_dtype is not None:
            torch.set_default_dtype(self.true_dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    @override
    def tensor_init_context(self) -> Any:
        return self._default_dtype()

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(dtype=self.true_dtype) if self.true_dtype is not None else module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.true_dtype is None:
            return data
        return apply_to_collection(data, Tensor, lambda t: t.to(self.true_dtype) if t.is_floating_point() else t)

    @contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        autocast = self.use_autocast and self.param_dtype is not None
        with torch.autocast(self.device_type, dtype=self.param_dtype) if autocast else nullcontext(), \
                self._default_dtype():
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
    if isinstance(plugin, HalfPrecision):
        return TitanPrecision(plugin.precision, "cpu")
    if type(plugin) is Precision:
        return TitanPrecision("32-true", "cpu")
    raise ValueError(
        f"TitanStrategy does not support precision={getattr(plugin, 'precision', type(plugin).__name__)!r}; "
        f"use Trainer(precision=...) with one of {SUPPORTED_PRECISION}."
    )


def configure_precision(plugin: TitanPrecision, module: pl.LightningModule, optimizers: list[Optimizer],
                        parallelized: ParallelizedAs | None) -> MasterWeights | None:
    """Decide how this run computes and set ``plugin`` up for it: the one place precision is chosen.

    - A module that parallelized itself (``parallelized`` None): autocast, as Lightning runs it.
    - A module FSDP shards: FSDP2's mixed precision (``parallelize`` gave it the policy).
    - Under bf16-mixed, an unsharded module whose every parameter TritonAdamW updates, with one backward per
      step: master weights.
    - Otherwise autocast.

    Returns:
        The master weights to release at teardown, where they were chosen.
    """
    plugin.grad_norm_group = parallelized.grad_norm_group if parallelized is not None else None
    master = None
    if parallelized is None:
        mode: PrecisionMode = "autocast"
    elif parallelized.sharded:
        mode = "fsdp_mixed"
    else:
        master = hold_master_weights_where_exact(module, optimizers, plugin.param_dtype,
                                                 pipelined=parallelized.pipeline is not None)
        mode = "master_weights" if master is not None else "autocast"
    plugin.mode = mode
    if plugin.precision == "bf16-mixed":  # in place of Lightning's AMP line, which the strategy silences
        rank_zero_info(f"TitanStrategy: bf16-mixed as {_BF16_MIXED_AS[mode]}.")
    return master


_BF16_MIXED_AS: dict[PrecisionMode, str] = {
    "fsdp_mixed": "FSDP2 mixed precision: fp32 sharded parameters, bf16 gathered weights and compute, gradients "
                  "reduced in fp32 (no autocast)",
    "master_weights": "bf16 parameters with fp32 masters in TritonAdamW (no autocast, no casts in the step)",
    "autocast": "torch.autocast over fp32 parameters",
}


class _WithoutLightningsAmpLine(logging.Filter):
    """Drops "Using bfloat16 Automatic Mixed Precision (AMP)", which Lightning prints while the Trainer builds its
    precision plugin, before TitanStrategy replaces that plugin (``configure_precision`` then says what runs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Automatic Mixed Precision (AMP)" not in record.getMessage()


def quiet_lightning_lines() -> None:
    """Silence what Lightning says that is not so under this strategy, or that no user can act on (once; every
    Trainer of this process is affected): its AMP line, and torch 2.13's pytree deprecation, which Lightning 2.6
    triggers twice a run."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _WithoutLightningsAmpLine) for f in logger.filters):
            logger.addFilter(_WithoutLightningsAmpLine())
