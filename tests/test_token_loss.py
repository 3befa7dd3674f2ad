"""The token-weighted loss in one process: its sums, accumulation windows weighted by tokens, and the warning
for modules that keep plain means. The multi-process layouts are checked against one process with padded
labels by every parity test (tests/support/parity.py's BASE_RUN)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from tests.support.train_worker import TINY, AffineSequences
from titan_strategy import TitanStrategy
from titan_strategy.token_loss import token_cross_entropy, token_mean

pytestmark = pytest.mark.unit


def test_token_cross_entropy_is_the_sum_the_mean_averages() -> None:
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    labels[0, 2:] = labels[2, 4:] = -100
    loss_sum, num_tokens = token_cross_entropy(logits, labels)
    assert int(num_tokens) == 15 - 3 - 1
    mean = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss_sum / num_tokens, mean)
    # Outside TitanStrategy (no trainer here) token_mean is that batch's own mean.
    torch.testing.assert_close(token_mean(LlamaModule(model=TINY), loss_sum, num_tokens), mean)


class _Steps(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.grad_norms: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        metrics = trainer.callback_metrics
        self.losses.append(float(metrics["train_loss"]))
        if "grad_norm" in metrics and len(self.grad_norms) < trainer.global_step:
            self.grad_norms.append(float(metrics["grad_norm"]))


class _PlainMeanLlama(LlamaModule):
    """A third-party style step: the batch's mean, no token sums handed over."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        self.log_loss("train", loss)
        return loss


def _fit(tmp_path: Path, module: LlamaModule, batch_size: int, accumulate: int, steps: int = 4) -> _Steps:
    steps_seen = _Steps()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TitanStrategy(), max_steps=steps,
                        accumulate_grad_batches=accumulate, gradient_clip_val=1.0, logger=False, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[steps_seen], default_root_dir=tmp_path)
    L.seed_everything(0, verbose=False)
    try:
        trainer.fit(module, DataLoader(AffineSequences(64, 32, TINY.vocab_size, padded=True), batch_size=batch_size))
    finally:  # the strategy's process group of one, which tests that build their own would collide with
        if dist.is_initialized():
            dist.destroy_process_group()
    return steps_seen


def _module(cls: type[LlamaModule] = LlamaModule) -> LlamaModule:
    return cls(model=TINY, lr=3e-3, warmup_steps=1, decay_steps=10)


def test_accumulated_windows_weight_every_token_like_one_larger_batch(tmp_path: Path) -> None:
    # Two batches of 4 padded samples have other token counts than each other: averaging their means would
    # weight tokens unevenly; the window's loss and gradients are those of the 8 samples together.
    one = _fit(tmp_path / "one", _module(), batch_size=8, accumulate=1)
    accumulated = _fit(tmp_path / "two", _module(), batch_size=4, accumulate=2)
    assert accumulated.losses[1::2] == pytest.approx(one.losses, rel=1e-5)
    assert accumulated.grad_norms == pytest.approx(one.grad_norms, rel=1e-5)
    assert accumulated.losses[0::2] != pytest.approx(one.losses, rel=1e-3)  # the first batch alone is not


def test_a_plain_mean_over_padded_labels_is_warned_once_where_means_are_averaged(tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match=r"plain mean, and its labels hold -100: averaged over 2 accumulated "
                                         r"batches.*token_mean\(self, loss_sum, num_tokens\)") as caught:
        _fit(tmp_path / "plain", _module(_PlainMeanLlama), batch_size=4, accumulate=2)
    assert sum("plain mean" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(tmp_path / "token", _module(), batch_size=4, accumulate=2)
    assert not [w for w in caught if "plain mean" in str(w.message)]
