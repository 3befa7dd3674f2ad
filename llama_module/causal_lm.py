"""CausalLM: a LightningModule that trains any transformers causal LM on ``TextDataModule``'s batches, pretrained
or from a config, with no parallelism of its own: under TitanStrategy the plan comes from the model
(``titan_strategy/parallelize/hf_causal_lm.py``).

    titan fit --config configs/hf_causal_lm.yaml
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor

from llama_module.module import warmup_cosine
from titan_strategy import is_token_weighted, log_step_metric, pretrained_on_meta

__all__ = ["CausalLM"]

Batch = dict[str, Tensor]


class CausalLM(L.LightningModule):
    """Next-token pre-training or fine-tuning of a transformers ``AutoModelForCausalLM``.

    The model is built in ``configure_model``. Under TitanStrategy a pretrained one is built on the meta
    device and each rank reads only its own shards of the directory's safetensors after sharding
    (``pretrained_on_meta``); under any other strategy it is ``from_pretrained``.

    Args:
        pretrained: a transformers model directory (config.json, safetensors); its tokenizer is what
            ``TextDataModule(tokenizer=...)`` should name too. None: a new model from ``config``.
        config: ``AutoConfig.for_model`` arguments of a new model (``{"model_type": "qwen2", ...}``), or overrides
            of the pretrained config.
        vocab_size: a new model's vocabulary (``titan fit`` links the tokenizer's); ignored with ``pretrained``.
        attn_implementation: transformers' attention ("sdpa", "eager", "flash_attention_2", ...).
        lr, betas, weight_decay: AdamW's (fused on CUDA).
        warmup_steps, decay_steps, min_lr_ratio: linear warm-up, then cosine decay to ``min_lr_ratio * lr`` over
            ``decay_steps`` (None: the rest of the run).
    """

    def __init__(self, pretrained: str | None = None, config: dict[str, Any] | None = None,
                 vocab_size: int | None = None, attn_implementation: str = "sdpa", lr: float = 3e-4,
                 betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1, warmup_steps: int = 100,
                 decay_steps: int | None = None, min_lr_ratio: float = 0.1) -> None:
        super().__init__()
        if pretrained is None and not (config or {}).get("model_type"):
            raise ValueError("CausalLM needs pretrained=<a transformers model directory>, or config={'model_type': "
                             "'llama', ...} for a new model.")
        self.save_hyperparameters()
        self.hparams.update(betas=list(betas))  # a plain list, for weights_only checkpoint loads
        self.model: torch.nn.Module | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        import transformers

        from titan_strategy import TitanStrategy

        hp = self.hparams
        overrides = {**(hp.config or {}), "attn_implementation": hp.attn_implementation}
        if hp.pretrained is not None and isinstance(self.trainer.strategy, TitanStrategy):
            self.model = pretrained_on_meta(hp.pretrained, **overrides)
        elif hp.pretrained is not None:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(hp.pretrained, dtype=torch.float32,
                                                                           **overrides)
        else:
            config = dict(hp.config)
            config.setdefault("vocab_size", hp.vocab_size)
            model_config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
            model_config._attn_implementation = hp.attn_implementation
            self.model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs of training on one token (forward and backward, no recomputation), from the config (a
        pipeline stage holds only some of the weights): 6 per weight of the matrix products (q, k, v, o, a gated
        MLP, the output projection), plus causal attention's scores and weighted sum."""
        config = self.model.config
        hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * config.intermediate_size
        weights = layers * per_layer + hidden * config.vocab_size
        attention = 6 * layers * heads * head_dim * seq_len
        return 6 * weights + attention

    def on_before_batch_transfer(self, batch: Batch, dataloader_idx: int) -> Batch:
        # TextDataModule's labels are each position's next token: what transformers calls shift_labels.
        batch = dict(batch)
        if "labels" in batch:
            batch["shift_labels"] = batch.pop("labels")
        return batch

    def _loss(self, batch: Batch) -> Tensor:
        # transformers computes a loss only when given labels; shift_labels are what it compares against. Training
        # keeps no key/value cache (transformers' default builds one, which compiled layers also recompile for).
        return self.model(input_ids=batch["input_ids"], labels=batch["shift_labels"],
                          shift_labels=batch["shift_labels"], use_cache=False).loss

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log_loss("train", loss)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        self.log_loss("val", self._loss(batch))

    def log_loss(self, stage: str, loss: Tensor) -> None:
        """``{stage}_loss``, as ``LlamaModule`` logs it (under TitanStrategy the loss is already every rank's)."""
        if stage == "train":
            log_step_metric(self, "train_loss", loss, bar_name="loss", sync_dist=not is_token_weighted(self))
        else:
            self.log(f"{stage}_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, betas=tuple(hp.betas), eps=1e-8,
                                      weight_decay=hp.weight_decay, fused=self.device.type == "cuda")
        return {"optimizer": optimizer,
                "lr_scheduler": warmup_cosine(self, optimizer, hp.warmup_steps, hp.decay_steps, hp.min_lr_ratio)}
