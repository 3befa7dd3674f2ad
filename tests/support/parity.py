"""Comparing training runs: a parallel run's per-step losses, gradient norms and evaluation against a
single-process run of the same seed and data (the ``reference_run`` fixture of tests/conftest.py caches those)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support.run_spec import DataSpec, ModelSpec, RunSpec, TrainerSpec

__all__ = ["BASE_RUN", "FULL_RUN", "GLOBAL_BATCH", "RTOL", "STEPS", "Record", "ReferenceRun",
           "assert_close_per_step", "assert_full_run_matches", "assert_identical_on_all_ranks",
           "assert_resume_continues", "series"]

Record = dict[str, Any]  # what one rank of tests/support/train_worker.py wrote (rank{N}.json)
ReferenceRun = Callable[[RunSpec], Record]  # the ``reference_run`` fixture

STEPS = 10
GLOBAL_BATCH = 8
RTOL = 1e-5
# 10 steps of the global batch, clipped at 1.0: the single-process run most parallel runs match. Its labels
# end in uneven tails of -100, so every run that matches it weights each token, not each rank's or microbatch's
# mean, the same as one process. Its samples hold documents of uneven lengths under the block-causal mask, as
# pre-training runs: every layout builds the mask and the positions from each microbatch's document ids.
BASE_RUN = RunSpec(steps=STEPS, batch_size=GLOBAL_BATCH, trainer=TrainerSpec(clip=1.0),
                   data=DataSpec(padded_labels=True, documents=True), model=ModelSpec(attention_mask="block_causal"))
# Trains, validates at steps 5 and 10, then runs trainer.test and trainer.predict (see assert_full_run_matches).
FULL_RUN = BASE_RUN.with_(trainer={"validate": True, "val_every": 5, "evaluate": True})


def series(record: Record, key: str, accumulate: int = 1) -> list[float]:
    """One value of ``key`` (``train_loss`` or ``grad_norm``) per optimizer step (the loss logged by an accumulation
    window's last batch is the window's)."""
    values = [step[key] for step in record["steps"] if key in step]
    if key == "grad_norm":  # recorded only on batches that ended with an optimizer step
        return values
    return values[accumulate - 1 :: accumulate]


def assert_close_per_step(actual: list[float], expected: list[float], rtol: float = RTOL) -> None:
    """``STEPS`` values, each within ``rtol`` of the single-process one; the message names the step."""
    assert len(actual) == len(expected) == STEPS
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a} vs single-process {e} (rel {abs(a - e) / abs(e):.2e})"


def assert_identical_on_all_ranks(records: list[Record], key: str = "train_loss") -> None:
    """Every rank logged the very same ``series`` of ``key`` as rank 0."""
    first = series(records[0], key)
    for rank, record in enumerate(records[1:], start=1):
        assert series(record, key) == first, f"rank {rank} logged a different {key}"


def assert_full_run_matches(records: list[Record], reference: Record) -> None:
    """A ``FULL_RUN`` matches the single-process one: train loss and grad norm at every step (identical on
    every rank), val and test losses, predictions, how often each Lightning hook ran, and every module
    (pipeline stage copies included) back in training mode after validation."""
    assert_identical_on_all_ranks(records)
    assert_identical_on_all_ranks(records, "grad_norm")
    assert_close_per_step(series(records[0], "train_loss"), series(reference, "train_loss"), RTOL)
    assert_close_per_step(series(records[0], "grad_norm"), series(reference, "grad_norm"), RTOL)
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


def assert_resume_continues(original: list[Record], resumed: list[Record], saved_at: int, steps: int) -> None:
    """A run resumed from ``original``'s step-``saved_at`` checkpoint logs the losses and grad norms
    that ``original`` logged after that step, identically on every rank."""
    assert_identical_on_all_ranks(resumed)
    expected = [step for step in original[0]["steps"] if step["step"] > saved_at]
    assert [step["step"] for step in resumed[0]["steps"]] == list(range(saved_at + 1, steps + 1))
    for before, after in zip(expected, resumed[0]["steps"]):
        assert after["train_loss"] == pytest.approx(before["train_loss"], rel=RTOL), (before, after)
        assert after["grad_norm"] == pytest.approx(before["grad_norm"], rel=RTOL), (before, after)
