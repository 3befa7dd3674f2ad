"""TritonAdamW: the same updates and state as torch's AdamW. On CUDA the updates run in its Triton kernel; on
the CPU in torch's ops (the path for tensors the kernel does not take)."""

from __future__ import annotations

import copy

import pytest
import torch

from llama_module import LlamaModule
from tests.conftest import DEVICES
from titan_strategy.kernels import adamw
from titan_strategy.kernels.adamw import TritonAdamW

SHAPES = [(48, 16), (16,), (80, 16), (8, 16)]
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}


def _parameters(device: str) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator).to(device)) for shape in SHAPES]


def _give_gradients(step: int, *param_sets: list[torch.nn.Parameter]) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for index, shape in enumerate(SHAPES):
        grad = torch.randn(shape, generator=generator)
        for params in param_sets:
            # The second parameter gets no gradient at step 2: AdamW skips it, and its step count lags.
            params[index].grad = None if (index, step) == (1, 2) else grad.to(params[index].device, copy=True)


def _step_both(ours: TritonAdamW, reference: torch.optim.AdamW, schedulers: list, step: int) -> None:
    if step == 3:  # clipping by the fused kernels' grad_scale: the reference gets the gradients pre-divided
        ours.grad_scale = torch.tensor(4.0, device=ours.param_groups[0]["params"][0].device)
        for param in reference.param_groups[0]["params"]:
            if param.grad is not None:
                param.grad /= 4.0
    ours.step()
    reference.step()
    if step == 3:
        del ours.grad_scale
    for scheduler in schedulers:
        scheduler.step()


@pytest.mark.parametrize("device", DEVICES)
def test_updates_match_torch_adamw_as_the_lr_changes(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    launches, launch = [], adamw._launch
    monkeypatch.setattr(adamw, "_launch", lambda *args: launches.append(launch(*args)))
    ours_params, reference_params = _parameters(device), _parameters(device)
    ours, reference = TritonAdamW(ours_params, **HYPER), torch.optim.AdamW(reference_params, **HYPER)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / 6) for opt in (ours, reference)]
    for step in range(6):
        _give_gradients(step, ours_params, reference_params)
        _step_both(ours, reference, schedulers, step)
        for a, b in zip(ours_params, reference_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert ours.state[ours_params[1]]["step"].item() == 5.0  # no gradient at step 2
    # On CUDA every update ran in the Triton kernel (6 steps of 4 parameters, one skipped once); on CPU none did.
    assert len(launches) == (23 if device == "cuda" else 0)
    for a, b in zip(ours.state.values(), reference.state.values()):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7)


@pytest.mark.unit
def test_its_state_loads_into_torch_adamw_and_back() -> None:
    ours_params, reference_params = _parameters("cpu"), _parameters("cpu")
    ours = TritonAdamW(ours_params, **HYPER)
    for step in range(2):
        _give_gradients(step, ours_params)
        ours.step()
    torch_adamw = torch.optim.AdamW(reference_params, **HYPER)
    with torch.no_grad():
        for a, b in zip(reference_params, ours_params):
            a.copy_(b)
    # Copies, as a checkpoint's round trip would make them (load_state_dict may keep the very tensors).
    torch_adamw.load_state_dict(copy.deepcopy(ours.state_dict()))
    back = TritonAdamW(ours_params, **HYPER)
    back.load_state_dict(copy.deepcopy(torch_adamw.state_dict()))
    assert all(state["step"].device.type == "cpu" for state in back.state.values())
    for step in range(2, 4):
        _give_gradients(step, ours_params, reference_params)
        back.step()
        torch_adamw.step()
        for a, b in zip(ours_params, reference_params):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.unit
def test_float8_weights_are_updated_through_the_values_they_wrap() -> None:
    # Under FSDP, torchao wraps each float8 weight's fp32 values in a subclass that has no data of its own:
    # the update (the Triton kernel on CUDA) goes to the wrapped tensor, and the parameter sees it.
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    values = torch.randn(SHAPES[0], generator=torch.Generator().manual_seed(0))
    wrapped = torch.nn.Parameter(WeightWithDynamicFloat8CastTensor(values.clone(), LinearMMConfig(),
                                                                   torch.float8_e4m3fn))
    plain = torch.nn.Parameter(values.clone())
    assert adamw._values(wrapped).data_ptr() == wrapped._tensor.data_ptr()
    ours, reference = TritonAdamW([wrapped], **HYPER), torch.optim.AdamW([plain], **HYPER)
    for step in range(3):
        wrapped.grad, plain.grad = (torch.full(SHAPES[0], 0.1 * (step + 1)) for _ in range(2))
        ours.step()
        reference.step()
    assert not torch.equal(plain, values)
    torch.testing.assert_close(wrapped._tensor, plain.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.unit
def test_amsgrad_is_refused_with_the_fix() -> None:
    params = _parameters("cpu")
    optimizer = TritonAdamW(params, **HYPER)
    optimizer.param_groups[0]["amsgrad"] = True
    _give_gradients(0, params)
    with pytest.raises(ValueError, match="TritonAdamW implements neither amsgrad nor maximize: set both to False"):
        optimizer.step()


@pytest.mark.unit
def test_llama_module_refuses_an_unknown_adamw_kernel() -> None:
    with pytest.raises(ValueError, match=r"adamw='apex' must be one of \['auto', 'triton', 'fused', 'foreach'\]"):
        LlamaModule(adamw="apex")
