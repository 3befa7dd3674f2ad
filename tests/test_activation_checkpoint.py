"""Activation checkpointing modes: fewer saved activations, what each recomputes, the same gradients and names."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llama_module import Llama, LlamaConfig
from titan_strategy.parallelize.activation_checkpoint import apply_ac

pytestmark = pytest.mark.unit

CONFIG = LlamaConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=300, ffn_dim=96, max_seq_len=64)


def _saved_tensors_and_grads(model: Llama, tokens: torch.Tensor) -> tuple[int, dict[str, torch.Tensor]]:
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens).float().square().mean()
    loss.backward()
    return saved, {name: param.grad for name, param in model.named_parameters()}


def test_full_ac_saves_less_and_keeps_gradients_and_names() -> None:
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    plain, checkpointed = Llama(CONFIG), Llama(CONFIG)
    plain.init_weights(seed=1)
    checkpointed.init_weights(seed=1)
    apply_ac(checkpointed, {f"layers.{i}": i for i in range(CONFIG.n_layers)}, "full")
    plain_saved, plain_grads = _saved_tensors_and_grads(plain, tokens)
    ac_saved, ac_grads = _saved_tensors_and_grads(checkpointed, tokens)
    # Only the embedding, final norm and output save activations for backward outside the blocks.
    assert ac_saved < plain_saved / 4, (ac_saved, plain_saved)
    assert list(ac_grads) == list(plain_grads)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ac_grads[name], grad, rtol=0, atol=0, msg=name)


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops that run (forward, recomputation and backward alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _run(mode: str, every: int = 2) -> tuple[int, dict[str, torch.Tensor], Counter[str], Llama]:
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model = Llama(CONFIG)
    model.init_weights(seed=1)
    apply_ac(model, {f"layers.{i}": i for i in range(CONFIG.n_layers)}, mode, every)
    with _OpCounter() as ops:
        saved, grads = _saved_tensors_and_grads(model, tokens)
    return saved, grads, ops.counts, model


@pytest.mark.parametrize("mode", ["full", "selective_op", "selective_layer"])
def test_every_mode_keeps_gradients_and_names(mode: str) -> None:
    _, plain_grads, _, plain = _run("none")
    _, grads, _, checkpointed = _run(mode)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_selective_op_keeps_attention_and_every_other_matmul() -> None:
    # What selective AC keeps lives in its own cache, out of sight of saved-tensor hooks, so the ops that
    # run again in backward tell what it kept.
    _, _, none_ops, _ = _run("none")
    _, _, full_ops, _ = _run("full")
    _, _, op_ops, _ = _run("selective_op")
    attention = next(name for name in none_ops if "scaled_dot_product" in name and "backward" not in name)
    # Full AC runs attention again in backward; selective_op keeps its output and never reruns it.
    assert (none_ops[attention], full_ops[attention], op_ops[attention]) == (3, 6, 3)
    # 7 matmuls per block (q, k, v, o, w1, w3, w2). Full AC reruns the first 6 (recomputation stops once
    # backward has what it needs: w2's output is not), selective_op only the 2nd, 4th and 6th (k, o, w3).
    matmuls_recomputed = {mode: ops["mm"] - none_ops["mm"] for mode, ops in (("full", full_ops), ("op", op_ops))}
    assert matmuls_recomputed == {"full": 6 * CONFIG.n_layers, "op": 3 * CONFIG.n_layers}


@pytest.mark.parametrize(("every", "checkpointed_blocks"), [(1, 3), (2, 1), (3, 1), (4, 0)])
def test_selective_layer_checkpoints_every_kth_block(every: int, checkpointed_blocks: int) -> None:
    _, _, none_ops, _ = _run("none")
    _, _, ops, _ = _run("selective_layer", every)
    attention = next(name for name in none_ops if "scaled_dot_product" in name and "backward" not in name)
    assert ops[attention] - none_ops[attention] == checkpointed_blocks
