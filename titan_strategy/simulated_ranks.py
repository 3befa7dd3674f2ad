"""Every rank of a small layout in one process, with real arithmetic: a layout's numerics on one device.

torch's local tensors (``torch.distributed._local_tensor``) hold one value per simulated rank; every op runs once
per rank and every collective is done in the process, on those values. Under ``SimulatedRanksStrategy`` the
model is built, parallelized and trained by the same TitanStrategy path and Lightning loop as a real run, so a
dp2 x tp2 layout on one GPU runs FSDP's all-gathers and reduce-scatters, TP's sharded matmuls, sequence
parallelism, loss parallelism, float8 and token-weighted losses on CUDA, and its losses can be compared with one
process. Use it before a multi-GPU machine exists; it is slow (every op runs ``world_size`` times) and says
nothing about speed or NCCL.

Where torch's code is not SPMD it cannot be simulated, and the strategy says so before training:
- pipeline parallelism (each stage runs other code);
- context parallelism's causal ring attention: torch's ring takes each rank's place from ``dist.get_rank()``,
  which is one number for every simulated rank. Block-causal attention under CP (keys and values all-gathered,
  ``LlamaModule(attention_mask="block_causal")``) is SPMD and is simulated;
- ``torch.compile`` and the Triton AdamW kernel (``adamw="auto"`` picks torch's foreach kernel here).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from titan_strategy import distributed
from titan_strategy.distributed import outside_simulated_ranks
from titan_strategy.rehearsal import RehearsalStrategy, rank_coordinates

__all__ = ["SimulatedRanksStrategy", "check_local_tensors"]


def check_local_tensors() -> None:
    """Raise where this torch cannot simulate ranks."""
    if distributed._local_tensor is None:
        raise RuntimeError(f"torch {torch.__version__} has no local tensors (torch.distributed._local_tensor), "
                           "so it cannot simulate ranks in one process; torch 2.11 and later have them.")


class _DrawnOutsideSimulation:
    """A data loader whose batches are drawn with plain tensors: samplers and collation run once, not per rank."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        with outside_simulated_ranks():
            batches = iter(self.loader)
        while True:
            with outside_simulated_ranks():
                batch = next(batches, StopIteration)
            if batch is StopIteration:
                return
            yield batch


class SimulatedRanksStrategy(RehearsalStrategy):
    """``TitanStrategy`` over all ``world_size`` ranks in this one process, each with its own values.

    Takes every TitanStrategy knob. Each batch the loader yields is the *global* batch: data-parallel rank ``d``
    trains on its ``d``-th slice of dim 0, so a one-process run over the same loader is the reference the losses
    should match (its loss is the same token-weighted mean over the same tokens).
    """

    def __init__(self, world_size: int, **knobs: Any) -> None:
        check_local_tensors()
        super().__init__(world_size, 0, **knobs)
        reasons = {
            "pipeline_parallel_size > 1: every stage runs other code, which local tensors (SPMD) cannot run":
                self.config.mesh.pp > 1,
            "compile=True: torch.compile does not trace local tensors": self.config.compile.blocks,
            "compile_loss=True: torch.compile does not trace local tensors": self.config.compile.loss,
        }
        refused = [reason for reason, applies in reasons.items() if applies]
        if refused:
            raise ValueError(f"Ranks cannot be simulated in one process with {'; '.join(refused)}. Simulate the "
                             "layout without it, or run it on real processes.")
        self._simulation: contextlib.ExitStack | None = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        from torch.distributed._local_tensor import LocalTensorMode

        # From here on (configure_model included) every tensor is one per rank; the mesh above was built plain.
        self._simulation = contextlib.ExitStack()
        self._simulation.enter_context(_fsdp_storage_per_rank())
        self._simulation.enter_context(LocalTensorMode(self.rehearsed_world_size))

    @override
    def teardown(self) -> None:
        if self._simulation is not None:
            self._simulation.close()
            self._simulation = None
        super().teardown()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}  # every batch is the global one; batch_to_device slices it

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return _DrawnOutsideSimulation(super().process_dataloader(dataloader))

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        with outside_simulated_ranks():
            batch = super().batch_to_device(batch, device, dataloader_idx)
        if not isinstance(batch, Mapping):
            raise TypeError(f"Simulated ranks slice a mapping of tensors per data-parallel rank, not a "
                            f"{type(batch).__name__}.")
        return {key: self._per_rank(key, value) if isinstance(value, Tensor) else value for key, value in batch.items()}

    def _per_rank(self, key: str, value: Tensor) -> Tensor:
        from torch.distributed._local_tensor import LocalTensor

        dims = self.parallel_dims
        if value.dim() == 0 or value.shape[0] % dims.batch_size:
            raise ValueError(f"batch[{key!r}] has {value.shape[0] if value.dim() else 'no'} rows, which the "
                             f"{dims.batch_size} data-parallel ranks cannot split evenly; make the loader's batch "
                             f"size a multiple of {dims.batch_size}.")
        slices = value.chunk(dims.batch_size)
        with outside_simulated_ranks():
            per_rank = {}
            for rank in range(self.rehearsed_world_size):
                where = rank_coordinates(dims, rank)
                per_rank[rank] = slices[where["dp_replicate"] * dims.dp_shard + where["dp_shard"]].clone()
        return LocalTensor(per_rank)


@contextlib.contextmanager
def _fsdp_storage_per_rank() -> Iterator[None]:
    """FSDP2 frees and re-allocates its unsharded parameters by resizing their storage in place, which a local
    tensor (a wrapper with no storage of its own) cannot do; resize each simulated rank's tensor instead."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    def per_rank(resize: Any) -> Any:
        def resize_each(tensor: Tensor) -> None:
            for local in tensor._local_tensors.values() if isinstance(tensor, LocalTensor) else (tensor,):
                resize(local)
        return resize_each

    saved = _fsdp_param.free_storage, _fsdp_param.alloc_storage, _fsdp_param_group.alloc_storage
    _fsdp_param.free_storage = per_rank(saved[0])
    _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = per_rank(saved[1])
    try:
        yield
    finally:
        _fsdp_param.free_storage, _fsdp_param.alloc_storage, _fsdp_param_group.alloc_storage = saved

