"""Output projection and cross-entropy in one, a chunk of tokens at a time: the full-vocabulary logits never exist.

At the 1B shape (seq 8192, batch 2, vocabulary 128,256) the logits alone are 4.2 GB in bf16 and 8.4 GB in fp32, and
a plain loss keeps them for backward. Here each chunk of tokens makes its logits, its loss and, when a gradient will
be asked for, its gradients right away (the softmax minus the one-hot target, times the weight and the hidden
states); only the hidden states' gradient and the weight's outlive the chunk. Backward then only
scales what forward made. The matrix products are those of the plain loss, so it costs no extra FLOPs.

Vocabulary parallel: with the weight a DTensor split on its rows (the vocabulary) over a tensor-parallel mesh, each
rank makes the logits of its vocabulary slice and the ranks exchange one (log-sum-exp, target logit) pair per token
and chunk. The loss comes out whole on every rank; the hidden states' gradient is each rank's partial sum, which the
input's own redistribution reduces.

On CUDA, a chunk's loss and gradient (the whole vocabulary on one rank) are one Triton kernel, one program per token:
it reads the token's logits once for the log-sum-exp, once more (mostly from L2) to overwrite them with the gradient.
Inductor's kernels for the same torch code stream the chunk from memory once more, so the kernel takes about a quarter
less time per chunk, and writing the gradient over the logits lowers the peak (benchmarks/loss_chunk.py;
benchmarks/RESULTS.md: 'Loss chunk kernel'). Elsewhere, and for a vocabulary split over ranks, the torch code runs
(compiled on CUDA).

Why not liger-kernel's fused linear cross-entropy: it runs only on CUDA (Triton), so no CPU test could check the
loss it computes, and it knows nothing of a vocabulary split over ranks.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_strategy.gpu import TRITON_INSTALLED

__all__ = ["DEFAULT_CHUNK_TOKENS", "linear_cross_entropy"]

IGNORE_INDEX = -100  # F.cross_entropy's default, as titan_strategy.token_loss's
DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk: 0.25 GB of bf16 logits at a 128K vocabulary. At the 1B shape 1024, 2048 and 4096 train as fast
as the plain loss and as each other, and 1024 peaks lowest (benchmarks/RESULTS.md: 'Loss chunk size')."""


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor,
                         chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> Tensor:
    """``cross_entropy(hidden @ weight.T, labels, reduction="sum", ignore_index=-100)`` in fp32, without the logits.

    Args:
        hidden: (..., dim) the final hidden states; a DTensor (any placement) when ``weight`` is one.
        weight: (vocab, dim) the output projection; a plain tensor, or a DTensor split on dim 0 over a 1-D mesh.
        labels: (...) token ids, -100 where a token has no label.
        chunk_tokens: tokens per chunk.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1.")
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        group, vocab_start = _vocabulary_split(weight)
        if isinstance(hidden, DTensor):
            # Every rank needs every token's hidden state; the gradient each rank hands back covers only its
            # vocabulary slice, so it is a partial sum.
            hidden = hidden.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial()])
        weight = weight.to_local()
    elif isinstance(hidden, DTensor):
        raise ValueError("linear_cross_entropy: hidden is a DTensor but weight is not; shard the weight on the "
                         "vocabulary (ColwiseParallel) or pass plain tensors.")
    wants_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_tokens, group, vocab_start, wants_grad)


def _vocabulary_split(weight: DTensor) -> tuple[dist.ProcessGroup, int]:
    """The group a vocabulary-split weight spans, and the first vocabulary row this rank holds."""
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"linear_cross_entropy takes a weight split on the vocabulary over one mesh dim, not "
                         f"{tuple(weight.placements)} over a {mesh.ndim}-D mesh.")
    rows_per_rank = -(-weight.shape[0] // mesh.size())  # DTensor's Shard splits like torch.chunk
    return mesh.get_group(), mesh.get_local_rank() * rows_per_rank


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, chunk_tokens: int,
                group: dist.ProcessGroup | None, vocab_start: int, wants_grad: bool) -> Tensor:
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        flat_labels = labels.reshape(-1)
        if flat_labels.numel() != flat_hidden.shape[0]:
            raise ValueError(f"linear_cross_entropy: {flat_hidden.shape[0]} hidden states but {flat_labels.numel()} "
                             f"labels (hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}).")
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(flat_hidden) if wants_grad else None
        # The weight's gradient sums over chunks in the weight's dtype, as a plain loss's one product would round it
        # once: an fp32 sum would cost 4 more bytes per weight (1 GB at 1B) and a read and write of them per chunk.
        grad_weight = torch.zeros_like(weight) if wants_grad else None
        for start in range(0, flat_hidden.shape[0], chunk_tokens):
            chunk = flat_hidden[start:start + chunk_tokens]
            logits = chunk @ weight.T
            chunk_labels = flat_labels[start:start + chunk_tokens]
            if group is None:
                chunk_loss, grad_logits = _loss_and_grad_of_chunk(logits, chunk_labels, wants_grad)
            else:
                chunk_loss, grad_logits = _split_loss_and_grad(logits, chunk_labels, vocab_start, group, wants_grad)
            loss_sum += chunk_loss
            if grad_logits is not None:
                grad_hidden[start:start + chunk_tokens] = grad_logits @ weight
                if grad_logits.dtype == grad_weight.dtype:
                    grad_weight.addmm_(grad_logits.T, chunk)
                else:  # under autocast: the bf16 logits of an fp32 weight
                    grad_weight.add_(grad_logits.T @ chunk)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.hidden_shape = hidden.shape
        return loss_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        # Out of place: zero-bubble schedules run this backward twice, for the input's and the weight's gradient.
        grad_hidden = (grad_hidden * grad_loss.to(grad_hidden.dtype)).view(ctx.hidden_shape)
        grad_weight = grad_weight * grad_loss.to(grad_weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None, None, None


def _loss_and_grad_of_chunk(logits: Tensor, labels: Tensor, wants_grad: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk, the whole vocabulary on this rank: the loss sum, and d(loss sum)/d(logits), which on CUDA
    overwrites the logits (they are not needed after)."""
    if not (logits.is_cuda and TRITON_INSTALLED):
        return _loss_and_grad(logits, labels, wants_grad)
    rows, vocab = logits.shape  # a fresh product: contiguous
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _row_kernel()[(rows,)](logits, labels.contiguous(), losses, vocab, IGNORE_INDEX, WANTS_GRAD=wants_grad,
                           BLOCK=_ROW_BLOCK, num_warps=_ROW_WARPS)
    return losses.sum(), logits if wants_grad else None


# Columns per loop step and warps per token: blocks of 2048 to 8192 columns with 4 to 16 warps run within about 5% of
# each other (benchmarks/loss_chunk.py; benchmarks/RESULTS.md: 'Loss chunk kernel').
_ROW_BLOCK, _ROW_WARPS = 4096, 8


@functools.cache
def _row_kernel() -> Any:
    """The loss and gradient of each token's logits as one Triton kernel."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_cross_entropy(logits_ptr, labels_ptr, losses_ptr, vocab, ignore_index, WANTS_GRAD: tl.constexpr,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * vocab
        label = tl.load(labels_ptr + row).to(tl.int64)
        labelled = label != ignore_index
        # Online log-sum-exp: a running maximum and the sum of exponentials relative to it.
        running_max = -float("inf")
        running_sum = 0.0
        for start in range(0, vocab, BLOCK):
            columns = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + columns, mask=columns < vocab, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
        log_sum_exp = running_max + tl.log(running_sum)
        target_logit = tl.load(row_ptr + tl.where(labelled, label, 0)).to(tl.float32)
        tl.store(losses_ptr + row, tl.where(labelled, log_sum_exp - target_logit, 0.0))
        if WANTS_GRAD:
            # softmax - one-hot(label), zero on an unlabelled token, written over the logits just read.
            for start in range(0, vocab, BLOCK):
                columns = start + tl.arange(0, BLOCK)
                in_row = columns < vocab
                x = tl.load(row_ptr + columns, mask=in_row, other=0.0).to(tl.float32)
                grad = tl.exp(x - log_sum_exp) - tl.where(columns == label, 1.0, 0.0)
                grad = tl.where(labelled, grad, 0.0)
                tl.store(row_ptr + columns, grad.to(row_ptr.dtype.element_ty), mask=in_row)

    return row_cross_entropy


# Each chunk's elementwise work in torch: the whole vocabulary off CUDA (CPU runs are tests), and a vocabulary split
# over ranks anywhere; the split's is compiled on CUDA so that no fp32 copy of a chunk's logits is written: the upcast,
# exp and one-hot fuse into the kernel that writes the gradient in the logits' own dtype.

def _loss_and_grad(logits: Tensor, labels: Tensor, wants_grad: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk, the whole vocabulary on this rank: the loss sum, and d(loss sum)/d(logits)."""
    labelled = labels != IGNORE_INDEX
    target = torch.where(labelled, labels, 0)
    wide = logits.float()
    log_sum_exp = torch.logsumexp(wide, dim=-1)
    target_logit = wide.gather(-1, target[:, None]).squeeze(-1)
    loss = torch.where(labelled, log_sum_exp - target_logit, 0.0).sum()
    return loss, _grad_logits(logits, log_sum_exp, target, labelled) if wants_grad else None


def _grad_logits(logits: Tensor, log_sum_exp: Tensor, target: Tensor, labelled: Tensor) -> Tensor:
    """softmax - one-hot(target), zero on unlabelled tokens, in the logits' dtype; ``target`` is relative to this
    rank's vocabulary slice and may fall outside it."""
    columns = torch.arange(logits.shape[-1], device=logits.device)
    grad = torch.exp(logits.float() - log_sum_exp[:, None]) - (columns[None, :] == target[:, None]).float()
    return torch.where(labelled[:, None], grad, 0.0).to(logits.dtype)


def _local_statistics(logits: Tensor, target: Tensor) -> Tensor:
    """(2, tokens): this rank's log-sum-exp over its vocabulary slice, and the target's logit where it holds it."""
    wide = logits.float()
    held = (target >= 0) & (target < logits.shape[-1])
    target_logit = wide.gather(-1, torch.where(held, target, 0)[:, None]).squeeze(-1)
    return torch.stack([torch.logsumexp(wide, dim=-1), torch.where(held, target_logit, 0.0)])


def _split_loss_and_grad(logits: Tensor, labels: Tensor, vocab_start: int, group: dist.ProcessGroup,
                         wants_grad: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk over a vocabulary split: one all-gather of every rank's (log-sum-exp, target logit) per token."""
    target = labels - vocab_start
    local = _compiled(_local_statistics, logits)(logits, target)
    ranks = dist.get_world_size(group)
    gathered = torch.empty((ranks * local.shape[0], local.shape[1]), dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.view(ranks, *local.shape)
    log_sum_exp = torch.logsumexp(gathered[:, 0], dim=0)
    labelled = labels != IGNORE_INDEX
    loss = torch.where(labelled, log_sum_exp - gathered[:, 1].sum(0), 0.0).sum()
    if not wants_grad:
        return loss, None
    return loss, _compiled(_grad_logits, logits)(logits, log_sum_exp, target, labelled)


_COMPILED: dict[Any, Any] = {}


def _compiled(function: Any, like: Tensor) -> Any:
    """``function`` compiled where the chunk lives on CUDA (eager elsewhere: a CPU run is a test)."""
    if like.device.type != "cuda":
        return function
    if function not in _COMPILED:
        _COMPILED[function] = torch.compile(function)
    return _COMPILED[function]
