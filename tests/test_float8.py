"""Float8 training: which layers convert (CPU, on the meta model), and that it trains on a float8 GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from llama_module import Llama, LlamaConfig
from tests.conftest import launch, one_rank_mesh
from tests.support.parity import ReferenceRun, series
from tests.support.run_spec import RunSpec, TrainerSpec
from titan_strategy.parallelize.cuda_graph import _address
from titan_strategy.parallelize.float8 import apply_float8, precompute_float8_scales


@pytest.mark.unit
def test_output_and_unaligned_layers_stay_bf16_and_names_stay() -> None:
    # ffn_dim 40 is not a multiple of 16, so the feed-forward projections cannot run in float8.
    config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=40, max_seq_len=64)
    with torch.device("meta"):
        model = Llama(config)
    names = [name for name, _ in model.named_parameters()]
    assert apply_float8(model, "tensorwise", skip=("output",), fsdp_all_gather=True) == 2 * 4  # q, k, v, o of both
    converted = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)
                 and hasattr(module, "config")}  # torchao's float8 linear keeps its Float8LinearConfig
    assert set(converted) == {f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    assert all(module.config.enable_fsdp_float8_all_gather for module in converted.values())
    assert [name for name, _ in model.named_parameters()] == names
    assert apply_float8(model, "none", skip=(), fsdp_all_gather=True) == 0


@pytest.mark.unit
def test_a_single_device_casts_tensorwise_weights_without_fsdp() -> None:
    config = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=64)
    with torch.device("meta"):
        model = Llama(config)
    assert apply_float8(model, "tensorwise", skip=("output",), fsdp_all_gather=False) == 7
    assert not model.layers["0"].feed_forward.w1.config.enable_fsdp_float8_all_gather


@pytest.mark.unit
def test_precomputed_scales_stay_where_they_are() -> None:
    # A CUDA graph that captured the float8 all-gather reads each weight's scale at the address it had then, so
    # a new scale must land in the tensor the weight already held (torchao hands out a new one each time).
    with one_rank_mesh("cpu", "dp_shard") as mesh:
        model = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
        apply_float8(model, "tensorwise", skip=(), fsdp_all_gather=True)
        fully_shard(model, mesh=mesh)
        shard = model[0].weight._local_tensor
        precompute_float8_scales(model)
        first = shard._precomputed_scale
        with torch.no_grad():
            model[0].weight.mul_(2.0)
        precompute_float8_scales(model)
        assert shard._precomputed_scale is first
        expected = torch.finfo(torch.float8_e4m3fn).max / model[0].weight.full_tensor().abs().max().double()
        torch.testing.assert_close(first, expected.float())
        # CUDA graphs check that a weight stayed where it was; torchao's float8 wrapper itself reads address 0.
        assert _address(model[0].weight) == shard._tensor.data_ptr() != 0


def _float8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_gpu(), reason="needs a GPU of compute capability >= 8.9")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_trains_like_bf16_on_cuda(recipe: str, tmp_path: Path, test_env: dict[str, str],
                                         reference_run: ReferenceRun) -> None:
    spec = RunSpec(steps=10, batch_size=8, accelerator="cuda",
                   trainer=TrainerSpec(clip=1.0, precision="bf16-mixed", timeout_seconds=300))
    bf16 = reference_run(spec.with_(trainer={"strategy": {"compile": True}}))
    float8 = launch(1, spec.with_(trainer={"strategy": {"compile": True, "float8": recipe}}), tmp_path / recipe,
                    test_env)[0]
    bf16_loss, float8_loss = series(bf16, "train_loss"), series(float8, "train_loss")
    assert float8_loss != bf16_loss  # float8 matmuls really ran
    assert float8_loss[-1] < float8_loss[0] - 0.3, float8_loss
    for a, b in zip(float8_loss, bf16_loss):
        assert a == pytest.approx(b, rel=5e-2), (float8_loss, bf16_loss)


@pytest.mark.multiprocess
@pytest.mark.parametrize(("recipe", "devices", "strategy"), [
    ("tensorwise", 2, {"tensor_parallel_size": 2}),
    ("rowwise", 2, {"tensor_parallel_size": 2}),
    # FSDP shards the float8 weights and all-gathers them in float8, with the scales precomputed after each step.
    ("tensorwise", 4, {"data_parallel_shard_size": 2, "tensor_parallel_size": 2}),
], ids=["tp2-tensorwise", "tp2-rowwise", "fsdp2xtp2-tensorwise"])
def test_float8_with_tensor_parallel_matches_one_process(recipe: str, devices: int, strategy: dict,
                                                          tmp_path: Path, test_env: dict[str, str],
                                                          reference_run: ReferenceRun) -> None:
    # On CPU, where torchao's float8 matmuls also run: TP and FSDP must not change what float8 computes. The
    # global batch is the same (8 sequences per data-parallel rank, 2 ranks under FSDP x TP).
    dp = devices // strategy["tensor_parallel_size"]
    spec = RunSpec(steps=4, batch_size=8 * dp, trainer=TrainerSpec(clip=1.0, float8_on_cpu=True, timeout_seconds=120))
    one = reference_run(spec.with_(trainer={"strategy": {"float8": recipe}}))
    # TritonAdamW updates the sharded runs (torch's ops on CPU, through the DTensor shards and, under FSDP,
    # torchao's float8 weight wrappers); the one-process run keeps torch's foreach AdamW.
    many = launch(devices, spec.with_(batch_size=8, model={"adamw": "triton"},
                                      trainer={"strategy": {**strategy, "float8": recipe}}),
                  tmp_path / "many", test_env)
    bf16 = reference_run(spec)
    one_loss = series(one, "train_loss")
    assert one_loss != series(bf16, "train_loss")  # float8 matmuls really ran
    for record in many:
        assert series(record, "train_loss") == pytest.approx(one_loss, rel=1e-4, abs=1e-5)
