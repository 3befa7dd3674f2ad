"""How long a checkpoint save holds training, per ``checkpoint_mode``, on one GPU or FSDP over several.

    python benchmarks/checkpoint_save.py --mode async_pinned --dir /tmp/bench_ckpt
    python benchmarks/checkpoint_save.py --mode async_pinned --dir /tmp/bench_ckpt --devices 8 --flavor 8B

Trains the 1B shape (seq 8192, batch 2, bf16-mixed, random tokens) and saves a full checkpoint
(model, AdamW state, loops) at two steps, to the same path, so the second save replaces the first
and reuses whatever the first allocated (pinned buffers, the background process). Prints one JSON
line (rank 0's, whose shard is as large as any other's): per save, the time the save held the
training loop as the checkpoint IO measured it (``blocking_s``: the save call plus any wait for
staging before the next optimizer step), the time until the checkpoint was published
(``total_s``), and ``loop_held_s``: ``blocking_s`` plus how much longer than the median the step
after the save took (background work that slows the loop, such as pinned-memory allocation, counts
as holding it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from llama_module.args import get_flavor
from llama_module.synthetic import RandomTokens
from titan_strategy import CHECKPOINT_MODES, TitanStrategy


class SaveAndTime(Callback):
    def __init__(self, save_at: list[int], path: Path) -> None:
        self.save_at, self.path = save_at, path
        self.step_s: dict[int, float] = {}
        self._last = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        torch.cuda.synchronize()
        now = time.perf_counter()
        self.step_s[trainer.global_step] = now - self._last
        if trainer.global_step in self.save_at:
            trainer.save_checkpoint(self.path)
        self._last = time.perf_counter()  # the save's blocking time is reported apart from the step time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=CHECKPOINT_MODES, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoint is written (and then removed)")
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--save-at", type=int, nargs="+", default=[8, 96])
    parser.add_argument("--steps", type=int, default=104)
    parser.add_argument("--devices", type=int, default=1, help="GPUs; more than one shards the model with FSDP")
    args = parser.parse_args()

    config = get_flavor(args.flavor)
    saver = SaveAndTime(args.save_at, args.dir / f"{args.mode}.ckpt")
    strategy = TitanStrategy(checkpoint_mode=args.mode)
    trainer = L.Trainer(accelerator="cuda", devices=args.devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[saver])
    data = DataLoader(RandomTokens(args.steps * args.batch_size, args.seq_len, config.vocab_size),
                      batch_size=args.batch_size, num_workers=2, pin_memory=True)
    trainer.fit(LlamaModule(model=config, warmup_steps=10), train_dataloaders=data)

    if not trainer.is_global_zero:
        return
    checkpoint = saver.path
    size_gib = sum(f.stat().st_size for f in checkpoint.iterdir()) / 2**30
    after_save = {step + 1 for step in args.save_at}
    median = statistics.median(s for step, s in saver.step_s.items() if step > 3 and step not in after_save)
    saves = [{"step": step, "blocking_s": round(t.blocking_s, 3), "total_s": round(t.total_s or float("nan"), 2),
              "loop_held_s": round(t.blocking_s + max(0.0, saver.step_s[step + 1] - median), 2)}
             for step, t in zip(args.save_at, strategy.checkpoint_io.timings)]
    print(json.dumps({
        "mode": args.mode, "flavor": args.flavor, "checkpoint_gib": round(size_gib, 2), "saves": saves,
        "median_step_s": round(median, 4),
        "step_after_save_s": [round(saver.step_s[step], 4) for step in sorted(after_save)],
        "devices": args.devices, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "lightning": L.__version__,
    }))
    shutil.rmtree(checkpoint)


if __name__ == "__main__":
    main()
