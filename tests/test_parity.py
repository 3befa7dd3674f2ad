"""Multi-process runs (CPU/gloo, fp32) against a single-process run of the same seed and data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import launch

STEPS = 10
GLOBAL_BATCH = 8
RTOL = 1e-5
# Trains, validates at steps 5 and 10, then runs trainer.test and trainer.predict (see assert_full_run_matches).
FULL_RUN = {"steps": STEPS, "clip": 1.0, "validate": True, "val_every": 5, "evaluate": True}


def _series(record: dict[str, Any], key: str, accumulate: int = 1) -> list[float]:
    """One value per optimizer step (micro-batch losses of an accumulation window are averaged)."""
    values = [step[key] for step in record["steps"] if key in step]
    if key == "grad_norm":  # recorded only on batches that ended with an optimizer step
        return values
    return [sum(values[i : i + accumulate]) / accumulate for i in range(0, len(values), accumulate)]


def _assert_close_per_step(actual: list[float], expected: list[float], rtol: float = RTOL) -> None:
    assert len(actual) == len(expected) == STEPS
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a} vs single-process {e} (rel {abs(a - e) / abs(e):.2e})"


def _assert_identical_on_all_ranks(records: list[dict[str, Any]], key: str = "train_loss") -> None:
    first = _series(records[0], key)
    for rank, record in enumerate(records[1:], start=1):
        assert _series(record, key) == first, f"rank {rank} logged a different {key}"


def assert_full_run_matches(records: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """A ``FULL_RUN`` matches the single-process one: train loss and grad norm at every step (identical on
    every rank), val and test losses, predictions, how often each Lightning hook ran, and every module
    (pipeline stage copies included) back in training mode after validation."""
    _assert_identical_on_all_ranks(records)
    _assert_identical_on_all_ranks(records, "grad_norm")
    _assert_close_per_step(_series(records[0], "train_loss"), _series(reference, "train_loss"), RTOL)
    _assert_close_per_step(_series(records[0], "grad_norm"), _series(reference, "grad_norm"), RTOL)
    for record in records:
        assert record["val_losses"] == pytest.approx(reference["val_losses"], rel=RTOL)
        assert record["test_loss"] == pytest.approx(reference["test_loss"], rel=RTOL)
        assert record["hook_calls"] == reference["hook_calls"]
        assert record["training_mode_after_validation"] and all(record["training_mode_after_validation"])
    # Every rank returns whole predictions (the last stage's logits under PP, every token under CP);
    # data-parallel ranks predict disjoint shares of the samples the single process predicts.
    by_batch_rank = {record["batch_rank"]: record for record in records}
    for record in records:
        assert record["prediction_abs_sum"] == by_batch_rank[record["batch_rank"]]["prediction_abs_sum"]
    [shape] = {tuple(r["prediction_shape"]) for r in records}
    assert [shape[0] * len(by_batch_rank), *shape[1:]] == reference["prediction_shape"]
    total = sum(r["prediction_abs_sum"] for r in by_batch_rank.values())
    assert total == pytest.approx(reference["prediction_abs_sum"], rel=RTOL)


def assert_resume_continues(original: list[dict[str, Any]], resumed: list[dict[str, Any]], saved_at: int,
                            steps: int) -> None:
    """A run resumed from ``original``'s step-``saved_at`` checkpoint logs the losses and grad norms
    that ``original`` logged after that step, identically on every rank."""
    _assert_identical_on_all_ranks(resumed)
    expected = [step for step in original[0]["steps"] if step["step"] > saved_at]
    assert [step["step"] for step in resumed[0]["steps"]] == list(range(saved_at + 1, steps + 1))
    for before, after in zip(expected, resumed[0]["steps"]):
        assert after["train_loss"] == pytest.approx(before["train_loss"], rel=RTOL), (before, after)
        assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=RTOL), (before, after)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("single")
    return launch(1, {"steps": STEPS, "batch_size": GLOBAL_BATCH, "clip": 1.0}, out, test_env)[0]


@pytest.mark.parametrize(("nproc", "strategy"), [
    (2, {}),
    (4, {}),
    (4, {"data_parallel_replicate_size": 2, "data_parallel_shard_size": 2}),
    (2, {"activation_checkpointing": "full"}),
    (2, {"activation_checkpointing": "selective_layer", "activation_checkpointing_every": 2}),
    # Selective AC's policy inside compiled blocks, and the compiled loss.
    (2, {"activation_checkpointing": "selective_op", "compile": True, "compile_loss": True}),
], ids=["fsdp2", "fsdp4", "hsdp2x2", "fsdp2-full-ac", "fsdp2-selective-layer-ac", "fsdp2-selective-op-ac-compiled"])
def test_loss_and_grad_norm_match_single_process(nproc: int, strategy: dict, single_process: dict, tmp_path: Path,
                                                 test_env: dict[str, str]) -> None:
    spec = {"steps": STEPS, "batch_size": GLOBAL_BATCH // nproc, "clip": 1.0, "strategy": strategy,
            "timeout_seconds": 300 if strategy.get("compile") else 60}  # a cold inductor cache is slow
    records = launch(nproc, spec, tmp_path, test_env)
    _assert_identical_on_all_ranks(records)
    _assert_identical_on_all_ranks(records, "grad_norm")
    _assert_close_per_step(_series(records[0], "train_loss"), _series(single_process, "train_loss"))
    # The norms stay below the clip (1.0) here: test_adamw_kernels_clip_... runs with clipping active.
    _assert_close_per_step(_series(records[0], "grad_norm"), _series(single_process, "grad_norm"))


CLIP_BELOW_THE_NORMS = 0.5  # this model's gradient norms are 0.6-0.8 over the run


@pytest.mark.parametrize(("nproc", "adamw"), [(1, "fused"), (2, "fused"), (2, "triton")],
                         ids=["single-device-fused", "fsdp2-fused", "fsdp2-triton"])
def test_adamw_kernels_clip_by_their_grad_scale_like_a_clipping_pass(nproc: int, adamw: str, tmp_path: Path,
                                                                     test_env: dict[str, str]) -> None:
    # torch's fused kernel and TritonAdamW (here on FSDP2's DTensor shards) divide the gradients by the clip
    # scale as they read them; the reference run (foreach AdamW, one process) clips them in a pass of its own first.
    spec = {"steps": STEPS, "clip": CLIP_BELOW_THE_NORMS}
    reference = launch(1, {**spec, "batch_size": GLOBAL_BATCH}, tmp_path / "foreach", test_env)[0]
    records = launch(nproc, {**spec, "batch_size": GLOBAL_BATCH // nproc, "adamw": adamw}, tmp_path, test_env)
    norms = _series(records[0], "grad_norm")
    assert all(norm > CLIP_BELOW_THE_NORMS for norm in norms), f"clipping was not active at every step: {norms}"
    _assert_close_per_step(norms, _series(reference, "grad_norm"))
    _assert_close_per_step(_series(records[0], "train_loss"), _series(reference, "train_loss"))


def test_gradient_accumulation_matches_a_twice_larger_batch(single_process: dict, tmp_path: Path,
                                                            test_env: dict[str, str]) -> None:
    spec = {"steps": STEPS, "batch_size": GLOBAL_BATCH // 4, "accumulate": 2, "clip": 1.0}
    records = launch(2, spec, tmp_path, test_env)
    _assert_close_per_step(_series(records[0], "train_loss", 2), _series(single_process, "train_loss"))
    _assert_close_per_step(_series(records[0], "grad_norm", 2), _series(single_process, "grad_norm"))
    # Each window's first forward ran with the previous window's gradients already released.
    assert records[0]["grads_alive_after_forward"] == [False] * STEPS


def test_bf16_mixed_trains_close_to_fp32(single_process: dict, tmp_path: Path, test_env: dict[str, str]) -> None:
    spec = {"steps": STEPS, "batch_size": GLOBAL_BATCH // 2, "clip": 1.0, "precision": "bf16-mixed"}
    records = launch(2, spec, tmp_path, test_env)
    _assert_identical_on_all_ranks(records)
    bf16, fp32 = _series(records[0], "train_loss"), _series(single_process, "train_loss")
    assert bf16[-1] < bf16[0] - 0.3, f"bf16-mixed loss did not fall: {bf16}"
    # bf16 compute really ran (not an fp32 run under another name), yet stays near the fp32 trajectory.
    assert bf16 != fp32
    _assert_close_per_step(bf16, fp32, rtol=2e-2)


def test_self_parallelized_module_runs_unchanged(tmp_path: Path, test_env: dict[str, str]) -> None:
    # A ModelParallelStrategy-style module shards itself in configure_model with
    # self.device_mesh["data_parallel"]; its reset_parameters() init must not depend on the layout.
    spec = {"steps": STEPS, "clip": 1.0, "self_sharded": True}
    two = launch(2, {**spec, "batch_size": GLOBAL_BATCH // 2}, tmp_path / "two", test_env)
    one = launch(1, {**spec, "batch_size": GLOBAL_BATCH}, tmp_path / "one", test_env)
    _assert_identical_on_all_ranks(two)
    _assert_close_per_step(_series(two[0], "train_loss"), _series(one[0], "train_loss"))
    assert _series(one[0], "train_loss")[-1] < _series(one[0], "train_loss")[0]


def test_grad_norm_is_logged_without_clipping(single_process: dict, tmp_path: Path, test_env: dict[str, str]) -> None:
    records = launch(2, {"steps": 2, "batch_size": GLOBAL_BATCH // 2}, tmp_path, test_env)
    norms = _series(records[0], "grad_norm")
    assert len(norms) == 2
    # Step 1 runs from identical weights, so its (pre-clipping) norm equals the clipped run's.
    assert norms[0] == pytest.approx(_series(single_process, "grad_norm")[0], rel=RTOL)
