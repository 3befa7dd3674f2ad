"""Multi-process runs (CPU/gloo, fp32) against a single-process run of the same seed and data."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import launch
from tests.support.parity import (
    BASE_RUN,
    GLOBAL_BATCH,
    RTOL,
    STEPS,
    Record,
    ReferenceRun,
    assert_close_per_step,
    assert_identical_on_all_ranks,
    series,
)

pytestmark = pytest.mark.multiprocess


@pytest.fixture()
def single_process(reference_run: ReferenceRun) -> Record:
    return reference_run(BASE_RUN)


@pytest.mark.parametrize(("nproc", "strategy"), [
    (2, {}),
    (4, {}),
    (4, {"data_parallel_replicate_size": 2, "data_parallel_shard_size": 2}),
    (2, {"activation_checkpointing": "full"}),
    (2, {"activation_checkpointing": "selective_layer", "activation_checkpointing_every": 2}),
    # Selective AC's policy inside compiled blocks, and the compiled loss.
    (2, {"activation_checkpointing": "selective_op", "compile": True, "compile_loss": True}),
], ids=["fsdp2", "fsdp4", "hsdp2x2", "fsdp2-full-ac", "fsdp2-selective-layer-ac", "fsdp2-selective-op-ac-compiled"])
def test_loss_and_grad_norm_match_single_process(nproc: int, strategy: dict, single_process: Record, tmp_path: Path,
                                                 test_env: dict[str, str]) -> None:
    timeout = 300 if strategy.get("compile") else 60  # a cold inductor cache is slow
    spec = BASE_RUN.with_(batch_size=GLOBAL_BATCH // nproc, trainer={"strategy": strategy, "timeout_seconds": timeout})
    records = launch(nproc, spec, tmp_path, test_env)
    assert_identical_on_all_ranks(records)
    assert_identical_on_all_ranks(records, "grad_norm")
    assert_close_per_step(series(records[0], "train_loss"), series(single_process, "train_loss"))
    # The norms stay below the clip (1.0) here: test_adamw_kernels_clip_... runs with clipping active.
    assert_close_per_step(series(records[0], "grad_norm"), series(single_process, "grad_norm"))


CLIP_BELOW_THE_NORMS = 0.5  # this model's gradient norms are 0.6-0.8 over the run


@pytest.mark.parametrize(("nproc", "adamw"), [(1, "fused"), (2, "fused"), (2, "triton")],
                         ids=["single-device-fused", "fsdp2-fused", "fsdp2-triton"])
def test_adamw_kernels_clip_by_their_grad_scale_like_a_clipping_pass(nproc: int, adamw: str, tmp_path: Path,
                                                                     test_env: dict[str, str],
                                                                     reference_run: ReferenceRun) -> None:
    # torch's fused kernel and TritonAdamW (here on FSDP2's DTensor shards) divide the gradients by the clip
    # scale as they read them; the reference run (foreach AdamW, one process) clips them in a pass of its own first.
    spec = BASE_RUN.with_(trainer={"clip": CLIP_BELOW_THE_NORMS})
    reference = reference_run(spec)
    records = launch(nproc, spec.with_(batch_size=GLOBAL_BATCH // nproc, model={"adamw": adamw}), tmp_path, test_env)
    norms = series(records[0], "grad_norm")
    assert all(norm > CLIP_BELOW_THE_NORMS for norm in norms), f"clipping was not active at every step: {norms}"
    assert_close_per_step(norms, series(reference, "grad_norm"))
    assert_close_per_step(series(records[0], "train_loss"), series(reference, "train_loss"))


def test_gradient_accumulation_matches_a_twice_larger_batch(single_process: Record, tmp_path: Path,
                                                            test_env: dict[str, str]) -> None:
    spec = BASE_RUN.with_(batch_size=GLOBAL_BATCH // 4, trainer={"accumulate": 2})
    records = launch(2, spec, tmp_path, test_env)
    assert_close_per_step(series(records[0], "train_loss", 2), series(single_process, "train_loss"))
    assert_close_per_step(series(records[0], "grad_norm", 2), series(single_process, "grad_norm"))
    # Each window's first forward ran with the previous window's gradients already released.
    assert records[0]["grads_alive_after_forward"] == [False] * STEPS


def test_bf16_mixed_trains_close_to_fp32(single_process: Record, tmp_path: Path, test_env: dict[str, str]) -> None:
    spec = BASE_RUN.with_(batch_size=GLOBAL_BATCH // 2, trainer={"precision": "bf16-mixed"})
    records = launch(2, spec, tmp_path, test_env)
    assert_identical_on_all_ranks(records)
    bf16, fp32 = series(records[0], "train_loss"), series(single_process, "train_loss")
    assert bf16[-1] < bf16[0] - 0.3, f"bf16-mixed loss did not fall: {bf16}"
    # bf16 compute really ran (not an fp32 run under another name), yet stays near the fp32 trajectory.
    assert bf16 != fp32
    assert_close_per_step(bf16, fp32, rtol=2e-2)


def test_self_parallelized_module_runs_unchanged(tmp_path: Path, test_env: dict[str, str],
                                                 reference_run: ReferenceRun) -> None:
    # A ModelParallelStrategy-style module shards itself in configure_model with
    # self.device_mesh["data_parallel"]; its reset_parameters() init must not depend on the layout.
    # It computes its loss itself, as a mean per rank: fully labelled data, where that is the token mean.
    spec = BASE_RUN.with_(model={"self_sharded": True}, data={"padded_labels": False})
    two = launch(2, spec.with_(batch_size=GLOBAL_BATCH // 2), tmp_path / "two", test_env)
    one = reference_run(spec)
    assert_identical_on_all_ranks(two)
    assert_close_per_step(series(two[0], "train_loss"), series(one, "train_loss"))
    assert series(one, "train_loss")[-1] < series(one, "train_loss")[0]


def test_grad_norm_is_logged_without_clipping(single_process: Record, tmp_path: Path, test_env: dict[str, str]) -> None:
    records = launch(2, BASE_RUN.with_(steps=2, batch_size=GLOBAL_BATCH // 2, trainer={"clip": None}), tmp_path,
                     test_env)
    norms = series(records[0], "grad_norm")
    assert len(norms) == 2
    # Step 1 runs from identical weights, so its (pre-clipping) norm equals the clipped run's.
    assert norms[0] == pytest.approx(series(single_process, "grad_norm")[0], rel=RTOL)
