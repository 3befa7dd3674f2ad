"""Pipeline parallelism inside Lightning's loop (CPU/gloo, fp32) against a single-process run.

Each run trains 10 steps, validates at steps 5 and 10, then runs ``trainer.test`` and
``trainer.predict``: losses, gradient norms (clipping at 1.0 is active), val/test losses, predictions
and the number of times each Lightning hook ran must match the unpipelined run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import launch
from tests.support.parity import (
    BASE_RUN,
    FULL_RUN,
    GLOBAL_BATCH,
    RTOL,
    Record,
    ReferenceRun,
    assert_close_per_step,
    assert_full_run_matches,
    assert_identical_on_all_ranks,
    assert_resume_continues,
    series,
)
from tests.support.run_spec import CallbackSpec, DataSpec, ModelSpec, RunSpec, TrainerSpec

pytestmark = pytest.mark.multiprocess


@pytest.fixture()
def single_4_layers(reference_run: ReferenceRun) -> Record:
    return reference_run(FULL_RUN.with_(model={"n_layers": 4}))


@pytest.fixture()
def single_8_layers(reference_run: ReferenceRun) -> Record:
    return reference_run(FULL_RUN.with_(model={"n_layers": 8}))


def _pp(size: int, schedule: str, **more: Any) -> dict[str, Any]:
    return {"pipeline_parallel_size": size, "pipeline_schedule": schedule, **more}


@pytest.mark.parametrize(("strategy", "extra"), [
    (_pp(2, "GPipe"), {"default_pipeline_loss": True}),
    (_pp(2, "1F1B"), {}),
    (_pp(2, "Interleaved1F1B"), {}),
    (_pp(2, "LoopedBFS"), {}),
    (_pp(2, "InterleavedZeroBubble"), {}),
    (_pp(2, "ZBVZeroBubble"), {}),
    (_pp(2, "DualPipeV"), {}),
    (_pp(2, "1F1B", pipeline_split_points=[1], pipeline_microbatches=4), {}),
], ids=["GPipe-default-loss", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
        "DualPipeV", "1F1B-uneven-split"])
def test_every_schedule_at_pp2_matches_single_process(strategy: dict, extra: dict, single_4_layers: Record,
                                                      tmp_path: Path, test_env: dict[str, str]) -> None:
    spec = FULL_RUN.with_(model=dict(n_layers=4, **extra), trainer={"strategy": strategy})
    assert_full_run_matches(launch(2, spec, tmp_path, test_env), single_4_layers)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_pp4_matches_single_process(schedule: str, single_8_layers: Record, tmp_path: Path,
                                    test_env: dict[str, str]) -> None:
    spec = FULL_RUN.with_(model={"n_layers": 8}, trainer={"strategy": _pp(4, schedule)})
    assert_full_run_matches(launch(4, spec, tmp_path, test_env), single_8_layers)


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pp2_x_fsdp2_x_tp2_matches_single_process(schedule: str, single_4_layers: Record, tmp_path: Path,
                                                  test_env: dict[str, str]) -> None:
    # 3-D: FSDP shards each stage over 2 ranks, TP (with sequence and loss parallel) splits it over 2 more.
    strategy = _pp(2, schedule, tensor_parallel_size=2, pipeline_microbatches=2)
    spec = FULL_RUN.with_(batch_size=GLOBAL_BATCH // 2, model={"n_layers": 4}, trainer={"strategy": strategy})
    assert_full_run_matches(launch(8, spec, tmp_path, test_env), single_4_layers)


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_accumulation_and_clipping_match_a_twice_larger_batch(schedule: str, single_4_layers: Record, tmp_path: Path,
                                                              test_env: dict[str, str]) -> None:
    spec = BASE_RUN.with_(batch_size=GLOBAL_BATCH // 2, model={"n_layers": 4},
                          trainer={"accumulate": 2, "strategy": _pp(2, schedule, pipeline_microbatches=4)})
    records = launch(2, spec, tmp_path, test_env)
    assert_identical_on_all_ranks(records)
    assert_close_per_step(series(records[0], "train_loss", 2), series(single_4_layers, "train_loss"), RTOL)
    # The norm is clipped at 1.0 over both stages' gradients: equal norms mean equal clipping.
    assert_close_per_step(series(records[0], "grad_norm", 2), series(single_4_layers, "grad_norm"), RTOL)


def test_compiled_stages_match_single_process(single_4_layers: Record, tmp_path: Path,
                                              test_env: dict[str, str]) -> None:
    # Each stage's blocks are compiled one by one, as without PP. A rank waits for its neighbour's
    # first compile (over 60 s with a cold cache on torch 2.11's CUDA wheel), hence the longer timeout.
    spec = BASE_RUN.with_(model={"n_layers": 4},
                          trainer={"timeout_seconds": 180, "strategy": _pp(2, "Interleaved1F1B", compile=True)})
    records = launch(2, spec, tmp_path, test_env)
    assert_identical_on_all_ranks(records)
    assert_close_per_step(series(records[0], "train_loss"), series(single_4_layers, "train_loss"), RTOL)
    assert_close_per_step(series(records[0], "grad_norm"), series(single_4_layers, "grad_norm"), RTOL)


def test_bf16_mixed_pipeline_trains_close_to_fp32(single_4_layers: Record, tmp_path: Path,
                                                  test_env: dict[str, str]) -> None:
    # bf16 activations travel between stages; FSDP2 keeps fp32 master weights and reduces in fp32.
    spec = BASE_RUN.with_(model={"n_layers": 4},
                          trainer={"precision": "bf16-mixed", "strategy": _pp(2, "ZBVZeroBubble")})
    records = launch(2, spec, tmp_path, test_env)
    assert_identical_on_all_ranks(records)
    bf16, fp32 = series(records[0], "train_loss"), series(single_4_layers, "train_loss")
    assert bf16 != fp32
    assert_close_per_step(bf16, fp32, rtol=2e-2)


@pytest.mark.parametrize("strategy", [_pp(2, "Interleaved1F1B"), {"tensor_parallel_size": 2}], ids=["pp2", "tp2"])
def test_checkpoint_callback_and_early_stopping_decide_as_without_parallelism(strategy: dict, tmp_path: Path,
                                                                              test_env: dict[str, str],
                                                                              reference_run: ReferenceRun) -> None:
    # ModelCheckpoint keeps the best 2 by train_loss, EarlyStopping watches it at every epoch end (2
    # steps), and the progress bar shows it. Their decisions are votes over every rank.
    spec = RunSpec(steps=8, batch_size=GLOBAL_BATCH, trainer=TrainerSpec(clip=1.0, progress_bar=True),
                   model=ModelSpec(n_layers=4), data=DataSpec(samples=16),
                   callbacks=CallbackSpec(lightning_callbacks=True))
    single = reference_run(spec)
    records = launch(2, spec.with_(trainer={"strategy": strategy}), tmp_path / "parallel", test_env)
    for record in records:
        assert record["global_step"] == single["global_step"]
        assert record["best_k_models"] == single["best_k_models"]
        assert record["best_model_score"] == pytest.approx(single["best_model_score"], rel=RTOL)
        assert "loss" in record["progress_bar_metrics"]


@pytest.mark.parametrize(("nproc", "strategy"), [(1, {}), (4, _pp(4, "1F1B"))], ids=["pp1", "pp4"])
def test_checkpoint_from_pp2_resumes_under_another_pipeline_size(nproc: int, strategy: dict, tmp_path: Path,
                                                                 test_env: dict[str, str]) -> None:
    # 24 samples of batch 8: step 3 ends an epoch, where Lightning resumes map-style data exactly.
    spec = RunSpec(steps=6, batch_size=GLOBAL_BATCH, trainer=TrainerSpec(clip=1.0), model=ModelSpec(n_layers=4),
                   data=DataSpec(samples=24))
    checkpoint = tmp_path / "pp2.ckpt"
    original = launch(2, spec.with_(trainer={"strategy": _pp(2, "ZBVZeroBubble")},
                                    checkpoints={"save_at": 3, "save_path": str(checkpoint)}),
                      tmp_path / "pp2", test_env)
    resumed = launch(nproc, spec.with_(trainer={"strategy": strategy}, checkpoints={"resume_from": str(checkpoint)}),
                     tmp_path / "resumed", test_env)
    assert_resume_continues(original, resumed, saved_at=3, steps=6)


@pytest.mark.parametrize(("spec", "message"), [
    (RunSpec(steps=2, model=ModelSpec(n_layers=2), batch_size=8,
             trainer=TrainerSpec(strategy=_pp(2, "Interleaved1F1B"))),
     "ValueError: The model has 2 blocks, fewer than the 4 pipeline stages"),
    (RunSpec(steps=2, model=ModelSpec(n_layers=4), batch_size=6,
             trainer=TrainerSpec(strategy=_pp(2, "1F1B", pipeline_microbatches=4))),
     "ValueError: A batch of 6 samples cannot be split into pipeline_microbatches=4"),
], ids=["too-few-blocks", "indivisible-batch"])
def test_bad_pipeline_input_fails_on_every_rank(spec: RunSpec, message: str, tmp_path: Path,
                                                test_env: dict[str, str]) -> None:
    with pytest.raises(AssertionError) as failure:
        launch(2, spec, tmp_path, test_env)
    for rank in (0, 1):
        assert f"\nrank{rank}: {message}" in str(failure.value)
