"""Total gradient norm over parameters that may be DTensors on different meshes, and clipping by it."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _by_mesh(parameters: Iterable[nn.Parameter]) -> dict[object, list[nn.Parameter]]:
    params_by_mesh: dict[object, list[nn.Parameter]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            params_by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    return params_by_mesh


def _norm_of(params_by_mesh: dict[object, list[nn.Parameter]], norm_type: float, group: ProcessGroup | None) -> Tensor:
    # torch.nn.utils.clip_grad_norm_ fails when gradients live on different meshes. Each mesh's share
    # is reduced to a plain tensor (full_tensor sums the partial norms across the mesh) first.
    shares = []
    for mesh, params in params_by_mesh.items():
        grads = [p.grad for p in params]
        if mesh is None and any(g.dtype != torch.float32 for g in grads):
            # bf16 gradients (master weights): torch would round each one's norm to bf16.
            share = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, norm_type, dtype=torch.float32)),
                                             norm_type)
        else:
            share = torch.nn.utils.get_total_norm(grads, norm_type)
        shares.append(share.full_tensor() if isinstance(share, DTensor) else share)
    local = torch.nn.utils.get_total_norm(shares, norm_type) if shares else torch.zeros(())
    if group is None:
        return local
    # Pipeline stages hold disjoint parameters: combine the ranks' norms (p-th powers add up).
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local.double() ** norm_type
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).to(local.dtype)


@torch.no_grad()
def total_grad_norm(parameters: Iterable[nn.Parameter], norm_type: float = 2.0,
                    group: ProcessGroup | None = None) -> Tensor:
    """The norm of all gradients together, equal on every rank.

    Args:
        parameters: this rank's parameters.
        norm_type: the p of the p-norm (``inf`` for the max norm).
        group: ranks that hold *other* parameters of the model (the pipeline group), or None.
    """
    return _norm_of(_by_mesh(parameters), norm_type, group)


def clip_scale(total_norm: Tensor, max_norm: float) -> Tensor:
    """What to divide the gradients by to clip them to ``max_norm``, for an optimizer that divides them by its
    ``grad_scale`` as it reads them: torch clips by ``max_norm / (norm + 1e-6)`` where that is below 1, and
    this is its reciprocal, at least 1. Computed on the device: no wait on the GPU."""
    return torch.clamp((total_norm.float() + 1e-6) / float(max_norm), min=1.0)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    group: ProcessGroup | None = None) -> Tensor:
    """Clip gradients in place so that their global norm is at most ``max_norm``; return that norm.

    ``group`` is as in ``total_grad_norm``.
    """
    params_by_mesh = _by_mesh(parameters)
    total = _norm_of(params_by_mesh, norm_type, group)
    # Scaling is per mesh too: one foreach kernel cannot take DTensors of different meshes.
    for params in params_by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
