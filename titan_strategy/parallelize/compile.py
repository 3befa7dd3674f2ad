"""Regional compile: each repeated block is compiled on its own, so one compiled graph serves them all."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_strategy.knobs import knob
from titan_strategy.mesh import ParallelDims
from titan_strategy.plan import PlannedModule

__all__ = ["CompileConfig", "apply_compile", "apply_compile_loss"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileConfig:
    """What ``torch.compile`` compiles."""

    blocks: bool = knob("compile", False)
    """Each repeated block of the model, on its own."""
    loss: bool = knob("compile_loss", False)
    """The module's ``compute_loss(output, target)``: the fp32 upcast of the logits fuses into the cross-entropy
    instead of materializing full-vocabulary fp32 logits."""
    cuda_graphs: bool = knob("cuda_graphs", False)
    """The model's training forward and backward replayed as CUDA graphs once warm (``cuda_graph.py``): CUDA
    only, on one device or under FSDP2/HSDP; pipeline, tensor and context parallelism are refused."""

    def check_device(self, device: torch.device) -> None:
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True replays CUDA graphs, but this run is on {device.type!r}; train on "
                             "a GPU, or set cuda_graphs=False.")

    def check_layout(self, dims: ParallelDims) -> None:
        """CUDA graphs are captured for a model on one device or data-parallel under FSDP2/HSDP."""
        if not self.cuda_graphs:
            return
        layout = {"pipeline_parallel_size": dims.pp, "tensor_parallel_size": dims.tp,
                  "context_parallel_size": dims.cp}
        beyond_one = {name: size for name, size in layout.items() if size > 1}
        if beyond_one:
            raise ValueError(f"cuda_graphs=True graphs a model on one device or under FSDP2/HSDP, but this layout "
                             f"has {beyond_one}: TP's and CP's collectives are not captured yet, and pipeline "
                             "schedules are exempt. Set cuda_graphs=False, or parallelize with data parallelism only.")

    def check_module(self, module: Any) -> None:
        """Refuse a module this config cannot compile, before any process starts."""
        if self.loss and not callable(getattr(module, "compute_loss", None)):
            raise ValueError(f"compile_loss=True compiles the module's compute_loss(output, target), but "
                             f"{type(module).__name__} has none; define it (see LlamaModule) "
                             "or set compile_loss=False.")
        if self.cuda_graphs and not isinstance(module, PlannedModule):
            raise ValueError(f"cuda_graphs=True graphs the model a parallel_plan() names, but {type(module).__name__} "
                             "declares none (it builds its own model in configure_model); add a parallel_plan() "
                             "(see LlamaModule), or set cuda_graphs=False.")


def apply_compile(model: nn.Module, blocks: tuple[str, ...]) -> None:
    """Compile every block in place (``nn.Module.compile``), which keeps parameter names clean for DCP."""
    options = _block_inductor_options()
    for name in blocks:
        model.get_submodule(name).compile(options=options)
    log.info("Compiled %d blocks with torch.compile%s", len(blocks), f", inductor options {options}" if options else "")


def _block_inductor_options() -> dict[str, Any]:
    """Inductor settings of the compiled blocks that differ from torch's defaults.

    Mix-order reduction off: inductor (torch 2.10+) fuses a norm's backward, whose two reductions run along the
    rows (the input's gradient) and along the columns (the weight's), into one persistent kernel. Under float8
    that kernel also takes the next matmul's scaling, and it took 2.4 ms per block at the 8B width, ten times the
    block's other norm backward and 10% of the step (profile, H100). Off, the 8B width x 16 layers with float8 trains
    6.5-7.5% faster (23,935 and 23,892 tokens/s against 22,261 and 22,424, one lease); the 1B shape in bf16
    stays within one run's noise (54,017 against 54,169; benchmarks/RESULTS.md, session 10).
    ``TORCHINDUCTOR_MIX_ORDER_REDUCTION`` set in the environment keeps the user's choice; a torch without the
    option compiles with its own."""
    from torch._inductor import config

    if "TORCHINDUCTOR_MIX_ORDER_REDUCTION" in os.environ or not hasattr(config.triton, "mix_order_reduction"):
        return {}
    return {"triton.mix_order_reduction": False}


def apply_compile_loss(module: Any) -> None:
    """Compile ``module.compute_loss`` in place; a module compiled by an earlier fit or validate keeps its graph."""
    loss = module.compute_loss
    if not hasattr(loss, "_torchdynamo_orig_callable"):
        module.compute_loss = torch.compile(loss)
