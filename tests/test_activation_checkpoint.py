"""Full activation checkpointing: fewer saved activations, the same gradients, the same parameter names."""

from __future__ import annotations

import torch

from llama_module import Llama, LlamaConfig
from titan_strategy.parallelize.activation_checkpoint import apply_ac

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
    apply_ac(checkpointed, tuple(f"layers.{i}" for i in range(CONFIG.n_layers)), "full")
    plain_saved, plain_grads = _saved_tensors_and_grads(plain, tokens)
    ac_saved, ac_grads = _saved_tensors_and_grads(checkpointed, tokens)
    # Only the embedding, final norm and output save activations for backward outside the blocks.
    assert ac_saved < plain_saved / 4, (ac_saved, plain_saved)
    assert list(ac_grads) == list(plain_grads)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    for name, grad in plain_grads.items():
        torch.testing.assert_close(ac_grads[name], grad, rtol=0, atol=0, msg=name)
