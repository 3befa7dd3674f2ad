"""A plain map-style DataLoader, shuffled by Lightning's sampler injection, resumes exactly: at an epoch's end,
mid-epoch under gradient accumulation, and on another data-parallel layout with the same global batch. So do
TextDataModule's packed windows, trained through `titan fit`."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, launch, run_command
from tests.support.parity import Record
from tests.support.run_spec import DataSpec, RunSpec, TrainerSpec

pytestmark = pytest.mark.multiprocess

# 32 samples at a global batch of 8: an epoch is 4 batches, so 8 steps cross one epoch boundary.
DP2 = RunSpec(steps=8, batch_size=4, data=DataSpec(samples=32, record_sample_ids=True, padded_labels=True),
              trainer=TrainerSpec(clip=1.0, strategy={"data_parallel_shard_size": 2}))
SAME_LAYOUT_RTOL = 1e-6
OTHER_LAYOUT_RTOL = 2e-5


def _checkpoints(every: dict[str, int], out: Path) -> dict[str, Any]:
    return {"dirpath": str(out / "checkpoints"), "save_top_k": -1, "filename": "{step}", **every}


def _batches(records: list[Record]) -> list[tuple[float, list[int]]]:
    """Per training batch: the logged loss, and the ids of every sample it held across the data-parallel ranks
    (one record per batch rank: TP/CP/PP ranks of a replica see the same samples)."""
    replicas = list({record["batch_rank"]: record for record in records}.values())
    return [(batch["train_loss"], sorted(i for replica in replicas for i in replica["steps"][index]["sample_ids"]))
            for index, batch in enumerate(records[0]["steps"])]


def _assert_resumed_tail(full: list[Record], resumed: list[Record], batches_after: int, rtol: float) -> None:
    expected, got = _batches(full)[-batches_after:], _batches(resumed)
    assert len(got) == batches_after
    for index, ((loss, ids), (resumed_loss, resumed_ids)) in enumerate(zip(expected, got)):
        assert resumed_ids == ids, f"resumed batch {index}: samples {resumed_ids}, uninterrupted {ids}"
        assert resumed_loss == pytest.approx(loss, rel=rtol), f"resumed batch {index}"


def _assert_each_epoch_sees_every_sample_once(records: list[Record], samples: int) -> None:
    ids = [i for _, batch in _batches(records) for i in batch]
    for start in range(0, len(ids), samples):
        assert sorted(ids[start : start + samples]) == list(range(samples))


def test_epoch_end_and_mid_epoch_checkpoints_resume_exactly(tmp_path: Path, test_env: dict[str, str]) -> None:
    epochs = _checkpoints({"every_n_epochs": 1}, tmp_path / "epochs")
    at_epoch_end = DP2.with_(checkpoints={"model_checkpoint": epochs})
    full = launch(2, at_epoch_end, tmp_path / "epochs", test_env)
    _assert_each_epoch_sees_every_sample_once(full, DP2.data.samples)
    resumed = launch(2, DP2.with_(checkpoints={"resume_from": str(tmp_path / "epochs/checkpoints/step=4.ckpt")}),
                     tmp_path / "epochs_resumed", test_env)
    _assert_resumed_tail(full, resumed, batches_after=4, rtol=SAME_LAYOUT_RTOL)

    # Accumulating 2 batches a step: step 3 is batch 6 of the epoch's 8.
    accumulating = DP2.with_(data={"samples": 64}, trainer={"accumulate": 2})
    full = launch(2, accumulating.with_(checkpoints={"model_checkpoint": _checkpoints({"every_n_train_steps": 3},
                                                                                       tmp_path / "steps")}),
                  tmp_path / "steps", test_env)
    _assert_each_epoch_sees_every_sample_once(full, 64)
    resume_from = str(tmp_path / "steps/checkpoints/step=3.ckpt")
    resumed = launch(2, accumulating.with_(checkpoints={"resume_from": resume_from}),
                     tmp_path / "steps_resumed", test_env)
    _assert_resumed_tail(full, resumed, batches_after=10, rtol=SAME_LAYOUT_RTOL)


def _layout(dp: int, batch_size: int, **strategy: Any) -> dict[str, Any]:
    """``RunSpec.with_``'s changes for the layout."""
    return {"batch_size": batch_size, "trainer": {"strategy": {"data_parallel_shard_size": dp, **strategy}}}


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> dict[str, Any]:
    """A dp2 run checkpointed at its first epoch's end (step 4), a dp4 run mid-epoch (step 3)."""
    out = tmp_path_factory.mktemp("elastic")
    dp2 = launch(2, DP2.with_(checkpoints={"model_checkpoint": _checkpoints({"every_n_epochs": 1}, out / "dp2")}),
                 out / "dp2", test_env)
    dp4 = launch(4, DP2.with_(**_layout(4, 2), checkpoints={
                     "model_checkpoint": _checkpoints({"every_n_train_steps": 3}, out / "dp4")}),
                 out / "dp4", test_env)
    return {"dp2": (dp2, out / "dp2/checkpoints/step=4.ckpt", 4), "dp4": (dp4, out / "dp4/checkpoints/step=3.ckpt", 5)}


@pytest.mark.parametrize(("saved", "layout"), [
    ("dp2", _layout(4, 2)),
    ("dp2", _layout(2, 4, pipeline_parallel_size=2, pipeline_microbatches=2)),
    ("dp4", _layout(2, 4)),
    ("dp4", _layout(2, 4, tensor_parallel_size=2)),
], ids=["dp2-to-dp4", "dp2-to-pp2xdp2", "dp4-to-dp2", "dp4-to-dp2xtp2"])
def test_another_data_parallel_layout_continues_with_the_same_samples(saved: str, layout: dict[str, Any],
                                                                       saved_runs: dict[str, Any], tmp_path: Path,
                                                                       test_env: dict[str, str]) -> None:
    full, checkpoint, batches_after = saved_runs[saved]
    degrees = layout["trainer"]["strategy"]
    processes = math.prod(degrees.get(name, 1) for name in ("data_parallel_shard_size", "tensor_parallel_size",
                                                            "pipeline_parallel_size"))
    resumed = launch(processes, DP2.with_(**layout, checkpoints={"resume_from": str(checkpoint)}), tmp_path, test_env)
    _assert_resumed_tail(full, resumed, batches_after=batches_after, rtol=OTHER_LAYOUT_RTOL)


def test_a_position_that_is_no_whole_number_of_global_batches_fails_on_every_rank(
        saved_runs: dict[str, Any], tmp_path: Path, test_env: dict[str, str]) -> None:
    _, checkpoint, _ = saved_runs["dp4"]  # 24 samples in: 2 ranks x 5 do not divide it
    before = sorted(p.name for p in checkpoint.parent.iterdir())
    with pytest.raises(AssertionError) as failure:
        launch(2, DP2.with_(batch_size=5, checkpoints={"resume_from": str(checkpoint)}), tmp_path, test_env)
    for rank in (0, 1):
        assert (f"\nrank{rank}: ValueError: The checkpoint stopped after 24 samples of epoch 0, not a whole number "
                "of this run's global batches of 10 samples (2 ranks x 5") in str(failure.value)
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == before
    assert not (tmp_path / "checkpoints").exists()


# ---- TextDataModule's packed windows, through `titan fit` ------------------------------------------------------

def _titan_fit(out: Path, test_env: dict[str, str], batch_size: int, *, resume_from: Path | None = None,
               **strategy: int) -> list[Record]:
    """configs/debug.yaml for 6 steps of ``batch_size`` 32-token windows per data-parallel rank, checkpointed at
    step 3, each batch's loss and window ids logged (tests/support/batch_log.py)."""
    config = yaml.safe_load((REPO / "configs" / "debug.yaml").read_text())
    processes = math.prod(strategy.values())
    config["trainer"].update(devices=processes, max_steps=6, limit_val_batches=0, logger=False,
                             enable_progress_bar=False, default_root_dir=str(out), callbacks=[
                                 {"class_path": "tests.support.batch_log.BatchLog", "init_args": {"out_dir": str(out)}},
                                 {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                                  "init_args": _checkpoints({"every_n_train_steps": 3}, out)}])
    config["trainer"]["strategy"]["init_args"] = {"data_parallel_shard_size": 1, **strategy}
    config["data"].update(seq_len=32, batch_size=batch_size, val_batches=0)
    out.mkdir(parents=True)
    (out / "fit.yaml").write_text(yaml.safe_dump(config))  # Lightning writes config.yaml
    titan = shutil.which("titan")
    run_command([*([titan] if titan else [sys.executable, "-m", "llama_module.cli"]), "fit", "--config",
                 str(out / "fit.yaml"), *([f"--ckpt_path={resume_from}"] if resume_from else [])], test_env, out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.fixture(scope="module")
def saved_text_runs(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> dict[str, Any]:
    """`titan fit` on dp2 x 4 windows and on dp4 x 2 (the same global batch), both checkpointed at step 3."""
    out = tmp_path_factory.mktemp("elastic_text")
    runs = {"dp2": _titan_fit(out / "dp2", test_env, 4, data_parallel_shard_size=2),
            "dp4": _titan_fit(out / "dp4", test_env, 2, data_parallel_shard_size=4)}
    for records in runs.values():
        assert [i for _, batch in _batches(records) for i in batch] == list(range(48))  # the global order
    return {name: (records, out / name / "checkpoints/step=3.ckpt") for name, records in runs.items()}


# (dp4 -> dp2 alone is left to the map-style test above: dp4 -> dp2 x tp2 shrinks the data-parallel degree too.)
@pytest.mark.parametrize(("saved", "batch_size", "layout"), [
    ("dp2", 2, {"data_parallel_shard_size": 4}),
    ("dp2", 4, {"data_parallel_shard_size": 2, "pipeline_parallel_size": 2}),
    ("dp4", 4, {"data_parallel_shard_size": 2, "tensor_parallel_size": 2}),
], ids=["dp2-to-dp4", "dp2-to-pp2xdp2", "dp4-to-dp2xtp2"])
def test_titan_fit_resumes_the_packed_windows_on_another_layout(saved: str, batch_size: int, layout: dict[str, int],
                                                                saved_text_runs: dict[str, Any], tmp_path: Path,
                                                                test_env: dict[str, str]) -> None:
    full, checkpoint = saved_text_runs[saved]
    resumed = _titan_fit(tmp_path / "resumed", test_env, batch_size, resume_from=checkpoint, **layout)
    _assert_resumed_tail(full, resumed, batches_after=3, rtol=OTHER_LAYOUT_RTOL)
