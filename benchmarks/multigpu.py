"""One multi-GPU training case of benchmarks/multigpu.sh: Lightning Trainer + TitanStrategy + LlamaModule.

    python benchmarks/multigpu.py --devices 8 --flavor 8B --seq-len 8192 --batch-size 1 \\
        --strategy '{"compile": true, "compile_loss": true, "activation_checkpointing": "selective_op"}'

Random tokens, bf16-mixed. ``--batch-size`` is per data-parallel rank (each of its cp·tp·pp ranks sees
the same batch). Lightning starts one process per device. Each rank prints one ``RESULT {json}`` line:
tokens/s per GPU and MFU (the ``Throughput`` callback's windows after the first, median), and its own
peak memory over the last window (the callback restarts the peak counters at each window).
multigpu.sh keeps rank 0's speed and the largest peak over the ranks (pipeline stages and CP ranks
differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import lightning as L
import torch
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from llama_module.args import get_flavor
from llama_module.synthetic import RandomTokens
from titan_strategy import Throughput, TitanStrategy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="case", help="a name for the result line")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--n-layers", type=int, help="override the flavor's number of blocks")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel rank and step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--window", type=int, default=5, help="steps per throughput window")
    parser.add_argument("--strategy", default="{}", help="TitanStrategy keyword arguments, as JSON")
    args = parser.parse_args()
    if args.steps < 1 + 2 * args.window:
        raise SystemExit(f"--steps={args.steps} gives fewer than two windows of --window={args.window} steps after "
                         f"the first; use --steps >= {1 + 2 * args.window}.")

    config = get_flavor(args.flavor)
    if args.n_layers is not None:
        config = dataclasses.replace(config, n_layers=args.n_layers)
    config = dataclasses.replace(config, max_seq_len=max(args.seq_len, config.max_seq_len))
    throughput = Throughput(log_every_n_steps=args.window, prog_bar=False)
    strategy = TitanStrategy(**json.loads(args.strategy))
    trainer = L.Trainer(accelerator="cuda", devices=args.devices, strategy=strategy, precision="bf16-mixed",
                        max_steps=args.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[throughput])
    data = DataLoader(RandomTokens(args.steps * args.batch_size * args.devices, args.seq_len, config.vocab_size),
                      batch_size=args.batch_size, num_workers=2, pin_memory=True)
    trainer.fit(LlamaModule(model=config, warmup_steps=10, decay_steps=1000), train_dataloaders=data)

    timed = throughput.windows[1:]  # the first window still compiles and warms the allocator up
    mfu = [w.mfu for w in timed if w.mfu is not None]
    print("RESULT " + json.dumps({
        "case": args.case, "rank": trainer.global_rank, "devices": args.devices,
        "tokens_per_s_per_gpu": round(statistics.median(w.tokens_per_s_per_device for w in timed)),
        "mfu_percent": round(100 * statistics.median(mfu), 1) if mfu else None,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
