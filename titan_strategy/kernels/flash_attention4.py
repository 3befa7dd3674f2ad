"""FlashAttention-4 (the ``flash-attn-4`` package: CuTe DSL kernels for Hopper and Blackwell) as a torch op.

FA4's causal forward + backward is faster than cuDNN's, the fastest of torch's SDPA backends, at the
Llama-3.2-1B attention shape (head_dim 64) and at Llama-3-8B's (head_dim 128), with grouped kv heads
(benchmarks/RESULTS.md: 'FA4'). Wrapped as a custom op, it is one opaque node to
torch.compile (FA4's own autograd Function would break a compiled block's graph), and selective
activation checkpointing can name it to keep its output.

The op calls FA4's forward and backward entry points, which are not its public API: the ``fa4`` extra
pins the version they were written against.
"""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
from torch import Tensor

from titan_strategy.gpu import check_gpu_capability

__all__ = ["FA4_MIN_CAPABILITY", "check_flash_attention4", "flash_attention4", "flash_attention4_installed"]

_FA4_PACKAGE = "flash-attn-4==4.0.0b36"
FA4_MIN_CAPABILITY = (9, 0)  # FA4 has kernels for SM 9.0 (Hopper) and SM 10.x (Blackwell)


def flash_attention4_installed() -> bool:
    # flash-attn 2 is also imported as flash_attn, but has no cute subpackage.
    return importlib.util.find_spec("flash_attn") is not None and \
        importlib.util.find_spec("flash_attn.cute") is not None


def check_flash_attention4(device: torch.device) -> None:
    """Raise ``ValueError`` naming the fix if FA4 cannot run on ``device``; before any model work."""
    check_gpu_capability(device, FA4_MIN_CAPABILITY, "attention_kernel='fa4'", "Hopper or Blackwell: H100, H200, B200",
                         "use attention_kernel='sdpa'")
    if not flash_attention4_installed():
        raise ValueError(f"attention_kernel='fa4' needs the flash-attn-4 package: pip install '{_FA4_PACKAGE}' "
                         "(or this project's [fa4] extra); or use attention_kernel='sdpa'.")


@functools.cache
def _fa4() -> ModuleType:
    from flash_attn.cute import interface

    return interface


@torch.library.custom_op("titan::flash_attention4", mutates_args=())
def flash_attention4(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    """Causal attention of (bs, seqlen, heads, head_dim) tensors; key and value may have fewer heads (each
    then serves ``heads / kv heads`` consecutive query heads). Returns the output, shaped like ``query``,
    and the log-sum-exp of each query's scores (bs, heads, seqlen), in fp32, which backward needs."""
    query, key, value = (t.contiguous() for t in (query, key, value))
    out, lse = _fa4()._flash_attn_fwd(query, key, value, causal=True, return_lse=True)[:2]
    return out, lse


@flash_attention4.register_fake
def _(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    bs, seqlen, heads, _ = query.shape
    return torch.empty_like(query, memory_format=torch.contiguous_format), \
        query.new_empty((bs, heads, seqlen), dtype=torch.float32)


@torch.library.custom_op("titan::flash_attention4_backward", mutates_args=())
def _flash_attention4_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                               lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    query, key, value, grad_out = (t.contiguous() for t in (query, key, value, grad_out))
    grad_query, grad_key, grad_value = _fa4()._flash_attn_bwd(query, key, value, out, grad_out, lse,
                                                              causal=True)[:3]
    return grad_query, grad_key, grad_value


@_flash_attention4_backward.register_fake
def _(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
      lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (query, key, value))


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple[Tensor, ...],
                   output: tuple[Tensor, Tensor]) -> None:
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor, _grad_lse: Tensor | None) -> tuple:
    query, key, value, out, lse = ctx.saved_tensors
    return _flash_attention4_backward(grad_out, query, key, value, out, lse)


flash_attention4.register_autograd(_backward, setup_context=_setup_context)
