"""The parallel degrees: as asked for (``MeshConfig``), and resolved for a world size (``ParallelDims``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_strategy.knobs import check_positive, knob

__all__ = ["MeshConfig", "ParallelDims"]


@dataclass(frozen=True)
class MeshConfig:
    """The parallel degrees as asked for; ``resolve`` fills ``dp_shard=-1`` once the world size is known."""

    dp_replicate: int = knob("data_parallel_replicate_size", 1)
    """HSDP replicas (parameters replicated across them)."""
    dp_shard: int = knob("data_parallel_shard_size", -1)
    """FSDP shard degree; -1 takes what the other degrees leave of the world."""
    cp: int = knob("context_parallel_size", 1)
    """Context-parallel degree: each rank holds 1/cp of every sequence (ring attention)."""
    tp: int = knob("tensor_parallel_size", 1)
    """Tensor-parallel degree (with sequence parallelism and loss parallel by default)."""
    pp: int = knob("pipeline_parallel_size", 1)
    """Pipeline stages' ranks: the pipeline-parallel degree."""

    def __post_init__(self) -> None:
        for name, value in self._fixed().items():
            if value == -1:
                raise ValueError(f"{name}=-1 is not allowed: only data_parallel_shard_size may be -1.")
            check_positive(name, value)
        if self.dp_shard != -1:
            check_positive("data_parallel_shard_size", self.dp_shard)

    def resolve(self, world_size: int) -> ParallelDims:
        """The degrees of a ``world_size`` run.

        Raises:
            ValueError: the degrees do not multiply to ``world_size`` (or leave no whole ``dp_shard``).
        """
        fixed = self._fixed()
        others = math.prod(fixed.values())
        if self.dp_shard == -1 and world_size % others:
            raise ValueError(
                f"The world size {world_size} is not divisible by {_product_text(fixed)} = {others}, so "
                "data_parallel_shard_size=-1 cannot fill the rest. Change the degrees or the number of devices."
            )
        dims = ParallelDims(dp_replicate=self.dp_replicate, dp_shard=self.shard_degree(world_size), cp=self.cp,
                            tp=self.tp, pp=self.pp)
        if dims.world_size != world_size:
            raise ValueError(
                f"The parallel degrees multiply to {_product_text(dims.knobs())} = {dims.world_size}, but "
                f"the world size is {world_size} (devices x nodes). Make them equal, or set "
                "data_parallel_shard_size=-1 to use the remaining devices for FSDP."
            )
        return dims

    def shard_degree(self, world_size: int) -> int:
        """``dp_shard``, with -1 filled by what the other degrees leave of ``world_size`` (rounded down)."""
        return self.dp_shard if self.dp_shard != -1 else world_size // math.prod(self._fixed().values())

    def _fixed(self) -> dict[str, int]:
        return {"data_parallel_replicate_size": self.dp_replicate, "context_parallel_size": self.cp,
                "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp}


def _product_text(knobs: dict[str, int]) -> str:
    return " x ".join(f"{name}={value}" for name, value in knobs.items())


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of the five parallel dimensions; their product is the world size."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for name, value in self.knobs().items():
            check_positive(name, value)

    @classmethod
    def from_world_size(
        cls, world_size: int, *, dp_replicate: int, dp_shard: int, cp: int, tp: int, pp: int
    ) -> ParallelDims:
        """``MeshConfig(...).resolve(world_size)``: ``dp_shard=-1`` takes what is left of the world.

        Raises:
            ValueError: a degree is invalid, or the degrees do not multiply to ``world_size``.
        """
        return MeshConfig(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp).resolve(world_size)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def batch_size(self) -> int:
        """Number of ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    def knobs(self) -> dict[str, int]:
        """The degrees under their TitanStrategy names, outer mesh dim first."""
        return {"pipeline_parallel_size": self.pp, "data_parallel_replicate_size": self.dp_replicate,
                "data_parallel_shard_size": self.dp_shard, "context_parallel_size": self.cp,
                "tensor_parallel_size": self.tp}
