"""Rotary position embedding of interleaved pairs as one Triton kernel each way (CUDA).

``llama_module.model.apply_rope`` rotates each pair (x[2i], x[2i+1]) of a head by its position's angle. The
kernels inductor makes of that torch code (the pair split and re-interleave, and the table rows gathered by
position, element by element) run far below memory speed: of the 1B step's pointwise work, RoPE was the furthest
from it.

This kernel reads each token's heads as one contiguous block, splits the pairs in registers, reads the token's
cos/sin row once for all its heads and writes the block back. Backward is the same kernel rotating the other way.
The 1B step and the 8B width x 16 layers with float8 each run about 1% faster with it (benchmarks/RESULTS.md:
'RoPE kernel'; benchmarks/layer_kernels.py times it alone).

A custom op, so that a compiled block keeps it as one opaque node; the model calls it where ``rope_kernel_takes``
says it applies (CUDA with Triton, plain tensors, a power-of-two head_dim, a table without gradient) and runs its
torch code elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from titan_strategy.gpu import TRITON_INSTALLED

__all__ = ["rope_kernel_takes", "rotate_pairs"]

_TOKENS_PER_PROGRAM = 4


def rope_kernel_takes(x: Tensor, rows: Tensor) -> bool:
    """Whether ``rotate_pairs`` runs ``x`` (bs, seqlen, heads, head_dim) with cos/sin ``rows``."""
    head_dim = x.shape[-1]
    return (x.is_cuda and type(x) is Tensor and type(rows) is Tensor and rows.dtype == torch.float32
            and not rows.requires_grad and head_dim >= 2 and head_dim & (head_dim - 1) == 0 and TRITON_INSTALLED)


@torch.library.custom_op("titan::rotate_pairs", mutates_args=())
def rotate_pairs(x: Tensor, rows: Tensor) -> Tensor:
    """``apply_rope(x, rows)``: x (bs, seqlen, heads, head_dim), rows (seqlen, head_dim/2, 2) shared by every
    sequence or (bs, seqlen, head_dim/2, 2), holding (cos, sin) of each position's angles. fp32 arithmetic, the
    result in x's dtype."""
    return _launch(x, rows, inverse=False)


@rotate_pairs.register_fake
def _(x: Tensor, rows: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("titan::rotate_pairs_backward", mutates_args=())
def _rotate_pairs_backward(grad: Tensor, rows: Tensor) -> Tensor:
    return _launch(grad, rows, inverse=True)


@_rotate_pairs_backward.register_fake
def _(grad: Tensor, rows: Tensor) -> Tensor:
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple[Tensor, Tensor], output: Tensor) -> None:
    ctx.save_for_backward(inputs[1])


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
    # A rotation's transpose is the rotation by the opposite angle; the table is a buffer and gets no gradient.
    (rows,) = ctx.saved_tensors
    return _rotate_pairs_backward(grad, rows), None


rotate_pairs.register_autograd(_backward, setup_context=_setup_context)


def _launch(x: Tensor, rows: Tensor, inverse: bool) -> Tensor:
    x, rows = x.contiguous(), rows.contiguous()
    bs, seqlen, heads, head_dim = x.shape
    if rows.shape[-3:] != (seqlen, head_dim // 2, 2) or rows.ndim not in (3, 4) or \
            (rows.ndim == 4 and rows.shape[0] not in (1, bs)):
        raise ValueError(f"rotate_pairs: rows {tuple(rows.shape)} do not fit x {tuple(x.shape)}; expected "
                         f"({seqlen}, {head_dim // 2}, 2) or ({bs}, {seqlen}, {head_dim // 2}, 2).")
    out = torch.empty_like(x)
    tokens = bs * seqlen
    if tokens == 0:
        return out
    # Token t of the flattened batch reads table row t (a row per token) or t mod seqlen (rows shared).
    table_tokens = rows.numel() // head_dim
    grid = (-(-tokens // _TOKENS_PER_PROGRAM),)
    import triton  # here, not at the top: CPU installs have no Triton, and only CUDA calls come here

    _rope_kernel()[grid](x, rows, out, tokens, table_tokens, heads, HEADS=triton.next_power_of_2(heads),
                         HALF=head_dim // 2, INVERSE=inverse, TOKENS=_TOKENS_PER_PROGRAM, num_warps=4)
    return out


@functools.cache
def _rope_kernel() -> Any:
    """The rotation of ``TOKENS`` tokens' heads per program."""
    import triton
    import triton.language as tl

    @triton.jit
    def rope_pairs(x_ptr, rows_ptr, out_ptr, tokens, table_tokens, heads, HEADS: tl.constexpr, HALF: tl.constexpr,
                   INVERSE: tl.constexpr, TOKENS: tl.constexpr):
        token = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
        head = tl.arange(0, HEADS)
        column = tl.arange(0, 2 * HALF)
        # (TOKENS, HEADS, head_dim): each token's heads are one contiguous run of memory.
        offsets = (token[:, None, None] * heads + head[None, :, None]) * (2 * HALF) + column[None, None, :]
        mask = (token[:, None, None] < tokens) & (head[None, :, None] < heads)
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        real, imag = tl.split(tl.reshape(x.to(tl.float32), (TOKENS, HEADS, HALF, 2)))
        # The token's (cos, sin) pairs, read once for all its heads.
        row_offsets = (token % table_tokens)[:, None] * (2 * HALF) + column[None, :]
        row = tl.load(rows_ptr + row_offsets, mask=token[:, None] < tokens, other=0.0)
        cos, sin = tl.split(tl.reshape(row, (TOKENS, HALF, 2)))
        cos, sin = cos[:, None, :], sin[:, None, :]
        if INVERSE:
            sin = -sin
        rotated = tl.join(real * cos - imag * sin, real * sin + imag * cos)
        tl.store(out_ptr + offsets, tl.reshape(rotated, (TOKENS, HEADS, 2 * HALF)).to(out_ptr.dtype.element_ty),
                 mask=mask)

    return rope_pairs
