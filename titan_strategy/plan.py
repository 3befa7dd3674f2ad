"""What a model declares so the strategy can parallelize it (the model itself stays parallelism-free)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = [
    "ContextParallelPlan", "ParallelPlan", "ParamFiller", "PipelinePlan", "PlannedModule", "TensorParallelPlan",
    "input_ids_and_labels",
]

ParamFiller = Callable[[nn.Parameter, Callable[[Tensor], None]], None]
"""Writes an initializer's output into a parameter; the initializer always sees the full tensor."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a model splits across tensor-parallel ranks.

    Attributes:
        styles: ``(sequence_parallel, loss_parallel) -> {submodule pattern: ParallelStyle}``; patterns
            may use ``*`` (``"layers.*.attention.wq"``). With loss parallel the output stays a DTensor
            sharded on its last (vocabulary) dim.
        split_sizes: sizes that every TP degree must divide, by name (``{"n_heads": 32, ...}``).
        vocab_size: what loss parallel splits; it must divide by the TP degree too.
        sequence_length: the sequence length of a batch; sequence parallelism splits it.
    """

    styles: Callable[[bool, bool], dict[str, ParallelStyle]]
    split_sizes: dict[str, int]
    vocab_size: int
    sequence_length: Callable[[Any], int]


def input_ids_and_labels(batch: Any) -> tuple[Tensor, Tensor | None]:
    """The default batch split under pipeline parallelism: what the first stage eats, what the loss compares to.

    A batch without labels (prediction) gives no target.
    """
    return batch["input_ids"], batch.get("labels")


@dataclass(frozen=True)
class PipelinePlan:
    """How a model's forward cuts into pipeline stages.

    A stage is a contiguous run of the plan's ``blocks``; the first stage also keeps ``first_stage``
    modules, the last stage ``last_stage`` modules. Every other block or module is removed from a
    stage (set to ``None``, or deleted from its ``ModuleDict``), so the model's ``forward`` must skip
    missing parts and pass hidden states through. Parameter names stay those of the full model.

    Attributes:
        first_stage: modules only the first stage holds (e.g. the token embedding).
        last_stage: modules only the last stage holds (e.g. final norm and output projection).
        split_batch: ``batch -> (first stage input, loss target)``.
        stage_inputs: ``batch -> {keyword: tensor}``, what every stage's forward takes besides its input (such
            as the document ids an attention mask is built from); each tensor is split into microbatches on dim 0.
        loss_inputs: ``batch -> {keyword: tensor}``, more of the same for training and evaluation only, not
            prediction: what a last stage that computes its loss itself takes (the labels of a fused output
            projection and cross-entropy); its output is then what ``pipeline_loss`` gets.
        log_loss: ``(stage, loss) -> None``, how the module logs the loss of a step (``stage`` is "train", "val"
            or "test"). The schedule runs in place of the module's ``*_step``, so the module says here what its
            steps would have logged; PP refuses a plan without it.
        boundary_width: width of the hidden state one stage hands the next, ``(batch, seq, boundary_width)``.
            Only ``titan rehearse`` reads it: a rehearsed rank has no neighbour stage to tell it that shape.
        stage_forward: ``(stage, input, **stage_inputs) -> output``, what a stage runs in place of the model's
            ``forward`` (None: the model's own ``forward`` skips the parts a stage lacks); for a model whose forward
            cannot, such as a transformers one.
    """

    first_stage: tuple[str, ...]
    last_stage: tuple[str, ...]
    split_batch: Callable[[Any], tuple[Tensor, Tensor | None]] = input_ids_and_labels
    stage_inputs: Callable[[Any], dict[str, Tensor]] = lambda batch: {}
    loss_inputs: Callable[[Any], dict[str, Tensor]] = lambda batch: {}
    log_loss: Callable[[str, Tensor], None] | None = None
    boundary_width: int | None = None
    stage_forward: Callable[..., Any] | None = None


@dataclass(frozen=True)
class ContextParallelPlan:
    """How a model's sequence dimension splits across context-parallel ranks.

    Each rank keeps two of ``2 * cp`` equal chunks of every sequence, chunk ``r`` and chunk
    ``2 * cp - 1 - r`` (head-tail load balancing: under a causal mask early tokens are cheap and
    late ones expensive, so every rank gets one of each). Attention runs as ring attention.

    Attributes:
        attention: pattern of the modules that compute attention (``"layers.*.attention.sdpa"``).
            Their ``forward(query, key, value, mask=None)`` takes ``(batch, heads, seq, head_dim)`` tensors.
            Without a mask it calls ``F.scaled_dot_product_attention(query, key, value, is_causal=True)``,
            which becomes ring attention. With one, the mask covers this rank's queries and every key of the
            sequence, in order: the rank then gets the whole key and value, gathered from every rank.
        buffers: model buffers indexed by token position, ``{name: sequence dim}`` (the window index of each
            token); during a step each rank sees the rows of its own tokens.
        batch: batch entries cut to each rank's tokens, ``{key: sequence dim}``.
        whole_batch: batch entries every rank keeps whole (what a mask over all keys is built from),
            ``{key: sequence dim}``; their sequence length must be the batch's.
        prediction_seq_dim: the sequence dim of the tensor ``predict_step`` returns; each CP rank
            predicts its own tokens and the strategy gathers the whole sequence back.
    """

    attention: str
    buffers: dict[str, int] = field(default_factory=dict)
    batch: dict[str, int] = field(default_factory=lambda: {"input_ids": 1, "labels": 1})
    whole_batch: dict[str, int] = field(default_factory=dict)
    prediction_seq_dim: int = 1


@dataclass(frozen=True)
class ParallelPlan:
    """A model's declaration of how it may be parallelized.

    Attributes:
        model: the ``nn.Module`` to parallelize (a submodule of the LightningModule).
        fsdp_units: groups of submodule names (relative to ``model``), in forward order; each group
            becomes one FSDP unit whose parameters are all-gathered together.
        init_weights: re-initializes every parameter and buffer of ``model`` after ``to_empty``;
            it receives a seed shared by all ranks and the ``ParamFiller`` to write through.
        blocks: names of the repeated blocks (compiled one by one, since they are identical).
        tensor_parallel: how to split the model across TP ranks; None if it cannot be.
        pipeline: how to cut the model into pipeline stages; None if it cannot be.
        context_parallel: how to split the sequence across CP ranks; None if it cannot be.
        float8_skip: linear layers that stay in bf16 under float8 training (the output projection,
            whose logits need the precision).
        short_batch_padding: lets a batch of fewer samples than the one CUDA graphs captured (a short last
            batch) replay them, padded to the captured batch size; None runs it eagerly. One entry per positional
            argument of the model's call: the value padded samples hold there, or None for copies of the batch's
            first sample (arguments past the tuple's end get copies too). Declaring it promises that padded
            samples change nothing the real ones see: samples never meet (no batch statistics, no routing
            across samples), and each output either has one row per sample first (the padded rows are cut off)
            or ignores what the padded samples hold (a loss summed over labelled tokens, for labels of -100).
    """

    model: nn.Module
    fsdp_units: tuple[tuple[str, ...], ...]
    init_weights: Callable[[int, ParamFiller], None]
    blocks: tuple[str, ...] = ()
    tensor_parallel: TensorParallelPlan | None = None
    pipeline: PipelinePlan | None = None
    context_parallel: ContextParallelPlan | None = None
    float8_skip: tuple[str, ...] = ()
    short_batch_padding: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        padding = self.short_batch_padding
        # bool is an int, but True as a token id or label is a slip, not a fill value.
        if padding is not None and not (isinstance(padding, tuple) and all(
                value is None or (isinstance(value, int) and not isinstance(value, bool)) for value in padding)):
            raise ValueError(f"ParallelPlan(short_batch_padding={padding!r}): give a tuple with one entry per "
                             "positional argument of the model's call, each an int (the value padded samples hold "
                             "there) or None (copies of the first sample), e.g. (None, None, -100) for "
                             "Llama(tokens, document_ids, labels); or None to run short batches eagerly.")


@runtime_checkable
class PlannedModule(Protocol):
    """A LightningModule that lets TitanStrategy parallelize it (see ``llama_module.LlamaModule``).

    Under pipeline parallelism it may also define ``pipeline_loss(output, target)``, the loss of one
    microbatch: ``(loss_sum, num_tokens)``, which the strategy turns into the step's token mean, or a plain
    mean (default: ``token_loss.token_cross_entropy``, which ignores label -100).
    """

    def parallel_plan(self) -> ParallelPlan: ...
