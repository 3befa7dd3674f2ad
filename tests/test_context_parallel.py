"""Context parallelism (load-balanced ring attention) alone and in 4-D, against one process (CPU/gloo, fp32).

Each full run trains 10 steps, validates at steps 5 and 10, then runs ``trainer.test`` and
``trainer.predict``; CP ranks hold different tokens, yet losses, gradient norms, predictions (gathered
back to whole sequences) and hook counts must match the single process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import launch, one_rank_mesh
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
from tests.support.run_spec import DataSpec, RunSpec, TrainerSpec
from titan_strategy.parallelize.context_parallel import (
    SequenceSharder,
    apply_cp,
    check_cp_plan,
    check_cp_sequence_length,
    ring_attention,
)
from titan_strategy.plan import ContextParallelPlan

# Plain causal attention: what runs as ring attention (block-causal attention gathers keys and values).
CAUSAL_FULL_RUN = FULL_RUN.with_(data={"documents": False}, model={"attention_mask": "causal"})


@pytest.fixture()
def single_process(reference_run: ReferenceRun) -> Record:
    return reference_run(FULL_RUN)


def _cp(size: int, rotate: str = "allgather", **more: Any) -> dict[str, Any]:
    return {"context_parallel_size": size, "context_parallel_rotate_method": rotate, **more}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("nproc", "batch_ranks", "strategy", "run"), [
    (2, 1, _cp(2), FULL_RUN),
    (4, 1, _cp(4, "alltoall"), CAUSAL_FULL_RUN),
    (4, 2, _cp(2), FULL_RUN),
    (4, 1, _cp(2, tensor_parallel_size=2), FULL_RUN),
    (4, 1, _cp(2, "alltoall", tensor_parallel_size=2, sequence_parallel=False, loss_parallel=False), CAUSAL_FULL_RUN),
    (4, 1, _cp(2, pipeline_parallel_size=2, pipeline_schedule="1F1B"), FULL_RUN),
    # Ring attention inside compiled blocks, recomputed in backward.
    (2, 1, _cp(2, activation_checkpointing="full", compile=True), CAUSAL_FULL_RUN),
], ids=["cp2-block-causal", "cp4-alltoall-causal", "fsdp2xcp2-block-causal", "tp2xcp2-block-causal",
        "tp2xcp2-plain-alltoall-causal", "pp2xcp2-block-causal", "cp2-full-ac-compiled-causal"])
def test_matches_single_process(nproc: int, batch_ranks: int, strategy: dict, run: RunSpec,
                                reference_run: ReferenceRun, tmp_path: Path, test_env: dict[str, str]) -> None:
    # A cold inductor cache makes the compiled run's first step slow on every rank.
    timeout = 300 if strategy.get("compile") else 60
    spec = run.with_(batch_size=GLOBAL_BATCH // batch_ranks, trainer={"strategy": strategy, "timeout_seconds": timeout})
    assert_full_run_matches(launch(nproc, spec, tmp_path, test_env), reference_run(run))


@pytest.mark.multiprocess
def test_4d_pp2_dp2_cp2_tp2_matches_single_process(single_process: Record, tmp_path: Path,
                                                   test_env: dict[str, str]) -> None:
    """The one 16-process smoke test: every dimension at 2, FSDP sharding over dp_shard x cp (training only)."""
    strategy = _cp(2, tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_schedule="1F1B")
    # 16 processes on a 2-core CI machine: the launch alone took 190 s of the default 240 once, and failed
    # once in a full run; a hang still ends the test.
    spec = BASE_RUN.with_(batch_size=GLOBAL_BATCH // 2, trainer={"strategy": strategy, "timeout_seconds": 300})
    records = launch(16, spec, tmp_path, test_env, timeout_s=480)
    for key in ("train_loss", "grad_norm"):
        assert_identical_on_all_ranks(records, key)
        assert_close_per_step(series(records[0], key), series(single_process, key), RTOL)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("saved", "resumed"), [
    ((2, _cp(2)), (1, {})),
    ((1, {}), (2, _cp(2, "alltoall"))),
], ids=["cp2-to-single", "single-to-cp2"])
def test_checkpoint_resumes_with_or_without_cp(saved: tuple[int, dict], resumed: tuple[int, dict], tmp_path: Path,
                                               test_env: dict[str, str]) -> None:
    # 24 samples of batch 8: step 3 ends an epoch, where Lightning resumes map-style data exactly.
    spec = RunSpec(steps=6, trainer=TrainerSpec(clip=1.0), batch_size=GLOBAL_BATCH, data=DataSpec(samples=24))
    checkpoint = tmp_path / "step3.ckpt"
    original = launch(saved[0], spec.with_(trainer={"strategy": saved[1]},
                                           checkpoints={"save_at": 3, "save_path": str(checkpoint)}),
                      tmp_path / "saved", test_env)
    continued = launch(resumed[0], spec.with_(trainer={"strategy": resumed[1]},
                                              checkpoints={"resume_from": str(checkpoint)}),
                       tmp_path / "resumed", test_env)
    assert_resume_continues(original, continued, saved_at=3, steps=6)


@pytest.mark.multiprocess
def test_indivisible_sequence_fails_on_every_rank_before_the_first_forward(tmp_path: Path,
                                                                          test_env: dict[str, str]) -> None:
    with pytest.raises(AssertionError) as failure:
        launch(2, RunSpec(steps=2, batch_size=4, data=DataSpec(seq_len=30), trainer=TrainerSpec(strategy=_cp(2))),
               tmp_path, test_env)
    for rank in (0, 1):
        assert (f"\nrank{rank}: ValueError: Context parallelism splits each sequence into 2 x context_parallel_size=2 "
                "chunks, but the batch has seq_len=30; use a seq_len divisible by 4.") in str(failure.value)


@pytest.mark.unit
@pytest.mark.parametrize(("seq_len", "cp", "tp", "message"), [
    (36, 4, 1, "seq_len=36; use a seq_len divisible by 8."),
    (36, 2, 2, "and sequence parallelism each rank's share across tensor_parallel_size=2, but the batch has "
               "seq_len=36; use a seq_len divisible by 8, or sequence_parallel=False."),
])
def test_sequence_length_rule_names_the_multiple_and_the_fix(seq_len: int, cp: int, tp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check_cp_sequence_length(seq_len, cp, tp)
    check_cp_sequence_length(2 * cp * tp * 3, cp, tp)


@pytest.mark.unit
def test_a_plan_without_cp_is_refused() -> None:
    with pytest.raises(ValueError, match="context_parallel_size=2, but the module's parallel_plan.. declares no "):
        check_cp_plan(None, 2)


class _MaskedAttention(nn.Module):
    """Attention with an explicit mask (which CP runs on gathered keys and values), or non-causal (which ring
    attention over load-balanced shards cannot do)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=self.causal)


class _Holder(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.attention = _MaskedAttention(causal)


@pytest.fixture
def cp_mesh_of_one() -> Any:
    """A one-rank CP ring: enough to run the CP code path in this process."""
    with one_rank_mesh("cpu", "cp") as mesh:
        yield mesh


@pytest.mark.unit
def test_attention_cp_cannot_shard_is_refused(cp_mesh_of_one: Any) -> None:
    qkv = [torch.randn(1, 2, 8, 4) for _ in range(3)]
    plan = ContextParallelPlan(attention="attention")
    masked, non_causal = _Holder(causal=True), _Holder(causal=False)
    for holder in (masked, non_causal):
        apply_cp(holder, cp_mesh_of_one, plan)
    with ring_attention("allgather"):
        mask = torch.ones(8, 8, dtype=torch.bool)
        with pytest.raises(ValueError, match=r"as attention of \(query, key, value\[, mask\]\), but it was called "
                                             r"with 3 positional and \['mask'\] keyword arguments"):
            masked.attention(*qkv, mask=mask)
        # Under a mask the keys and values are gathered whole: on a ring of one, plain masked attention.
        torch.testing.assert_close(non_causal.attention(*qkv, mask),
                                   F.scaled_dot_product_attention(*qkv, attn_mask=mask))
        with pytest.raises(ValueError, match=r"shards causal attention only \(is_causal=True, no attn_mask\)"):
            non_causal.attention(*qkv)
    with pytest.raises(ValueError, match=r"attention='attn\.\*' matches no submodule of _Holder"):
        apply_cp(_Holder(causal=True), cp_mesh_of_one, ContextParallelPlan(attention="attn.*"))


@pytest.mark.unit
def test_ring_of_one_equals_plain_attention_and_restores_buffers(cp_mesh_of_one: Any) -> None:
    holder = _Holder(causal=True)
    holder.register_buffer("positions", torch.arange(16.0), persistent=False)
    plan = ContextParallelPlan(attention="attention", buffers={"positions": 0})
    apply_cp(holder, cp_mesh_of_one, plan)
    sharder = SequenceSharder(holder, cp_mesh_of_one, plan, "alltoall")
    qkv = [torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3)]
    F.scaled_dot_product_attention(*qkv, is_causal=True).square().sum().backward()
    expected = [t.grad.clone() for t in qkv]
    for t in qkv:
        t.grad = None
    batch = {"input_ids": torch.arange(8).expand(2, 8), "labels": torch.arange(8).expand(2, 8), "id": 3}
    dispatcher = torch.distributed.tensor.DTensor._op_dispatcher
    # A handler someone registered after torch was imported survives the scope and is there within it.
    dispatcher._custom_op_handlers = {**dispatcher._custom_op_handlers, torch.ops.aten.erfinv.default: print}
    handlers = dispatcher._custom_op_handlers
    try:
        with sharder.step(batch, seq_len=8) as local:
            assert dispatcher._custom_op_handlers[torch.ops.aten.erfinv.default] is print
            assert holder.positions.tolist() == list(range(8))  # the rows of the batch's 8 positions
            assert local["id"] == 3 and torch.equal(local["input_ids"], batch["input_ids"])
            holder.attention(*qkv).square().sum().backward()
        assert dispatcher._custom_op_handlers is handlers
    finally:
        dispatcher._custom_op_handlers = {op: handler for op, handler in handlers.items()
                                          if op is not torch.ops.aten.erfinv.default}
    for t, grad in zip(qkv, expected):
        torch.testing.assert_close(t.grad, grad)
    assert holder.positions.shape == (16,)
    with pytest.raises(ValueError, match="seq_len=32, but the model's positions covers 16 positions"), \
            sharder.step(batch, seq_len=32):
        pass


@pytest.fixture
def cuda_cp_mesh_of_one() -> Any:
    with one_rank_mesh("cuda", "cp") as mesh:
        yield mesh


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA attention kernels need a CUDA GPU")
@pytest.mark.parametrize("kernel", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"])
def test_ring_attention_runs_every_cuda_kernel(kernel: str, cuda_cp_mesh_of_one: Any) -> None:
    """The CUDA path is torch's own ring attention; this checks it is reached, forward and backward, per kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    holder = _Holder(causal=True)
    apply_cp(holder, cuda_cp_mesh_of_one, ContextParallelPlan(attention="attention"))
    # Grouped-query attention, as the Llama model calls it: 8 query heads over 2 key/value heads.
    qkv = [torch.randn(2, heads, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for heads in (8, 2, 2)]
    with sdpa_kernel(getattr(SDPBackend, kernel)):
        query, key, value = qkv
        expected_out = F.scaled_dot_product_attention(query, key.repeat_interleave(4, dim=1),
                                                      value.repeat_interleave(4, dim=1), is_causal=True)
        expected_out.float().square().sum().backward()
        expected = [t.grad.clone() for t in qkv]
        for t in qkv:
            t.grad = None
        with ring_attention("allgather"):
            out = holder.attention(*qkv)
            out.float().square().sum().backward()
    assert not isinstance(out, torch.distributed.tensor.DTensor)
    torch.testing.assert_close(out, expected_out, rtol=2e-2, atol=2e-2)
    for t, grad in zip(qkv, expected):
        torch.testing.assert_close(t.grad, grad, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks the NCCL all-gather of the masked path")
def test_masked_attention_gathers_keys_and_values_over_nccl(cuda_cp_mesh_of_one: Any) -> None:
    """Block-causal CP gathers keys and values with torch's autograd all-gather, named differently in 2.11 and 2.13."""
    holder = _Holder(causal=False)
    apply_cp(holder, cuda_cp_mesh_of_one, ContextParallelPlan(attention="attention"))
    qkv = [torch.randn(2, 4, 64, 16, device="cuda", requires_grad=True) for _ in range(3)]
    mask = torch.ones(64, 64, dtype=torch.bool, device="cuda").tril()
    expected = F.scaled_dot_product_attention(*qkv, attn_mask=mask)
    expected_grads = torch.autograd.grad(expected.square().sum(), qkv)
    with ring_attention("allgather"):
        out = holder.attention(*qkv, mask)
        grads = torch.autograd.grad(out.square().sum(), qkv)
    torch.testing.assert_close(out, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
