"""CUDA graphs (titan_strategy.parallelize.cuda_graph): the graphed model trains as the eager one does, through
accumulation windows, a short last batch, evaluation, FSDP2 and Lightning; and the knob is refused where it cannot
run."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import threading
import types
from collections.abc import Generator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from unittest import mock

import lightning as L
import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from llama_module import LlamaModule
from tests.conftest import launch, one_rank_mesh
from tests.support.parity import series
from tests.support.run_spec import DataSpec, RunSpec, TrainerSpec
from tests.support.train_worker import TINY
from titan_strategy import TitanStrategy
from titan_strategy.config import TitanConfig
from titan_strategy.config.mesh import ParallelDims
from titan_strategy.parallelize.apply import _resolve_units
from titan_strategy.parallelize.cuda_graph import (
    CaptureSchedule,
    _digest,
    _fill,
    _gradient_sync_refusal,
    _signature,
    apply_cuda_graphs,
)
from titan_strategy.parallelize.fsdp import apply_fsdp, no_gradient_sync
from titan_strategy.runtime import ParallelRuntime

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SEQ_LEN = 32


def _module(cross_entropy: str = "chunked") -> LlamaModule:
    torch.manual_seed(0)
    module = LlamaModule(model=dataclasses.replace(TINY, max_seq_len=SEQ_LEN), cross_entropy=cross_entropy,
                         loss_chunk_tokens=24, lr=1e-2, warmup_steps=1)
    module.configure_model()
    return module


def _batches(sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for size in sizes:
        tokens = torch.randint(0, TINY.vocab_size, (size, SEQ_LEN + 1), generator=generator)
        labels = tokens[:, 1:].clone()
        labels[0, -5:] = -100
        batches.append({"input_ids": tokens[:, :-1].cuda(), "labels": labels.cuda()})
    return batches


def _train(module: LlamaModule, batches: list[dict[str, torch.Tensor]], accumulate: int,
           autocast: bool = False, hold_back_sync: bool = False) -> list[float]:
    """A plain loop: token-mean loss per batch, an optimizer step every ``accumulate`` batches (FSDP2's gradient
    reduce-scatter held back within the window if ``hold_back_sync``, as TitanStrategy does without graphs)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    losses = []
    for index, batch in enumerate(batches, start=1):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss_sum, count = module.token_loss(batch)
        held_back = hold_back_sync and index % accumulate != 0
        with no_gradient_sync(module) if held_back else contextlib.nullcontext():
            (loss_sum / count / accumulate).backward()
        losses.append((loss_sum / count).item())
        if index % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if index == 4:  # evaluation in between runs eagerly and leaves the graphs alone
            module.eval()
            with torch.no_grad():
                module.token_loss(batch)
            module.train()
    return losses


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("cross_entropy", "accumulate", "autocast", "padded"), [
    ("chunked", 1, False, False), ("chunked", 2, False, False), ("logits", 1, False, False),
    ("logits", 2, False, False), ("chunked", 2, True, False), ("chunked", 2, False, True), ("logits", 1, False, True)])
def test_graphed_training_matches_eager(cross_entropy: str, accumulate: int, autocast: bool, padded: bool) -> None:
    # 9 full batches, then a short one (another signature: eager, or with the Llama plan's short_batch_padding a
    # padded replay), then full ones again (replayed). Under autocast the capture turns autocast's cast cache off,
    # and compiled code (here the embedding) is guarded on it: the warm-ups run that way too, or the capture would
    # recompile, which fails (the Lightning test below did).
    batches = _batches([2] * 9 + [1] + [2] * 4)
    eager, graphed = _module(cross_entropy).cuda(), _module(cross_entropy).cuda()
    padding = graphed.parallel_plan().short_batch_padding if padded else None
    forward = apply_cuda_graphs(graphed.model, short_batch_padding=padding)
    tolerance = 1e-4 if autocast else 1e-5
    assert _train(graphed, batches, accumulate, autocast) == pytest.approx(_train(eager, batches, accumulate, autocast),
                                                                           rel=tolerance)
    assert forward.replays == 14 - 2 - (not padded)  # every batch after the warm-ups, the short one if padded
    for ours, theirs in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=1e-6)


@pytest.fixture
def fsdp_mesh_of_one() -> Generator[DeviceMesh, None, None]:
    """FSDP2 on this one GPU: its hooks, resharding, streams and sharded gradients are all there; with one rank
    it copies where it would all-gather and reduce-scatter (the collectives need more GPUs)."""
    with one_rank_mesh("cuda", "dp_shard") as mesh:
        yield mesh


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("accumulate", "param_dtype", "padded"),
                         [(1, None, False), (2, None, False), (2, torch.bfloat16, False), (2, None, True)])
def test_fsdp_graphed_training_matches_eager(fsdp_mesh_of_one: DeviceMesh, accumulate: int,
                                             param_dtype: torch.dtype | None, padded: bool) -> None:
    # The eager run holds the reduce-scatter back within each accumulation window, the graphed one reduce-scatters
    # every backward (as its capture did): the same sums. bf16 parameters with fp32 reductions: FSDP's mixed
    # precision, the cast of each shard captured with the all-gather.
    batches = _batches([2] * 9 + [1] + [2] * 4)
    runs = {}
    for graphs in (False, True):
        module = _module().cuda()
        plan = module.parallel_plan()
        apply_fsdp(module.model, _resolve_units(plan, module.model), fsdp_mesh_of_one, param_dtype=param_dtype,
                   reduce_dtype=torch.float32 if param_dtype else None, reshard_after_forward="default")
        padding = plan.short_batch_padding if padded else None
        graphed = apply_cuda_graphs(module.model, short_batch_padding=padding) if graphs else None
        runs[graphs] = _train(module, batches, accumulate, hold_back_sync=not graphs), module
    tolerance = 1e-3 if param_dtype else 1e-5
    (eager_losses, eager), (graphed_losses, graphed_module) = runs[False], runs[True]
    assert graphed_losses == pytest.approx(eager_losses, rel=tolerance)
    assert graphed is not None and graphed.replays == 14 - 2 - (not padded)
    for ours, theirs in zip(graphed_module.parameters(), eager.parameters()):
        assert isinstance(ours, DTensor)
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), rtol=tolerance, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_a_second_forward_before_backward_and_a_moved_parameter_are_refused() -> None:
    module = _module().cuda()
    apply_cuda_graphs(module.model, warmup_steps=1)
    batch = _batches([2])[0]
    for _ in range(2):  # eager, then captured
        loss_sum, _ = module.token_loss(batch)
        loss_sum.backward()
    first, _ = module.token_loss(batch)
    module.token_loss(batch)
    with pytest.raises(RuntimeError, match="another graphed training forward before this one's backward"):
        first.backward()
    module.model.output.weight.data = module.model.output.weight.data.clone()
    with pytest.raises(RuntimeError, match="now lives elsewhere .* update parameters in place"):
        module.token_loss(batch)


@pytest.mark.unit
def test_gradient_sync_turned_off_by_the_caller_is_refused() -> None:
    # A user's own set_requires_gradient_sync(False) (manual accumulation, as under ModelParallelStrategy) would
    # hold an eager backward's gradients back for an eager backward that replays never make.
    with one_rank_mesh("cpu", "dp_shard") as mesh:
        module = _module()
        apply_fsdp(module.model, _resolve_units(module.parallel_plan(), module.model), mesh, param_dtype=None,
                   reduce_dtype=None, reshard_after_forward="default")
        fsdp_modules = [m for m in module.model.modules() if isinstance(m, FSDPModule)]
        assert _gradient_sync_refusal(module.model, fsdp_modules) is None
        model = module.model
        turned_off = {"'layers.1'": lambda: model.layers["1"].set_requires_gradient_sync(False, recurse=False),
                      "'tok_embeddings'": lambda: model.tok_embeddings.set_requires_all_reduce(False)}
        for named, turn_off in turned_off.items():
            turn_off()
            with pytest.raises(RuntimeError, match=f"gradient sync is off on the model's FSDP2 module {named}.*"
                                                   "remove the call, or set cuda_graphs=False"):
                CaptureSchedule(warmup_steps=2).decide((), _gradient_sync_refusal(module.model, fsdp_modules))
            module.model.set_requires_gradient_sync(True)
        assert _gradient_sync_refusal(module.model, fsdp_modules) is None


@pytest.mark.gpu
@needs_cuda
def test_a_capture_that_raised_raises_again_when_caught() -> None:
    class ReadsBack(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            return out * (out.abs().max().item() >= 0)  # .item() waits on the GPU, which no capture allows

    model = ReadsBack(8, 8).cuda()
    apply_cuda_graphs(model, warmup_steps=1)
    x = torch.randn(2, 8, device="cuda")
    model(x).sum().backward()  # the warm-up, eager
    for _ in range(2):  # caught, each later call of those shapes tries to capture anew (no replay of nothing)
        with pytest.raises(RuntimeError, match="could not capture ReadsBack's training forward and backward"):
            model(x)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), torch.nn.functional.linear(x, model.weight, model.bias))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("devices", [1, pytest.param(2, marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="FSDP2 over NCCL needs 2 CUDA devices"))])
def test_lightning_trains_the_same_with_cuda_graphs(devices: int, tmp_path: Path, test_env: dict[str, str]) -> None:
    # Compiled blocks, bf16 weights with fp32 masters (FSDP2's bf16 parameters and fp32 reductions on 2 devices,
    # whose graphs then hold NCCL's all-gathers and reduce-scatters), accumulation windows of 2 batches, clipping,
    # validation within each epoch, and 22 samples a rank in batches of 4: every sixth batch is a short one, at the
    # end of each epoch, which replays padded (the Llama plan declares short_batch_padding). A hang fails the launch
    # at its timeout.
    spec = RunSpec(steps=8, batch_size=4, accelerator="cuda", data=DataSpec(samples=22 * devices),
                   trainer=TrainerSpec(accumulate=2, clip=1.0, validate=True, val_every=4, precision="bf16-mixed",
                                       timeout_seconds=120, strategy={"compile": True}))
    eager = launch(devices, spec, tmp_path / "eager", test_env, timeout_s=150)
    graphed = launch(devices, spec.with_(trainer={"strategy": {"compile": True, "cuda_graphs": True}}),
                     tmp_path / "graphed", test_env, timeout_s=150)
    for ours, theirs in zip(graphed, eager):
        assert ours["graph_replays"] == 16 - 2  # 16 batches (2 of them short, padded), 2 eager warm-ups
        assert ours["graphs_released"]  # before the process group went (captured collectives hold it)
        losses = series(ours, "train_loss", accumulate=2)
        assert losses == pytest.approx(series(theirs, "train_loss", accumulate=2), rel=1e-3), losses
        assert ours["val_losses"] == pytest.approx(theirs["val_losses"], rel=1e-3)


@pytest.mark.unit
def test_the_knob_is_refused_where_it_cannot_run() -> None:
    strategy = TitanStrategy(cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs=True replays CUDA graphs, but this run is on 'cpu'.*"
                                         "set cuda_graphs=False"):
        strategy.config.check_device(torch.device("cpu"))
    for dims, named in ((ParallelDims(dp_replicate=1, dp_shard=2, cp=2, tp=1, pp=1), "context_parallel_size"),
                        (ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1), "tensor_parallel_size"),
                        (ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2), "pipeline_parallel_size")):
        with pytest.raises(ValueError, match=f"'{named}': 2.*Set cuda_graphs=False, or parallelize with data "
                                             "parallelism only"):
            strategy.config.cuda_graphs.check_layout(dims)
    for dp_replicate, dp_shard in ((1, 1), (1, 8), (2, 4)):  # one device, FSDP2, HSDP
        strategy.config.cuda_graphs.check_layout(ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=1,
                                                          pp=1))

    with pytest.raises(ValueError, match="fault_tolerance='torchft' decides it on the host every step.*"
                                         "Set cuda_graphs=False"):
        TitanConfig.from_knobs(cuda_graphs=True, fault_tolerance="torchft", data_parallel_replicate_size=2)
    with pytest.raises(ValueError, match="activation_checkpointing='full' needs compile=True.*Set compile=True"):
        TitanConfig.from_knobs(cuda_graphs=True, activation_checkpointing="full")
    TitanConfig.from_knobs(cuda_graphs=True, activation_checkpointing="full", compile=True)

    class OwnModel(L.LightningModule):
        pass

    with pytest.raises(ValueError, match="OwnModel declares none .* set cuda_graphs=False"):
        strategy.config.check_module(OwnModel())


@pytest.mark.unit
def test_accumulation_windows_reduce_scatter_every_backward_under_graphs() -> None:
    # A replayed backward reduce-scatters as its capture did, so the strategy must not hold FSDP2's reduce-scatter
    # back within a window (an eager warm-up's held-back gradients would wait for an eager backward).
    # The runtime decides, from whether its model was graphed (apply_cuda_graphs wraps it where cuda_graphs=True).
    runtime = types.SimpleNamespace(plan=types.SimpleNamespace(model=torch.nn.Linear(1, 1)))
    for graphed, held_back in ((None, True), (mock.Mock(), False)):
        with (mock.patch("titan_strategy.runtime.graphed_call", return_value=graphed),
              mock.patch("titan_strategy.runtime.no_gradient_sync") as hold_back,
              ParallelRuntime.gradient_sync_held_back(runtime, L.LightningModule())):
            pass
        assert hold_back.called == held_back


@pytest.mark.unit
def test_ranks_capture_and_replay_together_when_their_shapes_differ() -> None:
    # Two ranks (threads of this process, each with its own gloo group) call the model with the shapes below: at
    # the 2nd and 5th call their shapes differ (a per-rank dynamic-padding collator). Deciding alone, rank 0 would
    # capture at its 3rd call and rank 1 at its 4th, and at the 5th rank 1 would replay collectives that rank 0
    # never joins. Agreed, both run every call of differing shapes eagerly, and the rest in the same order.
    full, other, short = (torch.zeros(4, SEQ_LEN, dtype=torch.long), torch.zeros(4, SEQ_LEN - 8, dtype=torch.long),
                          torch.zeros(2, SEQ_LEN, dtype=torch.long))
    calls = {0: [full, full, full, full, other, full, short], 1: [full, other, full, full, full, full, short]}
    expected = ["eager", "eager", "eager", "capture", "eager", "replay", "eager"]
    store, decisions, disagreements, settled, refusals = torch.distributed.HashStore(), {}, {}, {}, {}

    def rank(index: int) -> None:
        group = torch.distributed.ProcessGroupGloo(store, index, 2, timedelta(seconds=20))
        schedule, decisions[index] = CaptureSchedule(warmup_steps=2, group=group), []
        for tokens in calls[index]:
            decisions[index].append(schedule.decide(_signature((tokens,))))
            if decisions[index][-1] == "capture":
                # A capture that raised on one rank stops the others too (they would replay collectives it never
                # joins) and leaves nothing to replay: the next call of those shapes captures again, everywhere.
                assert not schedule.settle_capture(_signature((tokens,)), index == 0)
                assert schedule.decide(_signature((tokens,))) == "capture"
                settled[index] = schedule.settle_capture(_signature((tokens,)), True)
        disagreements[index] = schedule.disagreements
        # Gradient sync turned off on rank 1 alone: both ranks raise at that call, neither waits for the other.
        with pytest.raises(RuntimeError) as raised:
            schedule.decide(_signature((full,)), "sync is off here" if index == 1 else None)
        refusals[index] = str(raised.value)

    threads = [threading.Thread(target=rank, args=(index,)) for index in (0, 1)]
    shapes_differ = r"different input shapes \(rank 0: \(4, \d+\)\).* Give every rank batches of one shape"
    ran_eagerly = r"shapes \(2, 32\) \(the graphs are of \(4, 32\)\) ran eagerly"  # the 7th call, agreed on
    with pytest.warns(UserWarning, match=ran_eagerly), pytest.warns(UserWarning, match=shapes_differ):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    assert decisions == {0: expected, 1: expected}
    assert disagreements == {0: 2, 1: 2}
    assert settled == {0: True, 1: True}
    assert refusals == {0: "cuda_graphs=True: another rank cannot train on (its error says why), so this rank stops "
                           "too rather than wait in collectives that rank never joins.", 1: "sync is off here"}
    # Alone (no group), a rank decides from its own shapes: rank 1's sequence captures at its 4th call too, but
    # rank 0's at its 3rd, which is the divergence the agreement prevents.
    alone = CaptureSchedule(warmup_steps=2)
    assert [alone.decide(_signature((tokens,))) for tokens in calls[0]][:3] == ["eager", "eager", "capture"]
    # Once captured, a call of other shapes (a short last batch) runs eagerly and says once what that costs.
    assert alone.settle_capture(_signature((full,)), True)
    with pytest.warns(UserWarning, match=ran_eagerly + ".* 11 GiB more"):
        assert alone.decide(_signature((short,))) == "eager"
    assert [alone.decide(_signature((tokens,))) for tokens in (full, short)] == ["replay", "eager"]
    assert alone.uncaptured_calls == 2


@pytest.mark.unit
def test_the_agreed_signature_leaves_out_which_device_a_rank_has() -> None:
    # Rank r's inputs live on cuda:r: the same shapes and dtypes read alike on every rank, others do not.
    def on(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> int:
        return _digest(((shape, dtype, device),))

    rank0 = on((4, 8), torch.long, torch.device("cuda", 0))
    assert rank0 == on((4, 8), torch.long, torch.device("cuda", 1))
    assert rank0 != on((4, 7), torch.long, torch.device("cuda", 0))
    assert rank0 != on((4, 8), torch.int32, torch.device("cuda", 0))
    assert rank0 != on((4, 8), torch.long, torch.device("cpu"))
    assert _digest((("value", 3),)) != _digest((("value", 4),))


@pytest.mark.unit
def test_a_batch_of_fewer_samples_replays_padded_where_the_plan_allows() -> None:
    # The Llama plan's padding: tokens and document ids copy the first sample, labels are -100 (ignored).
    padding = _module().parallel_plan().short_batch_padding
    assert padding == (None, None, -100)
    schedule = CaptureSchedule(warmup_steps=0, padding=padding)

    def call(samples: int, length: int = SEQ_LEN, documents: bool = True) -> tuple[torch.Tensor | None, ...]:
        tokens = torch.arange(samples * length).view(samples, length)
        return tokens, tokens // 10 if documents else None, tokens + 1

    assert schedule.decide(_signature(call(4))) == "capture"
    assert schedule.settle_capture(_signature(call(4)), True)
    with mock.patch("titan_strategy.parallelize.cuda_graph.rank_zero_info") as said, \
            pytest.warns(UserWarning, match=r"\(6, 32\), \(6, 32\), \(6, 32\) \(the graphs .* all\.$"):
        decisions = [schedule.decide(_signature(args)) for args in (
            call(4), call(3), call(1), call(6), call(3, SEQ_LEN - 8), call(3, documents=False), call(2)[:2])]
    # Fewer samples replay padded; more samples, another length, a missing argument or one fewer run eagerly.
    assert decisions == ["replay", "pad", "pad", "eager", "eager", "eager", "eager"]
    assert said.call_count == 1 and "(3, 32), (3, 32), (3, 32) replays the graphs of (4, 32)" in said.call_args[0][0]
    assert schedule.padded_calls == 2 and schedule.uncaptured_calls == 4
    # Without the plan's padding, a short batch runs eagerly.
    alone = CaptureSchedule(warmup_steps=0)
    alone.settle_capture(_signature(call(4)), True)
    with pytest.warns(UserWarning, match=r"ran eagerly.*declare ParallelPlan\(short_batch_padding=...\)"):
        assert alone.decide(_signature(call(3))) == "eager"
    # What a padded replay reads: the short batch, then copies of its first sample, or the plan's value.
    static, short = torch.zeros(4, 3, dtype=torch.long), torch.tensor([[1, 2, 3], [4, 5, 6]])
    _fill(static, short, None)
    assert static.tolist() == [[1, 2, 3], [4, 5, 6], [1, 2, 3], [1, 2, 3]]
    _fill(static, short, -100)
    assert static.tolist() == [[1, 2, 3], [4, 5, 6], [-100] * 3, [-100] * 3]
    _fill(static, torch.ones(4, 3, dtype=torch.long), -100)
    assert static.tolist() == [[1] * 3] * 4


@pytest.mark.unit
@pytest.mark.parametrize("padding", [-100, [None, -100], (None, "-100"), (None, True)])
def test_a_malformed_short_batch_padding_is_refused_when_the_plan_is_made(padding: object) -> None:
    plan = _module().parallel_plan()
    with pytest.raises(ValueError, match=rf"short_batch_padding={re.escape(repr(padding))}\): give a tuple .* "
                                         r"e\.g\. \(None, None, -100\)"):
        replace(plan, short_batch_padding=padding)
