"""Modules nobody here wrote, under TitanStrategy as a new user brings them: a DDP-style ``nn.Module`` stack,
Lightning's BoringModel and tiny transformers causal LMs (built in ``__init__``, in ``configure_model``, loaded with
``from_pretrained``). Each trains as one process does on the same global batch, with the same weights on every
rank, or is refused before any step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import launch
from tests.support.run_spec import DataSpec, RunSpec
from tests.support.user_modules import HF_SHAPE, assert_same_weights, weight_sums

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

GLOBAL_BATCH = 8
RUN = RunSpec(steps=4, batch_size=GLOBAL_BATCH, data=DataSpec(samples=64, seq_len=32))


def _run(tmp_path: Path, env: dict[str, str], nproc: int, name: str, spec: RunSpec = RUN,
         **user_module: Any) -> list[dict[str, Any]]:
    """``spec`` on ``nproc`` processes, its ``batch_size`` the global batch (split over the data-parallel ranks)."""
    data_parallel = nproc // spec.trainer.strategy.get("tensor_parallel_size", 1)
    spec = spec.with_(batch_size=spec.batch_size // data_parallel, model={"user_module": user_module})
    return launch(nproc, spec, tmp_path / name, env)


def _assert_same_run(records: list[dict[str, Any]], reference: dict[str, Any], rtol: float = 1e-5) -> None:
    """Every rank logged the reference's losses and ends with its weights (same sums on every rank)."""
    for record in records:
        assert record["weights"] == records[0]["weights"]
        torch.testing.assert_close(record["losses"], reference["losses"], rtol=rtol, atol=1e-6)
    assert reference["losses"][-1] < reference["losses"][0]
    assert records[0]["weights"].keys() == reference["weights"].keys()
    assert_same_weights(records[0], reference, rtol)


@pytest.mark.parametrize(("kind", "build", "nproc", "strategy"), [
    ("mlp", "init", 2, {}),
    ("mlp", "manual", 2, {}),  # manual optimization: backward inside the step that FSDP's root runs as its forward
    ("boring", "init", 2, {}),
    ("llama", "init", 4, {}),
    ("qwen2_tied", "configure_model", 2, {}),  # its output projection stays its embedding after to_empty
    # HSDP over 2 x 2, and the decoder layers (found from _no_split_modules) checkpointed
    ("llama", "configure_model", 4, {"data_parallel_replicate_size": 2, "activation_checkpointing": "full"}),
])
def test_a_plain_module_trains_as_one_process(kind: str, build: str, nproc: int, strategy: dict[str, Any],
                                              tmp_path: Path, test_env: dict[str, str]) -> None:
    one = _run(tmp_path, test_env, 1, "one", kind=kind, build=build)[0]
    many = _run(tmp_path, test_env, nproc, "many", RUN.with_(trainer={"strategy": strategy}), kind=kind,
                build=build)
    _assert_same_run(many, one)
    if kind == "qwen2_tied":
        assert "model.lm_head.weight" not in one["weights"] and "model.lm_head.weight" not in many[0]["weights"]


def test_a_transformers_model_trains_under_titan_as_under_ddp(tmp_path: Path, test_env: dict[str, str]) -> None:
    ddp = _run(tmp_path, test_env, 2, "ddp", kind="llama", strategy="ddp")
    titan = _run(tmp_path, test_env, 2, "titan", kind="llama")
    _assert_same_run(titan, ddp[0])


def test_a_meta_built_transformers_model_is_initialized_as_transformers_does(tmp_path: Path,
                                                                             test_env: dict[str, str]) -> None:
    # configure_model builds on the meta device; the strategy initializes each module as an eager build does
    # (reset_parameters, then transformers' _init_weights), the same weights on 1 and 2 processes. An eager build
    # draws other numbers of the same distribution: every weight's sum of squares within 20% (torch's defaults alone
    # are about 25 times HF's 0.02 std squared), the first loss within 1% (torch's defaults alone: 2.8% off).
    one = _run(tmp_path, test_env, 1, "one", RUN.with_(steps=1), kind="llama", build="configure_model")[0]
    two = _run(tmp_path, test_env, 2, "two", RUN.with_(steps=1), kind="llama", build="configure_model")
    assert two[0]["weights_at_start"] == one["weights_at_start"]
    torch.testing.assert_close(two[0]["losses"], one["losses"], rtol=1e-6, atol=0)
    eager = _run(tmp_path, test_env, 1, "eager", RUN.with_(steps=1), kind="llama", build="init")[0]
    assert one["losses"][0] == pytest.approx(eager["losses"][0], rel=1e-2)
    for name, (_, squares) in eager["weights_at_start"].items():
        assert 0.8 < one["weights_at_start"][name][1] / squares < 1.25, name
    norms = [sums for name, sums in one["weights_at_start"].items() if "norm" in name]
    assert norms and all(total == pytest.approx(HF_SHAPE["hidden_size"]) for total, _ in norms)  # ones, as HF's


def test_padded_labels_leave_a_transformers_loss_layout_independent(tmp_path: Path, test_env: dict[str, str]) -> None:
    # transformers' own loss is a mean per batch: with -100 labels, 2 ranks' means averaged would not be one
    # process's token mean (as under DDP). TitanStrategy makes the model's loss the mean over every rank's labelled
    # tokens, so 2 ranks train as one process, and nothing warns about plain means.
    padded = RUN.with_(data={"padded_labels": True})
    one = _run(tmp_path, test_env, 1, "one", padded, kind="llama")[0]
    two = _run(tmp_path, test_env, 2, "two", padded, kind="llama")
    _assert_same_run(two, one)
    assert two[0]["warnings"] == []


def test_weights_given_in_init_reach_training_unchanged(pretrained: Path, tmp_path: Path,
                                                        test_env: dict[str, str]) -> None:
    expected = weight_sums(transformers.LlamaForCausalLM.from_pretrained(pretrained))
    loaded = _run(tmp_path, test_env, 2, "pretrained", RUN.with_(steps=1), kind="llama",
                  pretrained=str(pretrained))
    for record in loaded:
        assert record["weights_at_start"].keys() == {f"model.{name}" for name in expected}
        for name, sums in expected.items():
            assert record["weights_at_start"][f"model.{name}"] == pytest.approx(sums, rel=1e-12), name
    filled = _run(tmp_path, test_env, 2, "init_module", RUN.with_(steps=1), kind="llama", build="init_module")
    for record in filled:  # init_module(empty_init=False), then every weight filled with 0.5
        for name, (total, squares) in record["weights_at_start"].items():
            assert squares == pytest.approx(total / 2, rel=1e-12), name


def test_lightnings_contracts_hold(tmp_path: Path, test_env: dict[str, str]) -> None:
    # self.device_mesh is a torch DeviceMesh with the named views, and it deep-copies and pickles; SWA (which
    # deep-copies the module) trains on one device and averages; barebones and log_every_n_steps=0 train.
    short = RUN.with_(steps=16, data={"samples": 64})  # 2 epochs of 8 batches: SWA starts averaging in the second
    swa = _run(tmp_path, test_env, 1, "swa", short, kind="mlp", swa=True)[0]
    plain = _run(tmp_path, test_env, 1, "plain", short, kind="mlp")[0]
    assert swa["losses"][:8] == plain["losses"][:8]  # the same first epoch; then the averaged weights differ
    assert swa["weights"] != plain["weights"]
    # Sharded over 2 processes, the average is sharded alike: the same run, the averaged weights at its end too.
    _assert_same_run(_run(tmp_path, test_env, 2, "swa_sharded", short, kind="mlp", swa=True), swa)
    # A checkpoint mid-average carries it whole and resumes it sharded; the resumed steps of that epoch are the
    # same (Lightning's SWA rebuilds its LR schedule only where a strategy restores before setup, so later epochs
    # drift a little; the averaged weights come back as saved).
    saved = tmp_path / "swa.ckpt"
    saving = short.with_(steps=12, checkpoints={"save_at": 12, "save_path": str(saved)})
    _run(tmp_path, test_env, 2, "swa_saving", saving, kind="mlp", swa=True)
    resumed = _run(tmp_path, test_env, 2, "swa_resumed", short.with_(checkpoints={"resume_from": str(saved)}),
                   kind="mlp", swa=True)[0]
    torch.testing.assert_close(resumed["losses"], swa["losses"][12:], rtol=1e-5, atol=0)
    for options in ({"barebones": True}, {"log_every_n_steps": 0}):
        records = _run(tmp_path, test_env, 2, str(options), kind="llama", **options)
        assert all(record["global_step"] == RUN.steps for record in records)
        assert records[0]["losses"][-1] < records[0]["losses"][0]
    mesh = records[0]["mesh"]
    assert mesh["is_device_mesh"] and mesh["names"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert mesh["views"] == {"data_parallel": 2, "tensor_parallel": 1, "batch": 2, "loss": 2, "dp_shard_cp": 2}
    assert mesh["deep_copied"] == mesh["unpickled"] == 2


@pytest.mark.parametrize(("precision", "param_dtype"), [("bf16-true", "torch.bfloat16"),
                                                      ("bf16-mixed", "torch.float32")])
def test_a_plain_module_trains_in_bf16(precision: str, param_dtype: str, tmp_path: Path,
                                       test_env: dict[str, str]) -> None:
    # bf16-true: the parameters are bf16, FSDP reduces gradients in fp32. bf16-mixed: fp32 parameters, FSDP2's
    # bf16 policy on 2 processes, autocast on one. bf16 rounding apart, each is the one-process run.
    spec = RUN.with_(trainer={"precision": precision})
    one = _run(tmp_path, test_env, 1, "one", spec, kind="llama")[0]
    two = _run(tmp_path, test_env, 2, "two", spec, kind="llama")
    assert one["param_dtypes"] == two[0]["param_dtypes"] == [param_dtype]
    torch.testing.assert_close(two[0]["losses"], one["losses"], rtol=2e-2, atol=0)
    assert two[0]["losses"][-1] < two[0]["losses"][0]


@pytest.mark.parametrize(("options", "strategy", "error"), [
    ({"kind": "mlp"}, {"tensor_parallel_size": 2},
     r"TitanStrategy\(tensor_parallel_size=2\) cannot split MLP: it declares no parallel_plan\(\) and "
     r"parallelized nothing itself .* Set tensor_parallel_size=1"),
    ({"kind": "mlp", "build": "shard_one_block"}, {},
     r"RuntimeError: 8 trainable parameters \(embed.weight, embed.bias, blocks.1.0.weight, .*\) would train as "
     r"unsynchronized replicas on the 2 data-parallel ranks"),
    ({"kind": "qwen2", "build": "configure_model", "swa": True}, {},
     r"StochasticWeightAveraging copied the module in its setup hook, .* it holds 0 of the module's 51 parameters"),
])
def test_what_would_train_wrong_is_refused_before_the_first_step(options: dict[str, Any], strategy: dict[str, Any],
                                                                 error: str, tmp_path: Path,
                                                                 test_env: dict[str, str]) -> None:
    with pytest.raises(AssertionError, match=error):
        _run(tmp_path, test_env, 2, "refused", RUN.with_(trainer={"strategy": strategy}), **options)
    assert not list((tmp_path / "refused").glob("rank*.json"))


def test_checkpoints_travel_between_ddp_and_titan(tmp_path: Path, test_env: dict[str, str]) -> None:
    # DDP's .ckpt, saved mid-epoch -> TitanStrategy dp2 x tp2 resumes it (its data position from Lightning's loops)
    # -> a whole .ckpt at the epoch's end (save_distributed_checkpoint=False) -> a plain DDP Trainer resumes that:
    # the continued losses are those of one uninterrupted run (epochs of 4 steps of 8 of 32 samples).
    run = RUN.with_(steps=8, data={"samples": 32})
    ddp, titan = {"kind": "tiny_llama", "strategy": "ddp"}, {"kind": "tiny_llama"}
    straight = _run(tmp_path, test_env, 2, "straight", run, **ddp)[0]["losses"]
    first, second = tmp_path / "ddp.ckpt", tmp_path / "titan.ckpt"
    _run(tmp_path, test_env, 2, "ddp_first", run.with_(steps=2, checkpoints={"save_at": 2, "save_path": str(first)}),
         **ddp)
    assert first.is_file()
    middle = _run(tmp_path, test_env, 4, "titan_middle",
                  run.with_(steps=4, checkpoints={"resume_from": str(first), "save_at": 4, "save_path": str(second)},
                            trainer={"strategy": {"tensor_parallel_size": 2}}),
                  save_distributed_checkpoint=False, **titan)
    assert second.is_file()
    last = _run(tmp_path, test_env, 2, "ddp_last", run.with_(checkpoints={"resume_from": str(second)}), **ddp)
    torch.testing.assert_close(middle[0]["losses"] + last[0]["losses"], straight[2:], rtol=1e-5, atol=0)
    # validate(ckpt_path=) of a DDP file under dp2 x tp2 gives DDP's own validation loss
    by_ddp = _run(tmp_path, test_env, 2, "ddp_validate", run, validate_from=str(first), **ddp)
    tp2 = run.with_(trainer={"strategy": {"tensor_parallel_size": 2}})
    by_titan = _run(tmp_path, test_env, 4, "titan_validate", tp2, validate_from=str(first), **titan)
    assert by_titan[0]["validated"]["val_loss"] == pytest.approx(by_ddp[0]["validated"]["val_loss"], rel=1e-5)


def test_titan_convert_gives_a_file_a_plain_trainer_resumes(tmp_path: Path, test_env: dict[str, str]) -> None:
    from titan_strategy.checkpoint.convert import main as titan_convert

    run = RUN.with_(steps=8, data={"samples": 32})
    straight = _run(tmp_path, test_env, 2, "straight", run, kind="tiny_llama", strategy="ddp")[0]["losses"]
    folder, converted = tmp_path / "titan.ckpt", tmp_path / "converted.ckpt"
    _run(tmp_path, test_env, 2, "titan", run.with_(steps=4, checkpoints={"save_at": 4, "save_path": str(folder)}),
         kind="tiny_llama")
    assert folder.is_dir()
    assert titan_convert([str(folder), str(converted)]) == 0
    resumed = _run(tmp_path, test_env, 2, "resumed", run.with_(checkpoints={"resume_from": str(converted)}),
                   kind="tiny_llama", strategy="ddp")[0]["losses"]
    torch.testing.assert_close(resumed, straight[4:], rtol=1e-4, atol=0)
    with pytest.raises(SystemExit):  # refuses to overwrite
        titan_convert([str(folder), str(converted)])
