"""What the planner assumes of a GPU and its links (vendor data sheets; bandwidths are per GPU, one direction)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPU", "GPUS", "get_gpu"]


@dataclass(frozen=True)
class GPU:
    """A GPU kind as the planner sees it.

    Attributes:
        name: the table's key.
        memory_gib: usable device memory.
        peak_bf16_tflops: dense bf16 tensor-core peak.
        float8: has float8 tensor cores (SM 8.9+).
        intra_node_gbps: NVLink bandwidth per GPU, GB/s one way.
        inter_node_gbps: network bandwidth per GPU, GB/s one way (one 400 Gb/s NIC per GPU: 50).
    """

    name: str
    memory_gib: float
    peak_bf16_tflops: float
    float8: bool
    intra_node_gbps: float
    inter_node_gbps: float


GPUS: dict[str, GPU] = {gpu.name: gpu for gpu in (
    GPU("A100", memory_gib=80, peak_bf16_tflops=312, float8=False, intra_node_gbps=300, inter_node_gbps=25),
    GPU("H100", memory_gib=80, peak_bf16_tflops=989, float8=True, intra_node_gbps=450, inter_node_gbps=50),
    GPU("H200", memory_gib=141, peak_bf16_tflops=989, float8=True, intra_node_gbps=450, inter_node_gbps=50),
    GPU("B200", memory_gib=180, peak_bf16_tflops=2250, float8=True, intra_node_gbps=900, inter_node_gbps=50),
)}


def get_gpu(name: str, memory_gib: float | None = None) -> GPU:
    """The named kind, with its memory overridden where the user's cards differ (H100 NVL: 94 GiB)."""
    try:
        gpu = GPUS[name]
    except KeyError:
        raise ValueError(f"Unknown GPU kind {name!r}; choose one of {sorted(GPUS)}.") from None
    if memory_gib is None:
        return gpu
    if memory_gib <= 0:
        raise ValueError(f"gpu memory {memory_gib} GiB must be > 0.")
    return GPU(gpu.name, memory_gib, gpu.peak_bf16_tflops, gpu.float8, gpu.intra_node_gbps, gpu.inter_node_gbps)
