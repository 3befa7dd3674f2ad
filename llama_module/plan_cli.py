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
from titan_strategy.pipeline.layout import PipelineConfig
from titan_strategy.planner.estimate import Job, Layout, ModelShape
from titan_strategy.planner.hardware import GPU, GPUS, get_gpu
from titan_strategy.planner.report import format_plans, save_memory_png
from titan_strategy.planner.search import (
    Plan,
    PlanError,
    check_layout,
    describe,
    plan_layouts,
)

__all__ = ["check_training_config", "main", "model_shape"]


def model_shape(config: LlamaConfig) -> ModelShape:
    return ModelShape(dim=config.dim, n_layers=config.n_layers, n_heads=config.n_heads, n_kv_heads=config.n_kv_heads,
                      ffn_dim=config.ffn_dim, vocab_size=config.vocab_size)


def _config_of(model: Any) -> LlamaConfig:
    return get_flavor(model) if isinstance(model, str) else LlamaConfig.from_dict(model)


def _strategy_args(config: dict[str, Any]) -> dict[str, Any]:
    """TitanStrategy's arguments in a training YAML (``trainer.strategy.init_args``)."""
    strategy = (config.get("trainer") or {}).get("strategy")
    return (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}


def _pipeline_of(strategy: dict[str, Any], n_layers: int) -> tuple[str | None, int, int]:
    """(schedule, stages per rank, microbatches) of the strategy's pipeline knobs, resolved as TitanStrategy does."""
    size = strategy.get("pipeline_parallel_size", 1)
    if size == 1:
        return None, 1, 1
    schedule = strategy.get("pipeline_schedule", "1F1B")
    split_points = strategy.get("pipeline_split_points")
    try:
        layout = PipelineConfig(size=size, schedule=schedule,
                                microbatches=strategy.get("pipeline_microbatches"),
                                stages_per_rank=strategy.get("pipeline_stages_per_rank"),
                                layers_per_stage=strategy.get("pipeline_layers_per_stage"),
                                split_points=tuple(split_points) if split_points is not None else None).resolve(n_layers)
    except ValueError as error:
        raise PlanError(f"The pipeline cannot run: {error}") from None
    return schedule, layout.num_stages // size, layout.microbatches


def _layout_of_config(config: dict[str, Any], strategy: dict[str, Any], gpus: int,
                      n_layers: int) -> tuple[Layout, int, int]:
    """The layout a training YAML (with its strategy arguments) asks for, its sequence length and its global
    batch in tokens."""
    degrees = {"dp_replicate": strategy.get("data_parallel_replicate_size", 1),
               "tp": strategy.get("tensor_parallel_size", 1), "cp": strategy.get("context_parallel_size", 1),
               "pp": strategy.get("pipeline_parallel_size", 1)}
    others = degrees["dp_replicate"] * degrees["tp"] * degrees["cp"] * degrees["pp"]
    dp_shard = strategy.get("data_parallel_shard_size", -1)
    dp_shard = gpus // others if dp_shard == -1 else dp_shard
    schedule, stages_per_rank, microbatches = _pipeline_of(strategy, n_layers)
    layout = Layout(dp_shard=dp_shard, schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
                    ac=strategy.get("activation_checkpointing", "none"),
                    float8=strategy.get("float8", "none") != "none", **degrees)
    data = config.get("data") or {}
    seq_len, batch_size = data.get("seq_len", 2048), data.get("batch_size", 8)
    return layout, seq_len, seq_len * batch_size * layout.dp_replicate * layout.dp_shard


def check_training_config(config: dict[str, Any], gpu: GPU) -> tuple[Plan, Job]:
    """Check a training config (as ``titan fit`` reads it) against ``gpu``: ``PlanError`` names what does not fit."""
    trainer = config.get("trainer") or {}
    per_node = trainer.get("devices", 1)
    if not isinstance(per_node, int):
        raise PlanError(f"trainer.devices={per_node!r}: the check needs a number of devices.")
    gpus = per_node * (trainer.get("num_nodes") or 1)
    model = (config.get("model") or {}).get("model", "debug")
    shape = _config_of(model)
    strategy = _strategy_args(config)
    layout, seq_len, batch_tokens = _layout_of_config(config, strategy, gpus, shape.n_layers)
    job = Job(gpus=gpus, gpus_per_node=per_node, gpu=gpu, seq_len=seq_len, global_batch_tokens=batch_tokens,
              compiled_blocks=bool(strategy.get("compile", False)),
              compiled_loss=bool(strategy.get("compile_loss", False)),
              async_tp=bool(strategy.get("async_tensor_parallel", False)))
    return check_layout(model_shape(shape), layout, job), job


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
              compiled_loss=not args.eager, async_tp=args.async_tp)
    plans = plan_layouts(model_shape(_config_of(model)), job, top=args.top)
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
