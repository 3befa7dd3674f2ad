"""Kernels that models may call where torch's own are slower; each is optional and says what it needs.

Public: a LightningModule builds its optimizer and attention with these under any strategy.
"""

from titan_strategy.kernels.adamw import ADAMW_KERNELS, AdamWKernel, TritonAdamW, build_adamw
from titan_strategy.kernels.flash_attention4 import check_flash_attention4, flash_attention4
from titan_strategy.kernels.linear_cross_entropy import linear_cross_entropy

__all__ = ["ADAMW_KERNELS", "AdamWKernel", "TritonAdamW", "build_adamw", "check_flash_attention4", "flash_attention4",
           "linear_cross_entropy"]
