"""The one check of what GPU a feature needs, so every refusal reads alike and comes before any work; and whether
the Triton kernels (``titan_strategy.kernels``) can run here."""

from __future__ import annotations

import importlib.util

import torch

__all__ = ["TRITON_INSTALLED", "check_gpu_capability"]

# Looked up once at import: compiled code asks while it traces, where a lookup per call would not belong.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def check_gpu_capability(device: torch.device, minimum: tuple[int, int], setting: str, examples: str,
                         fix: str) -> None:
    """Raise ``ValueError`` if ``setting`` cannot run on ``device``: not an NVIDIA GPU, or one below ``minimum``.

    ``examples`` names GPUs that qualify; ``fix`` is what to set instead.
    """
    needed = f"{minimum[0]}.{minimum[1]}"
    if device.type != "cuda":
        raise ValueError(f"{setting} needs an NVIDIA GPU of compute capability >= {needed} ({examples}), but the run "
                         f"is on {device.type}; {fix}.")
    capability = torch.cuda.get_device_capability(device)
    if capability < minimum:
        raise ValueError(f"{setting} needs compute capability >= {needed}, but {torch.cuda.get_device_name(device)} "
                         f"has {capability[0]}.{capability[1]}; {fix}.")
