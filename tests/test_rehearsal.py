"""`titan rehearse`: one rank of the shipped 70B and 405B layouts, with a tiny model, in one CPU process.

The rank's parameter count is checked against its shard worked out here from the full model's shapes (TP
slices, then FSDP's dim-0 chunks, then the pipeline stages the rank holds); its peak memory against the same
run on a layout that gives each rank more to hold.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from llama_module.args import LlamaConfig
from llama_module.model import Llama
from llama_module.rehearse_cli import main as titan_rehearse
from llama_module.rehearse_cli import rehearsed_ranks
from tests.conftest import REPO, run_command
from titan_strategy.config import TitanConfig
from titan_strategy.config.mesh import ParallelDims
from titan_strategy.rehearsal import LiveStorageBytes, rank_coordinates, required_gib

# Every TP degree up to 8 divides its heads, kv heads, ffn_dim and vocabulary; ffn_dim does not split evenly over
# 8 FSDP shards (1032 / tp 8 = 129 rows), so a rank's shard depends on where it sits. Wide and short (16-token
# windows): parameters, gradients and AdamW state, not activations, make most of a rank's peak.
TINY = {"dim": 256, "n_layers": 16, "n_heads": 8, "n_kv_heads": 8, "vocab_size": 520, "ffn_dim": 1032,
        "max_seq_len": 16}
# Column-parallel weights are split on dim 0, row-parallel ones on dim 1 (llama_module/plan.py); the rest is whole.
TP_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "tok_embeddings": 0, "wo": 1, "w2": 1}


def _rehearse(tmp_path: Path, env: dict[str, str], config: str, *overrides: str) -> list[dict[str, Any]]:
    out = tmp_path / f"rehearsal_{len(list(tmp_path.glob('*.json')))}.json"
    titan = shutil.which("titan")
    run_command([*([titan] if titan else [sys.executable, "-m", "llama_module.cli"]), "rehearse", "--config",
                 str(REPO / "configs" / config), "--model.model", json.dumps(TINY), "--data.seq_len", "16",
                 "--model.attention_kernel", "sdpa",  # the configs' flex has no CPU backward; a dense mask does
                 "--steps", "2", "--json", str(out), *overrides], env, tmp_path)
    return json.loads(out.read_text())


def _expected_parameters(dims: ParallelDims, rank: int, layers: set[int], first: bool, last: bool) -> int:
    """Elements of the full model's parameters that ``rank`` holds, from their shapes alone."""
    where = rank_coordinates(dims, rank)
    shard = where["dp_shard"] * dims.cp + where["cp"]  # FSDP shards over (dp_shard, cp) flattened
    with torch.device("meta"):
        model = Llama(LlamaConfig(**TINY))
    total = 0
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        held = (parts[0] == "layers" and int(parts[1]) in layers) or (parts[0] == "tok_embeddings" and first) or \
            (parts[0] in ("norm", "output") and last)
        if not held:
            continue
        local = parameter
        if dims.tp > 1 and parts[-2] in TP_DIM:
            local = local.chunk(dims.tp, TP_DIM[parts[-2]])[where["tp"]]
        chunks = local.chunk(dims.dp_shard * dims.cp, 0)
        total += chunks[shard].numel() if shard < len(chunks) else 0
    return total


def _dims(config: str, world: int | None = None, **knobs: Any) -> ParallelDims:
    """The degrees of a shipped config, with some knobs changed, on its own world size or ``world``."""
    values = yaml.safe_load((REPO / "configs" / config).read_text())["trainer"]
    world = world or values["devices"] * values["num_nodes"]
    return TitanConfig.from_knobs(**(values["strategy"]["init_args"] | knobs)).mesh.resolve(world)


@pytest.mark.multiprocess  # `titan rehearse` in subprocesses, one per rank
def test_the_405b_layout_rehearses_its_first_and_last_stage_with_their_shards(tmp_path: Path,
                                                                             test_env: dict[str, str]) -> None:
    # FSDP8 x TP8 x PP8 over 512 ranks, Interleaved1F1B with 2 stages per rank: 16 one-block stages, stage s
    # on pipeline rank s % 8. The default ranks are the first stage's rank 0 and the last stage's rank 448.
    dims = _dims("llama3_405b_fsdp8_tp8_pp8.yaml")
    first, last = _rehearse(tmp_path, test_env, "llama3_405b_fsdp8_tp8_pp8.yaml")
    assert (first["rank"], last["rank"], first["world_size"]) == (0, 448, 512)
    assert first["parameters"] == _expected_parameters(dims, 0, {0, 8}, first=True, last=False)
    assert last["parameters"] == _expected_parameters(dims, 448, {7, 15}, first=False, last=True)
    assert last["coordinates"] == {"pp": 7, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert len(first["step_s"]) == 2 and first["peak_allocated_gib"] > 0
    # Half the pipeline ranks (256 GPUs): each holds twice the blocks, so more parameters and a higher peak.
    [fewer_stages] = _rehearse(tmp_path, test_env, "llama3_405b_fsdp8_tp8_pp8.yaml", "--trainer.num_nodes", "32",
                               "--trainer.strategy.init_args.pipeline_parallel_size", "4", "--ranks", "first")
    dims_pp4 = _dims("llama3_405b_fsdp8_tp8_pp8.yaml", world=256, pipeline_parallel_size=4)
    assert dims_pp4.world_size == 256
    assert fewer_stages["parameters"] == _expected_parameters(dims_pp4, 0, {0, 1, 8, 9}, first=True, last=False)
    assert fewer_stages["peak_allocated_gib"] > first["peak_allocated_gib"]


@pytest.mark.multiprocess
def test_the_70b_layout_rehearses_any_rank_with_its_shard(tmp_path: Path, test_env: dict[str, str]) -> None:
    # FSDP8 x TP8 over 64 ranks; rank 62 is TP rank 6 of the last FSDP shard, which gets 10 of w1's and w3's 129
    # rows where the others get 17.
    dims = _dims("llama3_70b_fsdp_tp8.yaml")
    [rank] = _rehearse(tmp_path, test_env, "llama3_70b_fsdp_tp8.yaml", "--rank", "62")
    assert rank["coordinates"] == {"pp": 0, "dp_replicate": 0, "dp_shard": 7, "cp": 0, "tp": 6}
    assert rank["parameters"] == _expected_parameters(dims, 62, set(range(16)), first=True, last=True)
    assert rank["parameters"] != _expected_parameters(dims, 0, set(range(16)), first=True, last=True)
    # TP4 on 32 GPUs keeps FSDP8: each rank holds twice the slice of every weight and activation.
    [wider] = _rehearse(tmp_path, test_env, "llama3_70b_fsdp_tp8.yaml", "--rank", "0", "--trainer.num_nodes", "4",
                        "--trainer.strategy.init_args.tensor_parallel_size", "4")
    dims_tp4 = _dims("llama3_70b_fsdp_tp8.yaml", world=32, tensor_parallel_size=4)
    assert (dims_tp4.dp_shard, dims_tp4.tp) == (8, 4)
    assert wider["parameters"] == _expected_parameters(dims_tp4, 0, set(range(16)), first=True, last=True)
    assert wider["peak_allocated_gib"] > rank["peak_allocated_gib"]


@pytest.mark.unit
@pytest.mark.parametrize(("overrides", "message"), [
    (["--trainer.num_nodes", "3"], "the world size is 24"),  # 24 GPUs for FSDP8 x TP8 x PP8
    (["--trainer.strategy.init_args.pipeline_stages_per_rank", "4"], "fewer than the 32 pipeline stages"),
    (["--ranks", "first,600"], "'600' is not first, last, heaviest or a rank 0..511"),
    (["--steps", "1"], "rehearse at least 2"),
], ids=["degrees", "stages", "rank", "steps"])
def test_a_layout_that_cannot_be_built_is_refused_before_any_work(overrides: list[str], message: str,
                                                                  capsys: pytest.CaptureFixture) -> None:
    code = titan_rehearse(["--config", str(REPO / "configs" / "llama3_405b_fsdp8_tp8_pp8.yaml"), "--model.model",
                           json.dumps(TINY), "--data.seq_len", "16", *overrides])
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.unit
def test_named_ranks_are_the_first_and_last_stage_and_the_one_with_most_parameters() -> None:
    # 16 ranks, pp8 x dp2: pipeline rank p starts at global rank 2p. 15 blocks, stage 6 holding blocks 6-13.
    strategy = TitanConfig.from_knobs(data_parallel_shard_size=2, pipeline_parallel_size=8, pipeline_schedule="1F1B",
                                      pipeline_split_points=[1, 2, 3, 4, 5, 6, 14])
    shape = LlamaConfig(**(TINY | {"n_layers": 15}))
    assert rehearsed_ranks("first,last,heaviest", 16, strategy, shape) == [0, 14, 12]
    assert rehearsed_ranks("last,3,last", 16, strategy, shape) == [14, 3]
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=2, pp=2)
    assert rank_coordinates(dims, 13) == {"pp": 1, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1}


@pytest.mark.unit
def test_live_storage_bytes_follows_ops_frees_and_in_place_resizes() -> None:
    weight = torch.zeros(256, 256, requires_grad=True)  # 256 KiB, held before the count starts
    with LiveStorageBytes(weight) as storages, torch.no_grad():
        hidden = torch.ones(128, 256) @ weight  # 128 KiB; its ones() input (128 KiB), not kept for backward, is freed
        assert storages.current == 256 * 256 * 4 + 128 * 256 * 4
        hidden.untyped_storage().resize_(0)  # FSDP frees gathered parameters this way
        assert storages.current == 256 * 256 * 4
        del hidden
    assert storages.peak == 256 * 256 * 4 + 2 * 128 * 256 * 4


@pytest.mark.unit
def test_running_out_of_memory_becomes_what_the_rank_needed_at_least() -> None:
    out_of_memory = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB. GPU 0 has a total "
                                           "capacity of 139.80 GiB of which 217.12 MiB is free.")
    try:  # the pipeline schedule wraps it: "[Stage 8] failed to run forward"
        raise RuntimeError("[Stage 8] failed to run forward") from out_of_memory
    except RuntimeError as wrapped:
        assert required_gib(wrapped, reserved_bytes=138 * 2**30) == pytest.approx(138.25)
    assert required_gib(RuntimeError("a shape mismatch"), reserved_bytes=0) is None
