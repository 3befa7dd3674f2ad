"""Parallel degrees: validation (no process group) and the named mesh (one process, fake backend)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from titan_strategy.config.mesh import ParallelDims
from titan_strategy.mesh import build_mesh

pytestmark = pytest.mark.unit


def _dims(world: int, **degrees: int) -> ParallelDims:
    defaults = {"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 1, "pp": 1}
    return ParallelDims.from_world_size(world, **{**defaults, **degrees})


@pytest.mark.parametrize(("world", "degrees", "expected"), [
    (8, {}, (1, 8, 1, 1, 1)),
    (8, {"tp": 2}, (1, 4, 1, 2, 1)),
    (16, {"pp": 2, "cp": 2, "tp": 2}, (1, 2, 2, 2, 2)),
    (8, {"dp_replicate": 2, "dp_shard": 4}, (2, 4, 1, 1, 1)),
    (1, {}, (1, 1, 1, 1, 1)),
])
def test_shard_degree_fills_the_world(world: int, degrees: dict, expected: tuple) -> None:
    dims = _dims(world, **degrees)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp) == expected
    assert dims.world_size == world


@pytest.mark.parametrize(("world", "degrees", "message"), [
    (8, {"tp": 3}, r"world size 8 is not divisible by .*tensor_parallel_size=3.* = 3"),
    (8, {"dp_shard": 2, "tp": 2}, r"multiply to .* = 4, but the world size is 8"),
    (4, {"dp_shard": 4, "tp": 2}, r"multiply to .*data_parallel_shard_size=4 x .*tensor_parallel_size=2 = 8"),
    (8, {"tp": -1}, r"tensor_parallel_size=-1 is not allowed: only data_parallel_shard_size may be -1"),
    (8, {"pp": 0}, r"pipeline_parallel_size=0 must be an integer >= 1"),
    (8, {"dp_shard": 0}, r"data_parallel_shard_size=0 must be an integer >= 1"),
    (8, {"cp": 2.0}, r"context_parallel_size=2.0 must be an integer >= 1"),
])
def test_bad_degrees_name_the_knob_and_the_fix(world: int, degrees: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _dims(world, **degrees)


@pytest.fixture()
def fake_world_16():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=5, world_size=16, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_mesh_has_named_dims_and_flattened_views(fake_world_16: None) -> None:
    dims = _dims(16, pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)
    mesh = build_mesh(dims, "cpu")
    assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    sizes = {name: mesh[name].size() for name in ("pp", "dp_shard", "cp", "tp", "batch", "dp_shard_cp", "loss",
                                                   "data_parallel", "tensor_parallel")}
    assert sizes == {"pp": 2, "dp_shard": 2, "cp": 2, "tp": 2, "batch": 2, "dp_shard_cp": 4, "loss": 4,
                     "data_parallel": 2, "tensor_parallel": 2}
    # rank 5 = (pp 0, dp_shard 1, cp 0, tp 1): the aliases are the same groups as batch and tp.
    assert mesh["data_parallel"].mesh.tolist() == mesh["batch"].mesh.tolist() == [1, 5]
    assert mesh["tensor_parallel"].mesh.tolist() == mesh["tp"].mesh.tolist() == [4, 5]
    assert mesh["loss"].mesh.tolist() == [1, 3, 5, 7]
    assert mesh["dp_replicate", "dp_shard_cp"].shape == (1, 4)
