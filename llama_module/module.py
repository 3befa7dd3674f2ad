"""LlamaModule: a standard LightningModule that pre-trains a Llama 3 with next-token cross-entropy."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from llama_module.args import LlamaConfig, get_flavor
from llama_module.documents import AttentionMaskKind, RopePositions, check_document_ids, check_masking
from llama_module.model import AttentionKernel, Llama, check_attention_kernel
from llama_module.plan import llama_plan
from titan_strategy import (
    ParallelPlan,
    TokenLoss,
    check_choice,
    count_labelled,
    is_token_weighted,
    log_step_metric,
    simulating_ranks,
    token_cross_entropy,
    token_mean,
)
from titan_strategy.kernels import AdamWKernel, build_adamw, check_flash_attention4
from titan_strategy.kernels.flash_attention4 import FA4_MIN_CAPABILITY, flash_attention4_installed
from titan_strategy.kernels.linear_cross_entropy import DEFAULT_CHUNK_TOKENS

__all__ = ["LlamaModule", "warmup_cosine"]

Batch = dict[str, Tensor]
CrossEntropy = Literal["chunked", "logits"]


class LlamaModule(L.LightningModule):
    """Llama 3 pre-training.

    Args:
        model: a flavor name (``debug``, ``1B``, ``3B``, ``8B``, ``70B``, ``405B``), a ``LlamaConfig``, or
            its fields as a dict (how the saved hyper-parameters spell it).
        vocab_size: overrides the flavor's vocabulary (``titan fit`` links it to the tokenizer's).
        max_seq_len: overrides the flavor's RoPE table length.
        lr: peak learning rate of AdamW.
        betas: AdamW betas.
        weight_decay: AdamW weight decay.
        warmup_steps: linear warm-up from 0 to ``lr``.
        decay_steps: cosine decay after warm-up; None decays over the rest of the run (``max_steps``).
        min_lr_ratio: the decay ends at ``min_lr_ratio * lr``.
        adamw: which AdamW kernel updates the parameters: ``triton`` (one Triton kernel per parameter,
            ``titan_strategy.kernels.adamw``: about 1.4x faster than torch's fused kernel; benchmarks/RESULTS.md:
            'TritonAdamW'), ``fused``
            (torch's fused kernel), ``foreach`` (torch's multi-tensor ops), or ``auto``: triton on CUDA,
            foreach elsewhere. All run the same AdamW and checkpoint the same state.
        attention_kernel: ``auto`` (the fastest that runs here, printed once: ``fa4`` for the causal mask where
            FlashAttention-4 is installed and the GPU is a Hopper or Blackwell and there is no context parallelism,
            ``flex`` for the block-causal mask on CUDA, otherwise ``sdpa``),
            ``sdpa`` (torch's, any device, context parallel; under the block-causal mask it takes a
            dense mask, meant for CPU and tests), ``fa4`` (FlashAttention-4 on Hopper/Blackwell, causal only, a few
            percent faster steps at the 1B shape, benchmarks/RESULTS.md: 'FA4'; needs the ``flash-attn-4`` package,
            and no context
            parallelism) or ``flex`` (FlexAttention with a block-sparse mask, block-causal only; CUDA, since
            torch has no FlexAttention backward on CPU).
        attention_mask: ``causal`` (every token attends to all earlier tokens of its window) or ``block_causal``
            (only to earlier tokens of its own document; batches then carry ``document_ids``, see
            ``llama_module.documents``).
        rope_positions: under ``block_causal``: ``document`` (positions restart at each document) or ``window``.
        cross_entropy: how the training, validation and test loss is computed: ``chunked`` (the output projection
            and the cross-entropy together, a chunk of tokens at a time, so the full-vocabulary logits never exist:
            ``titan_strategy.kernels.linear_cross_entropy``; vocabulary-parallel under TP) or ``logits`` (the
            logits, then ``compute_loss`` on them, as a module written for another strategy would). Prediction
            always returns logits.
        loss_chunk_tokens: tokens per chunk of the ``chunked`` cross-entropy (1024: 0.25 GB of bf16 logits at a
            128K vocabulary).
    """

    def __init__(self, model: str | LlamaConfig | dict[str, Any] = "debug", vocab_size: int | None = None,
                 max_seq_len: int | None = None, lr: float = 8e-4, betas: tuple[float, float] = (0.9, 0.95),
                 weight_decay: float = 0.1, warmup_steps: int = 200, decay_steps: int | None = None,
                 min_lr_ratio: float = 0.1, adamw: AdamWKernel = "auto", attention_kernel: AttentionKernel = "auto",
                 attention_mask: AttentionMaskKind = "causal", rope_positions: RopePositions = "document",
                 cross_entropy: CrossEntropy = "chunked", loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        config = get_flavor(model) if isinstance(model, str) else LlamaConfig.from_dict(model) \
            if isinstance(model, dict) else model
        overrides = {k: v for k, v in {"vocab_size": vocab_size, "max_seq_len": max_seq_len}.items() if v is not None}
        self.config = dataclasses.replace(config, **overrides)
        check_masking(attention_mask, rope_positions)
        check_attention_kernel(attention_kernel, attention_mask)
        check_choice("cross_entropy", cross_entropy, CrossEntropy)
        if loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens} must be >= 1.")
        overridden = [name for name in ("compute_loss", "pipeline_loss")
                      if getattr(type(self), name) is not getattr(LlamaModule, name)]
        if cross_entropy == "chunked" and overridden:
            raise ValueError(f"{type(self).__name__} overrides {' and '.join(overridden)}, which "
                             "cross_entropy='chunked' never calls on logits (the output projection computes the loss "
                             "itself). Pass cross_entropy='logits' to train on your loss.")
        check_choice("adamw", adamw, AdamWKernel)
        if warmup_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 and min_lr_ratio={min_lr_ratio} in [0, 1].")
        self.save_hyperparameters()
        # Plain values only, so that checkpoints load with torch.load(weights_only=True): a LlamaConfig as its dict.
        self.hparams.update(model=model if isinstance(model, str) else dataclasses.asdict(config), betas=list(betas))
        self.adamw = adamw
        self.attention_kernel = attention_kernel
        self.attention_mask = attention_mask
        self.rope_positions = rope_positions
        self.cross_entropy = cross_entropy
        self.loss_chunk_tokens = loss_chunk_tokens
        self.model: Llama | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.attention_kernel == "auto":
            self.attention_kernel, reason = self._fastest_attention_kernel()
            rank_zero_info(f"attention_kernel='auto' chose {self.attention_kernel!r}: {reason}.")
        if self.attention_kernel == "fa4":
            self._check_fa4()
        if self.attention_kernel == "flex" and self._root_device().type == "cpu":
            raise ValueError("attention_kernel='flex' trains on CUDA only: torch has no FlexAttention backward on "
                             "CPU. Use attention_kernel='sdpa' (a dense block-causal mask) on CPU.")
        self.model = Llama(self.config, self.attention_kernel, self.attention_mask, self.rope_positions,
                           self.loss_chunk_tokens)
        if not any(p.is_meta for p in self.model.parameters()):
            self.model.init_weights()  # a strategy that builds on the meta device initializes later

    def _fastest_attention_kernel(self) -> tuple[str, str]:
        """``attention_kernel='auto'``: the kernel, and why."""
        device = self._root_device()
        if self.attention_mask == "block_causal":
            if device.type != "cuda" or simulating_ranks():
                where = "simulated ranks" if device.type == "cuda" else device.type
                return "sdpa", f"a dense document mask, since FlexAttention does not train on {where}"
            return "flex", "FlexAttention's block-sparse document mask"
        if device.type != "cuda":
            return "sdpa", f"the run is on {device.type}"
        capability = torch.cuda.get_device_capability(device)
        if capability < FA4_MIN_CAPABILITY:
            return "sdpa", (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}."
                            f"{capability[1]}, FlashAttention-4 needs {FA4_MIN_CAPABILITY[0]}.{FA4_MIN_CAPABILITY[1]}")
        if not flash_attention4_installed():
            return "sdpa", "FlashAttention-4 is not installed (pip install -e \".[fa4]\" adds it)"
        if (cp := self._context_parallel_size()) > 1:
            return "sdpa", f"context_parallel_size={cp}: ring attention runs through torch's SDPA"
        return "fa4", "FlashAttention-4 is installed and runs on this GPU"

    def _context_parallel_size(self) -> int:
        mesh = self.device_mesh
        return mesh["cp"].size() if mesh is not None and "cp" in (mesh.mesh_dim_names or ()) else 1

    def _check_fa4(self) -> None:
        """Before the model exists: FA4 needs its GPU and package, and context parallelism's ring attention
        can only take over torch's SDPA."""
        if (cp := self._context_parallel_size()) > 1:
            raise ValueError(f"attention_kernel='fa4' with context_parallel_size={cp}: ring attention "
                             "runs through torch's SDPA. Use attention_kernel='sdpa', or context_parallel_size=1.")
        check_flash_attention4(self._root_device())

    def _root_device(self) -> torch.device:
        # Lightning moves the module to its device only after configure_model: ask the strategy.
        return self.trainer.strategy.root_device if self._trainer is not None else self.device

    def parallel_plan(self) -> ParallelPlan:
        """Lets TitanStrategy parallelize the Llama (see ``llama_module.plan``)."""
        assert self.model is not None
        return llama_plan(self.model, log_loss=self.log_loss, labels_to_last_stage=self.cross_entropy == "chunked")

    def forward(self, input_ids: Tensor, document_ids: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        """The logits; given ``labels``, the cross-entropy summed over the labelled tokens (chunked, see ``Llama``)."""
        assert self.model is not None, "configure_model() builds the model"
        return self.model(input_ids, document_ids, labels)

    def check_batch(self, batch: Any, *args: Any) -> None:
        """Under the block-causal mask a batch must say where its documents start: checked by every loop's
        batch-start hook, before the step, on the whole batch (context parallelism cuts it later). Not in
        ``on_after_batch_transfer``, which a user's DataModule may override and so switch off."""
        if self.attention_mask == "block_causal":
            if not isinstance(batch, dict):
                raise ValueError(f"attention_mask='block_causal' takes dict batches with 'input_ids' and "
                                 f"'document_ids', not {type(batch).__name__}.")
            check_document_ids(batch.get("document_ids"), batch["input_ids"])

    on_train_batch_start = on_validation_batch_start = on_test_batch_start = on_predict_batch_start = check_batch

    def compute_loss(self, logits: Tensor, labels: Tensor) -> TokenLoss:
        """Next-token cross-entropy summed over the labelled tokens, and their count (labels of -100 are ignored)."""
        return token_cross_entropy(logits, labels)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> TokenLoss:
        """TitanStrategy's hook under pipeline parallelism: the loss of one microbatch, from the last stage's output
        (with ``cross_entropy="chunked"`` that output already is the loss sum)."""
        if self.cross_entropy == "chunked":
            return output, count_labelled(target)
        return self.compute_loss(output, target)

    def token_loss(self, batch: Batch) -> TokenLoss:
        """The batch's cross-entropy summed over its labelled tokens, and their count, as ``cross_entropy`` says."""
        labels = batch["labels"]
        if self.cross_entropy == "logits":
            return self.compute_loss(self(batch["input_ids"], batch.get("document_ids")), labels)
        return self(batch["input_ids"], batch.get("document_ids"), labels), count_labelled(labels)

    def _mean_loss(self, batch: Batch) -> Tensor:
        # The mean over every labelled token of the global batch (and, in training, of the accumulation window).
        return token_mean(self, *self.token_loss(batch))

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs of training on one token, what the ``Throughput`` callback's MFU counts (see ``LlamaConfig``)."""
        return self.config.flops_per_token(seq_len)

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self._mean_loss(batch)
        self.log_loss("train", loss)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.log_loss("val", self._mean_loss(batch))

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        self.log_loss("test", self._mean_loss(batch))

    def log_loss(self, stage: str, loss: Tensor) -> None:
        """Log a step's loss as ``{stage}_loss``: in training every step (progress bar ``loss``), else per epoch.

        The steps above call it, and so does TitanStrategy under pipeline parallelism, where the schedule runs
        in place of these steps (``parallel_plan`` hands it over).
        """
        if stage == "train":  # under TitanStrategy the loss already is every rank's mean: no all-reduce per step
            log_step_metric(self, "train_loss", loss, bar_name="loss", sync_dist=not is_token_weighted(self))
        else:  # per epoch, one all-reduce of equal values is cheap (and keeps Lightning from warning about it)
            self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)

    def predict_step(self, batch: Batch, batch_idx: int) -> Tensor:
        """Next-token logits (bs, seqlen, vocab_size) of ``batch["input_ids"]``."""
        return self(batch["input_ids"], batch.get("document_ids"))

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = build_adamw(self.parameters(), self.adamw, self.device, lr=hp.lr, betas=tuple(hp.betas), eps=1e-8,
                                weight_decay=hp.weight_decay)
        return {"optimizer": optimizer,
                "lr_scheduler": warmup_cosine(self, optimizer, hp.warmup_steps, hp.decay_steps, hp.min_lr_ratio)}


def warmup_cosine(module: L.LightningModule, optimizer: torch.optim.Optimizer, warmup: int, decay: int | None,
                  min_ratio: float) -> dict[str, Any]:
    """The learning-rate schedule of ``configure_optimizers``, stepped every optimizer step: linear warm-up over
    ``warmup`` steps, then a cosine decay to ``min_ratio`` over ``decay`` steps (None: the rest of the run)."""
    if decay is None:
        total = module.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError(f"The run has no known length: set trainer.max_steps, or {type(module).__name__}"
                             "(decay_steps=...).")
        decay = max(int(total) - warmup, 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min((step - warmup) / decay, 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, factor), "interval": "step"}
