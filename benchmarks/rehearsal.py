"""Does a rehearsal measure what a real rank holds? And what do the paper's layouts hold per rank?

    python benchmarks/rehearsal.py accuracy       # 1B and 8B width on one GPU: real run vs its rehearsal
    python benchmarks/rehearsal.py paper          # titan rehearse of the paper's layouts (JSON lines)
    python benchmarks/rehearsal.py peak '["--config", "configs/X.yaml", "--rank", "0"]'   # what the peak holds

``accuracy`` trains the same single-device run twice through Lightning, each in a fresh process, with the
same random tokens and the same meter (``titan_strategy/rehearsal.py``): once with TitanStrategy on a real
process group, once with RehearsalStrategy on torch's fake one. ``paper`` runs ``titan rehearse`` on the
shipped configs (and the 70B one at the paper's FSDP32 x TP8), then on the planner's favourite layouts, printing
each rank's measurements as JSON (``--only WORD`` keeps the layouts whose name has it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from llama_module.synthetic import RandomTokens
from titan_strategy import TitanStrategy
from titan_strategy.rehearsal import RehearsalMeter, RehearsalStrategy

REPO = Path(__file__).resolve().parents[1]
EIGHT_B_WIDTH = {"dim": 4096, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256,
                 "ffn_dim": 14336, "max_seq_len": 8192}
# (name, model, batch size): the single-device shapes of RESULTS.md, seq 8192, compiled blocks and loss, SDPA.
SHAPES = [("1B", "1B", 2), ("8B-width", EIGHT_B_WIDTH, 1)]
# (name, config, extra titan rehearse arguments): the TorchTitan paper's layouts.
PAPER = [
    ("8B FSDP8", "llama3_8b_fsdp.yaml", []),
    ("70B FSDP8 x TP8 (64 GPUs)", "llama3_70b_fsdp_tp8.yaml", []),
    ("70B FSDP32 x TP8 (256 GPUs)", "llama3_70b_fsdp_tp8.yaml", ["--trainer.num_nodes", "32"]),
    ("405B FSDP8 x TP8 x PP8 Interleaved1F1B", "llama3_405b_fsdp8_tp8_pp8.yaml", []),
    ("405B FSDP8 x TP8 x PP8 1F1B", "llama3_405b_fsdp8_tp8_pp8.yaml",
     ["--trainer.strategy.init_args.pipeline_schedule", "1F1B"]),
    ("8B CP8 262,144 tokens", "llama3_8b_cp8_256k.yaml", []),
]
_KNOB = "--trainer.strategy.init_args."
# The planner's favourites (`python benchmarks/planner_scenarios.py`, top 3) not among the layouts above, without
# float8 as every rehearsal here; batches keep each scenario's tokens per step.
PLANNER_FAVOURITES = [
    ("70B FSDP64 x TP4 full AC (planner #1, 256 GPUs)", "llama3_70b_fsdp_tp8.yaml",
     ["--trainer.num_nodes", "32", f"{_KNOB}tensor_parallel_size", "4", f"{_KNOB}activation_checkpointing", "full",
      "--data.batch_size", "8"]),
    ("70B FSDP128 x TP2 full AC (planner #2, 256 GPUs)", "llama3_70b_fsdp_tp8.yaml",
     ["--trainer.num_nodes", "32", f"{_KNOB}tensor_parallel_size", "2", f"{_KNOB}activation_checkpointing", "full",
      "--data.batch_size", "4"]),
    ("405B FSDP64 x TP8 full AC (planner #1, 512 GPUs)", "llama3_405b_fsdp8_tp8_pp8.yaml",
     [f"{_KNOB}pipeline_parallel_size", "1", f"{_KNOB}data_parallel_shard_size", "64",
      f"{_KNOB}pipeline_microbatches", "null", "--data.batch_size", "4"]),
    ("405B FSDP128 x TP4 full AC (planner #2, 512 GPUs)", "llama3_405b_fsdp8_tp8_pp8.yaml",
     [f"{_KNOB}pipeline_parallel_size", "1", f"{_KNOB}data_parallel_shard_size", "128", f"{_KNOB}tensor_parallel_size",
      "4", f"{_KNOB}pipeline_microbatches", "null", "--data.batch_size", "2"]),
    ("405B FSDP4 x TP8 x PP16 Interleaved1F1B, 64 microbatches, selective_op AC (planner #3, 512 GPUs)",
     "llama3_405b_fsdp8_tp8_pp8.yaml",
     [f"{_KNOB}pipeline_parallel_size", "16", f"{_KNOB}data_parallel_shard_size", "4", f"{_KNOB}pipeline_microbatches",
      "64", f"{_KNOB}activation_checkpointing", "selective_op", "--data.batch_size", "64"]),
]


def one_device_run(model: str | dict, batch_size: int, rehearse: bool, steps: int) -> dict:
    """One single-device training run of ``model`` at seq 8192, measured by the rehearsal's meter."""
    knobs = {"compile": True, "compile_loss": True}
    strategy = RehearsalStrategy(world_size=1, rank=0, **knobs) if rehearse else TitanStrategy(**knobs)
    meter = RehearsalMeter()
    trainer = L.Trainer(strategy=strategy, accelerator="cuda", devices=1, precision="bf16-mixed", max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                        num_sanity_val_steps=0, callbacks=[meter])
    module = LlamaModule(model=model, max_seq_len=8192)
    trainer.fit(module, DataLoader(RandomTokens(steps * batch_size, 8192, module.config.vocab_size),
                                   batch_size=batch_size))
    return meter.result(trainer).as_dict()


def accuracy(steps: int) -> None:
    for name, model, batch_size in SHAPES:
        row = {"shape": name, "batch_size": batch_size}
        for kind in ("real", "rehearsal"):
            done = subprocess.run([sys.executable, __file__, "one", json.dumps([model, batch_size, kind, steps])],
                                  capture_output=True, text=True)
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ONE ")]
            if not found:
                print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"{name} {kind} failed")
            result = json.loads(found[0])
            row[kind] = {key: result[key] for key in ("peak_allocated_gib", "peak_reserved_gib", "compute_s")}
        row["allocated_ratio"] = row["rehearsal"]["peak_allocated_gib"] / row["real"]["peak_allocated_gib"]
        print(json.dumps(row), flush=True)


def paper(steps: int, only: list[str]) -> None:
    for name, config, extra in PAPER + PLANNER_FAVOURITES:
        if only and not any(word in name for word in only):
            continue
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "ranks.json"
            done = subprocess.run([sys.executable, "-m", "llama_module.rehearse_cli", "--config",
                                   str(REPO / "configs" / config), "--steps", str(steps), "--json", str(out), *extra],
                                  capture_output=True, text=True)
            results = json.loads(out.read_text()) if out.exists() else []
        print(json.dumps({"layout": name, "config": config, "extra": extra, "exit": done.returncode,
                          "ranks": results, "report": done.stdout[-3000:] if not results else ""}), flush=True)
        if not results:
            print(done.stderr[-3000:], file=sys.stderr)


def peak_breakdown(arguments: list[str], top: int, history: int) -> None:
    """Rehearse one rank with the CUDA allocator's history on, and print what was live at its peak, grouped by
    the innermost frame of our code or torch's distributed code that allocated it."""
    import collections

    import torch

    from llama_module.rehearse_cli import RehearsalCLI, _train

    # Python frames only: C++ frames make each event slow and large, and a 64-microbatch pipeline step makes millions.
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=history)
    cli = RehearsalCLI(arguments)
    print(json.dumps(_train(cli).as_dict()))
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    if len(events) >= history:  # the ring overflowed: what the lost events left live is not attributed below
        print(f"the history's {history:,} entries overflowed: allocations older than the oldest kept event are "
              "counted only in the allocator's peak below")
    live, current, peak, peak_at = {}, 0, 0, 0
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            current += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            current -= live.pop(event["addr"])
        if current > peak:
            peak, peak_at = current, index
    live = {}
    for event in events[:peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    ours = ("/titan_strategy/", "/llama_module/", "/distributed/", "/nn/functional", "/_higher_order_ops/")

    def origin(event: dict) -> str:
        frames = event.get("frames") or []
        frame = next((f for f in frames if any(part in f["filename"] for part in ours)), frames[0] if frames else None)
        return f"{frame['filename'].split('site-packages/')[-1]}:{frame['line']} {frame['name']}" if frame else "?"

    by_origin = collections.Counter()
    for event in live.values():
        by_origin[origin(event)] += event["size"]
    print(f"peak of the recorded allocations: {peak / 2**30:.2f} GiB; the allocator's: "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    for where, size in by_origin.most_common(top):
        print(f"{size / 2**30:8.2f} GiB  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["accuracy", "paper", "one", "peak"])
    parser.add_argument("spec", nargs="?", help="(one) [model, batch size, real|rehearsal, steps] as JSON; (peak) "
                        "titan rehearse arguments as a JSON list")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--history", type=int, default=12_000_000, help="(peak) allocator events kept")
    parser.add_argument("--only", nargs="*", default=[], help="(paper) layouts whose name contains one of these")
    args = parser.parse_args()
    if args.what == "one":
        model, batch_size, kind, steps = json.loads(args.spec)
        print("ONE " + json.dumps(one_device_run(model, batch_size, kind == "rehearsal", steps)), flush=True)
    elif args.what == "peak":
        peak_breakdown(json.loads(args.spec), top=40, history=args.history)
    elif args.what == "accuracy":
        accuracy(args.steps)
    else:
        paper(args.steps, args.only)


if __name__ == "__main__":
    main()
