"""One short fit of a tiny Llama for tests/test_simulated_ranks.py: in one process, or with every rank of a layout
simulated in this one (``SimulatedRanksStrategy``). Writes its per-step training losses as JSON.

    python tests/support/simulate_worker.py RUN.json OUT.json

RUN.json: {"world_size": 0 for one process, else the simulated world; "knobs": TitanStrategy knobs;
"device": "cpu" | "cuda"; "precision": Trainer precision; "attention_mask" and "attention_kernel": LlamaModule's}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from llama_module import LlamaModule
from titan_strategy import TitanStrategy
from titan_strategy.simulated_ranks import SimulatedRanksStrategy

# Widths divide by 16 (float8's matmuls) after a TP2 split; 32 tokens make 4 chunks of 8 under CP2.
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim": 128, "max_seq_len": 32}
STEPS, GLOBAL_BATCH, SEQ_LEN = 4, 4, 32


def samples() -> list[dict[str, torch.Tensor]]:
    """A map-style dataset: uneven documents and uneven tails of -100 labels, as padded pre-training rows."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for index in range(STEPS * GLOBAL_BATCH):
        tokens = torch.randint(0, TINY["vocab_size"], (SEQ_LEN + 1,), generator=generator)
        labels = tokens[1:].clone()
        labels[SEQ_LEN - index % 7 :] = -100
        boundaries = torch.zeros(SEQ_LEN, dtype=torch.long)
        boundaries[torch.randint(1, SEQ_LEN, (2,), generator=generator)] = 1
        rows.append({"input_ids": tokens[:-1], "labels": labels, "document_ids": boundaries.cumsum(0)})
    return rows


class Losses(Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.values.append(float(outputs["loss"]))


def main(run_path: str, out_path: str) -> None:
    run = json.loads(Path(run_path).read_text())
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    module = LlamaModule(model=TINY, attention_mask=run["attention_mask"], attention_kernel=run["attention_kernel"],
                         warmup_steps=0, decay_steps=STEPS)
    strategy = (SimulatedRanksStrategy(run["world_size"], **run["knobs"]) if run["world_size"]
                else TitanStrategy(**run["knobs"]))
    losses = Losses()
    trainer = L.Trainer(strategy=strategy, accelerator=run["device"], devices=1, precision=run["precision"],
                        max_steps=STEPS, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[losses])
    loader = torch.utils.data.DataLoader(samples(), batch_size=GLOBAL_BATCH, shuffle=True)
    trainer.fit(module, loader)
    Path(out_path).write_text(json.dumps(losses.values))


if __name__ == "__main__":
    main(*sys.argv[1:])
