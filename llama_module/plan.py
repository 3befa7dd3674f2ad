"""Llama's parallel plan: what TitanStrategy may shard, and how."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from llama_module.model import Llama
from titan_strategy import (
    IGNORE_INDEX,
    ContextParallelPlan,
    ParallelPlan,
    PipelinePlan,
    TensorParallelPlan,
    VocabularyParallelOutput,
)

__all__ = ["llama_plan", "llama_tp_styles"]


def llama_tp_styles(sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron-style TP: q/k/v and w1/w3 split by output column, wo and w2 by input row.

    Between blocks the residual stream is replicated, or, with sequence parallelism, sharded on the
    sequence dim (dim 1) so that norms and residual adds run on 1/tp of the tokens; attention and
    feed-forward all-gather it on entry and reduce-scatter on exit.
    """
    residual = Shard(1) if sequence_parallel else Replicate()
    styles: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # Given labels the output projection returns the loss, split over the vocabulary whatever loss_parallel says.
        "output": VocabularyParallelOutput(input_layouts=residual,
                                           output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                           use_local_output=not loss_parallel),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=residual),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=residual),
    }
    if sequence_parallel:
        styles |= {
            "norm": SequenceParallel(),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.ffn_norm": SequenceParallel(),
            # The RoPE table, the positions and the mask are the same on every rank and stay plain tensors.
            "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                     desired_input_layouts=(Replicate(), None, None, None)),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                        desired_input_layouts=(Replicate(),)),
        }
    return styles


def _sequence_length(batch: Any) -> int:
    return batch["input_ids"].shape[1]


def _document_ids(batch: Any) -> dict[str, Tensor]:
    return {"document_ids": batch["document_ids"]}


def _labels(batch: Any) -> dict[str, Tensor]:
    return {"labels": batch["labels"]}


def llama_plan(model: Llama, log_loss: Callable[[str, Tensor], None] | None = None,
               labels_to_last_stage: bool = False) -> ParallelPlan:
    """FSDP units in forward order: the embedding, each block, then final norm and output together.

    Norm and output form one unit because they run back to back and the norm alone is tiny. Pipeline
    stages cut the blocks into runs; the embedding rides with the first, norm and output with the last.
    ``log_loss`` is how the LightningModule logs a stage's loss when the pipeline schedule runs its steps.
    Under the block-causal mask every stage builds it from the microbatch's ``document_ids``, which every CP
    rank keeps whole. ``labels_to_last_stage``: the module's loss is the model's own (``Llama(..., labels=)``),
    so each microbatch's labels reach the stages' forward.
    """
    # Declared for the whole model: the strategy keeps, per pipeline stage, the units that stage holds.
    embedding, head = ("tok_embeddings",), ("norm", "output")
    blocks = tuple(f"layers.{name}" for name in model.layers)
    units = (embedding, *((block,) for block in blocks), head)
    config = model.config
    tensor_parallel = TensorParallelPlan(
        styles=llama_tp_styles,
        split_sizes={"n_heads": config.n_heads, "n_kv_heads": config.n_kv_heads, "ffn_dim": config.ffn_dim},
        vocab_size=config.vocab_size,
        sequence_length=_sequence_length,
    )
    documents = model.documents.attention_mask == "block_causal"
    pipeline = PipelinePlan(first_stage=embedding, last_stage=head, log_loss=log_loss, boundary_width=config.dim,
                            **({"stage_inputs": _document_ids} if documents else {}),
                            **({"loss_inputs": _labels} if labels_to_last_stage else {}))
    # Attention is the one place tokens meet; RoPE positions and the mask follow the tokens' window indices.
    context_parallel = ContextParallelPlan(attention="layers.*.attention.sdpa", buffers={"documents.token_index": 0},
                                           whole_batch={"document_ids": 1} if documents else {})
    # Samples never meet (attention stays within each one) and the loss ignores labels of -100, so a short batch
    # padded with copies of its first sample, unlabelled, replays CUDA graphs: Llama(tokens, document_ids, labels).
    return ParallelPlan(model=model, fsdp_units=units, init_weights=model.init_weights, blocks=blocks,
                        tensor_parallel=tensor_parallel, pipeline=pipeline, context_parallel=context_parallel,
                        float8_skip=("output",), short_batch_padding=(None, None, IGNORE_INDEX))
