"""Production checkpointing: exact resume, async saves, crash safety, keep-latest-k, integrity checks."""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.plugins import TorchCheckpointIO

from tests.conftest import free_port, launch, run_command
from tests.support.run_spec import CheckpointSpec, DataSpec, DrillSpec, RunSpec, TrainerSpec
from titan_strategy import (
    CorruptCheckpointError,
    DistributedCheckpointIO,
    TitanStrategy,
)
from titan_strategy.checkpoint import ELASTIC_POSITION_KEY, RankPlace, read_model_weights
from titan_strategy.checkpoint.dcp import _loader_states
from titan_strategy.checkpoint.manifest import checkpoint_bytes
from titan_strategy.checkpoint.rng import capture_rng_states, restore_rng_states

# 20 steps of text data: a resumed run must also restore each data-parallel rank's position in its stream.
TEXT = RunSpec(steps=20, batch_size=2, trainer=TrainerSpec(clip=1.0), data=DataSpec(kind="text"),
               checkpoints=CheckpointSpec(rng_probe=True))


def _keep_latest_two(folder: Path) -> dict[str, Any]:
    return {"dirpath": str(folder), "every_n_train_steps": 5, "save_top_k": 2, "monitor": "step", "mode": "max",
            "save_last": True}


def _complete(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if (path / "titan_checkpoint.json").is_file())


@pytest.mark.multiprocess
def test_async_resume_repeats_an_uninterrupted_run_exactly(tmp_path: Path, test_env: dict[str, str]) -> None:
    # 20 steps in one go, against 10 steps, a restart from ckpt_path="last", and 10 more. Writes are slowed
    # so that ModelCheckpoint asks to delete older checkpoints while the newer one is still being written.
    spec = TEXT.with_(trainer={"strategy": {"checkpoint_mode": "async"}}, drills={"slow_writes_s": 0.3})
    full = launch(2, spec.with_(checkpoints={"model_checkpoint": _keep_latest_two(tmp_path / "full"),
                                                 "log_removals": True}),
                  tmp_path / "full_run", test_env)
    halves = spec.with_(checkpoints={"model_checkpoint": _keep_latest_two(tmp_path / "halves")})
    launch(2, halves.with_(steps=10), tmp_path / "first", test_env)
    resumed = launch(2, halves.with_(checkpoints={"resume_from": "last"}), tmp_path / "second", test_env)
    for rank in range(2):
        expected = [step for step in full[rank]["steps"] if step["step"] > 10]
        assert [step["step"] for step in resumed[rank]["steps"]] == list(range(11, 21))
        for before, after in zip(expected, resumed[rank]["steps"]):
            assert after["train_loss"] == pytest.approx(before["train_loss"], rel=1e-6), (before, after)
            assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=1e-6), (before, after)
            assert after["rng"] == before["rng"], "Python, NumPy and torch generators continue where they were"
    # Keep-latest-2 plus last, and every deletion came after the checkpoint that replaced it was complete.
    assert _complete(tmp_path / "full") == ["epoch=0-step=15.ckpt", "epoch=0-step=20.ckpt", "last.ckpt"]
    assert sorted(path.name for path in (tmp_path / "full").iterdir()) == _complete(tmp_path / "full")
    removals = full[0]["removals"]
    assert [r["removed"] for r in removals] == ["epoch=0-step=5.ckpt", "epoch=0-step=10.ckpt"]
    for removal, newer in zip(removals, ["epoch=0-step=15.ckpt", "epoch=0-step=20.ckpt"]):
        assert newer in removal["complete"], removal


@pytest.mark.multiprocess
def test_a_rank_killed_during_an_async_save_leaves_the_previous_checkpoint_to_resume(
        tmp_path: Path, test_env: dict[str, str]) -> None:
    folder = tmp_path / "checkpoints"
    spec = RunSpec(steps=6, batch_size=4,
                   trainer=TrainerSpec(strategy={"checkpoint_mode": "async"}, timeout_seconds=20),
                   checkpoints=CheckpointSpec(model_checkpoint={"dirpath": str(folder), "every_n_train_steps": 2,
                                                                "save_top_k": -1}))
    with pytest.raises(AssertionError, match="SIGKILL|Signals.SIGKILL|-9"):
        # Rank 1 dies inside its shard write of the step-4 save, which runs in the background.
        launch(2, spec.with_(drills={"kill_during_save": {"rank": 1, "save": 2}}), tmp_path / "killed", test_env)
    assert _complete(folder) == ["epoch=0-step=2.ckpt"]
    assert not (folder / "epoch=0-step=4.ckpt").exists(), "a partial save must never carry a checkpoint name"
    resumed = launch(2, spec.with_(steps=4, trainer={"strategy": {"checkpoint_mode": "async", "auto_resume": True}}),
                     tmp_path / "resumed", test_env)
    assert [step["step"] for step in resumed[0]["steps"]] == [3, 4]
    assert _complete(folder) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("disk_full", "mode"), [("before", "sync"), ("while", "async")])
def test_a_full_disk_fails_the_save_with_the_numbers_and_publishes_nothing(disk_full: str, mode: str, tmp_path: Path,
                                                                           test_env: dict[str, str]) -> None:
    # Saves at steps 2 and 4; from the second on the disk is full: reported before staging ("before"), or by the
    # shard write of a background save, which the run's end waits for ("while").
    folder = tmp_path / "checkpoints"
    spec = RunSpec(steps=4, batch_size=4, trainer=TrainerSpec(strategy={"checkpoint_mode": mode}),
                   drills=DrillSpec(disk_full=disk_full),
                   checkpoints=CheckpointSpec(model_checkpoint={"dirpath": str(folder), "every_n_train_steps": 2,
                                                                "save_top_k": -1}))
    with pytest.raises(AssertionError, match="failed") as failure:
        launch(1, spec, tmp_path / "run", test_env)
    previous = folder / "epoch=0-step=2.ckpt"
    size = f"the last checkpoint took {checkpoint_bytes(previous):,}"
    message = next(line for line in str(failure.value).splitlines() if "CheckpointDiskFullError: " in line)
    assert str(folder / "epoch=0-step=4.ckpt") in message and size in message and "bytes free" in message
    assert ("Not saving" if disk_full == "before" else "failed on rank 0: the disk holding") in message
    assert _complete(folder) == ["epoch=0-step=2.ckpt"]
    assert not (folder / "epoch=0-step=4.ckpt").exists(), "a failed save must never carry a checkpoint name"
    loaded = DistributedCheckpointIO().load_checkpoint(previous)  # intact: every file matches its manifest
    assert loaded["state_dict"]["model.tok_embeddings.weight"].shape == (256, 64)


# One process saves twice through DCP's background writer process, as async_pinned saves do (any device).
_WRITER_PROCESS_SAVES = """
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from titan_strategy.checkpoint.writer_process import start_quiet_writer
dist.init_process_group("gloo", world_size=1, rank=0)
for save in range(2):
    if sys.argv[1] == "quiet":
        start_quiet_writer(dist.group.WORLD)
    state = {"weight": torch.full((4, 4), float(save))}
    dcp.async_save(state, checkpoint_id=f"{sys.argv[2]}/save{save}",
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    loaded = {"weight": torch.zeros(4, 4)}
    dcp.load(loaded, checkpoint_id=f"{sys.argv[2]}/save{save}")
    assert torch.equal(loaded["weight"], state["weight"])
dist.destroy_process_group()  # gloo's left to the interpreter's teardown may abort (titan_strategy/distributed.py)
print("saved and read back twice")
"""


@pytest.mark.multiprocess
def test_the_background_writer_process_logs_no_info_lines(tmp_path: Path, test_env: dict[str, str]) -> None:
    logs = {}
    for how in ("quiet", "torch's"):
        env = dict(test_env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        result = run_command([sys.executable, "-c", _WRITER_PROCESS_SAVES, how, str(tmp_path / how)], env, tmp_path)
        assert "saved and read back twice" in result.stdout
        logs[how] = result.stderr
    assert logs["torch's"].count("Received async checkpoint request") == 2  # what the quiet start removes
    assert "Received async checkpoint request" not in logs["quiet"] and " - INFO - " not in logs["quiet"]


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> Path:
    out = tmp_path_factory.mktemp("one_rank")
    checkpoint = out / "step2.ckpt"
    launch(1, RunSpec(steps=2, batch_size=4, checkpoints=CheckpointSpec(save_at=2, save_path=str(checkpoint))), out,
           test_env)
    return checkpoint


def _damage(checkpoint: Path, how: str, tmp_path: Path) -> tuple[Path, str]:
    """A copy of ``checkpoint`` with its first shard file altered, and the error that names it."""
    copy = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoint, copy)
    shard = sorted(copy.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    if how == "truncate":
        shard.write_bytes(data[: len(data) // 2])
        return copy, rf"{shard.name} has {len(data) // 2} bytes, {len(data)} were written"
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(data)
    return copy, rf"{shard.name} fails its CRC-32 check"


@pytest.mark.multiprocess  # (the saved_checkpoint fixture launches a run)
@pytest.mark.parametrize("how", ["truncate", "flip_a_byte"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(saved_checkpoint: Path, how: str, tmp_path: Path) -> None:
    damaged, message = _damage(saved_checkpoint, how, tmp_path)
    with pytest.raises(CorruptCheckpointError, match=message):
        read_model_weights(damaged)
    assert read_model_weights(saved_checkpoint)  # the original is intact


@pytest.mark.multiprocess
def test_resuming_from_a_damaged_checkpoint_fails_before_loading(saved_checkpoint: Path, tmp_path: Path,
                                                                  test_env: dict[str, str]) -> None:
    damaged, message = _damage(saved_checkpoint, "flip_a_byte", tmp_path)
    with pytest.raises(AssertionError, match=rf"rank0: CorruptCheckpointError: {damaged} is damaged: {message}"):
        launch(1, RunSpec(steps=3, batch_size=4, checkpoints=CheckpointSpec(resume_from=str(damaged))),
               tmp_path / "resumed", test_env)


@pytest.mark.multiprocess
def test_the_checkpoint_io_reads_a_checkpoint_whole_in_one_process(saved_checkpoint: Path) -> None:
    loaded = DistributedCheckpointIO().load_checkpoint(saved_checkpoint)
    assert loaded["hyper_parameters"]["model"]["dim"] == 64
    assert loaded["state_dict"]["model.tok_embeddings.weight"].shape == (256, 64)


@pytest.mark.multiprocess
def test_an_unfinished_checkpoint_is_refused(saved_checkpoint: Path, tmp_path: Path) -> None:
    unfinished = tmp_path / "unfinished.ckpt"
    shutil.copytree(saved_checkpoint, unfinished)
    (unfinished / "titan_checkpoint.json").unlink()
    with pytest.raises(FileNotFoundError, match="no titan_checkpoint.json: a save that never finished has none"):
        read_model_weights(unfinished)


@pytest.mark.multiprocess
def test_a_per_rank_loader_position_on_more_data_parallel_ranks_fails_clearly_on_every_rank(
        tmp_path: Path, test_env: dict[str, str]) -> None:
    # A user's stream saved a position for each of 2 data-parallel ranks; ranks 2 and 3 have none, and none can
    # be derived. All 4 must stop with the same error (none may wait in a collective for the others).
    spec = RunSpec(steps=2, batch_size=2, data=DataSpec(kind="rank_stream"))
    checkpoint = tmp_path / "dp2.ckpt"
    launch(2, spec.with_(checkpoints={"save_at": 2, "save_path": str(checkpoint)}), tmp_path / "dp2", test_env)
    with pytest.raises(AssertionError) as failure:
        launch(4, spec.with_(steps=3, checkpoints={"resume_from": str(checkpoint)}), tmp_path / "dp4", test_env)
    for rank in range(4):
        assert f"\nrank{rank}: ValueError: {checkpoint} holds dataloader positions for 2 data-parallel ranks, " \
               "but this run has 4, and the loader's position is per rank" in str(failure.value)
    assert not (tmp_path / "dp4" / "checkpoints").exists()


@pytest.mark.unit
def test_each_rank_gets_its_own_loader_position_or_every_rank_s_global_one() -> None:
    per_rank, elastic = ({"read": 3}, {"read": 5}), ({ELASTIC_POSITION_KEY: True, "next": 8},) * 2
    saved = [[per_rank[rank], elastic[rank]] for rank in range(2)]  # two stateful loaders on each of 2 ranks
    place = RankPlace(rank=3, world_size=4, batch_rank=1, batch_world_size=2)
    assert _loader_states(saved, place, Path("c.ckpt")) == [
        {"read": 5}, {ELASTIC_POSITION_KEY: True, "saved_ranks": list(elastic)}]
    # On another data-parallel degree only the global position can be handed over.
    elsewhere = RankPlace(rank=0, world_size=4, batch_rank=0, batch_world_size=4)
    assert _loader_states([[s] for s in elastic], elsewhere, Path("c.ckpt")) == [
        {ELASTIC_POSITION_KEY: True, "saved_ranks": list(elastic)}]
    with pytest.raises(ValueError, match="holds dataloader positions for 2 data-parallel ranks, but this run has 4"):
        _loader_states(saved, elsewhere, Path("c.ckpt"))


@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"checkpoint_mode": "eventually"}, r"checkpoint_mode='eventually' must be one of \['sync', 'async', "
                                        r"'async_pinned'\]"),
    ({"checkpoint_mode": "async_pinned"}, r"checkpoint_mode='async_pinned' stages into pinned memory from CUDA, "
                                          r"not from 'cpu'; use checkpoint_mode='async'"),
])
def test_bad_checkpoint_mode_fails_before_launching(kwargs: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(**kwargs), default_root_dir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.unit
def test_another_checkpoint_io_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="through DistributedCheckpointIO, not TorchCheckpointIO; remove that plugin"):
        L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(), plugins=[TorchCheckpointIO()],
                  default_root_dir=tmp_path)


@pytest.mark.unit
def test_the_rng_states_round_trip() -> None:
    states = capture_rng_states(torch.device("cpu"))
    first = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_states(states, torch.device("cpu"))
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
