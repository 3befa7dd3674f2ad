"""Throughput: tokens/s per device, TFLOP/s, MFU, peak memory and the data-loading share of a training run.

Per device means per GPU of the job: the global rate divided by the world size. A rank sees the
batch of its data-parallel group, which the group's ``world / dp`` ranks (its cp·tp·pp ranks) share,
so a rank's own rate is its batch tokens over time, divided by ``world / dp``. Lightning's
``ThroughputMonitor`` multiplies by the world size instead, which overcounts under TP, PP and CP.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from titan_strategy.step_metrics import log_to_progress_bar

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["PEAK_BF16_TFLOPS", "Throughput", "ThroughputWindow", "peak_tflops_of"]

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peaks (vendor data sheets, no sparsity), by a substring of the device name;
# the first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200": 989.0, "A100": 312.0, "GB200": 2500.0,
    "B200": 2250.0,
}


def peak_tflops_of(device_name: str) -> float | None:
    return next((peak for name, peak in PEAK_BF16_TFLOPS.items() if name in device_name), None)


@dataclass(frozen=True)
class ThroughputWindow:
    """What one logging window measured on one rank, and what follows from it.

    Attributes:
        tokens: tokens of the batches this rank trained on in the window (its data-parallel group's share).
        seconds: wall time of the window, GPU work included.
        data_seconds: time spent between a batch's end and the next batch's start (fetching data).
        ranks_per_batch: ranks that share one data-parallel batch (world size / data-parallel size).
        flops_per_token: model FLOPs of training on one token (forward + backward, no recomputation).
        peak_tflops: the device's peak, or None where unknown (no MFU then).
    """

    tokens: int
    seconds: float
    data_seconds: float
    ranks_per_batch: int
    flops_per_token: float | None
    peak_tflops: float | None

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens / self.seconds / self.ranks_per_batch

    @property
    def tflops_per_device(self) -> float | None:
        if self.flops_per_token is None:
            return None
        return self.tokens_per_s_per_device * self.flops_per_token / 1e12

    @property
    def mfu(self) -> float | None:
        tflops = self.tflops_per_device
        return None if tflops is None or self.peak_tflops is None else tflops / self.peak_tflops

    def metrics(self) -> dict[str, float]:
        values = {"tokens_per_s_per_device": self.tokens_per_s_per_device, "tflops_per_device": self.tflops_per_device,
                  "mfu_percent": None if self.mfu is None else 100 * self.mfu,
                  "data_loading_percent": 100 * self.data_seconds / self.seconds}
        return {f"throughput/{name}": value for name, value in values.items() if value is not None}


class Throughput(Callback):
    """Measure and log training throughput every ``log_every_n_steps`` training batches.

    The first training batch (compilation, allocator warm-up) and any batch interrupted by
    validation are left out. On CUDA a window's ends are events on the compute stream, so measuring
    never waits for the GPU: a window is logged, with the step it ended at, at the first batch end
    after the GPU has passed its last event (usually the next one), and the windows still pending
    when training ends or validation starts are logged then.

    Args:
        log_every_n_steps: training batches per window.
        flops_per_token: model FLOPs of one training token; None asks the LightningModule's
            ``flops_per_token(seq_len)`` (LlamaModule has one), else no TFLOP/s or MFU are reported.
        peak_tflops: the device peak that MFU divides by; None looks the device up in ``PEAK_BF16_TFLOPS``.
        tokens_fn: ``batch -> (tokens, seq_len)``; None counts the batch's ``input_ids`` (or its first tensor).
        prog_bar: also show tokens/s and MFU in the progress bar.

    Logged (to the trainer's loggers): ``throughput/tokens_per_s_per_device``,
    ``throughput/tflops_per_device``, ``throughput/mfu_percent``, ``throughput/data_loading_percent``, and on
    CUDA ``memory/peak_allocated_gib`` and ``memory/peak_reserved_gib`` over the window (on CPU
    ``memory/host_peak_rss_gib``, the process's high-water mark so far).
    """

    def __init__(self, log_every_n_steps: int = 10, flops_per_token: float | None = None,
                 peak_tflops: float | None = None, tokens_fn: Callable[[Any], tuple[int, int]] | None = None,
                 prog_bar: bool = True) -> None:
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1.")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"peak_tflops={peak_tflops} must be > 0 (the device's dense bf16 peak in TFLOP/s).")
        self.log_every_n_steps = log_every_n_steps
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.tokens_fn = tokens_fn or _count_input_ids
        self.prog_bar = prog_bar
        self.windows: list[ThroughputWindow] = []
        self._start: _Mark | None = None
        self._last_end: float | None = None
        self._batches = self._tokens = 0
        self._data_seconds = 0.0
        self._seq_len = 0
        self._pending: list[_EndedWindow] = []

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        now = time.perf_counter()
        if self._start is not None and self._last_end is not None:
            self._data_seconds += now - self._last_end
        tokens, self._seq_len = self.tokens_fn(batch)
        self._tokens += tokens

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._batches += 1
        if self._start is not None and self._batches >= self.log_every_n_steps:
            end = _Mark(pl_module.device)
            self._pending.append(_EndedWindow(
                start=self._start, end=end, step=trainer.global_step, tokens=self._tokens,
                data_seconds=self._data_seconds, memory=_memory(pl_module.device),
            ))
            self._start = None
        if self._start is None:
            self._restart(pl_module.device)
        self._last_end = time.perf_counter()
        self._publish(trainer, pl_module, wait=False)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._publish(trainer, pl_module, wait=True)
        self._start = None  # the window in progress would count validation as training time

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._publish(trainer, pl_module, wait=True)

    def _restart(self, device: torch.device) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._batches = self._tokens = 0
        self._data_seconds = 0.0
        self._start = _Mark(device)

    def _publish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, wait: bool) -> None:
        """Log the ended windows whose last GPU work has run (all of them with ``wait``), oldest first."""
        while self._pending and (wait or self._pending[0].end.reached()):
            ended = self._pending.pop(0)
            window = ThroughputWindow(
                tokens=ended.tokens, seconds=ended.start.seconds_until(ended.end), data_seconds=ended.data_seconds,
                ranks_per_batch=_ranks_per_batch(trainer), flops_per_token=self._flops_per_token(pl_module),
                peak_tflops=self._peak(pl_module.device),
            )
            self.windows.append(window)
            self._log(trainer, pl_module, {**window.metrics(), **ended.memory}, ended.step)

    def _flops_per_token(self, pl_module: pl.LightningModule) -> float | None:
        if self.flops_per_token is not None:
            return self.flops_per_token
        flops = getattr(pl_module, "flops_per_token", None)
        return float(flops(self._seq_len)) if callable(flops) else None

    def _peak(self, device: torch.device) -> float | None:
        if self.peak_tflops is not None:
            return self.peak_tflops
        return peak_tflops_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, metrics: dict[str, float], step: int) -> None:
        # Straight to the loggers: self.log would publish them only on the trainer's own logging steps.
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
        if self.prog_bar:
            shown = {"tok/s": metrics["throughput/tokens_per_s_per_device"]}
            if "throughput/mfu_percent" in metrics:
                shown["mfu%"] = metrics["throughput/mfu_percent"]
            for name, value in shown.items():
                log_to_progress_bar(pl_module, name, round(value, 1))


class _Mark:
    """A point in a device's timeline: a CUDA event on the current stream, or the host clock elsewhere
    (where the host runs the work itself)."""

    def __init__(self, device: torch.device) -> None:
        self._event: torch.cuda.Event | None = None
        self._host = time.perf_counter()
        if device.type == "cuda":
            self._event = torch.cuda.Event(enable_timing=True)
            self._event.record(torch.cuda.current_stream(device))

    def reached(self) -> bool:
        """Whether the device has run everything queued before the mark (never waits)."""
        return self._event is None or self._event.query()

    def seconds_until(self, later: _Mark) -> float:
        if self._event is None or later._event is None:
            return later._host - self._host
        later._event.synchronize()  # returns at once where ``reached()``
        return self._event.elapsed_time(later._event) / 1e3


@dataclass(frozen=True)
class _EndedWindow:
    """A window whose batches are all queued; its time is known once the device reaches ``end``."""

    start: _Mark
    end: _Mark
    step: int
    tokens: int
    data_seconds: float
    memory: dict[str, float]


def _count_input_ids(batch: Any) -> tuple[int, int]:
    """(tokens, sequence length) of the batch's ``input_ids``, or of its first tensor."""
    tensor = _first_tensor(batch["input_ids"] if isinstance(batch, dict) and "input_ids" in batch else batch)
    if tensor is None:
        raise ValueError(f"Throughput found no tensor in the batch ({type(batch).__name__}) to count tokens in; "
                         "pass Throughput(tokens_fn=lambda batch: (tokens, seq_len)).")
    return tensor.numel(), tensor.shape[-1] if tensor.dim() else 1


def _first_tensor(value: Any) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((found for found in map(_first_tensor, items) if found is not None), None)


def _ranks_per_batch(trainer: pl.Trainer) -> int:
    """Ranks that see the same batch: the world over the data-parallel degree the sampler splits by."""
    strategy = trainer.strategy
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return max(trainer.world_size // kwargs.get("num_replicas", trainer.world_size), 1)


def _memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":  # the host process's high-water mark (Linux reports KiB), so CPU runs have a curve too
        return {"memory/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
