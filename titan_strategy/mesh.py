"""Parallel degrees (validated before any process group or model exists) and the named DeviceMesh."""

from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_strategy.config.mesh import ParallelDims

__all__ = ["TitanMesh", "build_mesh"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


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
