"""Total gradient norm over parameters that may be DTensors on different meshes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0) -> Tensor:
    """Clip gradients in place so that their global norm is at most ``max_norm``; return that norm.

    ``torch.nn.utils.clip_grad_norm_`` fails when gradients live on different meshes. Here each
    mesh's share is reduced to a plain tensor (``full_tensor`` sums the partial norms across the
    mesh) before the shares are combined, so every rank sees the norm of the whole model.
    """
    params_by_mesh: dict[object, list[nn.Parameter]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            params_by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    shares = []
    for params in params_by_mesh.values():
        share = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        shares.append(share.full_tensor() if isinstance(share, DTensor) else share)
    if not shares:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(shares, norm_type)
    # Scaling is per mesh too: one foreach kernel cannot take DTensors of different meshes.
    for params in params_by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
