"""Single-GPU training throughput of Lightning Trainer + TitanStrategy + LlamaModule, against a plain loop.

    python benchmarks/throughput.py --matrix 1B --results benchmarks/RESULTS.md      # the 1B rows
    python benchmarks/throughput.py --matrix 8B-width --results benchmarks/RESULTS.md
    python benchmarks/throughput.py --flavor 1B --compile --compile-loss --activation-checkpointing selective_op
    python benchmarks/throughput.py --flavor 1B --compile --compile-loss --attention-mask block_causal \
        --attention-kernel flex --reference

Each row runs in a fresh process. In it, a plain PyTorch loop trains the same recipe first (when the row
asks for a reference): the model parallelized by the same ``titan_strategy.parallelize`` call, the
same data loader, the module's AdamW and LR schedule, clipping at 1.0, no Lightning. Then Lightning
trains it through TitanStrategy. Both are timed over the same steps after warm-up, so their ratio is
what Lightning and the strategy's hooks cost, measured side by side.

Shapes: ``1B`` is the Llama-3.2-1B shape (dim 2048, 16 layers, untied output), seq 8192, batch 2;
``8B-width`` is Llama-3-8B's width (dim 4096, ffn 14336) with 16 layers, seq 8192, batch 1. Random
tokens (the data path is not measured); with ``--attention-mask block_causal`` each window is cut into
documents whose lengths are drawn from 40 real C4 documents' (``llama_module/synthetic.py``). bf16-mixed (on one
GPU the strategy does not wrap the model in FSDP: with TritonAdamW the weights are bf16 with fp32 masters,
with torch's AdamW autocast casts them).
MFU counts ``LlamaModule.flops_per_token`` (recomputation not counted) over the device's dense bf16 peak; under
the block-causal mask a second MFU counts attention over each document only (the FLOPs the mask leaves).
A run that runs out of memory reports ``oom`` instead of failing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.autograd import DeviceType
from torch.utils.data import DataLoader

from llama_module import LlamaModule
from llama_module.args import get_flavor
from llama_module.synthetic import RandomTokens, document_ids
from titan_strategy import Throughput, TitanStrategy
from titan_strategy.callbacks.throughput import peak_tflops_of
from titan_strategy.config import TitanConfig
from titan_strategy.grad_norm import clip_grad_norm_
from titan_strategy.kernels.adamw import ADAMW_KERNELS
from titan_strategy.kernels.linear_cross_entropy import DEFAULT_CHUNK_TOKENS
from titan_strategy.master_weights import hold_master_weights
from titan_strategy.mesh import build_mesh
from titan_strategy.parallelize.apply import parallelize
from titan_strategy.parallelize.compile import apply_compile_loss

THROUGHPUT_WINDOW = 10  # steps per Throughput callback window, its cross-check of the step timer

SHAPES = {"1B": {"flavor": "1B", "n_layers": None, "batch_size": 2},
          "8B-width": {"flavor": "8B", "n_layers": 16, "batch_size": 1}}
# Rows of each matrix: (compile, compile_loss, activation checkpointing, float8, with the plain-loop reference).
MATRICES = {
    "1B": [(False, False, "none", "none", False), (True, False, "none", "none", False),
           (True, True, "none", "none", True), (True, True, "selective_op", "none", False),
           (True, True, "selective_layer", "none", False), (True, True, "full", "none", False)],
    "8B-width": [(True, True, "none", "none", True), (True, True, "none", "tensorwise", True),
                 (True, True, "none", "rowwise", False)],
}


def attended_seq_len(seq_len: int, samples: int = 64) -> float:
    """The sequence length that counts as many attention FLOPs as the block-causal mask leaves: the mean over
    windows of sum(document length ^ 2) / seq_len (``flops_per_token`` counts the full score matrix)."""
    counts = [torch.bincount(document_ids(i, seq_len)).double() for i in range(samples)]
    return float(sum((c * c).sum() for c in counts) / (samples * seq_len))


class KernelProfile:
    """Profiles the ``steps`` optimizer steps after step ``after``, then prints the kernels that took the GPU's
    time, the host syncs, and how busy the GPU was (the profiler itself slows those steps' wall time)."""

    def __init__(self, name: str, after: int, steps: int = 3) -> None:
        self.name, self.after, self.steps = name, after, steps
        self.profiler: torch.profiler.profile | None = None
        self.start = 0.0

    def step_done(self, step: int) -> None:
        if step == self.after:
            torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                               torch.profiler.ProfilerActivity.CUDA])
            self.profiler.start()
            self.start = time.perf_counter()
        elif self.profiler is not None and step == self.after + self.steps:
            torch.cuda.synchronize()
            wall_ms = 1e3 * (time.perf_counter() - self.start)
            self.profiler.stop()
            events = self.profiler.key_averages()
            # GPU-side annotations (Optimizer.step#...) span kernels that are counted already.
            kernels = [event for event in events
                       if event.device_type == DeviceType.CUDA and not event.is_user_annotation]
            busy_ms = sum(event.self_device_time_total for event in kernels) / 1e3
            # The host waits on the GPU only in these calls; a GPU tensor's .item() shows as cudaStreamSynchronize,
            # while aten::_local_scalar_dense would also count the free .item() of CPU tensors.
            syncs = {event.key: event.count for event in events
                     if event.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")}
            print(f"### {self.name}: {self.steps} steps\n"
                  f"{events.table(sort_by='self_cuda_time_total', row_limit=60, max_name_column_width=90)}\n"
                  f"{self.name}: GPU busy {busy_ms:.0f} ms of {wall_ms:.0f} ms wall; host syncs {syncs}", flush=True)
            self.profiler = None


class ProfileCallback(Callback):
    def __init__(self, profile: KernelProfile) -> None:
        self.profile = profile

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self.profile.step_done(trainer.global_step)


class StepTimer(Callback):
    """Wall time from the end of step ``warmup`` to the end of training: two host syncs in all."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = self.elapsed = 0.0
        self.timed_steps = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.warmup:
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, *args: object) -> None:
        torch.cuda.synchronize()
        self.elapsed = time.perf_counter() - self.start
        self.timed_steps = trainer.global_step - self.warmup


def _strategy_knobs(row: dict[str, Any]) -> dict[str, Any]:
    return {"compile": row["compile"], "compile_loss": row["compile_loss"], "cuda_graphs": row["cuda_graphs"],
            "activation_checkpointing": row["ac"], "float8": row["float8"]}


def _loader(row: dict[str, Any], vocab: int) -> DataLoader:
    documents = row["attention_mask"] == "block_causal"
    samples = row["steps"] * row["batch_size"] - (1 if row["short_last_batch"] else 0)
    return DataLoader(RandomTokens(samples, row["seq_len"], vocab, documents),
                      batch_size=row["batch_size"], num_workers=2, pin_memory=True)


def _module(row: dict[str, Any]) -> LlamaModule:
    config = get_flavor(row["flavor"])
    if row["n_layers"] is not None:
        config = dataclasses.replace(config, n_layers=row["n_layers"])
    return LlamaModule(model=dataclasses.replace(config, max_seq_len=max(row["seq_len"], 2048)), warmup_steps=10,
                       decay_steps=1000, attention_kernel=row["attention_kernel"], adamw=row["adamw"],
                       attention_mask=row["attention_mask"], cross_entropy=row["cross_entropy"],
                       loss_chunk_tokens=row["loss_chunk_tokens"])


def plain_loop(row: dict[str, Any]) -> dict[str, Any]:
    """The same recipe without Lightning: parallelize, then forward, loss, backward, clip, step."""
    device = torch.device("cuda", 0)
    module = _module(row).to(device)  # the device configure_model checks its kernels against
    with torch.device("meta"):
        module.configure_model()
    config = TitanConfig.from_knobs(**_strategy_knobs(row))
    dims = config.mesh.resolve(1)
    runtime = parallelize(module.parallel_plan(), build_mesh(dims, "cuda"), dims, config, device,
                          param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = runtime.parts[0]
    assert model is module.model, "one device, no pipeline: the module's loss runs the parallelized model"
    assert not runtime.sharded, "one GPU: nothing is sharded, as in the strategy's run"
    if row["compile_loss"]:
        apply_compile_loss(module)
    schedule = module.configure_optimizers()  # the module's AdamW kernel and LR schedule
    optimizer, scheduler = schedule["optimizer"], schedule["lr_scheduler"]["scheduler"]
    # As the strategy does: with TritonAdamW, bf16 weights and fp32 masters; with torch's AdamW, autocast.
    autocast = hold_master_weights(model, [optimizer], torch.bfloat16) is None
    start, done = 0.0, 0
    profile = KernelProfile("plain loop", row["warmup"]) if row["profile"] else None
    for step, batch in enumerate(_loader(row, module.config.vocab_size), start=1):
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss_sum, num_tokens = module.token_loss(batch)  # the same loss as the Lightning run
        loss = loss_sum / num_tokens.clamp(min=1)
        loss.backward()
        clip_grad_norm_(list(model.parameters()), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if step == row["warmup"]:
            torch.cuda.synchronize()
            start = time.perf_counter()
        if profile is not None:
            profile.step_done(step)
        done = step
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    result = _rates(row, module, (done - row["warmup"]) / elapsed)
    del model, optimizer, loss
    return result


def lightning_run(row: dict[str, Any]) -> dict[str, Any]:
    module = _module(row)
    timer = StepTimer(row["warmup"])
    throughput = Throughput(log_every_n_steps=THROUGHPUT_WINDOW, prog_bar=False)
    profile = [ProfileCallback(KernelProfile("Lightning", row["warmup"]))] if row["profile"] else []
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=TitanStrategy(**_strategy_knobs(row)),
                        precision="bf16-mixed", max_steps=row["steps"], gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[timer, throughput, *profile])
    trainer.fit(module, train_dataloaders=_loader(row, module.config.vocab_size))
    result = _rates(row, module, timer.timed_steps / timer.elapsed)
    last = throughput.windows[-1]
    result["callback_tokens_per_s"] = round(last.tokens_per_s_per_device)
    result["callback_mfu_percent"] = None if last.mfu is None else round(100 * last.mfu, 1)
    return result


def _rates(row: dict[str, Any], module: LlamaModule, steps_per_s: float) -> dict[str, Any]:
    tokens_per_s = steps_per_s * row["batch_size"] * row["seq_len"]
    peak = peak_tflops_of(torch.cuda.get_device_name()) or float("nan")

    def mfu(seq_len: float) -> float:
        return round(100 * tokens_per_s * module.config.flops_per_token(seq_len) / (peak * 1e12), 1)

    masked = row["attention_mask"] == "block_causal"
    return {"tokens_per_s": round(tokens_per_s), "mfu_percent": mfu(row["seq_len"]),
            "mfu_attended_percent": mfu(round(attended_seq_len(row["seq_len"]))) if masked else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1)}


def _fresh_memory() -> None:
    gc.collect()
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_row(row: dict[str, Any]) -> dict[str, Any]:
    """One row, in this process: the plain loop (if asked), then Lightning."""
    result: dict[str, Any] = {**row}
    # One process group for both runs (Lightning reuses an initialized one).
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{row['port']}", world_size=1, rank=0,
                            device_id=torch.device("cuda", 0))
    for name, run in (("plain", plain_loop if row["reference"] else None), ("lightning", lightning_run)):
        if run is None:
            continue
        _fresh_memory()
        try:
            result[name] = run(row)
        except torch.OutOfMemoryError:
            result[name] = {"oom": True, "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
    if "plain" in result and "tokens_per_s" in result["plain"] and "tokens_per_s" in result["lightning"]:
        result["lightning_vs_plain"] = round(result["lightning"]["tokens_per_s"] / result["plain"]["tokens_per_s"], 4)
    return result


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    common = {"seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "profile": args.profile,
              "attention_kernel": args.attention_kernel, "attention_mask": args.attention_mask, "adamw": args.adamw,
              "cross_entropy": args.cross_entropy, "loss_chunk_tokens": args.loss_chunk_tokens,
              "cuda_graphs": args.cuda_graphs, "short_last_batch": args.short_last_batch}
    if args.matrix is None:
        shape = {"flavor": args.flavor, "n_layers": args.n_layers, "batch_size": args.batch_size}
        return [{**shape, **common, "compile": args.compile, "compile_loss": args.compile_loss,
                 "ac": args.activation_checkpointing, "float8": args.float8, "reference": args.reference}]
    chosen = range(len(MATRICES[args.matrix])) if args.rows is None else [int(i) for i in args.rows.split(",")]
    return [{**SHAPES[args.matrix], **common, "compile": compile, "compile_loss": compile_loss, "ac": ac,
             "float8": float8, "reference": reference}
            for index, (compile, compile_loss, ac, float8, reference) in enumerate(MATRICES[args.matrix])
            if index in chosen]


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| shape | attention | AdamW | cross-entropy | compile | compiled loss | CUDA graphs | AC | float8 | "
             "tokens/s | MFU (attended) | peak alloc / reserved GiB | plain loop tokens/s | Lightning / plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        run, plain = r["lightning"], r.get("plain")
        shape = r["flavor"] if r["n_layers"] is None else f"{r['flavor']} width x {r['n_layers']} layers"
        shape += ", last batch short" if r.get("short_last_batch") else ""
        attended = f" ({run['mfu_attended_percent']}%)" if run.get("mfu_attended_percent") is not None else ""
        speed = "OOM | —" if run.get("oom") else f"{run['tokens_per_s']:,} | {run['mfu_percent']}%{attended}"
        memory = f"{run['peak_memory_gib']} / {run.get('peak_reserved_gib', '—')}"
        reference = "—" if plain is None else "OOM" if plain.get("oom") else f"{plain['tokens_per_s']:,}"
        ratio = f"{r['lightning_vs_plain']:.3f}" if "lightning_vs_plain" in r else "—"
        attention = r["attention_kernel"] + (", block-causal" if r["attention_mask"] == "block_causal" else "")
        loss = r["cross_entropy"] + (f" ({r['loss_chunk_tokens']})" if r["cross_entropy"] == "chunked" else "")
        lines.append(f"| {shape} | {attention} | {r['adamw']} | {loss} | {'yes' if r['compile'] else 'no'} | "
                     f"{'yes' if r['compile_loss'] else 'no'} | {'yes' if r['cuda_graphs'] else 'no'} | "
                     f"{r['ac']} | {r['float8']} | {speed} | {memory} | {reference} | {ratio} |")
    return "\n".join(lines)


def _commit() -> str:
    if os.environ.get("TITAN_COMMIT"):
        return os.environ["TITAN_COMMIT"]
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrix", choices=sorted(MATRICES), help="run every row of a matrix")
    parser.add_argument("--rows", help="only these rows of the matrix, by index: 0,3")
    parser.add_argument("--profile", action="store_true", help="print the CUDA kernels that take the time in 3 "
                        "steps of each run, and the host syncs (those steps' timing then includes the profiler)")
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--n-layers", type=int, help="override the flavor's number of blocks")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    parser.add_argument("--compile-loss", action="store_true", help="torch.compile the loss")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay the model's forward and backward as "
                        "CUDA graphs (TitanStrategy(cuda_graphs=True); the plain loop too)")
    parser.add_argument("--short-last-batch", action="store_true", help="one sample fewer, so the last batch is "
                        "short: with --cuda-graphs it replays the graphs padded (LlamaModule's short_batch_padding), "
                        "and the peak shows whether it needs memory beside the graphs' pool")
    parser.add_argument("--activation-checkpointing", default="none",
                        choices=["none", "full", "selective_op", "selective_layer"])
    parser.add_argument("--float8", default="none", choices=["none", "tensorwise", "rowwise"])
    parser.add_argument("--attention-kernel", default="sdpa", choices=["sdpa", "fa4", "flex"],
                        help="LlamaModule(attention_kernel=...): torch's SDPA, FlashAttention-4 or FlexAttention")
    parser.add_argument("--attention-mask", default="causal", choices=["causal", "block_causal"],
                        help="LlamaModule(attention_mask=...); block_causal cuts windows into C4-length documents")
    parser.add_argument("--cross-entropy", default="chunked", choices=["chunked", "logits"],
                        help="LlamaModule(cross_entropy=...): projection and loss fused by chunks, or logits then loss")
    parser.add_argument("--loss-chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                        help="LlamaModule(loss_chunk_tokens=...): tokens per chunk of the chunked cross-entropy")
    parser.add_argument("--adamw", default="auto", choices=ADAMW_KERNELS,
                        help="LlamaModule(adamw=...): the AdamW kernel; auto is triton on CUDA")
    parser.add_argument("--reference", action="store_true", help="also run the plain-loop reference")
    parser.add_argument("--results", type=Path, help="append a dated section with the table to this Markdown file")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row's JSON, run in this process
    args = parser.parse_args()
    if args.steps < THROUGHPUT_WINDOW + 1:
        parser.error(f"--steps {args.steps} ends before the Throughput callback's first window (steps 2 to "
                     f"{THROUGHPUT_WINDOW + 1}), which the run reports beside its own timing; pass --steps "
                     f"{THROUGHPUT_WINDOW + 1} or more")
    if args.short_last_batch and args.batch_size < 2:
        parser.error(f"--short-last-batch takes a sample off the last batch, which --batch-size {args.batch_size} "
                     "cannot spare; pass --batch-size 2 or more")
    if args.row:
        print("ROW " + json.dumps(run_row(json.loads(args.row))), flush=True)
        return
    results = []
    for index, row in enumerate(_rows(args)):
        row["port"] = 29600 + index
        done = subprocess.run([sys.executable, __file__, "--row", json.dumps(row)], capture_output=True, text=True)
        found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
        if done.returncode or not found:
            print(done.stdout[-3000:], done.stderr[-6000:], file=sys.stderr)
            raise SystemExit(f"row {row} failed with exit code {done.returncode}")
        if args.profile:
            print("\n".join(line for line in done.stdout.splitlines() if not line.startswith("ROW ")))
        results.append(json.loads(found[0]))
        print(json.dumps(results[-1]), flush=True)
    table = _table(results)
    print(table)
    if args.results is not None:
        import torchao

        header = (f"\n## {datetime.date.today()} — throughput matrix {args.matrix or 'single row'} (issue #8)\n\n"
                  f"Machine: 1 x {torch.cuda.get_device_name()}, torch {torch.__version__}, lightning {L.__version__}, "
                  f"torchao {torchao.__version__}, commit {_commit()}. Command: `python benchmarks/throughput.py "
                  f"{' '.join(sys.argv[1:])}`; steps {args.steps}, timed after step {args.warmup}.\n\n")
        with args.results.open("a") as results_file:
            results_file.write(header + table + "\n")


if __name__ == "__main__":
    main()
