"""Long-context memory on one GPU: where a single GPU runs out and context parallelism becomes necessary.

    python benchmarks/long_context.py --flavor 8B --seq-lens 8192 32768 65536 131072

Each sequence length trains in its own process (``benchmarks/throughput.py``, batch 1, bf16-mixed,
full activation checkpointing, cp=1), so one that runs out of memory cannot disturb the next. Prints a
Markdown table: peak allocated and reserved memory, and tokens/s where the run fits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

THROUGHPUT = Path(__file__).with_name("throughput.py")


def run(flavor: str, seq_len: int, n_layers: int | None, steps: int, warmup: int, compile: bool) -> dict:
    command = [sys.executable, str(THROUGHPUT), "--flavor", flavor, "--seq-len", str(seq_len), "--batch-size", "1",
               "--steps", str(steps), "--warmup", str(warmup), "--activation-checkpointing", "full"]
    command += ["--n-layers", str(n_layers)] if n_layers is not None else []
    command += ["--compile"] if compile else []
    finished = subprocess.run(command, capture_output=True, text=True)
    results = [line for line in finished.stdout.splitlines() if line.startswith("{")]
    if not results:
        raise RuntimeError(f"{' '.join(command)} failed:\n{finished.stderr[-3000:]}")
    return json.loads(results[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="8B")
    parser.add_argument("--n-layers", type=int, help="override the flavor's number of blocks")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    print("| seq_len | fits | peak allocated GiB | peak reserved GiB | tokens/s | MFU |")
    print("|---|---|---|---|---|---|")
    for seq_len in args.seq_lens:
        result = run(args.flavor, seq_len, args.n_layers, args.steps, args.warmup, args.compile)
        speed = ("-", "-") if result["oom"] else (f"{result['tokens_per_s']:,}", f"{result['mfu_percent']}%")
        print(f"| {seq_len:,} | {'no (OOM)' if result['oom'] else 'yes'} | {result['peak_memory_gib']} | "
              f"{result['peak_reserved_gib']} | {speed[0]} | {speed[1]} |", flush=True)
        print(json.dumps(result), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
