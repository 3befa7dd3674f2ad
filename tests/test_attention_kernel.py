"""LlamaModule(attention_kernel=...): FlashAttention-4 trains like SDPA on a Hopper GPU, and is refused clearly
where it cannot run."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import llama_module.module
from llama_module import LlamaModule
from llama_module.args import get_flavor
from llama_module.model import Llama
from tests.conftest import launch
from tests.support.parity import ReferenceRun, series
from tests.support.run_spec import DataSpec, ModelSpec, RunSpec, TrainerSpec
from titan_strategy.kernels.flash_attention4 import (
    flash_attention4,
    flash_attention4_installed,
)


@pytest.mark.unit
def test_an_unknown_kernel_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"attention_kernel='fa3' must be one of \['auto', 'sdpa', 'fa4', 'flex'\]"):
        LlamaModule(attention_kernel="fa3")
    with pytest.raises(ValueError, match=r"attention_kernel='fa4' takes attention_mask='causal' only .* Use "
                                         r"attention_kernel='flex' for block-causal attention"):
        LlamaModule(attention_kernel="fa4", attention_mask="block_causal")
    with pytest.raises(ValueError, match=r"attention_kernel='flex' runs the block-causal mask; .* Use "
                                         r"attention_mask='block_causal' or another kernel"):
        LlamaModule(attention_kernel="flex")
    with pytest.raises(ValueError, match=r"attention_mask='sliding' must be one of \['causal', 'block_causal'\]"):
        LlamaModule(attention_mask="sliding")
    with pytest.raises(ValueError, match=r"rope_positions='global' must be one of \['document', 'window'\]"):
        LlamaModule(rope_positions="global")


@pytest.mark.unit
def test_auto_builds_sdpa_on_cpu_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    for mask, why in (("causal", "the run is on cpu"),
                      ("block_causal", "a dense document mask, since FlexAttention does not train on cpu")):
        module = LlamaModule(attention_mask=mask)
        with caplog.at_level(logging.INFO):
            module.configure_model()
            module.configure_model()  # a second fit on the same module: the model exists, nothing is printed
        chosen = [record.getMessage() for record in caplog.records if "attention_kernel='auto'" in record.getMessage()]
        assert chosen == [f"attention_kernel='auto' chose 'sdpa': {why}."]
        assert {layer.attention.sdpa.kernel for layer in module.model.layers.values()} == {"sdpa"}
        assert module.hparams.attention_kernel == "auto"  # a checkpoint loaded elsewhere chooses again there
        caplog.clear()


@pytest.mark.unit
@pytest.mark.parametrize(("mask", "capability", "installed", "cp", "chosen", "why"), [
    ("causal", (9, 0), True, 1, "fa4", "FlashAttention-4 is installed and runs on this GPU"),
    ("causal", (10, 0), True, 1, "fa4", "FlashAttention-4 is installed and runs on this GPU"),
    ("causal", (8, 0), True, 1, "sdpa", "FAKE GPU has compute capability 8.0, FlashAttention-4 needs 9.0"),
    ("causal", (9, 0), False, 1, "sdpa", 'FlashAttention-4 is not installed (pip install -e ".[fa4]" adds it)'),
    ("causal", (9, 0), True, 2, "sdpa", "context_parallel_size=2: ring attention runs through torch's SDPA"),
    ("block_causal", (9, 0), True, 2, "flex", "FlexAttention's block-sparse document mask"),
])
def test_auto_on_a_gpu_takes_the_fastest_kernel_that_runs(monkeypatch: pytest.MonkeyPatch, mask: str,
                                                          capability: tuple[int, int], installed: bool, cp: int,
                                                          chosen: str, why: str) -> None:
    module = LlamaModule(attention_mask=mask)
    monkeypatch.setattr(LlamaModule, "_root_device", lambda self: torch.device("cuda", 0))
    monkeypatch.setattr(LlamaModule, "_context_parallel_size", lambda self: cp)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FAKE GPU")
    monkeypatch.setattr(llama_module.module, "flash_attention4_installed", lambda: installed)
    assert module._fastest_attention_kernel() == (chosen, why)


@pytest.mark.unit
def test_the_model_itself_takes_a_resolved_kernel() -> None:
    with pytest.raises(ValueError, match=r"attention_kernel='auto' is resolved by LlamaModule on its device; the "
                                         r"model takes one of \['sdpa', 'fa4', 'flex'\]"):
        Llama(get_flavor("debug"), "auto")


@pytest.mark.multiprocess
def test_fa4_is_refused_on_cpu_before_the_model_exists(tmp_path: Path, test_env: dict[str, str]) -> None:
    with pytest.raises(AssertionError, match=r"attention_kernel='fa4' needs an NVIDIA GPU of compute capability >= "
                                             r"9\.0 \(Hopper or Blackwell.*\), but the run is on cpu; use "
                                             r"attention_kernel='sdpa'"):
        launch(1, RunSpec(steps=1, batch_size=2, model=ModelSpec(attention_kernel="fa4")), tmp_path, test_env)


@pytest.mark.multiprocess
def test_fa4_is_refused_under_context_parallelism(tmp_path: Path, test_env: dict[str, str]) -> None:
    spec = RunSpec(steps=1, batch_size=2, model=ModelSpec(attention_kernel="fa4"),
                   trainer=TrainerSpec(strategy={"context_parallel_size": 2}))
    with pytest.raises(AssertionError, match=r"attention_kernel='fa4' with context_parallel_size=2: ring attention "
                                             r"runs through torch's SDPA"):
        launch(2, spec, tmp_path, test_env)


@pytest.mark.unit
def test_the_op_has_shapes_for_compile_without_running_the_kernel() -> None:
    # torch.compile traces the op on fake tensors: its output is the query's shape, its log-sum-exp (bs, heads, seq).
    query, key = torch.empty(2, 64, 8, 64, device="meta"), torch.empty(2, 64, 2, 64, device="meta")
    out, lse = flash_attention4(query, key, key)
    assert (out.shape, lse.shape, lse.dtype) == (query.shape, (2, 8, 64), torch.float32)


def _fa4_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) and flash_attention4_installed()


@pytest.mark.gpu
@pytest.mark.skipif(not _fa4_gpu(), reason="needs a Hopper or Blackwell GPU and the flash-attn-4 package")
def test_fa4_trains_like_sdpa_on_cuda(tmp_path: Path, test_env: dict[str, str], reference_run: ReferenceRun) -> None:
    # head_dim 64 (FA4 has no kernels for the tiny model's 8); compiled blocks, and under selective AC the op's
    # output is kept while the rest is recomputed.
    spec = RunSpec(steps=10, batch_size=8, accelerator="cuda", data=DataSpec(seq_len=64),
                   trainer=TrainerSpec(clip=1.0, precision="bf16-mixed", timeout_seconds=300),
                   model=ModelSpec(config={"dim": 256, "n_heads": 4, "n_kv_heads": 2}))
    sdpa = reference_run(spec.with_(trainer={"strategy": {"compile": True}}))
    fa4 = launch(1, spec.with_(model={"attention_kernel": "fa4"},
                               trainer={"strategy": {"compile": True, "activation_checkpointing": "selective_op"}}),
                 tmp_path / "fa4", test_env)[0]
    sdpa_loss, fa4_loss = series(sdpa, "train_loss"), series(fa4, "train_loss")
    assert fa4_loss != sdpa_loss  # FA4's kernels really ran
    assert fa4_loss[-1] < fa4_loss[0] - 0.3, fa4_loss
    for a, b in zip(fa4_loss, sdpa_loss):
        assert a == pytest.approx(b, rel=2e-2), (fa4_loss, sdpa_loss)
