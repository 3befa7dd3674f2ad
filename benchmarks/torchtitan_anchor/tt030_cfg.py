"""torchtitan 0.3.0 config registry for the anchor kit (used as `--module tt030_cfg`).

0.3.0 has no TOML/flavor dict: `--module M --config F` imports M (or M.config_registry)
and calls F() -> Trainer.Config; CLI flags then override fields.  This module lives on
PYTHONPATH (this folder) so 0.3.0's files stay untouched.

Shape = our 1B: dim 2048, 16 layers, 32 heads / 8 kv heads, FFN 8192, vocab 128256,
rope theta 5e5 (llama scaling, factor 32), UNTIED output projection.
Differences forced by 0.3.0: attention is FlexAttention (0.3.0 rejects SDPA for
language models: "sdpa is no longer supported for language models"), and wq/wk/wv
are fused (fuse_qkv=True in its llama3 builder).
"""

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import _EMBEDDING_INIT, _1b, model_registry
from torchtitan.trainer import Trainer


def _ours_1b(attn_backend: str = "flex", tp_gemm_backend: str = "default"):
    cfg = _1b(attn_backend=attn_backend, tp_gemm_backend=tp_gemm_backend)
    cfg.enable_weight_tying = False  # ours is untied
    cfg.tok_embeddings.param_init = _EMBEDDING_INIT  # 0.3.0 skips it only when tied
    for layer in cfg.layers:
        rope = getattr(layer.attention, "rope", None)
        if rope is not None:
            rope.scaling_factor = 32.0  # Llama 3.2 rope scaling, as in our "1B"
    return cfg


def llama3_1b_ours() -> Trainer.Config:
    import torchtitan.models.llama3 as l3

    l3.llama3_configs["1B_ours"] = _ours_1b
    spec = model_registry("1B_ours", attn_backend="flex")
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        ),
        hf_assets_path="/tmp/tt_assets/tokenizer",
        dump_folder="/tmp/tt_v030_out",
        model_spec=spec,
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=3, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        training=TrainingConfig(local_batch_size=2, seq_len=8192, steps=30),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset="c4_test", dataset_path="/tmp/tt_assets/c4_test"
        ),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=1, data_parallel_replicate_degree=1
        ),
        activation_checkpoint=None,
        compile=CompileConfig(enable=True, components=["model", "loss"]),
    )
