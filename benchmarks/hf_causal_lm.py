"""Single-GPU throughput of one Hugging Face ``LlamaForCausalLM`` LightningModule under ModelParallelStrategy and
TitanStrategy, beside this repo's own LlamaModule.

    python benchmarks/hf_causal_lm.py --results benchmarks/RESULTS.md                  # every variant
    python benchmarks/hf_causal_lm.py --variants titan,titan-compile --knob activation_checkpointing=selective_op
    python benchmarks/hf_causal_lm.py --tiny --accelerator cpu --steps 2 --warmup 1 --variants mps,titan  # smoke

Variants, each in a fresh process, all training the same ``CausalLM`` module (``transformers.LlamaForCausalLM``
built from a config in ``configure_model``, random weights, ``labels=input_ids`` so the model's own shifted loss,
fused ``torch.optim.AdamW(lr=1e-4)``):

- ``mps``: Lightning's ``ModelParallelStrategy`` recipe (its tensor_parallel example and the "2D Parallelism" page):
  ``configure_model`` calls ``fully_shard`` on each decoder layer, then on the whole HF model, over
  ``self.device_mesh["data_parallel"]`` with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``. The
  Trainer keeps its default ``precision="32-true"``, as that example does: the policy is the mixed precision (fp32
  sharded weights and optimizer, bf16 compute), and the example notes that the strategy does not apply the Trainer's
  precision to FSDP2. "bf16-mixed" would add autocast on top of bf16 parameters; "bf16-true" would drop the fp32
  master weights. The docs' toy guards ``fully_shard`` with ``dp_mesh.size() > 1``; here it shards on one device
  too, since without it the fp32 model runs without any bf16 compute. The model is built in fp32 on the CPU (the
  strategy runs ``configure_model`` with no device context) and ``fully_shard`` moves it to the GPU.
- ``mps-compile``: the same, each decoder layer ``torch.compile``-d (and put back in the ``ModuleList``) before
  ``fully_shard``.
- ``titan``: the bare module (no parallelization code; built on the meta device and materialized by the strategy)
  under ``TitanStrategy(**knobs)`` with ``precision="bf16-mixed"``. ``--knob name=value`` (docs/knobs.md) sets a knob.
- ``titan-compile``: ``titan`` with ``compile=true`` (each decoder layer compiled on its own).
- ``llama``: not HF: ``benchmarks/throughput.py --flavor 1B --compile --compile-loss`` (LlamaModule, its defaults),
  run as a subprocess with the same warm-up and timed steps, its JSON result folded into this table.

Shape: Llama-3.2-1B (hidden 2048, ffn 8192, 16 layers, 32 heads, 8 kv heads, vocab 128,256, untied output, RoPE theta
500,000), SDPA, ``use_cache=False`` (see ``Shape.hf_config``), seq 8192, batch 2; every variant starts from the same
seed. ``--tiny`` shrinks it (hidden 64, 2 layers, seq 128) for a CPU smoke test; the ``llama`` variant then has no
equivalent and is skipped. Steps ``--warmup`` + ``--steps``; the clock runs from the end of step ``--warmup`` to the
end of the last step, with a device sync at each end, as throughput.py's does. A variant
that runs out of memory reports ``oom`` instead of numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
import transformers
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset

VARIANTS = ("mps", "mps-compile", "titan", "titan-compile", "llama")
RATIOS = (("titan", "mps"), ("titan-compile", "mps-compile"), ("titan", "llama"), ("titan-compile", "llama"))
OOM = "oom"


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    batch_size: int

    def hf_config(self) -> transformers.LlamaConfig:
        return transformers.LlamaConfig(
            hidden_size=self.hidden, intermediate_size=self.ffn, num_hidden_layers=self.layers,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, vocab_size=self.vocab,
            rope_theta=500000, max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa",
            # transformers' default use_cache=True builds a KV cache in training forwards too, and its per-layer
            # state makes each compiled decoder layer recompile, past dynamo's limit of 8 (the rest run eager).
            use_cache=False)


SHAPES = {"1B": Shape(2048, 8192, 16, 32, 8, 128256, 8192, 2), "tiny": Shape(64, 256, 2, 4, 2, 512, 128, 2)}


class RandomWindows(Dataset):
    """Uniform random tokens, one fixed window per index; labels are the inputs (HF shifts them in its loss)."""

    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        self.samples, self.seq_len, self.vocab = samples, seq_len, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


class CausalLM(L.LightningModule):
    """The user's module: a transformers causal LM and its own loss, no parallelization code."""

    def __init__(self, hf_config: transformers.LlamaConfig) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.model: transformers.LlamaForCausalLM | None = None

    def configure_model(self) -> None:
        if self.model is None:  # a later fit/validate keeps the built model
            self.model = transformers.LlamaForCausalLM(self.hf_config)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


class ShardedCausalLM(CausalLM):
    """``CausalLM`` plus ModelParallelStrategy's recipe: FSDP2 on each decoder layer (compiled first if asked),
    then on the whole model, with a bf16-compute, fp32-reduce policy."""

    def __init__(self, hf_config: transformers.LlamaConfig, compile_layers: bool) -> None:
        super().__init__(hf_config)
        self.compile_layers = compile_layers

    def configure_model(self) -> None:
        super().configure_model()
        assert self.model is not None
        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        layers = self.model.model.layers
        for index, layer in enumerate(layers):
            if self.compile_layers:
                layer = layers[index] = torch.compile(layer)
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(self.model, mesh=mesh, mp_policy=policy)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepWindow(Callback):
    """Wall time from the end of step ``warmup`` to the end of the last step (a device sync at each end), and the
    last step's loss."""

    def __init__(self, warmup: int, last: int) -> None:
        self.warmup, self.last = warmup, last
        self.start = self.elapsed = 0.0
        self.loss: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, *args: Any) -> None:
        step = trainer.global_step
        if step not in (self.warmup, self.last):
            return
        _synchronize(trainer.strategy.root_device)
        if step == self.warmup:
            self.start = time.perf_counter()
        else:
            self.elapsed = time.perf_counter() - self.start
            loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
            self.loss = round(float(loss), 4)


def _module_and_strategy(row: dict[str, Any]) -> tuple[CausalLM, Strategy, str]:
    """The variant's module, strategy and Trainer precision."""
    config = SHAPES[row["shape"]].hf_config()
    if row["variant"].startswith("mps"):
        return ShardedCausalLM(config, compile_layers=row["variant"] == "mps-compile"), ModelParallelStrategy(), \
            "32-true"
    from titan_strategy import TitanStrategy  # only titan rows need the strategy importable

    return CausalLM(config), TitanStrategy(**row["knobs"]), "bf16-mixed"


def train_variant(row: dict[str, Any]) -> dict[str, Any]:
    """Trains one mps/titan variant in this process; its rates, peak memory and last loss."""
    shape = SHAPES[row["shape"]]
    module, strategy, precision = _module_and_strategy(row)
    window = StepWindow(row["warmup"], row["warmup"] + row["steps"])
    trainer = L.Trainer(accelerator=row["accelerator"], devices=1, strategy=strategy, precision=precision,
                        max_steps=row["warmup"] + row["steps"], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[window])
    samples = (row["warmup"] + row["steps"]) * shape.batch_size
    loader = DataLoader(RandomWindows(samples, shape.seq_len, shape.vocab), batch_size=shape.batch_size,
                        num_workers=2, pin_memory=row["accelerator"] == "cuda")
    trainer.fit(module, train_dataloaders=loader)
    step_time = window.elapsed / row["steps"]
    return {"tokens_per_s": round(shape.batch_size * shape.seq_len / step_time), "step_time_s": round(step_time, 4),
            "peak_memory_gib": _peak_memory_gib(row["accelerator"]), "loss": window.loss}


def _peak_memory_gib(accelerator: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if accelerator == "cuda" else None


def _environment(accelerator: str) -> dict[str, Any]:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "lightning": L.__version__,
            "gpu": torch.cuda.get_device_name() if accelerator == "cuda" else "cpu"}


def run_row(row: dict[str, Any]) -> dict[str, Any]:
    """One mps/titan row, in this (fresh) process."""
    result = {**row, **_environment(row["accelerator"])}
    L.seed_everything(0, verbose=False)  # the same initial weights and loss in every variant
    try:
        result |= train_variant(row)
    except torch.OutOfMemoryError:
        result |= {"tokens_per_s": OOM, "step_time_s": OOM, "peak_memory_gib": OOM, "loss": OOM,
                   "oom_at_gib": _peak_memory_gib(row["accelerator"])}
    return result


def run_llama(row: dict[str, Any]) -> dict[str, Any]:
    """LlamaModule through throughput.py, whose ``--steps`` counts the warm-up too; its Lightning result's rates."""
    shape = SHAPES[row["shape"]]
    command = [sys.executable, str(Path(__file__).with_name("throughput.py")), "--flavor", "1B", "--compile",
               "--compile-loss", "--batch-size", str(shape.batch_size), "--seq-len", str(shape.seq_len),
               "--steps", str(row["warmup"] + row["steps"]), "--warmup", str(row["warmup"])]
    done = subprocess.run(command, capture_output=True, text=True)
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not found:
        return _failed(row, done)
    run = found[-1]["lightning"]
    result = {**row, "command": " ".join(command[1:])}
    if run.get("oom"):
        return result | {"tokens_per_s": OOM, "step_time_s": OOM, "peak_memory_gib": OOM, "loss": OOM,
                         "oom_at_gib": run.get("peak_memory_gib")}
    step_time = shape.batch_size * shape.seq_len / run["tokens_per_s"]
    return result | {"tokens_per_s": run["tokens_per_s"], "step_time_s": round(step_time, 4),
                     "peak_memory_gib": run["peak_memory_gib"], "loss": None}


def _failed(row: dict[str, Any], done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """A row whose process failed: its output tail to stderr, the last error line into the result."""
    print(f"--- {row['variant']} failed with exit code {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-8000:]}",
          file=sys.stderr, flush=True)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return {**row, "error": lines[-1] if lines else f"exit code {done.returncode}"}


def run_in_fresh_process(row: dict[str, Any]) -> dict[str, Any]:
    if row["variant"] == "llama":
        return run_llama(row)
    done = subprocess.run([sys.executable, __file__, "--row", json.dumps(row)], capture_output=True, text=True)
    found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
    return json.loads(found[0]) if not done.returncode and found else _failed(row, done)


def _number(value: Any, spec: str) -> str:
    if value is None:
        return "—"
    return value if isinstance(value, str) else format(value, spec)


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| variant | knobs | tokens/s | step s | peak alloc GiB | last loss |", "|---|---|---|---|---|---|"]
    for r in results:
        knobs = ", ".join(f"{k}={v}" for k, v in r.get("knobs", {}).items()) or "—"
        if "error" in r:
            lines.append(f"| {r['variant']} | {knobs} | failed: {r['error'][:120]} | | | |")
            continue
        lines.append(f"| {r['variant']} | {knobs} | {_number(r['tokens_per_s'], ',')} | "
                     f"{_number(r['step_time_s'], '.3f')} | {_number(r['peak_memory_gib'], '.1f')} | "
                     f"{_number(r['loss'], '.4f')} |")
    return "\n".join(lines)


def _ratios(results: list[dict[str, Any]]) -> str:
    rates = {r["variant"]: r.get("tokens_per_s") for r in results}
    lines = []
    for top, bottom in RATIOS:
        if top in rates and bottom in rates:
            a, b = rates[top], rates[bottom]
            value = f"{a / b:.3f}" if isinstance(a, int | float) and isinstance(b, int | float) else "—"
            lines.append(f"- {top} / {bottom}: {value}")
    return "\n".join(lines)


def _knob_value(text: str) -> Any:
    """JSON where it parses (true, 2, null), else the string itself (none, selective_op)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _knobs(parser: argparse.ArgumentParser, pairs: list[str]) -> dict[str, Any]:
    knobs = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            parser.error(f"--knob {pair!r} is not name=value, e.g. --knob compile=true")
        knobs[name] = _knob_value(value)
    if knobs:
        from titan_strategy import TitanStrategy

        unknown = sorted(set(knobs) - set(inspect.signature(TitanStrategy).parameters))
        if unknown:
            parser.error(f"--knob {', '.join(unknown)}: not TitanStrategy arguments (see docs/knobs.md)")
    return knobs


def _rows(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)}: choose among {','.join(VARIANTS)}")
    knobs = _knobs(parser, args.knob)
    rows = []
    for variant in variants:
        if variant == "llama" and (args.tiny or args.accelerator != "cuda"):
            print("skipping llama: throughput.py runs the 1B shape on CUDA only", file=sys.stderr)
            continue
        row = {"variant": variant, "shape": "tiny" if args.tiny else "1B", "accelerator": args.accelerator,
               "steps": args.steps, "warmup": args.warmup}
        if variant.startswith("titan"):
            row["knobs"] = knobs | ({"compile": True} if variant == "titan-compile" else {})
        rows.append(row)
    return rows


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return found.stdout.strip() or "unknown"


def _write_results(path: Path, results: list[dict[str, Any]], report: str) -> None:
    gpu = next((r["gpu"] for r in results if "gpu" in r), "unknown")
    header = (f"\n## {datetime.date.today()} — Hugging Face LlamaForCausalLM under Lightning: ModelParallelStrategy "
              f"against TitanStrategy\n\nMachine: 1 x {gpu}, torch {torch.__version__}, transformers "
              f"{transformers.__version__}, lightning {L.__version__}, commit {_commit()}. Command: `python "
              f"benchmarks/hf_causal_lm.py {' '.join(sys.argv[1:])}`.\n\n")
    with path.open("a") as results_file:
        results_file.write(header + report + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, among {','.join(VARIANTS)}")
    parser.add_argument("--knob", action="append", default=[], metavar="NAME=VALUE",
                        help="a TitanStrategy knob for the titan variants (docs/knobs.md), e.g. compile=true; repeat")
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after the warm-up")
    parser.add_argument("--warmup", type=int, default=8, help="steps before the clock starts")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, for a smoke test")
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--results", type=Path, help="append a dated section with the table to this Markdown file")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # internal: one row's JSON, run in this process
    args = parser.parse_args()
    if args.row:
        print("ROW " + json.dumps(run_row(json.loads(args.row))), flush=True)
        return
    if args.steps < 1 or args.warmup < 1:
        parser.error(f"--steps {args.steps} and --warmup {args.warmup} must both be at least 1")
    results = []
    for row in _rows(args, parser):
        results.append(run_in_fresh_process(row))
        print(json.dumps(results[-1]), flush=True)
    report = "\n\n".join(part for part in (_table(results), _ratios(results)) if part)
    print(report)
    if args.results is not None:
        _write_results(args.results, results, report)
    if any("error" in r for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
