"""TitanStrategy's flat knobs turned into one frozen config per feature, and the rules that span features.

Each knob is described once, by its field in a feature's dataclass here (its ``Literal`` type, default and
docstring); ``docs/knobs.md`` is generated from them (``python -m titan_strategy.knob_reference``). The modules of
this package are leaves: they import no runtime code, so reading a config is cheap. ``TitanStrategy(...)``, its
YAML form and ``titan plan --check`` all go through ``TitanConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, get_type_hints

import torch

from titan_strategy.config.activation_checkpoint import ACMode, ActivationCheckpointConfig
from titan_strategy.config.checkpoint import CheckpointConfig, CheckpointMode
from titan_strategy.config.compile import CompileConfig
from titan_strategy.config.context_parallel import ContextParallelConfig, RotateMethod
from titan_strategy.config.cuda_graphs import CudaGraphsConfig
from titan_strategy.config.distributed import DistributedConfig
from titan_strategy.config.fault_tolerance import FaultTolerance, FaultToleranceConfig
from titan_strategy.config.float8 import Float8Config, Float8Recipe
from titan_strategy.config.fsdp import FSDPConfig, ReshardPolicy
from titan_strategy.config.mesh import MeshConfig, ParallelDims
from titan_strategy.config.pipeline import ZERO_BUBBLE_SCHEDULES, PipelineConfig, ScheduleName
from titan_strategy.config.tensor_parallel import TensorParallelConfig
from titan_strategy.knobs import KNOB

__all__ = ["PLUGIN_ARGUMENTS", "ACMode", "CheckpointMode", "FaultTolerance", "Float8Recipe", "ParallelDims",
           "PipelineConfig", "ReshardPolicy", "RotateMethod", "ScheduleName", "TitanConfig", "compiled_tp_problem",
           "compiled_zero_bubble_problem", "knob_fields", "knob_names"]

# TitanStrategy's arguments that are Lightning plugins beside the knobs, not knobs.
PLUGIN_ARGUMENTS = ("cluster_environment", "checkpoint_io")
# Measured on CPU/gloo: compiled tensor-parallel blocks get gradients ~1% off the eager ones on torch
# 2.13 (grad norm 0.8004 vs 0.8064 for the test model), and are exact on 2.11.
_COMPILED_TP_IS_BROKEN = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 13)


@dataclass(frozen=True)
class TitanConfig:
    """Every TitanStrategy knob, by feature. Each feature checks its own values when built; this checks the
    rules between features. Build it from the flat knobs with ``from_knobs``; ``knobs()`` gives them back."""

    mesh: MeshConfig = field(default_factory=MeshConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    tensor_parallel: TensorParallelConfig = field(default_factory=TensorParallelConfig)
    context_parallel: ContextParallelConfig = field(default_factory=ContextParallelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    activation_checkpointing: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    cuda_graphs: CudaGraphsConfig = field(default_factory=CudaGraphsConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        if self.mesh.pp != self.pipeline.size:
            raise ValueError(f"The mesh has pipeline_parallel_size={self.mesh.pp} but the pipeline config "
                             f"{self.pipeline.size}; build both from the same knobs (TitanConfig.from_knobs).")
        problem = compiled_zero_bubble_problem(self.compile.blocks, self.pipeline.size, self.pipeline.schedule)
        if problem:
            raise ValueError(problem)
        self.fault_tolerance.check_layout(self.mesh, self.pipeline.size)
        if self.cuda_graphs.enabled and self.fault_tolerance.mode != "none":
            raise ValueError(f"cuda_graphs=True freezes the gradient all-reduce into a graph, but fault_tolerance="
                             f"{self.fault_tolerance.mode!r} decides it on the host every step (quorum, participation, "
                             "a communicator rebuilt when replicas change). Set cuda_graphs=False, or "
                             "fault_tolerance='none'.")
        if self.cuda_graphs.enabled and self.activation_checkpointing.mode != "none" and not self.compile.blocks:
            raise ValueError(f"cuda_graphs=True with activation_checkpointing={self.activation_checkpointing.mode!r} "
                             "needs compile=True: eager checkpointing saves the CUDA RNG state, which no graph "
                             "capture may read. Set compile=True, or activation_checkpointing='none'.")
        if self.tensor_parallel.async_tp and not self.compile.blocks:
            raise ValueError("async_tensor_parallel=True needs compile=True: AsyncTP is an inductor pass over "
                             "compiled blocks. Set compile=True, or async_tensor_parallel=False.")

    @classmethod
    def from_knobs(cls, **knobs: Any) -> TitanConfig:
        """The config of ``TitanStrategy(**knobs)``; knobs left out take their defaults.

        Raises:
            TypeError: a knob TitanStrategy does not have.
            ValueError: a value a feature or a rule between features refuses.
        """
        unknown = set(knobs) - set(knob_names())
        if unknown:
            raise TypeError(f"TitanStrategy has no knob {sorted(unknown)}; the knobs are {sorted(knob_names())}.")
        features = {name: feature(**{f.name: knobs[f.metadata[KNOB]] for f in knob_fields(feature)
                                     if f.metadata[KNOB] in knobs})
                    for name, feature in _features().items()}
        # The pipeline's rules need its degree, a knob of the mesh.
        features["pipeline"] = dataclasses.replace(features["pipeline"], size=features["mesh"].pp)
        return cls(**features)

    @classmethod
    def for_this_job(cls, **knobs: Any) -> TitanConfig:
        """``from_knobs``, then ``check_job``: the config of a run about to start here."""
        config = cls.from_knobs(**knobs)
        config.check_job()
        return config

    def knobs(self) -> dict[str, Any]:
        """The flat TitanStrategy arguments this config stands for (the inverse of ``from_knobs``)."""
        flat = {}
        for name in _features():
            feature = getattr(self, name)
            flat |= {f.metadata[KNOB]: getattr(feature, f.name) for f in knob_fields(type(feature))}
        return flat

    def check_job(self) -> None:
        """Refuse what this job cannot run: what the installed torch gets wrong, and a torchft job that does not
        say where its lighthouse is or which group it is. Apart from ``__post_init__``'s rules, which hold for any
        job, since ``titan plan --check`` reads configs for clusters that may run another torch."""
        problem = compiled_tp_problem(self.compile, self.mesh.tp)
        if problem:
            raise ValueError(problem)
        self.fault_tolerance.check_job(self.mesh.dp_replicate)

    def check_module(self, module: Any) -> None:
        """Refuse a LightningModule these knobs cannot train, before any process starts."""
        self.compile.check_module(module)
        self.cuda_graphs.check_module(module)
        self.pipeline.check_module(module)

    def check_device(self, device: torch.device) -> None:
        """Refuse what cannot run on ``device``, before any process starts (the checkpoint IO checks its mode)."""
        self.tensor_parallel.check_device(device)
        self.cuda_graphs.check_device(device)
        self.float8.check_device(device)


def _features() -> dict[str, type]:
    hints = get_type_hints(TitanConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TitanConfig)}


def knob_fields(feature: type) -> list[dataclasses.Field]:
    """The fields of a feature config that hold a knob (a field such as the pipeline's degree holds another
    feature's knob, set from it)."""
    return [f for f in dataclasses.fields(feature) if KNOB in f.metadata]


def knob_names() -> tuple[str, ...]:
    """Every flat TitanStrategy knob, once each, in feature order."""
    return tuple(f.metadata[KNOB] for feature in _features().values() for f in knob_fields(feature))


# Also the capacity planner's rules (a layout it proposes must be one the strategy runs).
def compiled_zero_bubble_problem(compile: bool, pipeline_parallel_size: int, schedule: str | None) -> str | None:
    if compile and pipeline_parallel_size > 1 and schedule in ZERO_BUBBLE_SCHEDULES:
        return (f"pipeline_schedule={schedule!r} splits backward into input- and weight-gradient passes, which torch "
                "refuses for compiled stages; use compile=False, or a schedule such as 'Interleaved1F1B'.")
    return None


def compiled_tp_problem(compile: CompileConfig, tensor_parallel_size: int) -> str | None:
    for name, on in (("compile", compile.blocks), ("compile_loss", compile.loss)):
        if on and tensor_parallel_size > 1 and _COMPILED_TP_IS_BROKEN:
            return (f"{name}=True with tensor_parallel_size={tensor_parallel_size} gives wrong gradients on torch "
                    f"{torch.__version__} (a DTensor backward regression; torch 2.11 is correct). Use {name}=False, "
                    "or torch 2.11.")
    return None
