"""A callback for runs started through ``titan fit``: per training batch, the logged loss and the ids of the samples
(``sample_id``) or packed windows (``window_id``) it held, written as ``OUT_DIR/rank{N}.json`` in the format of
tests/support/train_worker.py's records (``tests.support.parity.Record``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class BatchLog(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        ids = batch["sample_id"] if "sample_id" in batch else batch["window_id"]
        self.steps.append({"step": trainer.global_step, "train_loss": float(trainer.callback_metrics["train_loss"]),
                           "sample_ids": ids.tolist()})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"steps": self.steps, "batch_rank": trainer.strategy.distributed_sampler_kwargs["rank"]}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
