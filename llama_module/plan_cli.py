"""``titan plan``: propose 4-D layouts for a Llama flavor on a GPU cluster, or check a training config.

    titan plan --model 8B --gpus 128 --gpu H100 --seq-len 8192 --global-batch-tokens 2097152 --png plan.png
    titan plan --check configs/llama3_8b_fsdp.yaml --gpu H100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from llama_module.args import LlamaConfig, get_flavor
from titan_strategy.config import PLUGIN_ARGUMENTS, TitanConfig
from titan_strategy.kernels.linear_cross_entropy import DEFAULT_CHUNK_TOKENS
from titan_strategy.planner.estimate import Job, Layout
from titan_strategy.planner.hardware import GPU, GPUS, get_gpu
from titan_strategy.planner.report import format_plans, save_memory_png
from titan_strategy.planner.search import (
    Plan,
    PlanError,
    check_layout,
    describe,
    plan_layouts,
)

__all__ = ["check_training_config", "main", "training_layout"]


def _config_of(model: Any) -> LlamaConfig:
    return get_flavor(model) if isinstance(model, str) else LlamaConfig.from_dict(model)


def _strategy_config(config: dict[str, Any]) -> TitanConfig:
    """The TitanStrategy knobs of a training YAML (``trainer.strategy.init_args``), read as the strategy reads
    them: a value it would refuse fails here too."""
    strategy = (config.get("trainer") or {}).get("strategy")
    arguments = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    try:
        return TitanConfig.from_knobs(**{k: v for k, v in arguments.items() if k not in PLUGIN_ARGUMENTS})
    except (TypeError, ValueError) as error:
        raise PlanError(f"TitanStrategy refuses these knobs: {error}") from None


def _layout_of_config(strategy: TitanConfig, gpus: int, n_layers: int) -> Layout:
    """The layout a strategy config asks for on ``gpus`` GPUs (the planner says why one that does not divide
    cannot run, and what would)."""
    mesh, pipeline = strategy.mesh, strategy.pipeline
    stages_per_rank, microbatches = 1, 1
    if pipeline.size > 1:
        try:
            resolved = pipeline.resolve(n_layers)
        except ValueError as error:
            raise PlanError(f"The pipeline cannot run: {error}") from None
        stages_per_rank, microbatches = resolved.num_stages // pipeline.size, resolved.microbatches
    return Layout(dp_replicate=mesh.dp_replicate, dp_shard=mesh.shard_degree(gpus), tp=mesh.tp, cp=mesh.cp,
                  pp=mesh.pp, schedule=pipeline.schedule if pipeline.size > 1 else None, microbatches=microbatches,
                  stages_per_rank=stages_per_rank, ac=strategy.activation_checkpointing.mode,
                  float8=strategy.float8.recipe != "none")


def check_training_config(config: dict[str, Any], gpu: GPU) -> tuple[Plan, Job]:
    """Check a training config (as ``titan fit`` reads it) against ``gpu``: ``PlanError`` names what does not fit."""
    shape, layout, job = training_layout(config, gpu)
    return check_layout(shape, layout, job), job


def _llama_module_arguments(model: dict[str, Any]) -> dict[str, Any]:
    """A config's ``model`` section as LlamaModule's arguments: as a YAML may write them, or as ``titan fit`` parses
    them (``class_path`` and ``init_args``)."""
    if "class_path" not in model:
        return model
    if model["class_path"] not in ("llama_module.LlamaModule", "llama_module.module.LlamaModule"):
        raise PlanError(f"model.class_path={model['class_path']}: the planner knows LlamaModule's shapes only; check "
                        "the layout of another module by rehearsing it (titan rehearse), or leave out --plan_check.")
    return model.get("init_args") or {}


def training_layout(config: dict[str, Any], gpu: GPU) -> tuple[LlamaConfig, Layout, Job]:
    """The model shape, layout and job a training config (as ``titan fit`` reads it) asks the planner about."""
    trainer = config.get("trainer") or {}
    per_node = trainer.get("devices", 1)
    if not isinstance(per_node, int):
        raise PlanError(f"trainer.devices={per_node!r}: the check needs a number of devices.")
    gpus = per_node * (trainer.get("num_nodes") or 1)
    model = _llama_module_arguments(config.get("model") or {})
    shape = _config_of(model.get("model", "debug"))
    strategy = _strategy_config(config)
    layout = _layout_of_config(strategy, gpus, shape.n_layers)
    data = config.get("data") or {}
    seq_len, batch_size = data.get("seq_len", 2048), data.get("batch_size", 8)
    job = Job(gpus=gpus, gpus_per_node=per_node, gpu=gpu, seq_len=seq_len,
              global_batch_tokens=seq_len * batch_size * layout.dp_replicate * layout.dp_shard,
              compiled_blocks=strategy.compile.blocks, compiled_loss=strategy.compile.loss,
              async_tp=strategy.tensor_parallel.async_tp,
              loss_chunk_tokens=model.get("loss_chunk_tokens", DEFAULT_CHUNK_TOKENS)
              if model.get("cross_entropy", "chunked") == "chunked" else None)
    return shape, layout, job


def _check(args: argparse.Namespace) -> int:
    plan, job = check_training_config(yaml.safe_load(Path(args.check).read_text()), get_gpu(args.gpu, args.gpu_memory))
    print(f"{args.check}: fits. {describe(plan.layout)}")
    print(format_plans([plan], job, args.save_window_s))
    return 0


def _plan(args: argparse.Namespace) -> int:
    model = yaml.safe_load(Path(args.model).read_text())["model"]["model"] if args.model.endswith(".yaml") \
        else args.model
    job = Job(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=get_gpu(args.gpu, args.gpu_memory),
              seq_len=args.seq_len, global_batch_tokens=args.global_batch_tokens, compiled_blocks=not args.eager,
              compiled_loss=not args.eager, async_tp=args.async_tp, loss_chunk_tokens=DEFAULT_CHUNK_TOKENS)
    plans = plan_layouts(_config_of(model), job, top=args.top)
    print(format_plans(plans, job, args.save_window_s))
    if args.png is not None:
        print(f"Memory picture: {save_memory_png(plans, job, args.png)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="titan plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="CONFIG.yaml", help="check a training config instead of proposing layouts")
    parser.add_argument("--model", default="8B", help="a flavor (debug, 1B, 3B, 8B, 70B, 405B) or a training YAML")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu", default="H100", choices=sorted(GPUS))
    parser.add_argument("--gpu-memory", type=float, help="GiB per GPU, where it differs from the kind's")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step (default: 2 sequences "
                        "per GPU)")
    parser.add_argument("--eager", action="store_true", help="plan for uncompiled blocks and loss (default: "
                        "compile=True and compile_loss=True, which keep fewer activations)")
    parser.add_argument("--async-tp", action="store_true", help="plan with AsyncTP (async_tensor_parallel=True)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--png", type=Path, help="write the memory breakdown of the top layouts here")
    parser.add_argument("--save-window-s", type=float, default=60.0, help="checkpoint save window, for the write "
                        "bandwidth column")
    args = parser.parse_args(argv)
    if args.global_batch_tokens is None:
        args.global_batch_tokens = 2 * args.seq_len * args.gpus
    try:
        return _check(args) if args.check else _plan(args)
    except (PlanError, ValueError, OSError) as error:
        print(f"titan plan: {error}", file=sys.stderr)
        return 1 if isinstance(error, PlanError) else 2


if __name__ == "__main__":
    raise SystemExit(main())
