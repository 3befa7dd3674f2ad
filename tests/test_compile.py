"""Regional compile: the inductor settings the blocks compile with (that they compile and run is covered wherever
a test trains with compile=True, e.g. test_documents' compiled blocks on CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llama_module import Llama, LlamaConfig
from titan_strategy.parallelize.compile import apply_compile

pytestmark = pytest.mark.unit

CONFIG = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, ffn_dim=64, max_seq_len=16)


def _options_of_compiled_blocks(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    seen = []
    compile_for_real = torch.compile

    def recording(function: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("options"))
        return compile_for_real(function, **kwargs)

    monkeypatch.setattr(torch, "compile", recording)
    apply_compile(Llama(CONFIG), ("layers.0", "layers.1"))
    return seen


def test_blocks_compile_without_mix_order_reduction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", raising=False)
    assert _options_of_compiled_blocks(monkeypatch) == [{"triton.mix_order_reduction": False}] * 2


@pytest.mark.parametrize("chosen", ["0", "1"])
def test_mix_order_reduction_set_in_the_environment_is_left_to_inductor(monkeypatch: pytest.MonkeyPatch,
                                                                       chosen: str) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_MIX_ORDER_REDUCTION", chosen)
    assert _options_of_compiled_blocks(monkeypatch) == [{}, {}]
