"""``titan rehearse``: run one rank of a multi-GPU training config on this one device, and measure what it holds.

    titan rehearse --config configs/llama3_70b_fsdp_tp8.yaml                 # rank 0
    titan rehearse --config configs/llama3_405b_fsdp8_tp8_pp8.yaml           # PP: the first and last stage's ranks
    titan rehearse --config configs/llama3_405b_fsdp8_tp8_pp8.yaml --ranks first,last,heaviest --steps 3
    titan rehearse --config configs/llama3_70b_fsdp_tp8.yaml --check --gpu H100   # exit 1 if a rank would not fit

Every LightningCLI override of ``titan fit`` works (``--model.model 8B``,
``--trainer.strategy.init_args.tensor_parallel_size 4``). The rank runs the config's strategy, model, precision,
AC, compile, float8 and pipeline schedule through Lightning's loop, on random tokens of the config's batch shape,
with every collective a no-op (``titan_strategy/rehearsal.py``). Communication is not timed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from torch.utils.data import DataLoader

from llama_module.data import TextDataModule
from llama_module.module import LlamaModule
from llama_module.plan_cli import training_layout
from llama_module.synthetic import RandomTokens
from titan_strategy.callbacks.throughput import peak_tflops_of
from titan_strategy.config import PLUGIN_ARGUMENTS, TitanConfig
from titan_strategy.planner.estimate import RUNTIME_GIB, Estimate, estimate
from titan_strategy.planner.hardware import GPU, GPUS, get_gpu
from titan_strategy.rehearsal import RankRehearsal, RehearsalMeter, required_gib

__all__ = ["main", "rehearsed_ranks"]

_STRATEGIES = ("titan_strategy.TitanStrategy", "titan_strategy.strategy.TitanStrategy")
# Callbacks a rehearsal leaves out: it writes no checkpoint, its collectives cannot hang, and it has no logger.
_LEFT_OUT = ("ModelCheckpoint", "FlightRecorder", "LearningRateMonitor")


class RehearseError(ValueError):
    """The config cannot be rehearsed as asked; the message says why and what would."""


def rehearsed_ranks(spec: str, world_size: int, strategy: TitanConfig, shape: Any) -> list[int]:
    """The ranks named by ``spec`` (``first``, ``last``, ``heaviest`` or numbers, comma-separated), in order."""
    dims = strategy.mesh.resolve(world_size)
    stage_ranks = world_size // dims.pp  # pp is the outermost mesh dim: pipeline rank p starts at p x this
    named = {"first": 0, "last": (dims.pp - 1) * stage_ranks,
             "heaviest": _heaviest_pipeline_rank(strategy, dims.pp, shape) * stage_ranks}
    ranks = []
    for part in spec.split(","):
        part = part.strip()
        rank = named.get(part, int(part) if part.isdigit() else None)
        if rank is None or not 0 <= rank < world_size:
            raise RehearseError(f"--ranks {spec!r}: {part!r} is not first, last, heaviest or a rank "
                                f"0..{world_size - 1}.")
        if rank not in ranks:
            ranks.append(rank)
    return ranks


def _heaviest_pipeline_rank(strategy: TitanConfig, pp: int, shape: Any) -> int:
    """The pipeline rank with the most parameters (its blocks, plus the embedding or the output projection);
    on a tie the later one, whose stages also compute the loss."""
    if pp == 1:
        return 0
    layout = strategy.pipeline.resolve(shape.n_layers)
    embedding = shape.vocab_size * shape.dim

    def parameters(pp_rank: int) -> int:
        stages = layout.stages_of(pp_rank)
        held = sum(len(layout.blocks[stage]) for stage in stages) * shape.block_params
        return held + embedding * ((0 in stages) + (layout.num_stages - 1 in stages))

    return max(range(pp), key=lambda rank: (parameters(rank), rank))


class RehearsalCLI(LightningCLI):
    """The ``titan fit`` config parser, for one rank: the config's trainer and model, a rehearsal strategy for its
    full world size in place of its TitanStrategy, and random tokens of the data section's batch shape. Without
    ``--rank`` it only parses (``main`` then runs each rank in a process of its own)."""

    def __init__(self, args: list[str]) -> None:
        # LightningCLI warns when it is given args while sys.argv has some too (`titan rehearse ...` has both).
        with mock.patch.object(sys, "argv", sys.argv[:1]):
            super().__init__(LlamaModule, TextDataModule, args=args, run=False, seed_everything_default=0,
                             save_config_callback=None)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # typing.Optional, not `X | None`: runtime values handed to jsonargparse.
        parser.add_argument("--rank", type=Optional[int], default=None, help="the rank to rehearse")  # noqa: UP045
        parser.add_argument("--ranks", type=Optional[str], default=None,  # noqa: UP045
                            help="ranks to rehearse, one process each: first, last, heaviest or numbers, comma-"
                                 "separated (default: rank 0, or the first and last stage's under PP)")
        parser.add_argument("--steps", type=int, default=3, help="optimizer steps (the first is not measured)")
        parser.add_argument("--check", type=bool, default=False, help="exit 1 if a rank would not fit --gpu")
        parser.add_argument("--gpu", type=str, default="H100", help=f"the target GPU: {', '.join(sorted(GPUS))}")
        parser.add_argument("--json", type=Optional[str], default=None,  # noqa: UP045
                            help="also write the measurements here")

    def before_instantiate_classes(self) -> None:
        config = self.config
        if config.steps < 2:
            raise RehearseError(f"--steps {config.steps}: the first step compiles and warms up; rehearse at least 2.")
        try:
            self.target = get_gpu(config.gpu)
        except ValueError as error:
            raise RehearseError(f"--gpu {config.gpu}: {error}") from None
        self.shape, self.layout, self.job = training_layout(_plain(config), self.target)
        self.world_size, self.strategy_config = _world_and_strategy(config, self.shape.n_layers)
        if config.rank is not None:
            _rehearse_rank(config, self.world_size)

    def instantiate_classes(self) -> None:
        if self.config.rank is not None:
            super().instantiate_classes()


def _rehearse_rank(config: Namespace, world_size: int) -> None:
    """Turn the parsed ``titan fit`` config into one rank's rehearsal, in place."""
    trainer = config.trainer
    trainer.strategy.class_path = "titan_strategy.rehearsal.RehearsalStrategy"
    trainer.strategy.init_args.world_size, trainer.strategy.init_args.rank = world_size, config.rank
    trainer.devices, trainer.num_nodes = 1, 1
    trainer.accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    trainer.max_steps, trainer.max_epochs = config.steps, None
    trainer.limit_val_batches, trainer.num_sanity_val_steps = 0, 0
    trainer.enable_checkpointing, trainer.logger = False, False
    trainer.default_root_dir = tempfile.mkdtemp(prefix="titan-rehearse-")
    trainer.callbacks = [callback for callback in trainer.callbacks or []
                         if callback.class_path.rsplit(".", 1)[-1] not in _LEFT_OUT]
    config.data.tokenizer = None  # the run's tokenizer file need not be here: only the batch shape is read


def _world_and_strategy(config: Namespace, n_layers: int) -> tuple[int, TitanConfig]:
    """The rehearsed run's world size (devices x nodes) and its validated strategy knobs."""
    trainer = config.trainer
    strategy = trainer.strategy
    if not isinstance(strategy, Namespace) or strategy.class_path not in _STRATEGIES:
        raise RehearseError(f"trainer.strategy={strategy!r}: titan rehearse runs TitanStrategy configs; set "
                            "trainer.strategy.class_path: titan_strategy.TitanStrategy.")
    if not isinstance(trainer.devices, int) or trainer.devices < 1:
        raise RehearseError(f"trainer.devices={trainer.devices!r}: the rehearsal needs the run's number of devices "
                            "per node.")
    knobs = {k: v for k, v in strategy.init_args.as_dict().items() if k not in PLUGIN_ARGUMENTS}
    world_size = trainer.devices * (trainer.num_nodes or 1)
    strategy_config = TitanConfig.from_knobs(**knobs)
    # What titan fit refuses (degrees that do not divide, too few blocks for the stages), with its words, here.
    strategy_config.mesh.resolve(world_size)
    if strategy_config.pipeline.size > 1:
        strategy_config.pipeline.resolve(n_layers)
    return world_size, strategy_config


def _plain(config: Namespace) -> dict[str, Any]:
    """The parsed config as ``titan plan --check`` reads a YAML."""
    values = config.as_dict()
    return {"trainer": values["trainer"], "model": values["model"], "data": values["data"]}


def _train(cli: RehearsalCLI) -> RankRehearsal | float:
    """Train ``--steps`` steps of ``--rank``: its measurements, or the GiB it needed at least if it ran out."""
    config, trainer, module = cli.config, cli.trainer, cli.model
    seq_len, batch_size = config.data.seq_len, config.data.batch_size
    dims = cli.strategy_config.mesh.resolve(cli.world_size)
    windows = config.steps * trainer.accumulate_grad_batches * dims.batch_size * batch_size
    documents = module.attention_mask == "block_causal"
    meter = RehearsalMeter()
    trainer.callbacks.append(meter)
    try:
        trainer.fit(module, DataLoader(RandomTokens(windows, seq_len, module.config.vocab_size, documents),
                                       batch_size=batch_size))
    except Exception as error:
        device = trainer.strategy.root_device
        needs = required_gib(error, torch.cuda.memory_reserved(device) if device.type == "cuda" else 0)
        if needs is None:
            raise
        return needs
    return meter.result(trainer)


def _needs_gib(result: dict[str, Any]) -> float:
    """What the rank needs on a GPU: its reserved peak plus the CUDA context and NCCL's buffers."""
    return result.get("needs_at_least_gib", result.get("peak_reserved_gib", 0.0)) + RUNTIME_GIB


def _fits(result: dict[str, Any], target: GPU) -> bool:
    return "needs_at_least_gib" not in result and _needs_gib(result) <= target.memory_gib


def _planned(cli: RehearsalCLI, result: dict[str, Any]) -> Estimate:
    """The planner's estimate for the rehearsed rank: its model of the first or the last pipeline stage (a
    middle stage's rank: the heavier of the two)."""
    stage, last = result["coordinates"]["pp"], cli.layout.pp - 1
    return estimate(cli.shape, cli.layout, cli.job, "first" if stage == 0 else "last" if stage == last else "busiest")


def _describe(result: dict[str, Any], cli: RehearsalCLI) -> str:
    """One rank's measurements beside the planner's estimate for it."""
    target = cli.target
    if "needs_at_least_gib" in result:
        return (f"rank {result['rank']}: does not fit: needs >= {result['needs_at_least_gib']:.1f} GiB (it ran out of "
                "memory on this device)")
    where = ", ".join(f"{name} {index}" for name, index in result["coordinates"].items())
    capacity = f" ({result['device_memory_gib']:.1f} GiB)" if result["device_memory_gib"] else ""
    planned = _planned(cli, result)
    measured_peak, target_peak = peak_tflops_of(result["device"]), target.peak_bf16_tflops
    scaled = (f"; about {result['compute_s'] * measured_peak / target_peak:.3f} s on a {target.name} "
              "(scaled by peak bf16 TFLOP/s)") if measured_peak else ""
    return (f"rank {result['rank']} of {result['world_size']} ({where}) on {result['device']}{capacity}\n"
            f"  parameters held    {result['parameters']:,}\n"
            f"  peak allocated     {result['peak_allocated_gib']:8.2f} GiB   planner: "
            f"{planned.peak_allocated_gib:.2f} GiB\n"
            f"  peak reserved      {result['peak_reserved_gib']:8.2f} GiB   planner: "
            f"{planned.peak_reserved_gib:.2f} GiB\n"
            f"  compute per step   {result['compute_s']:8.3f} s{scaled}; planner: {planned.time['compute']:.3f} s\n"
            "                     communication is not timed: every collective was a no-op\n"
            f"  on a {target.name} ({target.memory_gib:g} GiB): {'fits' if _fits(result, target) else 'does not fit'}"
            f", needs {_needs_gib(result):.1f} GiB with {RUNTIME_GIB:g} GiB for the CUDA context and NCCL")


def _run_ranks(argv: list[str], ranks: list[int]) -> list[dict[str, Any]]:
    """Each rank in a fresh process (its own device state and peak): this command with ``--rank``."""
    results = []
    with tempfile.TemporaryDirectory() as folder:
        for rank in ranks:
            path = Path(folder) / f"rank_{rank}.json"
            command = [sys.executable, "-m", "llama_module.rehearse_cli", *argv, "--rank", str(rank),
                       "--json", str(path), "--check", "false"]
            done = subprocess.run(command, check=False)
            if not path.exists():
                raise RehearseError(f"rank {rank}'s rehearsal stopped (exit {done.returncode}) before it measured.")
            results.extend(json.loads(path.read_text()))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cli = RehearsalCLI(argv)
        config = cli.config
        if config.rank is None:
            default = "first,last" if cli.strategy_config.mesh.pp > 1 else "first"
            ranks = rehearsed_ranks(config.ranks or default, cli.world_size, cli.strategy_config, cli.shape)
            results = _run_ranks(argv, ranks)
            print("\n".join(f"rank {r['rank']}: {'fits' if _fits(r, cli.target) else 'does not fit'} on a "
                            f"{cli.target.name} ({_needs_gib(r):.1f} GiB needed)" for r in results))
        else:
            measured = _train(cli)
            results = [measured.as_dict() if isinstance(measured, RankRehearsal) else
                       {"rank": config.rank, "needs_at_least_gib": measured}]
            print(_describe(results[0], cli))
    except (RehearseError, ValueError) as error:
        print(f"titan rehearse: {error}", file=sys.stderr)
        return 2
    if config.json:
        Path(config.json).write_text(json.dumps(results, indent=1))
    out_of_memory = any("needs_at_least_gib" in result for result in results)
    return 1 if out_of_memory or (config.check and not all(_fits(r, cli.target) for r in results)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
