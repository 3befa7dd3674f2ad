"""The TorchTitan paper's published runs, as planner inputs: what the planner is checked against.

Source: the TorchTitan paper (arXiv 2410.06511, tables 1-6) and torchtitan's
``benchmarks/llama3_h100_202412_torchtitan.md``, which give the setup: H100 SXM with 96 GB HBM2e at
a 500 W power limit, 8 per host on NVLink, 400 Gb/s RDMA per GPU, seq 8192, torch.compile of the
blocks only (the loss ran eager), memory as the allocator's peak reserved GiB. The 8B-on-128 run is
the compiled bf16 row of table 3; the others ran Float8, and the 70B and 405B ones AsyncTP.
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_module.args import LlamaConfig, get_flavor
from titan_strategy.planner.estimate import Job, Layout
from titan_strategy.planner.hardware import get_gpu

__all__ = ["PAPER_RUNS", "PaperRun"]

PAPER_H100 = get_gpu("H100", memory_gib=96)


@dataclass(frozen=True)
class PaperRun:
    name: str
    flavor: str
    job: Job
    layout: Layout
    tokens_per_s_per_gpu: float
    memory_gib: float

    @property
    def shape(self) -> LlamaConfig:
        return get_flavor(self.flavor)


def _job(gpus: int, sequences: int, seq_len: int = 8192, async_tp: bool = False) -> Job:
    return Job(gpus=gpus, gpus_per_node=8, gpu=PAPER_H100, seq_len=seq_len, global_batch_tokens=sequences * seq_len,
               compiled_loss=False, async_tp=async_tp)


def _layout(dp_shard: int, ac: str, float8: bool, tp: int = 1, cp: int = 1, pp: int = 1, schedule: str | None = None,
            microbatches: int = 1, stages_per_rank: int = 1) -> Layout:
    return Layout(dp_replicate=1, dp_shard=dp_shard, tp=tp, cp=cp, pp=pp, schedule=schedule,
                  microbatches=microbatches, stages_per_rank=stages_per_rank, ac=ac, float8=float8)


PAPER_RUNS = (
    PaperRun("8B, 128 GPUs, FSDP (table 3, compile, bf16, selective AC)", "8B", _job(128, 256),
             _layout(128, "selective_op", False), 6514, 62.0),
    PaperRun("70B, 256 GPUs, FSDP32 x TP8 (table 4, AsyncTP, float8, full AC)", "70B", _job(256, 512, async_tp=True),
             _layout(32, "full", True, tp=8), 876, 67.6),
    PaperRun("405B, 512 GPUs, FSDP8 x TP8 x PP8, 1F1B (table 5)", "405B", _job(512, 256, async_tp=True),
             _layout(8, "full", True, tp=8, pp=8, schedule="1F1B", microbatches=32), 100, 82.5),
    PaperRun("405B, 512 GPUs, FSDP8 x TP8 x PP8, Interleaved1F1B (table 5)", "405B", _job(512, 256, async_tp=True),
             _layout(8, "full", True, tp=8, pp=8, schedule="Interleaved1F1B", microbatches=32, stages_per_rank=2),
             128, 72.7),
    PaperRun("8B, 8 GPUs, 262,144 tokens, CP8 (table 2, float8, full AC)", "8B", _job(8, 1, seq_len=262144),
             _layout(1, "full", True, cp=8), 548, 84.5),
)
