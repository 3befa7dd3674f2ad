"""AdamW whose update of each parameter is one Triton kernel.

The update reads a parameter, its gradient and both moments and writes the parameter and moments back:
28 bytes per fp32 value, a pure memory-bandwidth job. torch's fused AdamW (``fused=True``) moves those
bytes at about 60% of the GPU's memory bandwidth; this kernel, launched once per parameter, moves them
about 1.4x faster (``benchmarks/optimizer_step.py``; benchmarks/RESULTS.md: 'TritonAdamW').

``TritonAdamW`` is a ``torch.optim.AdamW``: same hyper-parameters, same state (``step``, ``exp_avg``,
``exp_avg_sq``, with ``step`` on the CPU as in torch's default implementation), so its checkpoints load
into torch's AdamW and back. Like the fused one, it divides each gradient by ``optimizer.grad_scale``
where that is set, which is how TitanStrategy's precision plugin clips gradients without a pass of its
own. Parameters may be DTensors (FSDP2, TP): AdamW is elementwise, so each rank updates its local shard;
and inside torchao's float8 weights under FSDP, the fp32 values they wrap.
Tensors the kernel does not take (off CUDA, not fp32, not contiguous) are updated by torch's ops, with the
same arithmetic.

Master weights: where ``master_weights`` maps a bf16 parameter to an fp32 tensor (TitanStrategy's
``MasterWeights`` sets it, for bf16-mixed runs that FSDP does not shard), the update applies to that fp32
master, reading the parameter's bf16 gradient, and writes the parameter back as the master rounded to bf16,
in the same kernel. The moments are fp32, like the master. The model then computes with bf16 weights that
no cast has to produce, and its gradients stay bf16: the per-step casts of autocast are gone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_strategy.distributed import simulating_ranks
from titan_strategy.gpu import TRITON_INSTALLED
from titan_strategy.knobs import choices

__all__ = ["ADAMW_KERNELS", "AdamWKernel", "TritonAdamW", "build_adamw"]

AdamWKernel = Literal["auto", "triton", "fused", "foreach"]
ADAMW_KERNELS: tuple[str, ...] = choices(AdamWKernel)

_PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def _adamw_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad_scale: Tensor | None,
                  compute_copy: Tensor | None, lr: float, weight_decay: float, beta1: float, beta2: float, eps: float,
                  step_size: float, bias_correction2_sqrt: float) -> None:
    """One parameter's update: the Triton kernel where it takes the tensors, else torch's AdamW arithmetic in
    torch's order (which the kernel follows). ``compute_copy``, where given, receives the updated ``param``
    in its own (lower) precision; ``grad`` may then be in that precision too."""
    fp32 = (param, exp_avg, exp_avg_sq)
    copies = () if compute_copy is None else (compute_copy,)
    grad_dtypes = {torch.float32, *(c.dtype for c in copies)}
    # Parameters and plain tensors: other subclasses may not hold their values where their data pointer says.
    if all(type(t) in _PLAIN_TYPES and t.is_cuda and t.is_contiguous() for t in (*fp32, grad, *copies)) \
            and all(t.dtype == torch.float32 for t in fp32) and grad.dtype in grad_dtypes \
            and TRITON_INSTALLED:
        _launch(param, grad, exp_avg, exp_avg_sq, grad_scale, compute_copy, lr, weight_decay, beta1, beta2, eps,
                step_size, bias_correction2_sqrt)
        return
    grad = grad.to(param.dtype)
    if grad_scale is not None:
        grad = grad / grad_scale
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
    if compute_copy is not None:
        compute_copy.copy_(param)


_BLOCK, _NUM_WARPS = 1024, 4  # elements per program: 8 fp32 values of each tensor per thread


@functools.cache
def _triton_kernel() -> Any:
    """The update as one Triton kernel (each tensor read once; parameter and moments written once)."""
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_scale_ptr, copy_ptr, numel, lr,
                     weight_decay, beta1, beta2, eps, step_size, bias_correction2_sqrt, HAS_GRAD_SCALE: tl.constexpr,
                     HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        param = tl.load(param_ptr + offsets, mask=mask)
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask)
        if HAS_GRAD_SCALE:
            grad = grad / tl.load(grad_scale_ptr)
        param = param * (1 - lr * weight_decay)
        exp_avg = exp_avg + (1 - beta1) * (grad - exp_avg)
        exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - step_size * (exp_avg / denom)
        tl.store(param_ptr + offsets, param, mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=mask)
        if HAS_COPY:
            tl.store(copy_ptr + offsets, param.to(copy_ptr.dtype.element_ty), mask=mask)

    return adamw_kernel


def _launch(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad_scale: Tensor | None,
            compute_copy: Tensor | None, *hyper: float) -> None:
    numel = param.numel()
    _triton_kernel()[((numel + _BLOCK - 1) // _BLOCK,)](  # pointers of absent tensors are never read
        param, grad, exp_avg, exp_avg_sq, grad_scale if grad_scale is not None else param,
        compute_copy if compute_copy is not None else param, numel, *hyper,
        HAS_GRAD_SCALE=grad_scale is not None, HAS_COPY=compute_copy is not None, BLOCK=_BLOCK, num_warps=_NUM_WARPS)


def _values(tensor: Tensor) -> Tensor:
    """The plain tensor that holds this rank's values of ``tensor``, to update in place: a DTensor's local
    shard, and inside a wrapper subclass (torchao's float8 weights under FSDP wrap their fp32 values) the one
    tensor of the same shape and dtype it wraps."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    if type(tensor) is not Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        inner = getattr(tensor, names[0]) if len(names) == 1 else None
        if inner is not None and (inner.shape, inner.dtype) == (tensor.shape, tensor.dtype):
            return inner
    return tensor


class TritonAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (decoupled weight decay, no amsgrad) with one Triton kernel per parameter.

    Args:
        params: parameters or parameter groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``'s.

    Attributes:
        master_weights: parameter -> the fp32 tensor its updates apply to (empty: each parameter is its own).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self.master_weights: dict[Tensor, Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("TritonAdamW implements neither amsgrad nor maximize: set both to False, or use "
                                 "torch.optim.AdamW.")
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                master = self.master_weights.get(param)
                updated = param if master is None else master
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(updated, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(updated, memory_format=torch.preserve_format)
                state["step"] += 1
                values = _values(updated)
                if values.numel() == 0:  # a rank whose FSDP shard of this parameter is empty
                    continue
                step = state["step"].item()  # a CPU tensor: no wait on the GPU
                _adamw_update(values, _values(param.grad), _values(state["exp_avg"]), _values(state["exp_avg_sq"]),
                              grad_scale, None if master is None else param.data, group["lr"],
                              group["weight_decay"], beta1, beta2, group["eps"], group["lr"] / (1 - beta1 ** step),
                              (1 - beta2 ** step) ** 0.5)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torch casts the loaded moments to their parameter's dtype; a parameter with a master has them in the
        # master's, so it stands in for the parameter while they load.
        swapped = {param: param.data for param in self.master_weights}
        for param, master in self.master_weights.items():
            param.data = master
        try:
            super().load_state_dict(state_dict)
        finally:
            for param, compute_copy in swapped.items():
                param.data = compute_copy


def build_adamw(params: Iterable[Any], kernel: str, device: torch.device, **hyper: Any) -> torch.optim.AdamW:
    """AdamW with ``hyper`` (lr, betas, eps, weight_decay), updated by ``kernel``, one of ``ADAMW_KERNELS``:
    ``triton`` (``TritonAdamW``), torch's ``fused`` or ``foreach`` kernels, or ``auto``: triton on CUDA, foreach
    elsewhere."""
    if kernel == "auto":
        kernel = "triton" if device.type == "cuda" and not simulating_ranks() else "foreach"
    if kernel == "triton" and simulating_ranks():
        raise ValueError("adamw='triton' launches one Triton kernel per parameter, which cannot take simulated "
                         "ranks' tensors; use adamw='auto' or 'foreach' under SimulatedRanksStrategy.")
    if kernel == "triton":
        return TritonAdamW(params, **hyper)
    return torch.optim.AdamW(params, **hyper, fused=kernel == "fused" or None, foreach=kernel == "foreach" or None)
