"""A transformers model built in ``configure_model`` (on the meta device) trains on one device under TitanStrategy:
initialized by transformers' own ``_init_weights`` on that device, in ``bf16-true``, with its decoder layers
compiled on CUDA."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import DEVICES
from tests.support.train_worker import AffineSequences
from tests.support.user_modules import VOCAB, CausalLM
from titan_strategy import TitanStrategy

pytest.importorskip("transformers")


@pytest.mark.parametrize("device", DEVICES)
def test_a_meta_built_transformers_model_trains_in_bf16_true(device: str, tmp_path: Path) -> None:
    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: torch.Tensor,
                               *args: object) -> None:
            losses.append(float(outputs["loss"]))

    module = CausalLM("llama", "configure_model")
    trainer = L.Trainer(accelerator=device, devices=1, precision="bf16-true", max_steps=6, logger=False,
                        strategy=TitanStrategy(compile=device == "cuda"), enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
                        default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(AffineSequences(48, 32, VOCAB), batch_size=8))
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16}
    assert all(p.device.type == device for p in module.parameters())
    norms = [p for name, p in module.named_parameters() if name.endswith("norm.weight")]
    assert norms and all(abs(float(p.float().mean()) - 1) < 0.05 for p in norms)  # HF's ones, a few steps on
    assert len(losses) == 6 and losses[-1] < losses[0]
