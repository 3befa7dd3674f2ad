"""Parallel degrees (validated before any process group or model exists) and the named DeviceMesh."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_strategy.knobs import check_positive, knob

__all__ = ["MeshConfig", "ParallelDims", "TitanMesh", "build_mesh"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class MeshConfig:
    """The parallel degrees as asked for; ``resolve`` fills ``dp_shard=-1`` once the world size is known."""

    dp_replicate: int = knob("data_parallel_replicate_size", 1)
    """HSDP replicas (parameters replicated across them)."""
    dp_shard: int = knob("data_parallel_shard_size", -1)
    """FSDP shard degree; -1 takes what the other degrees leave of the world."""
    cp: int = knob("context_parallel_size", 1)
    tp: int = knob("tensor_parallel_size", 1)
    pp: int = knob("pipeline_parallel_size", 1)

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


class TitanMesh(DeviceMesh):
    """The root 5-D DeviceMesh, whose flattened views are reachable by name like its own dims.

    It is a torch ``DeviceMesh`` (code written for ModelParallelStrategy passes it where torch expects one; it
    deep-copies and pickles as one). ``mesh["batch"]`` returns the flattened mesh kept at build time rather than
    re-slicing it from the root, which torch deprecates.
    """

    _views: dict[str, DeviceMesh]

    @classmethod
    def of(cls, root: DeviceMesh, views: dict[str, DeviceMesh]) -> TitanMesh:
        """``root`` itself, seen as a TitanMesh with ``views`` (the same state: no new process group)."""
        mesh = cls.__new__(cls)
        mesh.__dict__.update(root.__dict__)
        mesh._views = views
        return mesh

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        if isinstance(names, str) and names in self._views:
            return self._views[names]
        with warnings.catch_warnings():
            # A tuple mixing original and flattened dims (HSDP's (dp_replicate, dp_shard_cp)) can only
            # be sliced from the root; the deprecation does not apply to that form.
            warnings.filterwarnings("ignore", message="Slicing a flattened dim")
            return super().__getitem__(names)

    def __repr__(self) -> str:
        return f"TitanMesh({super().__repr__()}, views={sorted(self._views)})"


def build_mesh(dims: ParallelDims, device_type: str) -> TitanMesh:
    """Build the mesh over the already-initialized default process group.

    Dimensions, outer to inner (inner dims map to ranks that are close, e.g. on one NVLink domain):
        pp:            pipeline stages.
        dp_replicate:  HSDP replicas; parameters are replicated across this dim.
        dp_shard:      FSDP shards within one replica.
        cp:            context parallel: the sequence is split across this dim.
        tp:            tensor parallel: matmuls are split across this dim.
    Flattened views:
        batch:         dp_replicate x dp_shard, ranks that get different data (and the sampler's view).
        dp_shard_cp:   dp_shard x cp, over which FSDP shards parameters (CP ranks hold disjoint tokens).
        loss:          dp_replicate x dp_shard x cp, over which losses and metrics are averaged.
        data_parallel / tensor_parallel: aliases of batch / tp, so modules written for Lightning's
                       ModelParallelStrategy run unchanged.
    """
    sizes = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    root = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)
    views = {
        "batch": root["dp_replicate", "dp_shard"]._flatten("batch"),
        "dp_shard_cp": root["dp_shard", "cp"]._flatten("dp_shard_cp"),
        "loss": root["dp_replicate", "dp_shard", "cp"]._flatten("loss"),
        "data_parallel": root["dp_replicate", "dp_shard"]._flatten("data_parallel"),
        "tensor_parallel": root["tp"]._flatten("tensor_parallel"),
    }
    views.update({name: root[name] for name in MESH_DIMS})
    expected = {"batch": dims.batch_size, "dp_shard_cp": dims.dp_shard * dims.cp,
                "loss": dims.batch_size * dims.cp, "tensor_parallel": dims.tp}
    for name, size in expected.items():
        if views[name].size() != size:
            raise RuntimeError(f"Mesh view {name!r} has size {views[name].size()}, expected {size}.")
    return TitanMesh.of(root, views)
