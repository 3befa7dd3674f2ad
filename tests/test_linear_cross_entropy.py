"""The chunked output projection and cross-entropy against the plain loss in one process (the multi-process
layouts are checked by every parity test: the reference_run fixture's single process takes the plain loss)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llama_module import LlamaModule
from tests.support.train_worker import TINY
from titan_strategy.kernels import linear_cross_entropy

pytestmark = pytest.mark.unit


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 37, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (3, 37), generator=generator)
    labels[0, :5] = labels[2, 30:] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("chunk_tokens", [1, 10, 111, 4096], ids=["one-token", "short-last-chunk", "exact", "one"])
def test_loss_and_gradients_match_the_plain_loss(chunk_tokens: int) -> None:
    hidden, weight, labels = _inputs(torch.float32)
    plain = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    (0.3 * plain).backward()
    expected = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    chunked = linear_cross_entropy(hidden, weight, labels, chunk_tokens)
    (0.3 * chunked).backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    torch.testing.assert_close((hidden.grad, weight.grad), expected, rtol=1e-5, atol=1e-6)


def test_bf16_gradients_stay_within_bf16_rounding_of_the_plain_loss() -> None:
    hidden, weight, labels = _inputs(torch.bfloat16)
    plain = F.cross_entropy((hidden @ weight.T).flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                            reduction="sum")
    plain.backward()
    expected = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    chunked = linear_cross_entropy(hidden, weight, labels, 10)
    chunked.backward()
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, plain, rtol=1e-4, atol=0)
    for grad, reference in zip((hidden.grad, weight.grad), expected):
        assert grad.dtype == torch.bfloat16
        assert (grad.float() - reference.float()).abs().max() <= 2**-7 * reference.float().abs().max()


def test_without_gradients_it_makes_none() -> None:
    hidden, weight, labels = _inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, 10)
    assert not loss.requires_grad
    plain = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss, plain.detach(), rtol=1e-6, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the row kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda_the_row_kernel_matches_the_plain_loss(dtype: torch.dtype) -> None:
    # A vocabulary of 5003: the kernel's second block of 4096 columns is partly outside the row.
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 300, 64, generator=generator).to("cuda", dtype).requires_grad_()
    weight = (0.3 * torch.randn(5003, 64, generator=generator)).to("cuda", dtype).requires_grad_()
    labels = torch.randint(0, 5003, (2, 300), generator=generator).cuda()
    labels[0, :40] = labels[1, 290:] = -100
    labels[1, 0], labels[1, 1] = 0, 5002  # the first and last column
    plain = F.cross_entropy((hidden @ weight.T).flatten(0, 1).float(), labels.flatten(), reduction="sum")
    plain.backward()
    expected = hidden.grad, weight.grad
    hidden.grad = weight.grad = None
    with torch.no_grad():
        without_grad = linear_cross_entropy(hidden, weight, labels, 256)
    chunked = linear_cross_entropy(hidden, weight, labels, 256)
    chunked.backward()
    torch.testing.assert_close(without_grad, chunked)
    if dtype == torch.float32:
        torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=0)
        torch.testing.assert_close((hidden.grad, weight.grad), expected, rtol=1e-4, atol=1e-5)
        return
    torch.testing.assert_close(chunked, plain, rtol=1e-4, atol=0)
    for grad, reference in zip((hidden.grad, weight.grad), expected):
        assert (grad.float() - reference.float()).abs().max() <= 2**-7 * reference.float().abs().max()


def test_bad_arguments_name_the_value() -> None:
    hidden, weight, labels = _inputs(torch.float32)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        linear_cross_entropy(hidden, weight, labels, 0)
    with pytest.raises(ValueError, match="111 hidden states but 74 labels"):
        linear_cross_entropy(hidden, weight, labels[:2], 10)
    with pytest.raises(ValueError, match="cross_entropy='fused'"):
        LlamaModule(model=TINY, cross_entropy="fused")


class _SmoothedLoss(LlamaModule):
    def compute_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), label_smoothing=0.1, reduction="sum")
        return loss, (labels != -100).sum()


def test_a_module_with_its_own_loss_is_told_to_take_the_logits() -> None:
    with pytest.raises(ValueError, match="_SmoothedLoss overrides compute_loss, .* cross_entropy='logits'"):
        _SmoothedLoss(model=TINY)
    _SmoothedLoss(model=TINY, cross_entropy="logits")


def test_the_module_trains_on_the_same_loss_either_way() -> None:
    torch.manual_seed(0)
    chunked = LlamaModule(model=TINY, loss_chunk_tokens=7)
    chunked.configure_model()
    plain = LlamaModule(model=TINY, cross_entropy="logits")
    plain.configure_model()
    plain.model.load_state_dict(chunked.model.state_dict())
    tokens = torch.randint(0, TINY.vocab_size, (2, 32))
    labels = torch.randint(0, TINY.vocab_size, (2, 32))
    labels[1, 20:] = -100
    batch = {"input_ids": tokens, "labels": labels}
    losses = [module._mean_loss(batch) for module in (chunked, plain)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    # Prediction returns the logits under both.
    torch.testing.assert_close(chunked(tokens), plain(tokens))
