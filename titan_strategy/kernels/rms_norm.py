"""RMSNorm as one Triton kernel each way (CUDA).

``llama_module.model.RMSNorm`` normalizes each row in fp32, rounds it to the input's dtype and scales it by the
weight. Inductor's kernels for that code run at memory speed forward, but its backward is three kernels per layer
(the weight's gradient, a reduction over every token, among them), which take over three times what their bytes
need.

Forward here reads a row once and writes it once. Backward reads each row's input and gradient once, writes the
input's gradient, and keeps the weight's gradient in registers across the rows a program owns; a sum over the
programs' partial sums finishes it. The row's scale is recomputed from the input it reads anyway, so nothing but
the input is saved.

The 1B step runs 0.36% faster with it and peaks 0.2 GiB lower (benchmarks/RESULTS.md: 'RMSNorm kernel'); less than
the profile promised, since the residual adds inductor fused into its norm kernels now run on their own (folding
the add into this kernel gained nothing measurable, so it was not kept: 'Tried, not kept').

A custom op, so that a compiled block keeps it as one opaque node; the model calls it where
``rms_norm_kernel_takes`` says it applies (CUDA with Triton, plain tensors) and runs its torch code elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from titan_strategy.gpu import TRITON_INSTALLED

__all__ = ["rms_norm", "rms_norm_kernel_takes"]

# A row is held in registers whole; beyond this width a program would spill.
_MAX_DIM = 16384
# Programs per streaming multiprocessor in backward: enough rows in flight to keep memory busy, few enough partial
# weight gradients (each a row of fp32) that summing them costs little.
_BACKWARD_PROGRAMS_PER_SM = 8


def rms_norm_kernel_takes(x: Tensor, weight: Tensor) -> bool:
    """Whether ``rms_norm`` runs ``x`` (..., dim) with ``weight`` (dim,)."""
    return (x.is_cuda and type(x) is Tensor and not isinstance(weight, DTensor) and weight.is_cuda
            and weight.shape == x.shape[-1:] and 0 < x.shape[-1] <= _MAX_DIM and TRITON_INSTALLED)


@torch.library.custom_op("titan::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * rms_norm(x)`` with the normalized rows rounded to x's dtype first, as the model's torch code
    does; the result in the promoted dtype of x and weight."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    dim = x.shape[-1]
    rows = x.numel() // dim
    if rows:
        _kernels()[0][(rows,)](x, weight, out, dim, eps, **_row_launch(dim))
    return out


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


@torch.library.custom_op("titan::rms_norm_backward", mutates_args=())
def _rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    grad, x, weight = grad.contiguous(), x.contiguous(), weight.contiguous()
    x_grad = torch.empty_like(x)
    dim = x.shape[-1]
    rows = x.numel() // dim
    programs = max(1, min(rows, _backward_programs(x.device)))
    weight_grads = torch.empty(programs, dim, dtype=torch.float32, device=x.device)  # each program writes its row
    if rows:
        _kernels()[1][(programs,)](grad, x, weight, x_grad, weight_grads, rows, dim, -(-rows // programs), eps,
                                   **_row_launch(dim))
    return x_grad, weight_grads.sum(0).to(weight.dtype)


@_rms_norm_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx: Any, inputs: tuple[Tensor, Tensor, float], output: Tensor) -> None:
    x, weight, ctx.eps = inputs
    ctx.save_for_backward(x, weight)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, weight = ctx.saved_tensors
    x_grad, weight_grad = _rms_norm_backward(grad, x, weight, ctx.eps)
    return x_grad, weight_grad, None


rms_norm.register_autograd(_backward, setup_context=_setup_context)


def _row_launch(dim: int) -> dict[str, int]:
    """A whole row per program: its width padded to a power of two, and a warp per 512 values of it (1 to 16)."""
    import triton  # here, not at the top: CPU installs have no Triton, and only CUDA calls come here

    block = triton.next_power_of_2(dim)
    return {"BLOCK": block, "num_warps": min(max(block // 512, 1), 16)}


def _backward_programs(device: torch.device) -> int:
    return _BACKWARD_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The forward kernel (a row per program) and the backward one (a run of rows per program)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_forward(x_ptr, weight_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
        column = tl.arange(0, BLOCK)
        inside = column < dim
        offsets = tl.program_id(0).to(tl.int64) * dim + column
        x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + column, mask=inside, other=0.0).to(tl.float32)
        scale = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        normed = (x * scale).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offsets, (normed * weight).to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def rms_norm_backward(grad_ptr, x_ptr, weight_ptr, x_grad_ptr, weight_grads_ptr, rows, dim, rows_per_program,
                          eps, BLOCK: tl.constexpr):
        program = tl.program_id(0)
        column = tl.arange(0, BLOCK)
        inside = column < dim
        weight = tl.load(weight_ptr + column, mask=inside, other=0.0).to(tl.float32)
        weight_grad = tl.zeros((BLOCK,), dtype=tl.float32)
        first = program.to(tl.int64) * rows_per_program  # int64 offsets: rows x dim may pass 2**31
        for row in range(first, tl.minimum(first + rows_per_program, rows)):
            offsets = row * dim + column
            x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
            scale = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
            normed = x * scale
            weight_grad += grad * normed.to(x_ptr.dtype.element_ty).to(tl.float32)
            # The gradient of the rounded rows is itself rounded to x's dtype in the torch code.
            normed_grad = (grad * weight).to(x_ptr.dtype.element_ty).to(tl.float32)
            x_grad = scale * (normed_grad - normed * (tl.sum(normed_grad * normed, axis=0) / dim))
            tl.store(x_grad_ptr + offsets, x_grad.to(x_grad_ptr.dtype.element_ty), mask=inside)
        tl.store(weight_grads_ptr + program * dim + column, weight_grad, mask=inside)

    return rms_norm_forward, rms_norm_backward
