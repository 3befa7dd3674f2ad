"""Single-GPU training throughput of Lightning Trainer + TitanStrategy + LlamaModule.

    python benchmarks/throughput.py --flavor 1B --seq-len 8192 --batch-size 2 --steps 30

Random tokens (the data path is not measured), bf16-mixed through FSDP2's MixedPrecisionPolicy on a
one-rank mesh, fused AdamW. Reports tokens/s and MFU over the steps after warm-up, and peak memory.
MFU counts 6 * (parameters without the embedding) + 12 * layers * dim * seq_len FLOPs per token (the
recomputation of activation checkpointing is not counted). A run that runs out of GPU memory prints
``"oom": true`` and the peak it reached instead of failing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from llama_module import LlamaModule
from llama_module.args import get_flavor
from titan_strategy import TitanStrategy

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "B200": 2250.0}


class RandomTokens(Dataset):
    def __init__(self, length: int, seq_len: int, vocab: int) -> None:
        self.length, self.seq_len, self.vocab = length, seq_len, vocab

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens[:-1], "labels": tokens[1:]}


class StepTimer(Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start: float | None = None
        self.timed_steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        torch.cuda.synchronize()
        if trainer.global_step == self.warmup:
            self.start = time.perf_counter()
        elif trainer.global_step > self.warmup:
            self.timed_steps += 1
        self.elapsed = time.perf_counter() - (self.start or time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    parser.add_argument("--activation-checkpointing", default="none", choices=["none", "full"])
    parser.add_argument("--n-layers", type=int, help="override the flavor's number of blocks")
    args = parser.parse_args()

    config = get_flavor(args.flavor)
    if args.n_layers is not None:
        config = dataclasses.replace(config, n_layers=args.n_layers)
    config = dataclasses.replace(config, max_seq_len=max(args.seq_len, 2048))
    timer = StepTimer(args.warmup)
    strategy = TitanStrategy(compile=args.compile, activation_checkpointing=args.activation_checkpointing)
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, precision=args.precision,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    module = LlamaModule(model=config, warmup_steps=10)
    data = DataLoader(RandomTokens(args.steps * args.batch_size, args.seq_len, config.vocab_size),
                      batch_size=args.batch_size, num_workers=2, pin_memory=True)
    torch.cuda.reset_peak_memory_stats()
    setting = {"flavor": args.flavor, "n_layers": config.n_layers, "seq_len": args.seq_len, "batch_size": args.batch_size,
               "precision": args.precision, "compile": args.compile,
               "activation_checkpointing": args.activation_checkpointing}
    try:
        trainer.fit(module, train_dataloaders=data)
    except torch.OutOfMemoryError:
        print(json.dumps({**setting, "oom": True, "timed_steps": timer.timed_steps, **_memory()}))
        return

    tokens_per_s = timer.timed_steps * args.batch_size * args.seq_len / timer.elapsed
    flops_per_token = 6 * config.num_params(exclude_embedding=True) + 12 * config.n_layers * config.dim * args.seq_len
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), float("nan"))
    result = {
        **setting, "oom": False, "tokens_per_s": round(tokens_per_s),
        "mfu_percent": round(100 * tokens_per_s * flops_per_token / (peak * 1e12), 1), **_memory(), "device": name,
        "torch": torch.__version__, "lightning": L.__version__, "timed_steps": timer.timed_steps,
    }
    if trainer.is_global_zero:
        print(json.dumps(result))


def _memory() -> dict[str, float]:
    return {"peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1),
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}


if __name__ == "__main__":
    main()
