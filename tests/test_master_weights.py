"""Master weights (titan_strategy.master_weights): bf16 parameters for compute, fp32 masters that TritonAdamW
updates. On CUDA the updates run in TritonAdamW's kernel; on the CPU in torch's ops."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.conftest import DEVICES, launch
from tests.support.parity import ReferenceRun, assert_resume_continues, series
from tests.support.run_spec import ModelSpec, RunSpec, TrainerSpec
from titan_strategy.kernels import adamw
from titan_strategy.kernels.adamw import TritonAdamW
from titan_strategy.master_weights import hold_master_weights

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
# How close one device with master weights stays to FSDP2's mixed precision (the same numerics, gradients summed
# in another order), and farther than which autocast's fp32 residual stream goes, over 10 steps of the tiny Llama.
FSDP2_RTOL = 3e-4


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Linear(48, 8), nn.LayerNorm(8)).to(device)


def _give_bf16_gradients(step: int, *models: nn.Module) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for params in zip(*(model.parameters() for model in models)):
        grad = torch.randn(params[0].shape, generator=generator).bfloat16()  # values both precisions hold
        for param in params:
            param.grad = grad.to(param.device, param.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_masters_follow_fp32_adamw_and_parameters_hold_them_rounded(device: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    launches, launch_kernel = [], adamw._launch
    monkeypatch.setattr(adamw, "_launch", lambda *args: launches.append(launch_kernel(*args)))
    ours, reference = _model(device), _model(device)
    optimizer, reference_optimizer = TritonAdamW(ours.parameters(), **HYPER), torch.optim.AdamW(reference.parameters(),
                                                                                                **HYPER)
    masters = hold_master_weights(ours, [optimizer], torch.bfloat16)
    assert masters is not None and {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    for step in range(4):
        _give_bf16_gradients(step, ours, reference)
        if step == 2:  # clipping by grad_scale: the reference gets its gradients pre-divided
            optimizer.grad_scale = torch.tensor(4.0, device=device)
            for param in reference.parameters():
                param.grad /= 4.0
        optimizer.step()
        reference_optimizer.step()
        optimizer.__dict__.pop("grad_scale", None)
    for param, expected in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(masters.masters[param], expected.detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(param, masters.masters[param].bfloat16())
    assert len(launches) == (4 * 6 if device == "cuda" else 0)  # 6 parameters, 4 steps, all in the kernel


@pytest.mark.unit
def test_checkpoints_hold_the_fp32_masters_and_load_back_into_them() -> None:
    trained = _model("cpu")
    optimizer = TritonAdamW(trained.parameters(), **HYPER)
    masters = hold_master_weights(trained, [optimizer], torch.bfloat16)
    assert masters is not None
    for step in range(3):
        _give_bf16_gradients(step, trained)
        optimizer.step()
    model_state, optimizer_state = trained.state_dict(), copy.deepcopy(optimizer.state_dict())
    assert {name: value.dtype for name, value in model_state.items()} == dict.fromkeys(model_state, torch.float32)
    for name, param in trained.named_parameters():
        assert model_state[name] is masters.masters[param]
    assert not torch.equal(model_state["0.weight"], model_state["0.weight"].bfloat16().float())  # not rounded

    fresh = _model("cpu")
    fresh_optimizer = TritonAdamW(fresh.parameters(), **HYPER)
    fresh_masters = hold_master_weights(fresh, [fresh_optimizer], torch.bfloat16)
    assert fresh_masters is not None
    fresh.load_state_dict(copy.deepcopy(model_state))
    fresh_optimizer.load_state_dict(copy.deepcopy(optimizer_state))
    for (name, param), loaded in zip(trained.named_parameters(), fresh.parameters()):
        assert torch.equal(fresh_masters.masters[loaded], model_state[name])
        assert torch.equal(loaded, param)  # the bf16 values
        for key in ("exp_avg", "exp_avg_sq"):  # torch would have cast them to the parameter's bf16
            assert fresh_optimizer.state[loaded][key].dtype == torch.float32
            assert torch.equal(fresh_optimizer.state[loaded][key], optimizer.state[param][key])

    fresh_masters.release()
    assert fresh_optimizer.master_weights == {}
    for name, param in fresh.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, model_state[name])
        assert fresh.state_dict()[name].data_ptr() == param.data_ptr()  # the hooks are gone


@pytest.mark.unit
def test_not_held_unless_triton_adamw_updates_every_fp32_parameter() -> None:
    model = _model("cpu")
    assert hold_master_weights(model, [torch.optim.AdamW(model.parameters())], torch.bfloat16) is None
    assert hold_master_weights(model, [TritonAdamW(list(model.parameters())[:-1])], torch.bfloat16) is None
    assert hold_master_weights(model, [TritonAdamW(model.parameters())], None) is None  # fp32 training
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _assert_within(actual: list[float], expected: list[float], rtol: float) -> None:
    assert len(actual) == len(expected) > 0
    for step, (a, e) in enumerate(zip(actual, expected), start=1):
        assert abs(a - e) <= rtol * abs(e), f"step {step}: {a} vs {e} (rel {abs(a - e) / abs(e):.2e})"


BF16_TRITON = RunSpec(steps=10, batch_size=8, trainer=TrainerSpec(clip=1.0, precision="bf16-mixed"),
                      model=ModelSpec(adamw="triton"))


@pytest.mark.multiprocess
def test_one_device_trains_like_fsdp2_mixed_precision(tmp_path: Path, test_env: dict[str, str],
                                                      reference_run: ReferenceRun) -> None:
    single = launch(1, BF16_TRITON, tmp_path / "single", test_env)[0]
    fsdp2 = launch(2, BF16_TRITON.with_(batch_size=4), tmp_path / "fsdp2", test_env)[0]
    autocast = reference_run(BF16_TRITON.with_(model={"adamw": "foreach"}))
    assert single["param_dtypes_in_training"] == ["torch.bfloat16"]
    assert single["param_dtypes_after_fit"] == autocast["param_dtypes_in_training"] == ["torch.float32"]
    for key in ("train_loss", "grad_norm"):
        _assert_within(series(single, key), series(fsdp2, key), FSDP2_RTOL)
    # Autocast keeps the residual stream in fp32, which FSDP2's mixed precision does not: not the same numerics.
    losses = zip(series(autocast, "train_loss"), series(fsdp2, "train_loss"))
    assert max(abs(a - e) / e for a, e in losses) > FSDP2_RTOL


@pytest.mark.multiprocess
def test_a_checkpoint_resumes_exactly_and_under_fsdp2(tmp_path: Path, test_env: dict[str, str]) -> None:
    # 24 samples of batch 8: step 3 ends an epoch, where Lightning resumes map-style data exactly.
    spec = BF16_TRITON.with_(steps=6, data={"samples": 24})
    checkpoint = tmp_path / "step3.ckpt"
    original = launch(1, spec.with_(checkpoints={"save_at": 3, "save_path": str(checkpoint)}), tmp_path / "saved",
                      test_env)
    resumed = launch(1, spec.with_(checkpoints={"resume_from": str(checkpoint)}), tmp_path / "resumed", test_env)
    assert_resume_continues(original, resumed, saved_at=3, steps=6)  # masters and fp32 moments came back
    # The checkpoint is a plain fp32 one: FSDP2 (no master weights) picks it up.
    sharded = launch(2, spec.with_(batch_size=4, checkpoints={"resume_from": str(checkpoint)}), tmp_path / "fsdp2",
                     test_env)
    after = [step for step in original[0]["steps"] if step["step"] > 3]
    _assert_within([s["train_loss"] for s in sharded[0]["steps"]], [s["train_loss"] for s in after], FSDP2_RTOL)


@pytest.fixture()
def process_group_left_behind() -> Iterator[None]:
    """An in-process fit initializes torch.distributed (one rank) and leaves it; later tests start their own."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.unit  # Lightning's single-device fit, in this process
@pytest.mark.usefixtures("process_group_left_behind")
@pytest.mark.parametrize(("module_args", "trainer_args", "held"), [
    ({"adamw": "triton"}, {}, True),
    ({"adamw": "foreach"}, {}, False),  # torch's AdamW keeps no masters: autocast
    ({"adamw": "triton"}, {"accumulate_grad_batches": 2}, False),  # gradients would add up in bf16
    ({"adamw": "triton"}, {"precision": "32-true"}, False),
], ids=["triton", "foreach", "accumulating", "fp32"])
def test_held_only_where_gradients_come_from_one_backward(module_args: dict, trainer_args: dict, held: bool,
                                                          tmp_path: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader

    from llama_module import LlamaModule
    from tests.support.train_worker import TINY, AffineSequences
    from titan_strategy import TitanStrategy

    seen: list[tuple[set[torch.dtype], bool]] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *_: Any) -> None:
            seen.append(({p.dtype for p in pl_module.parameters()}, trainer.precision_plugin.use_autocast))

    module = LlamaModule(model=TINY, warmup_steps=1, decay_steps=10, **module_args)
    trainer = L.Trainer(**{"accelerator": "cpu", "devices": 1, "strategy": TitanStrategy(), "precision": "bf16-mixed",
                           "max_steps": 2, "logger": False, "enable_checkpointing": False,
                           "enable_progress_bar": False, "enable_model_summary": False, "callbacks": [Record()],
                           "default_root_dir": str(tmp_path), **trainer_args})
    trainer.fit(module, DataLoader(AffineSequences(16, 32, TINY.vocab_size), batch_size=2))
    expected = ({torch.bfloat16}, False) if held else ({torch.float32}, True)  # (autocast is a no-op in fp32)
    assert seen and all(batch == expected for batch in seen)
    assert {p.dtype for p in module.parameters()} == {torch.float32}  # after fit, the masters again
