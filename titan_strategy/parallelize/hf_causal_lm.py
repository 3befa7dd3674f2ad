"""The plan of a transformers causal LM that a LightningModule holds and parallelizes nothing of: derived from the
model itself, for every degree the knobs ask for.

- FSDP units and the blocks that activation checkpointing and compile take one by one: the decoder layers, found
  from the model's ``_no_split_modules``.
- Tensor parallelism from the config's ``base_model_tp_plan`` (``colwise``, ``rowwise``, and
  ``replicated_with_grad_allreduce`` for per-head norms), the token embedding split on the vocabulary, and the
  output projection on the vocabulary too, with loss parallel. Under sequence parallelism the residual stream
  between the layers stays a DTensor sharded on the sequence, so that what the model computes from its shape
  (positions, the causal mask) sees the whole sequence.
- Pipeline stages from the config's ``base_model_pp_plan`` (embedding first, layers, final norm), the output
  projection on the last stage. A stage runs ``run_stage`` below in place of the model's forward.
- Context parallelism: attention runs as causal SDPA in a module of its own, which becomes ring attention.
- The loss: the model's own ``loss_function`` is replaced by the token-weighted mean over every rank
  (``token_mean``), with the labels shifted across context-parallel chunks before each rank keeps its tokens.

A family whose forward does more between its layers than embedding, rotary positions and norm (Gemma scales its
embeddings, soft-caps its logits) is refused where a degree needs that forward split (PP) or its attention
replaced (CP, PP); the error names the fix: a ``parallel_plan()``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from titan_strategy.config.mesh import ParallelDims
from titan_strategy.kernels.linear_cross_entropy import linear_cross_entropy
from titan_strategy.parallelize.blocks import repeated_blocks
from titan_strategy.parallelize.context_parallel import gather_sequence, load_balanced_shard
from titan_strategy.parallelize.materialize import OwnInitializer, own_initializers, run_initializers
from titan_strategy.parallelize.tensor_parallel import VocabularyParallelOutput
from titan_strategy.plan import ContextParallelPlan, ParallelPlan, ParamFiller, PipelinePlan, TensorParallelPlan
from titan_strategy.token_loss import IGNORE_INDEX, count_labelled, token_cross_entropy, token_mean

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["causal_lm_in", "hf_causal_lm_plan", "next_token_labels", "pretrained_on_meta"]

# Families whose base model runs embedding -> rotary positions -> decoder layers -> norm and nothing else, with
# decoder layers that take (hidden_states, attention_mask, position_ids, position_embeddings), and whose causal LM
# hands the output projection's result to the loss unchanged (no soft-capping or scaling of the logits): a pipeline
# stage can run their pieces itself, their attention can be swapped for causal SDPA, and their loss computed inside
# the output projection.
_PLAIN_DECODERS = ("llama", "mistral", "qwen2", "qwen3")
_ATTENTION = "titan_causal"
# Where pretrained_on_meta records the directory the strategy loads each rank's shards from.
_PRETRAINED_DIR = "_titan_pretrained_dir"


def causal_lm_in(module: nn.Module) -> tuple[str, nn.Module] | None:
    """The transformers causal LM the module holds (its name and itself), where it holds exactly one and every
    trainable parameter of the module is the model's; else None."""
    transformers = sys.modules.get("transformers")  # a model of transformers' has imported it already
    if transformers is None:
        return None
    found = [(name, sub) for name, sub in module.named_modules()
             if isinstance(sub, transformers.PreTrainedModel) and sub.get_output_embeddings() is not None]
    outermost = [(name, sub) for name, sub in found
                 if not any(name != other and name.startswith(other + ".") for other, _ in found if other)]
    if len(outermost) != 1:
        return None
    name, model = outermost[0]
    own = {id(p) for p in model.parameters()}
    if any(p.requires_grad and id(p) not in own for p in module.parameters()):
        return None
    return name, model


def pretrained_on_meta(directory: str, **config_overrides: Any) -> nn.Module:
    """A transformers causal LM built on the meta device from ``directory``'s config, whose weights TitanStrategy
    reads from the directory's safetensors after sharding, each rank only its own shards: call it in
    ``configure_model`` where ``AutoModelForCausalLM.from_pretrained`` would load the whole model on every rank.
    ``config_overrides`` go to ``AutoConfig.from_pretrained`` (``attn_implementation="sdpa"``, say)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, **config_overrides)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    setattr(model, _PRETRAINED_DIR, str(directory))
    return model


# ---- the plan ---------------------------------------------------------------------------------------------------

def hf_causal_lm_plan(module: pl.LightningModule, model: nn.Module, dims: ParallelDims, *,
                      sequence_parallel: bool) -> ParallelPlan:
    """The plan of ``model``, a transformers causal LM inside ``module``, for the degrees of ``dims``.

    Prepares the model for them: its loss becomes the token-weighted mean; under PP or CP its attention runs in
    a module of its own; under CP its rotary positions and shifted labels are this rank's.

    Raises:
        ValueError: a degree the family lacks a piece for, naming it and the fix.
    """
    family = getattr(model.config, "model_type", type(model).__name__)
    blocks = repeated_blocks(model)
    if not blocks:
        _refuse(model, "FSDP units", "decoder layers named in _no_split_modules")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    split = {knob: size for knob, size in (("pipeline_parallel_size", dims.pp), ("context_parallel_size", dims.cp))
             if size > 1}
    if split and family not in _PLAIN_DECODERS:
        _refuse(model, " and ".join(f"{knob}={size}" for knob, size in split.items()),
                f"a forward TitanStrategy knows how to split (model_type {family!r}; it knows "
                f"{', '.join(_PLAIN_DECODERS)})")
    if split:
        _use_causal_attention(model, cp=dims.cp)
    model.loss_function = functools.partial(_token_weighted_loss, module)
    if dims.pp == 1:  # a pipeline stage runs its layers itself, with no cache
        model.register_forward_pre_hook(_no_cache_in_training, with_kwargs=True)
    if dims.cp > 1:
        _cp_positions_and_labels(module, model)
    if family in _PLAIN_DECODERS:  # their forward hands the projection's output to the loss unchanged
        _loss_without_logits(model)  # after the CP hook, which shifts the labels it sees
    base = _prefix(model)
    stage_sequence_parallel = dims.tp > 1 and sequence_parallel
    return ParallelPlan(
        model=model, fsdp_units=tuple((block,) for block in blocks),
        init_weights=functools.partial(_init_weights, model, own_initializers(model)), blocks=blocks,
        tensor_parallel=_tensor_parallel(model, base, tied) if dims.tp > 1 else None,
        pipeline=_pipeline(model, base, tied, dims, module, stage_sequence_parallel) if dims.pp > 1 else None,
        context_parallel=ContextParallelPlan(attention=f"{base}layers.*.self_attn.causal_attention",
                                             batch={"input_ids": 1, "labels": 1, "shift_labels": 1})
        if dims.cp > 1 else None,
        float8_skip=(_output_name(model),),
    )


def _no_cache_in_training(causal_lm: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A training forward keeps no key/value cache unless the call asks for one: transformers' default
    (``use_cache=True``) would hold every layer's keys and values to the step's end, and compiled layers recompile
    for it."""
    if causal_lm.training and kwargs.get("use_cache") is None:
        kwargs = {**kwargs, "use_cache": False}
    return args, kwargs


def _refuse(model: nn.Module, degree: str, missing: str) -> None:
    raise ValueError(
        f"TitanStrategy cannot derive {degree} for {type(model).__name__}: it lacks {missing}. Give the "
        "LightningModule a parallel_plan() that says how (docs/your-module.md#planned-modules; "
        "titan_strategy/parallelize/hf_causal_lm.py derives one to start from), or set that degree to 1.")


def _prefix(model: nn.Module) -> str:
    """The base model's name inside the causal LM, with its dot (``"model."``)."""
    return f"{model.base_model_prefix}." if getattr(model, model.base_model_prefix, None) is not None else ""


def _output_name(model: nn.Module) -> str:
    head = model.get_output_embeddings()
    return next(name for name, sub in model.named_modules() if sub is head)


def _init_weights(model: nn.Module, initializers: list[OwnInitializer], seed: int, fill: ParamFiller) -> None:
    """Transformers' own initialization of the modules this rank holds (a pipeline stage lacks some), then, for a
    model from ``pretrained_on_meta``, each rank's shards of the directory's weights."""
    held = set(model.modules())
    run_initializers([init for init in initializers if init.module in held], seed, fill)
    directory = getattr(model, _PRETRAINED_DIR, None)
    if directory is not None:
        from titan_strategy.checkpoint.hf_safetensors import load_safetensors

        load_safetensors(model, Path(directory))


# ---- tensor parallelism -----------------------------------------------------------------------------------------

class _HeadNorm(SequenceParallel):
    """transformers' ``replicated_with_grad_allreduce``: a norm over each head's features (Qwen3's q/k norms)
    after the heads are split across TP ranks. Its weight is replicated, its input a DTensor sharded on the head
    dim of (batch, seq, heads, head_dim), so the weight's gradient is summed over the ranks' heads."""

    def __init__(self) -> None:
        super().__init__(sequence_dim=2, use_local_output=True)


class _GatherSequence(ParallelStyle):
    """Under sequence parallelism: the hidden state a layer's attention or MLP takes (its first positional
    argument, or ``hidden_states=``) is all-gathered from the sequence shards, for the column-split projections."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(functools.partial(_gather_hidden, device_mesh), with_kwargs=True)
        return module


def _gather_hidden(mesh: DeviceMesh, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    def gathered(hidden: Any) -> Any:
        if not isinstance(hidden, DTensor):
            hidden = DTensor.from_local(hidden, mesh, (Shard(1),), run_check=False)
        return hidden.redistribute(mesh, (Replicate(),))

    if args:
        return (gathered(args[0]), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": gathered(kwargs["hidden_states"])}


class _TiedOutput(VocabularyParallelOutput):
    """The output projection whose weight is the token embedding's: the embedding's style, applied first, has
    split that weight on the vocabulary as this one would, into a parameter of the embedding's; the projection
    takes that one (splitting its own again would untie the two)."""

    def __init__(self, embedding: nn.Module, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = embedding

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        module.weight = self.embedding.weight


_TP_STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
"""The styles of transformers' ``base_model_tp_plan`` that map onto ours."""


def _tensor_parallel(model: nn.Module, base: str, tied: bool) -> TensorParallelPlan:
    """The config's ``base_model_tp_plan`` as our styles, plus the vocabulary-split embedding and output projection
    and, under sequence parallelism, the norms and the gathers before the column-split projections."""
    config = model.config
    hf_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    if not hf_plan:
        _refuse(model, "tensor parallelism", "a base_model_tp_plan in its config")
    unknown = {pattern: style for pattern, style in hf_plan.items() if style not in _TP_STYLES}
    if unknown:
        _refuse(model, "tensor parallelism", f"a TP style TitanStrategy maps for {unknown} (it maps "
                f"{', '.join(_TP_STYLES)})")
    layer = model.get_submodule(repeated_blocks(model)[0])
    norms = [name for name, child in layer.named_children() if "norm" in type(child).__name__.lower()]
    gathered = sorted({pattern.rsplit(".", 2)[0] for pattern, style in hf_plan.items() if style == "colwise"})
    output = _output_name(model)

    def styles(sequence_parallel: bool, loss_parallel: bool) -> dict[str, ParallelStyle]:
        residual = Shard(1) if sequence_parallel else Replicate()
        # A DTensor residual under SP: the model reads the sequence length and builds positions from it.
        keep = {"use_local_output": not sequence_parallel}
        chosen: dict[str, ParallelStyle] = {}
        for pattern, style in hf_plan.items():
            name = base + pattern
            if style == "colwise":
                chosen[name] = ColwiseParallel()
            elif style == "rowwise":
                chosen[name] = RowwiseParallel(output_layouts=residual, **keep)
            else:
                chosen[name] = _HeadNorm()
        # Before the output projection: a tied weight is split here, and kept there.
        chosen[f"{base}embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual, **keep)
        vocabulary = {"input_layouts": residual, "output_layouts": Shard(-1) if loss_parallel else Replicate(),
                      "use_local_output": not loss_parallel}
        chosen[output] = (_TiedOutput(model.get_input_embeddings(), **vocabulary) if tied
                          else VocabularyParallelOutput(**vocabulary))
        if sequence_parallel:
            chosen[f"{base}norm"] = SequenceParallel()
            chosen |= {f"{base}layers.*.{norm}": SequenceParallel() for norm in norms}
            chosen |= {base + parent: _GatherSequence() for parent in gathered}
        return chosen

    sizes = {"num_attention_heads": config.num_attention_heads,
             "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "intermediate_size": config.intermediate_size}
    return TensorParallelPlan(styles=styles, split_sizes=sizes, vocab_size=config.vocab_size,
                              sequence_length=_sequence_length)


def _sequence_length(batch: Any) -> int:
    return batch["input_ids"].shape[1]


# ---- attention under PP and CP ----------------------------------------------------------------------------------

class CausalAttention(nn.Module):
    """Scaled dot-product attention under a causal mask, on (batch, heads, seq, head_dim) tensors: a module of
    its own, so that context parallelism can make its inputs sequence shards (and it ring attention).

    Args:
        scale: the attention module's softmax scale.
        sequence_shards: how many context-parallel ranks each hold part of the sequence.
    """

    def __init__(self, scale: float, sequence_shards: int) -> None:
        super().__init__()
        self.scale, self.sequence_shards = scale, sequence_shards

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        gqa = query.size(1) != key.size(1)
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.scale,
                                              **({"enable_gqa": True} if gqa else {}))


def _causal_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None, sliding_window: int | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention interface, as TitanStrategy runs it under PP and CP: causal, no other mask."""
    attention = module.causal_attention
    whole_sequence = query.shape[2] * attention.sequence_shards
    if attention_mask is not None or (sliding_window is not None and whole_sequence > sliding_window):
        raise ValueError(
            f"Under pipeline or context parallelism TitanStrategy runs {type(module).__name__} as causal attention, "
            "but this call needs another mask: an attention_mask with padding, or a sliding window of "
            f"{sliding_window} tokens shorter than the {whole_sequence}-token sequence. Pass no attention_mask "
            "(label padding -100 instead) and sequences no longer than the window, or set those degrees to 1.")
    if dropout or kwargs.get("softcap") is not None:
        raise ValueError(f"{type(module).__name__} asks for attention dropout or soft-capping, which causal SDPA "
                         "under pipeline or context parallelism does not do; set attention_dropout=0.0, or those "
                         "degrees to 1.")
    return attention(query, key, value).transpose(1, 2).contiguous(), None


def _use_causal_attention(model: nn.Module, cp: int) -> None:
    """Every attention module of the model gets a ``causal_attention`` child, and the model calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(_ATTENTION, _causal_attention)
    # sdpa's mask: None where causal alone is right, so that any other mask reaches _causal_attention and is refused.
    ALL_MASK_ATTENTION_FUNCTIONS.register(_ATTENTION, sdpa_mask)
    for name in repeated_blocks(model):
        attention = model.get_submodule(name).self_attn
        attention.causal_attention = CausalAttention(attention.scaling, cp)
    model.config._attn_implementation = _ATTENTION


# ---- context parallelism ----------------------------------------------------------------------------------------

def _cp_mesh(module: pl.LightningModule) -> DeviceMesh:
    return module.device_mesh["cp"]


def _cp_positions_and_labels(module: pl.LightningModule, model: nn.Module) -> None:
    """Each rank holds two chunks of every sequence: its rotary positions are those chunks' positions, and the
    labels transformers would shift inside its loss are shifted over the whole sequence first."""
    base = getattr(model, model.base_model_prefix)

    def rank_positions(rotary: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, positions = (args + (kwargs.pop("position_ids", None),))[:2]
        mesh = _cp_mesh(module)
        whole = torch.arange(positions.shape[-1] * mesh.size(), device=positions.device)
        return (hidden, load_balanced_shard(whole, mesh.get_local_rank(), mesh.size(), 0).unsqueeze(0)), kwargs

    def shifted_labels(causal_lm: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for given in ("position_ids", "attention_mask"):
            if kwargs.get(given) is not None:
                raise ValueError(f"Under context parallelism each rank holds two chunks of the sequence, and "
                                 f"{given}= would cover the whole of it; call the model without it.")
        labels = kwargs.pop("labels", None)
        if labels is not None and kwargs.get("shift_labels") is None:
            kwargs = {**kwargs, "labels": labels, "shift_labels": next_token_labels(labels, _cp_mesh(module))}
        elif labels is not None:
            kwargs["labels"] = labels
        return args, kwargs

    base.rotary_emb.register_forward_pre_hook(rank_positions, with_kwargs=True)
    model.register_forward_pre_hook(shifted_labels, with_kwargs=True)


def next_token_labels(labels: Tensor, cp_mesh: DeviceMesh | None = None) -> Tensor:
    """transformers' labels (each position's own token) as next-token targets: each position gets the next
    position's label, the last none (-100). Under context parallelism ``labels`` are this rank's two chunks of
    the sequence: they are gathered, shifted over the whole sequence, and this rank's chunks kept."""
    def shifted(whole: Tensor) -> Tensor:
        return F.pad(whole[..., 1:], (0, 1), value=IGNORE_INDEX)

    if cp_mesh is None or cp_mesh.size() == 1:
        return shifted(labels)
    seq_dim = labels.dim() - 1
    whole = shifted(gather_sequence(labels, cp_mesh, seq_dim))
    return load_balanced_shard(whole, cp_mesh.get_local_rank(), cp_mesh.size(), seq_dim)


# ---- the loss ---------------------------------------------------------------------------------------------------

def _loss_without_logits(model: nn.Module) -> None:
    """A call with labels computes the loss inside the output projection, chunk by chunk
    (``linear_cross_entropy``): the (batch, seq, vocabulary) logits never exist. The model's ``logits`` are
    then None, so that code reading them fails instead of reading a loss; a call without labels returns logits.

    The projection returns its token sum carrying the count (``labelled_tokens``), and ``_token_weighted_loss``
    makes the mean of it."""
    head = model.get_output_embeddings()
    pending: dict[str, Tensor] = {}

    def remember_targets(causal_lm: nn.Module, args: tuple, kwargs: dict) -> None:
        # Set on every call, so that a call that failed before the projection leaves nothing for the next one.
        labels, shifted = kwargs.get("labels"), kwargs.get("shift_labels")
        pending["targets"] = shifted if shifted is not None or labels is None else next_token_labels(labels)

    def project(hidden: Tensor) -> Tensor:
        targets = pending.pop("targets", None)
        if targets is None:
            return F.linear(hidden, head.weight, head.bias)
        loss_sum = linear_cross_entropy(hidden, head.weight, targets)
        loss_sum.labelled_tokens = count_labelled(targets)
        return loss_sum

    def drop_logits(causal_lm: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if getattr(output, "logits", None) is not None and hasattr(output.logits, "labelled_tokens"):
            output.logits = None
        return output

    if head.bias is not None or type(head) is not nn.Linear:
        return  # a projection of its own kind computes its logits its own way
    model.register_forward_pre_hook(remember_targets, with_kwargs=True)
    model.register_forward_hook(drop_logits, with_kwargs=True)
    head.forward = project


def _token_weighted_loss(module: pl.LightningModule, logits: Tensor, labels: Tensor | None = None,
                         vocab_size: int | None = None, num_items_in_batch: Any = None,
                         ignore_index: int = IGNORE_INDEX, shift_labels: Tensor | None = None,
                         **kwargs: Any) -> Tensor:
    """transformers' causal LM loss as the mean over every labelled token of the step, on every rank and
    layout (``token_mean``); ``num_items_in_batch`` is that count already, so it is not needed."""
    if hasattr(logits, "labelled_tokens"):  # the output projection's loss sum (_loss_without_logits)
        return token_mean(module, logits, logits.labelled_tokens)
    targets = shift_labels if shift_labels is not None else next_token_labels(labels)
    if ignore_index != IGNORE_INDEX:
        targets = targets.masked_fill(targets == ignore_index, IGNORE_INDEX)
    loss_sum, num_tokens = token_cross_entropy(logits, targets)
    return token_mean(module, loss_sum, num_tokens)


# ---- pipeline parallelism ---------------------------------------------------------------------------------------

def _pipeline(model: nn.Module, base: str, tied: bool, dims: ParallelDims, module: pl.LightningModule,
              sequence_parallel: bool) -> PipelinePlan:
    hf_plan = getattr(model.config, "base_model_pp_plan", None) or {}
    if not {"embed_tokens", "layers", "norm"} <= set(hf_plan):
        _refuse(model, f"pipeline_parallel_size={dims.pp}", "a base_model_pp_plan with embed_tokens, layers, norm")
    if tied:
        _refuse(model, f"pipeline_parallel_size={dims.pp}",
                "separate input and output embeddings (tie_word_embeddings=True puts one weight on the first and "
                "the last stage; untie them with tie_word_embeddings=False)")
    cp = dims.cp

    def split_batch(batch: Any) -> tuple[Tensor, Tensor | None]:
        """Token ids, and next-token targets: the batch's ``shift_labels``, or its ``labels`` shifted."""
        if batch.get("shift_labels") is not None:
            return batch["input_ids"], batch["shift_labels"]
        labels = batch.get("labels")
        targets = None if labels is None else next_token_labels(labels, _cp_mesh(module) if cp > 1 else None)
        return batch["input_ids"], targets

    def log_loss(stage: str, loss: Tensor) -> None:
        """The module's own ``log_loss(stage, loss)`` where it has one, else ``{stage}_loss``."""
        if callable(own := getattr(module, "log_loss", None)):
            own(stage, loss)
        else:
            module.log(f"{stage}_loss", loss, prog_bar=True)

    return PipelinePlan(first_stage=(f"{base}embed_tokens",), last_stage=(f"{base}norm", _output_name(model)),
                        split_batch=split_batch, log_loss=log_loss, boundary_width=model.config.hidden_size,
                        stage_forward=functools.partial(_stage_forward, module=module,
                                                        sequence_parallel=sequence_parallel))


def _stage_forward(causal_lm: nn.Module, inputs: Tensor, *, module: pl.LightningModule,
                   sequence_parallel: bool) -> Tensor:
    """One pipeline stage of a plain decoder: the embedding if the stage holds it, the rotary positions, the
    stage's layers, then the final norm and output projection if it holds them. The first stage takes token
    ids, the others the hidden state the previous one sent: under sequence parallelism this rank's sequence
    shard, which becomes the DTensor the layers take (and a DTensor leaves as its shard)."""
    base = getattr(causal_lm, causal_lm.base_model_prefix)
    if base.embed_tokens is not None:
        hidden = base.embed_tokens(inputs)
    elif sequence_parallel:
        hidden = DTensor.from_local(inputs, module.device_mesh["tp"], (Shard(1),), run_check=False)
    else:
        hidden = inputs
    positions = torch.arange(hidden.shape[1], device=inputs.device).unsqueeze(0)
    rope = base.rotary_emb(hidden, positions)
    for layer in base.layers:
        if layer is not None:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    if base.norm is not None:
        hidden = base.norm(hidden)
    head = causal_lm.get_output_embeddings()
    if head is not None:
        return head(hidden)
    return hidden.to_local() if isinstance(hidden, DTensor) else hidden
