"""Modules nobody here wrote, under TitanStrategy as a new user brings them: a DDP-style ``nn.Module`` stack,
Lightning's BoringModel and tiny transformers causal LMs (built in ``__init__``, in ``configure_model``, loaded with
``from_pretrained``). Each trains as one process does on the same global batch, with the same weights on every
rank, or is refused before any step."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import launch
from tests.run_spec import RunSpec
from tests.user_modules import HF_SHAPE, weight_sums

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

GLOBAL_BATCH = 8
RUN = RunSpec(steps=4, batch_size=GLOBAL_BATCH, samples=64, seq_len=32)


def _run(tmp_path: Path, env: dict[str, str], nproc: int, name: str, spec: RunSpec = RUN,
         **user_module: Any) -> list[dict[str, Any]]:
    spec = replace(spec, batch_size=spec.batch_size // nproc, user_module=user_module)
    return launch(nproc, spec, tmp_path / name, env)


def _assert_same_run(records: list[dict[str, Any]], reference: dict[str, Any], rtol: float = 1e-5) -> None:
    """Every rank logged the reference's losses and ends with its weights (same sums on every rank)."""
    for record in records:
        assert record["weights"] == records[0]["weights"]
        torch.testing.assert_close(record["losses"], reference["losses"], rtol=rtol, atol=1e-6)
    assert reference["losses"][-1] < reference["losses"][0]
    for name, sums in reference["weights"].items():
        torch.testing.assert_close(records[0]["weights"][name], sums, rtol=rtol, atol=1e-5, msg=name)


@pytest.mark.parametrize(("kind", "build", "nproc"), [
    ("mlp", "init", 2),
    ("boring", "init", 2),
    ("llama", "init", 4),
    ("qwen2", "configure_model", 2),
])
def test_a_plain_module_trains_as_one_process(kind: str, build: str, nproc: int, tmp_path: Path,
                                              test_env: dict[str, str]) -> None:
    one = _run(tmp_path, test_env, 1, "one", kind=kind, build=build)[0]
    many = _run(tmp_path, test_env, nproc, "many", kind=kind, build=build)
    _assert_same_run(many, one)


def test_a_transformers_model_trains_under_titan_as_under_ddp(tmp_path: Path, test_env: dict[str, str]) -> None:
    ddp = _run(tmp_path, test_env, 2, "ddp", kind="llama", strategy="ddp")
    titan = _run(tmp_path, test_env, 2, "titan", kind="llama")
    _assert_same_run(titan, ddp[0])


def test_a_meta_built_transformers_model_is_initialized_as_transformers_does(tmp_path: Path,
                                                                             test_env: dict[str, str]) -> None:
    # configure_model builds on the meta device; the strategy initializes with transformers' own _init_weights,
    # the same weights on 1 and 2 processes. Eagerly built (torch's defaults, then _init_weights) gives other
    # numbers of the same distribution: the first loss agrees to 0.2%, where torch's defaults alone are 2.8% off.
    one = _run(tmp_path, test_env, 1, "one", replace(RUN, steps=1), kind="llama", build="configure_model")[0]
    two = _run(tmp_path, test_env, 2, "two", replace(RUN, steps=1), kind="llama", build="configure_model")
    assert two[0]["weights_at_start"] == one["weights_at_start"]
    torch.testing.assert_close(two[0]["losses"], one["losses"], rtol=1e-6, atol=0)
    eager = _run(tmp_path, test_env, 1, "eager", replace(RUN, steps=1), kind="llama", build="init")[0]
    assert one["losses"][0] == pytest.approx(eager["losses"][0], rel=2e-3)
    norms = [sums for name, sums in one["weights_at_start"].items() if "norm" in name]
    assert norms and all(total == pytest.approx(HF_SHAPE["hidden_size"]) for total, _ in norms)  # ones, as HF's


@pytest.fixture
def pretrained(tmp_path: Path) -> Path:
    """A tiny LlamaForCausalLM saved with non-unit norms, so any re-initialization shows."""
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SHAPE))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path / "pretrained")
    return tmp_path / "pretrained"


def test_weights_given_in_init_reach_training_unchanged(pretrained: Path, tmp_path: Path,
                                                        test_env: dict[str, str]) -> None:
    expected = weight_sums(transformers.LlamaForCausalLM.from_pretrained(pretrained))
    loaded = _run(tmp_path, test_env, 2, "pretrained", replace(RUN, steps=1), kind="llama",
                  pretrained=str(pretrained))
    for record in loaded:
        assert record["weights_at_start"].keys() == {f"model.{name}" for name in expected}
        for name, sums in expected.items():
            assert record["weights_at_start"][f"model.{name}"] == pytest.approx(sums, rel=1e-12), name
    filled = _run(tmp_path, test_env, 2, "init_module", replace(RUN, steps=1), kind="llama", build="init_module")
    for record in filled:  # init_module(empty_init=False), then every weight filled with 0.5
        for name, (total, squares) in record["weights_at_start"].items():
            assert squares == pytest.approx(total / 2, rel=1e-12), name
