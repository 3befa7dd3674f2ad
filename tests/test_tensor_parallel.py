"""Tensor / sequence parallel with loss parallel, alone and composed with FSDP2/HSDP (CPU/gloo, fp32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import launch
from tests.support.parity import (
    BASE_RUN,
    GLOBAL_BATCH,
    RTOL,
    Record,
    ReferenceRun,
    assert_close_per_step,
    assert_identical_on_all_ranks,
    series,
)
from tests.support.run_spec import DataSpec, RunSpec, TrainerSpec
from titan_strategy.parallelize.tensor_parallel import (
    check_sequence_length,
    check_tp_plan,
)
from titan_strategy.plan import TensorParallelPlan

WITH_VALIDATION = BASE_RUN.with_(trainer={"validate": True})


@pytest.fixture()
def single_process_with_validation(reference_run: ReferenceRun) -> Record:
    return reference_run(WITH_VALIDATION)


def _tp(size: int, sequence_parallel: bool = True, loss_parallel: bool = True, **more: Any) -> dict:
    return {"tensor_parallel_size": size, "sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
            **more}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("nproc", "strategy"), [
    (2, _tp(2)),
    (2, _tp(2, sequence_parallel=False)),
    (2, _tp(2, loss_parallel=False)),
    (2, _tp(2, sequence_parallel=False, loss_parallel=False)),
    (4, _tp(4)),
    (4, _tp(4, sequence_parallel=False, loss_parallel=False)),
    (4, _tp(2)),
    (8, _tp(2, data_parallel_replicate_size=2, data_parallel_shard_size=2)),
], ids=["tp2", "tp2-no-sp", "tp2-no-loss-parallel", "tp2-plain", "tp4", "tp4-plain", "fsdp2xtp2", "hsdp2xfsdp2xtp2"])
def test_matches_single_process(nproc: int, strategy: dict, single_process_with_validation: Record, tmp_path: Path,
                                test_env: dict[str, str]) -> None:
    data_parallel = nproc // strategy["tensor_parallel_size"]
    spec = WITH_VALIDATION.with_(batch_size=GLOBAL_BATCH // data_parallel, trainer={"strategy": strategy})
    records = launch(nproc, spec, tmp_path, test_env)
    reference = single_process_with_validation
    assert_identical_on_all_ranks(records)
    assert_close_per_step(series(records[0], "train_loss"), series(reference, "train_loss"), RTOL)
    # Clipping at 1.0 is active: equal grad norms under 2-D/3-D meshes mean equal clipping too.
    assert_close_per_step(series(records[0], "grad_norm"), series(reference, "grad_norm"), RTOL)
    for record in records:  # validation under TP (loss parallel included) gives the same val_loss
        assert record["val_losses"] == pytest.approx(reference["val_losses"], rel=RTOL)


# (processes, batch per rank, strategy): a global batch of 8 either way.
@pytest.mark.multiprocess
@pytest.mark.parametrize(("saved", "resumed"), [((4, 4, _tp(2)), (4, 2, {})), ((1, 8, {}), (2, 4, {}))],
                         ids=["fsdp2xtp2-to-fsdp4", "single-device-to-fsdp2"])
def test_checkpoint_resumes_under_another_layout(saved: tuple[int, int, dict], resumed: tuple[int, int, dict],
                                                  tmp_path: Path, test_env: dict[str, str]) -> None:
    # 24 samples of global batch 8: step 3 ends an epoch, where Lightning resumes map-style data exactly.
    # A single device saves plain tensors (no FSDP there); a sharded run reads its shards out of them.
    checkpoint = tmp_path / "saved.ckpt"
    (saved_nproc, saved_batch, saved_strategy), (resumed_nproc, resumed_batch, resumed_strategy) = saved, resumed
    spec = RunSpec(steps=6, batch_size=saved_batch, data=DataSpec(samples=24),
                   trainer=TrainerSpec(clip=1.0, strategy=saved_strategy))
    original = launch(saved_nproc, spec.with_(checkpoints={"save_at": 3, "save_path": str(checkpoint)}),
                      tmp_path / "saved", test_env)
    after = launch(resumed_nproc, spec.with_(batch_size=resumed_batch, trainer={"strategy": resumed_strategy},
                                             checkpoints={"resume_from": str(checkpoint)}),
                   tmp_path / "resumed", test_env)
    assert_identical_on_all_ranks(after)
    [expected] = [s for s in original[0]["steps"] if s["step"] == 4]
    first = after[0]["steps"][0]
    assert first["step"] == 4
    assert first["train_loss"] == pytest.approx(expected["train_loss"], rel=RTOL)
    assert first["grad_norm"] == pytest.approx(expected["grad_norm"], rel=RTOL)


def _plan(**sizes: int) -> TensorParallelPlan:
    split = {"n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336} | {k: v for k, v in sizes.items() if k != "vocab_size"}
    return TensorParallelPlan(styles=lambda sp, lp: {}, split_sizes=split, vocab_size=sizes.get("vocab_size", 128256),
                              sequence_length=lambda batch: 0)


@pytest.mark.unit
@pytest.mark.parametrize(("plan", "tp", "loss_parallel", "message"), [
    (_plan(n_heads=12), 8, True, r"tensor_parallel_size=8 does not divide n_heads=12; use a tensor_parallel_size that "
                                 r"divides it \(\[1, 2, 3, 4, 6, 12\]\)"),
    (_plan(), 16, True, r"tensor_parallel_size=16 does not divide n_kv_heads=8"),
    (_plan(ffn_dim=1001), 8, True, r"tensor_parallel_size=8 does not divide ffn_dim=1001"),
    (_plan(vocab_size=8450), 4, True, r"does not divide vocab_size=8450; use loss_parallel=False or"),
    (None, 2, True, r"declares no tensor_parallel plan; set tensor_parallel_size=1"),
])
def test_indivisible_shapes_name_the_value_and_the_fix(plan: TensorParallelPlan | None, tp: int, loss_parallel: bool,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_tp_plan(plan, tp, loss_parallel=loss_parallel)


@pytest.mark.unit
def test_vocab_need_not_divide_without_loss_parallel() -> None:
    check_tp_plan(_plan(vocab_size=8450), 2, loss_parallel=False)


@pytest.mark.unit
def test_sequence_parallel_needs_a_divisible_seq_len() -> None:
    check_sequence_length(4096, 8)
    with pytest.raises(ValueError, match=r"seq_len=1001; use a seq_len divisible by 8, or sequence_parallel=False"):
        check_sequence_length(1001, 8)


@pytest.mark.unit
def test_async_tp_needs_compile_and_cuda(tmp_path: Path) -> None:
    import lightning as L

    from titan_strategy import TitanStrategy

    with pytest.raises(ValueError, match=r"async_tensor_parallel=True needs compile=True"):
        TitanStrategy(tensor_parallel_size=2, async_tensor_parallel=True)
    # The device is known once the Trainer picks it, still before any process starts.
    strategy = TitanStrategy(async_tensor_parallel=True, compile=True)
    with pytest.raises(ValueError, match=r"runs on CUDA only \(symmetric memory\), not on 'cpu'"):
        L.Trainer(accelerator="cpu", devices=2, strategy=strategy, default_root_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def _compiled_tp_refused() -> bool:
    from titan_strategy import config

    return config._COMPILED_TP_IS_BROKEN


@pytest.mark.multiprocess
def test_compiled_blocks_match_eager(tmp_path: Path, test_env: dict[str, str], reference_run: ReferenceRun) -> None:
    """Regional compile under FSDP2, and under FSDP2 x TP where torch compiles TP correctly."""
    from titan_strategy import TitanStrategy

    spec = RunSpec(steps=4, batch_size=GLOBAL_BATCH, trainer=TrainerSpec(clip=1.0))
    eager = reference_run(spec)
    compiled = launch(2, spec.with_(batch_size=GLOBAL_BATCH // 2, trainer={"strategy": {"compile": True}}),
                      tmp_path / "compiled", test_env)[0]
    for key in ("train_loss", "grad_norm"):
        assert series(compiled, key) == pytest.approx(series(eager, key), rel=RTOL)
    if _compiled_tp_refused():
        with pytest.raises(ValueError, match=r"compile=True with tensor_parallel_size=2 gives wrong gradients"):
            TitanStrategy(tensor_parallel_size=2, compile=True)
    else:
        with_tp = launch(2, spec.with_(trainer={"strategy": _tp(2, compile=True)}), tmp_path / "compiled_tp",
                         test_env)[0]
        for key in ("train_loss", "grad_norm"):
            assert series(with_tp, key) == pytest.approx(series(eager, key), rel=RTOL)
