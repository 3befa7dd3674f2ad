"""Transformers causal LMs that a user's LightningModule holds, with no plan and no parallelism of its own, under
every degree TitanStrategy derives for them (``parallelize/hf_causal_lm.py``): each layout trains as one process
does on the same global batch, with the same weights at the end, and really shards."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import launch
from tests.support.run_spec import DataSpec, RunSpec
from tests.support.user_modules import assert_same_weights

transformers = pytest.importorskip("transformers")

GLOBAL_BATCH = 8
RUN = RunSpec(steps=4, batch_size=GLOBAL_BATCH, data=DataSpec(samples=64, seq_len=32))


def _run(tmp_path: Path, env: dict[str, str], nproc: int, name: str, knobs: dict[str, Any],
         spec: RunSpec = RUN, **user_module: Any) -> list[dict[str, Any]]:
    """``spec`` on ``nproc`` processes under TitanStrategy(**knobs), with the global batch split over the
    data-parallel ranks."""
    model_ranks = (knobs.get("tensor_parallel_size", 1) * knobs.get("pipeline_parallel_size", 1)
                   * knobs.get("context_parallel_size", 1))
    spec = spec.with_(batch_size=spec.batch_size // (nproc // model_ranks), trainer={"strategy": knobs},
                      model={"user_module": user_module})
    return launch(nproc, spec, tmp_path / name, env)


def _assert_same_run(records: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Every rank logged the reference's losses; every weight a rank holds ends as the reference's; the ranks
    together hold every weight."""
    for record in records:
        torch.testing.assert_close(record["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        assert_same_weights(record, reference)
    assert reference["losses"][-1] < reference["losses"][0]
    assert set().union(*(record["weights"] for record in records)) == set(reference["weights"])


OneProcess = Callable[[str], dict[str, Any]]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> OneProcess:
    """The one-process run of a kind built in ``configure_model``, run once for every layout it is compared to."""
    runs: dict[str, dict[str, Any]] = {}

    def run(kind: str) -> dict[str, Any]:
        if kind not in runs:
            runs[kind] = _run(tmp_path_factory.mktemp(kind), test_env, 1, "one", {}, kind=kind,
                              build="configure_model")[0]
        return runs[kind]

    return run


LAYOUTS = {
    "tp2": (2, {"tensor_parallel_size": 2}),
    "dp2_tp2": (4, {"tensor_parallel_size": 2}),
    "tp2_no_sp": (2, {"tensor_parallel_size": 2, "sequence_parallel": False, "loss_parallel": False}),
    "pp2_1f1b": (2, {"pipeline_parallel_size": 2, "pipeline_schedule": "1F1B"}),
    "pp2_interleaved": (2, {"pipeline_parallel_size": 2, "pipeline_schedule": "Interleaved1F1B"}),
    "cp2": (2, {"context_parallel_size": 2}),
    "pp2_dp2_tp2": (8, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("kind", "layout"), [
    ("qwen2", "dp2_tp2"), ("qwen3", "tp2"), ("qwen2_tied", "tp2_no_sp"),
    ("mistral", "pp2_1f1b"), ("qwen3", "pp2_interleaved"), ("llama", "cp2"), ("qwen2", "cp2"),
    ("llama", "pp2_dp2_tp2"), ("gemma2", "tp2"),
])
def test_a_transformers_model_trains_as_one_process_on_every_layout(kind: str, layout: str, tmp_path: Path,
                                                                     test_env: dict[str, str],
                                                                     one_process: OneProcess) -> None:
    nproc, strategy = LAYOUTS[layout]
    one = one_process(kind)
    many = _run(tmp_path, test_env, nproc, "many", strategy, kind=kind, build="configure_model")
    _assert_same_run(many, one)
    # Each rank holds about 1/model-degree of the weights (FSDP shards what TP and PP leave over every other rank),
    # plus the norms TP replicates; CP ranks see 1/cp of each sequence.
    total = sum(one["numels"].values())
    assert all(record["local_numel"] <= 0.56 * total * 2 / nproc for record in many)
    cp = strategy.get("context_parallel_size", 1)
    if "pipeline_parallel_size" not in strategy:
        assert all(record["seen_seq_len"] == RUN.data.seq_len // cp for record in many)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["dp2_tp2", "pp2_1f1b"])
def test_from_pretrained_in_init_trains_as_plain_pytorch(layout: str, pretrained: Path, tmp_path: Path,
                                                         test_env: dict[str, str]) -> None:
    # The user's own from_pretrained in __init__ (every rank loads the whole model; rank 0's weights are kept and
    # sharded) against the same module in a plain one-process loop: Lightning without a parallel strategy.
    nproc, knobs = LAYOUTS[layout]
    plain = _run(tmp_path, test_env, 1, "plain", {}, kind="llama", pretrained=str(pretrained), strategy="ddp")[0]
    many = _run(tmp_path, test_env, nproc, "many", knobs, kind="llama", pretrained=str(pretrained))
    _assert_same_run(many, plain)


@pytest.mark.multiprocess
def test_a_pretrained_directory_loads_each_ranks_shards_and_saves_back(pretrained: Path, tmp_path: Path,
                                                                        test_env: dict[str, str]) -> None:
    # llama_module.CausalLM(pretrained=...) under pp2 x tp2: each rank starts from the directory's weights (read
    # shard by shard after sharding), trains as one process, and the model saved back from the ranks' shards loads
    # in transformers with the one-process model's logits.
    from tests.support.user_modules import weight_sums

    runs = {name: _run(tmp_path, test_env, nproc, name, strategy, kind="causal_lm", pretrained=str(pretrained),
                       save_hf=str(tmp_path / f"{name}_hf"))
            for name, nproc, strategy in [("one", 1, {}),
                                          ("many", 4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2})]}
    expected = weight_sums(transformers.LlamaForCausalLM.from_pretrained(pretrained))
    for record in runs["many"]:
        for name, sums in record["weights_at_start"].items():
            assert sums == pytest.approx(expected[name.removeprefix("model.")], rel=1e-12), name
    _assert_same_run(runs["many"], runs["one"][0])
    tokens = torch.arange(32).view(2, 16)
    logits = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}_hf")(tokens).logits
              for name in runs]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.multiprocess
def test_a_transformers_model_resumes_mid_epoch_on_another_layout(tmp_path: Path, test_env: dict[str, str],
                                                                  one_process: OneProcess) -> None:
    # Saved after 2 of 4 steps on dp2, resumed on dp2 x tp2: the last 2 steps are one uninterrupted process's.
    build = {"kind": "qwen2", "build": "configure_model"}
    straight = one_process("qwen2")["losses"]
    saved = tmp_path / "step2"
    _run(tmp_path, test_env, 2, "first", {}, RUN.with_(checkpoints={"save_at": 2, "save_path": str(saved)}), **build)
    resumed = _run(tmp_path, test_env, 4, "resumed", {"tensor_parallel_size": 2},
                   RUN.with_(checkpoints={"resume_from": str(saved)}), **build)
    for record in resumed:
        torch.testing.assert_close(record["losses"], straight[2:], rtol=1e-5, atol=1e-6)


@pytest.mark.unit
@pytest.mark.parametrize(("kind", "dims", "error"), [
    ("phi3", {"tp": 2}, r"cannot derive tensor parallelism for Phi3ForCausalLM: it lacks a TP style TitanStrategy "
                        r"maps for \{'layers.\*.self_attn.qkv_proj': 'colwise_gather_output'"),
    ("gemma2", {"pp": 2}, r"cannot derive pipeline_parallel_size=2 for Gemma2ForCausalLM: .*model_type 'gemma2'"),
    ("gemma2", {"cp": 2}, r"cannot derive context_parallel_size=2 for Gemma2ForCausalLM"),
    ("qwen2_tied", {"pp": 2}, r"pipeline_parallel_size=2 .*\(tie_word_embeddings=True puts one weight on the first"),
])
def test_what_a_family_lacks_is_refused_with_the_fix(kind: str, dims: dict[str, int], error: str) -> None:
    import lightning as L

    from tests.support.user_modules import hf_model
    from titan_strategy.config.mesh import ParallelDims
    from titan_strategy.parallelize.hf_causal_lm import hf_causal_lm_plan

    sizes = {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1} | dims
    with pytest.raises(ValueError, match=error) as refused:
        hf_causal_lm_plan(L.LightningModule(), hf_model(kind), ParallelDims(**sizes), sequence_parallel=True)
    assert "parallel_plan()" in str(refused.value) or "tie_word_embeddings=False" in str(refused.value)
