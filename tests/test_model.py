"""The Llama against an independent implementation (HF transformers), and its meta-device init."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from llama_module import Llama, LlamaConfig, RopeScaling
from llama_module.args import FLAVORS, get_flavor
from llama_module.hf import to_hf_state_dict
from llama_module.model import apply_rope, apply_rope_in_torch, rms_norm_in_torch
from titan_strategy.kernels.rms_norm import rms_norm, rms_norm_kernel_takes
from titan_strategy.kernels.rope import rope_kernel_takes

pytestmark = pytest.mark.unit

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=300, ffn_dim=96, max_seq_len=64,
                     rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                              original_max_seq_len=16))


def _hf_llama(config: LlamaConfig) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    scaling = config.rope_scaling
    rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor, "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_seq_len}
    hf_config = transformers.LlamaConfig(
        hidden_size=config.dim, intermediate_size=config.ffn_dim, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads, vocab_size=config.vocab_size,
        rms_norm_eps=config.norm_eps, max_position_embeddings=config.max_seq_len, tie_word_embeddings=False,
        rope_parameters=rope, rope_scaling=rope, rope_theta=config.rope_theta, attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(hf_config).eval()


def _copy_weights(ours: Llama, hf: torch.nn.Module) -> None:
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.config), strict=False)
    assert not unexpected and all("rotary" in key for key in missing), (missing, unexpected)


def _sharp_llama(config: LlamaConfig) -> Llama:
    """Weights that make every part matter: peaked attention (so RoPE shows) and non-unit norms."""
    torch.manual_seed(0)
    model = Llama(config)
    model.init_weights(seed=3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(("wq.weight", "wk.weight")):
                param.normal_(std=0.4)
    return model


def test_logits_match_hf_transformers_llama() -> None:
    ours = _sharp_llama(CONFIG)
    hf = _hf_llama(CONFIG)
    _copy_weights(ours, hf)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_rope_scaling_changes_the_output() -> None:
    # Guards the test above: without 3.1 scaling the two models must disagree.
    ours = _sharp_llama(dataclasses.replace(CONFIG, rope_scaling=None))
    hf = _hf_llama(CONFIG)
    _copy_weights(ours, hf)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, 48))
    with torch.no_grad():
        assert not torch.allclose(ours(tokens), hf(tokens).logits, atol=1e-3)


def test_meta_init_equals_direct_init_and_ignores_construction_order() -> None:
    direct = Llama(CONFIG)
    direct.init_weights(seed=7)
    with torch.device("meta"):
        meta = Llama(CONFIG)
    meta.to_empty(device="cpu")
    torch.manual_seed(12345)  # global RNG state must not matter
    meta.init_weights(seed=7)
    for (name, a), b in zip(direct.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(direct.rope.table, meta.rope.table)


def test_parameter_names_are_stable_and_rope_is_not_checkpointed() -> None:
    keys = list(Llama(CONFIG).state_dict())
    assert "layers.1.attention.wq.weight" in keys and "output.weight" in keys
    assert not any("rope" in key for key in keys)


@pytest.mark.parametrize(("name", "billions"), [("1B", 1.5), ("3B", 3.6), ("8B", 8.0), ("70B", 70.6), ("405B", 405.9)])
def test_flavor_sizes_match_llama3(name: str, billions: float) -> None:
    # 1B/3B are larger than Llama 3.2's published counts because their output layer is untied here.
    assert get_flavor(name).num_params() / 1e9 == pytest.approx(billions, rel=0.02)


def test_unknown_flavor_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="Unknown Llama flavor '7B'.*405B"):
        get_flavor("7B")


@pytest.mark.parametrize(("changes", "message"), [
    ({"n_heads": 5}, "dim=64 must be divisible by n_heads=5"),
    ({"n_kv_heads": 3}, "n_heads=4 must be divisible by n_kv_heads=3"),
    ({"n_layers": 0}, "n_layers=0 must be >= 1"),
])
def test_config_rejects_inconsistent_shapes(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(CONFIG, **changes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the RoPE kernel runs on CUDA")
@pytest.mark.parametrize("per_sequence", [False, True], ids=["shared-rows", "per-sequence-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda_the_rope_kernel_matches_the_torch_code(dtype: torch.dtype, per_sequence: bool) -> None:
    # 6 heads (the kernel pads them to 8) and 37 tokens (its last program is partly outside the batch).
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(3, 37, 6, 16, generator=generator).to("cuda", dtype).requires_grad_()
    rows = torch.randn((3, 37, 8, 2) if per_sequence else (37, 8, 2), generator=generator).cuda()
    grad = torch.randn(x.shape, generator=generator).to("cuda", dtype)
    assert rope_kernel_takes(x, rows)
    rotated = apply_rope(x, rows)
    rotated.backward(grad)
    kernel_grad, x.grad = x.grad, None
    torch.testing.assert_close(torch.compile(apply_rope)(x, rows), rotated, rtol=0, atol=0)
    expected = apply_rope_in_torch(x, rows)
    expected.backward(grad)
    # Equal up to fused multiply-adds: one rounding of the fp32 result, one ulp of the bf16 one.
    torch.testing.assert_close((rotated, kernel_grad), (expected, x.grad))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the RMSNorm kernel runs on CUDA")
@pytest.mark.parametrize(("dtype", "weight_dtype"),
                         [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-fp32-weight"])
def test_on_cuda_the_rms_norm_kernel_matches_the_torch_code(dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    # A width of 72 (the kernel pads its rows to 128) and 1,000 rows (backward's programs get uneven runs of them).
    generator = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(4, 250, 72, generator=generator)).to("cuda", dtype).requires_grad_()
    weight = torch.empty(72).uniform_(0.5, 1.5, generator=generator).to("cuda", weight_dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=generator).to("cuda", torch.promote_types(dtype, weight_dtype))
    assert rms_norm_kernel_takes(x, weight)
    normed = rms_norm(x, weight, 1e-5)
    normed.backward(grad)
    kernel_grads, x.grad, weight.grad = (x.grad, weight.grad), None, None
    torch.testing.assert_close(torch.compile(rms_norm)(x, weight, 1e-5), normed, rtol=0, atol=0)
    expected = rms_norm_in_torch(x, weight, 1e-5)
    expected.backward(grad)
    # Compared in x's dtype: a normalized value one ulp apart (another summation order) stays one ulp apart when
    # an fp32 weight scales it.
    torch.testing.assert_close((normed.to(dtype), kernel_grads[0]), (expected.to(dtype), x.grad))
    # The weight's gradient sums fp32 products where the torch code rounds each one to bf16 first: the reference
    # is those fp32 products, summed in float64.
    rounded = F.rms_norm(x.detach().double(), (72,), eps=1e-5).to(dtype).double()
    reference = (grad.double() * rounded).sum((0, 1))
    torch.testing.assert_close(kernel_grads[1].to(dtype), reference.to(dtype))


def test_sequence_longer_than_rope_table_is_refused() -> None:
    model = Llama(CONFIG)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_every_flavor_builds_on_meta_with_the_counts_its_config_gives() -> None:
    # The config's counts are the only ones (the planner and the MFU read them): they must be the built model's.
    for config in FLAVORS.values():
        with torch.device("meta"):
            model = Llama(config)
        assert _numel(model) == config.num_params()
        assert _numel(model) - _numel(model.tok_embeddings) == config.num_params(exclude_embedding=True)
        assert {_numel(block) for block in model.layers.values()} == {config.block_params}
