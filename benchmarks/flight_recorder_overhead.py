"""Step time with and without the FlightRecorder callback, on a clean run (nothing is dumped).

    python benchmarks/flight_recorder_overhead.py --accelerator cpu --devices 2 --rounds 3      # gloo
    python benchmarks/flight_recorder_overhead.py --accelerator cuda --devices 1 --flavor 1B \\
        --seq-len 8192 --batch-size 2 --precision bf16-mixed                                     # NCCL

Three settings, each a fresh job (FR reads its settings when the process group is created), run in
turn ``--rounds`` times so that drifting machine load hits all of them alike:

- ``off``: no callback and ``TORCH_FR_BUFFER_SIZE=0`` (torch records nothing);
- ``torch_default``: no callback, torch's own defaults;
- ``flight_recorder``: ``FlightRecorder()`` (20,000-entry buffer, watchdog thread, gloo p2p log).

Each job reports the median step time after warm-up (per step: batch start to batch end, with a CUDA
synchronize at the end on GPU). The table gives the median over rounds and the overhead vs ``off``.

On a small shared CPU machine the rounds scatter by more than the effect, so ``--collectives`` also
times what recording costs per collective: ``--devices`` gloo processes issue ``--ops`` small
all-reduces, in blocks, under each setting (the callback's per-batch work is two attribute stores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from llama_module.args import get_flavor
from llama_module.synthetic import RandomTokens
from titan_strategy import FlightRecorder, TitanStrategy

SETTINGS = ("off", "torch_default", "flight_recorder")


class StepTimes(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: object) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._start)


def run_job(args: argparse.Namespace) -> None:
    config = get_flavor(args.flavor)
    config = dataclasses.replace(config, max_seq_len=max(args.seq_len, config.max_seq_len))
    timer = StepTimes()
    callbacks: list[Callback] = [timer]
    if args.job == "flight_recorder":
        callbacks.append(FlightRecorder(dump_dir=args.dump_dir))
    strategy = TitanStrategy(pipeline_parallel_size=args.pipeline_parallel_size)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        precision=args.precision, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=callbacks)
    data = DataLoader(RandomTokens(args.steps * args.batch_size * args.devices, args.seq_len, config.vocab_size),
                      batch_size=args.batch_size)
    trainer.fit(LlamaModule(model=config, warmup_steps=2), train_dataloaders=data)
    if trainer.is_global_zero:
        steady = timer.times[args.warmup:]
        print("RESULT " + json.dumps({"setting": args.job, "median_step_s": statistics.median(steady),
                                      "steps": len(steady)}), flush=True)


def collective_job(ops: int, blocks: int = 10) -> None:
    """One gloo job: the median time of one small all-reduce over ``blocks`` blocks of ``ops``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tensor = torch.ones(16)
    per_op = []
    for block in range(blocks + 1):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ops):
            dist.all_reduce(tensor)
        if block:  # the first block warms up
            per_op.append((time.perf_counter() - start) / ops)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"median_step_s": statistics.median(per_op)}), flush=True)
    dist.destroy_process_group()


def _run_setting(command: list[str], setting: str) -> float:
    env = dict(os.environ)
    if setting == "off":
        env["TORCH_FR_BUFFER_SIZE"] = "0"
    elif setting == "flight_recorder":
        env["TORCH_FR_BUFFER_SIZE"] = "20000"  # what FlightRecorder sets before the process group
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    [line] = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))["median_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--flavor", default="debug")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dump-dir", default="/tmp/flight_recorder_overhead")
    parser.add_argument("--collectives", action="store_true", help="time one recorded collective instead")
    parser.add_argument("--ops", type=int, default=2000, help="all-reduces per block (--collectives)")
    parser.add_argument("--job", choices=SETTINGS, help=argparse.SUPPRESS)  # one job of the comparison
    args = parser.parse_args()
    if args.job is not None:
        collective_job(args.ops) if args.collectives else run_job(args)
        return

    medians: dict[str, list[float]] = {setting: [] for setting in SETTINGS}
    for _ in range(args.rounds):
        for setting in SETTINGS:
            command = [sys.executable, *sys.argv, "--job", setting]
            if args.collectives:
                command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={args.devices}", *command[1:]]
            medians[setting].append(_run_setting(command, setting))
    off = statistics.median(medians["off"])
    device = torch.cuda.get_device_name() if args.accelerator == "cuda" else f"CPU x{os.cpu_count()}"
    what = ("one all-reduce of 16 floats" if args.collectives else
            f"flavor {args.flavor}, seq {args.seq_len}, batch {args.batch_size}, pp {args.pipeline_parallel_size}")
    print(f"{device}, torch {torch.__version__}, {args.devices} process(es), {what}; median of {args.rounds} rounds")
    unit, scale = ("us", 1e6) if args.collectives else ("ms", 1e3)
    print(f"| setting | median ({unit}) | per round ({unit}) | vs off |")
    print("|---|---|---|---|")
    for setting, values in medians.items():
        median = statistics.median(values)
        rounds = ", ".join(f"{scale * v:.1f}" for v in values)
        print(f"| {setting} | {scale * median:.1f} | {rounds} | {100 * (median / off - 1):+.1f}% |")


if __name__ == "__main__":
    main()
