"""Llama 3 / 3.1 decoder: GQA attention, RoPE with 3.1 frequency scaling, RMSNorm, SwiGLU.

No parallelism lives here. The model can be built on the meta device and filled later by
``init_weights``; blocks sit in a ``ModuleDict`` keyed by index so that parameter names stay the
same when pipeline stages cut some of them out.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llama_module.args import LlamaConfig, RopeScaling
from llama_module.documents import AttentionMask, DocumentMasking, RopePositions, flex_attention
from titan_strategy import check_choice, choices
from titan_strategy.kernels import flash_attention4, linear_cross_entropy
from titan_strategy.kernels.linear_cross_entropy import DEFAULT_CHUNK_TOKENS
from titan_strategy.kernels.rms_norm import rms_norm, rms_norm_kernel_takes
from titan_strategy.kernels.rope import rope_kernel_takes, rotate_pairs

__all__ = ["AttentionKernel", "Llama", "ParamFiller", "check_attention_kernel", "fill_in_place", "rope_table"]

AttentionKernel = Literal["auto", "sdpa", "fa4", "flex"]


def check_attention_kernel(kernel: str, attention_mask: str = "causal", resolved: bool = False) -> None:
    """``resolved``: the model's layers take a kernel that runs, not ``auto`` (``LlamaModule`` resolves it)."""
    check_choice("attention_kernel", kernel, AttentionKernel)
    if resolved and kernel == "auto":
        raise ValueError("attention_kernel='auto' is resolved by LlamaModule on its device; the model takes one of "
                         f"{list(choices(AttentionKernel)[1:])}.")
    if kernel == "flex" and attention_mask != "block_causal":
        raise ValueError("attention_kernel='flex' runs the block-causal mask; plain causal attention is faster on "
                         "attention_kernel='sdpa' or 'fa4'. Use attention_mask='block_causal' or another kernel.")
    if kernel == "fa4" and attention_mask != "causal":
        raise ValueError(f"attention_kernel='fa4' takes attention_mask='causal' only (the installed FlashAttention-4 "
                         f"path here has no document mask), not {attention_mask!r}. Use attention_kernel='flex' "
                         "for block-causal attention, or attention_mask='causal'.")

Initializer = Callable[[Tensor], None]
ParamFiller = Callable[[nn.Parameter, Initializer], None]
"""How an initializer reaches a parameter: it is handed the *full* tensor to fill."""


def fill_in_place(param: nn.Parameter, initializer: Initializer) -> None:
    """The default ``ParamFiller``: the parameter is an ordinary, whole tensor."""
    initializer(param.data)


def _scaled_frequencies(freqs: Tensor, scaling: RopeScaling) -> Tensor:
    # Llama 3.1: wavelengths longer than original_len / low_freq_factor are divided by `factor`,
    # shorter than original_len / high_freq_factor are kept, and the band between is interpolated.
    wavelen = 2 * math.pi / freqs
    low_freq_wavelen = scaling.original_max_seq_len / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_seq_len / scaling.high_freq_factor
    smooth = (scaling.original_max_seq_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.factor, interpolated)
    return torch.where(wavelen < high_freq_wavelen, freqs, scaled)


def rope_table(config: LlamaConfig, device: torch.device | None = None) -> Tensor:
    """cos/sin of every (position, frequency): shape (max_seq_len, head_dim // 2, 2), fp32."""
    exponents = torch.arange(0, config.head_dim, 2, device=device, dtype=torch.float32) / config.head_dim
    freqs = 1.0 / (config.rope_theta**exponents)
    if config.rope_scaling is not None:
        freqs = _scaled_frequencies(freqs, config.rope_scaling)
    angles = torch.outer(torch.arange(config.max_seq_len, device=device, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, rows: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x: (bs, seqlen, heads, head_dim) by the RoPE table's rows of
    their positions: (seqlen, head_dim/2, 2), the same for every sequence, or (bs, seqlen, head_dim/2, 2).

    On CUDA one Triton kernel each way (``titan_strategy.kernels.rope``), since inductor's kernels for the torch
    code read at about a third of memory speed; ``apply_rope_in_torch`` elsewhere.
    """
    if rope_kernel_takes(x, rows):
        return rotate_pairs(x, rows)
    return apply_rope_in_torch(x, rows)


def apply_rope_in_torch(x: Tensor, rows: Tensor) -> Tensor:
    """``apply_rope`` in torch ops. Real-valued on purpose: inductor cannot fuse complex arithmetic."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (bs, seqlen, heads, head_dim/2, 2)
    rows = rows if rows.ndim == 4 else rows[None]
    cos, sin = rows[:, :, None, :, 0], rows[:, :, None, :, 1]  # (bs or 1, seqlen, 1, head_dim/2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class RotaryTable(nn.Module):
    """Holds the RoPE cos/sin table as a non-persistent buffer: derived from the config, never checkpointed."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("table", rope_table(config), persistent=False)

    def forward(self) -> Tensor:
        return self.table

    def reset_parameters(self) -> None:
        self.table.copy_(rope_table(self.config, device=self.table.device))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        # On CUDA one Triton kernel each way (titan_strategy.kernels.rms_norm): inductor's backward for the torch
        # code is three kernels, each reading the rows.
        if rms_norm_kernel_takes(x, self.weight):
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_in_torch(x, self.weight, self.eps)


def rms_norm_in_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``RMSNorm`` in torch ops: normalized in fp32, rounded to x's dtype, then scaled."""
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x) * weight


class AttentionCore(nn.Module):
    """Scaled dot-product attention of (bs, heads, seqlen, head_dim) tensors: causal, or under a document mask.

    Key and value may have fewer heads than the query (grouped-query attention): each then serves
    ``query heads / kv heads`` consecutive query heads. The kernels do that themselves, which is faster
    than expanding key and value first and keeps the expanded copies out of the saved activations.

    A module of its own so that a parallelism can take over exactly this call (context parallelism
    turns it into ring attention over sequence shards, or gathers the keys and values under a mask).

    ``kernel``: ``sdpa`` (torch's SDPA, which picks its backend; causal, or with a dense boolean mask),
    ``fa4`` (FlashAttention-4, Hopper and Blackwell, causal: ``titan_strategy.kernels.flash_attention4``) or
    ``flex`` (FlexAttention with a block-sparse mask; compiled). ``mask``: None (causal) or what
    ``DocumentMasking`` built for this kernel.
    """

    def __init__(self, kernel: str = "sdpa") -> None:
        super().__init__()
        check_attention_kernel(kernel, "block_causal" if kernel == "flex" else "causal", resolved=True)
        self.kernel = kernel

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: AttentionMask | None = None) -> Tensor:
        grouped = query.size(1) != key.size(1)
        if self.kernel == "flex":
            return flex_attention(query, key, value, mask)
        if self.kernel == "fa4":  # it takes (bs, seqlen, heads, head_dim): the layout the projections made
            out, _ = flash_attention4(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
            return out.transpose(1, 2)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=grouped)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, attention_kernel: str = "sdpa") -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        self.sdpa = AttentionCore(attention_kernel)

    def forward(self, x: Tensor, rope: Tensor, positions: Tensor, mask: AttentionMask | None) -> Tensor:
        """``rope``: the RoPE table; ``positions``: each token's row of it, (seqlen,) or (bs, seqlen)."""
        # x may be a tensor-parallel DTensor; its shape is then the global one, which RoPE needs.
        bs, seqlen, _ = x.shape
        if positions.ndim == 1:  # the positions of the window, which may be longer than this sequence
            if seqlen > positions.shape[0]:
                raise ValueError(f"Sequence length {seqlen} exceeds max_seq_len={positions.shape[0]}; raise "
                                 "LlamaModule(max_seq_len=...) or shorten the data's seq_len.")
            positions = positions[:seqlen]
        rope = rope[positions]
        # -1 instead of n_heads: under tensor parallelism each rank holds only its share of heads.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_local_heads, head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, seqlen, n_local_kv_heads, head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # (bs, n_local_heads, seqlen, hd)
        out = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: LlamaConfig, attention_kernel: str = "sdpa") -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, attention_kernel)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_dim)

    def forward(self, x: Tensor, rope: Tensor, positions: Tensor, mask: AttentionMask | None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope, positions, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputProjection(nn.Linear):
    """The projection onto the vocabulary. Given ``labels`` it returns the next-token cross-entropy summed over the
    labelled tokens (fp32, labels of -100 ignored) instead of the logits, which then never exist whole
    (``titan_strategy.kernels.linear_cross_entropy``), ``chunk_tokens`` tokens at a time."""

    def __init__(self, dim: int, vocab_size: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__(dim, vocab_size, bias=False)
        self.chunk_tokens = chunk_tokens

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        if labels is None:
            return super().forward(x)
        return linear_cross_entropy(x, self.weight, labels, self.chunk_tokens)


class Llama(nn.Module):
    """Token ids (bs, seqlen) -> logits (bs, seqlen, vocab_size); with ``labels``, their loss sum instead.

    ``tok_embeddings``, ``norm`` and ``output`` may be set to ``None`` (a pipeline stage without
    them): then the input is the hidden state and the output the hidden state. ``attention_kernel``:
    see ``AttentionCore``; ``attention_mask`` and ``rope_positions``: see ``DocumentMasking``;
    ``loss_chunk_tokens``: see ``OutputProjection``.
    """

    def __init__(self, config: LlamaConfig, attention_kernel: str = "sdpa", attention_mask: str = "causal",
                 rope_positions: RopePositions = "document", loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        check_attention_kernel(attention_kernel, attention_mask, resolved=True)
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, attention_kernel)
                                     for i in range(config.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(config.dim, config.norm_eps)
        self.output: OutputProjection | None = OutputProjection(config.dim, config.vocab_size, loss_chunk_tokens)
        self.rope = RotaryTable(config)
        self.documents = DocumentMasking(config.max_seq_len, attention_mask, attention_kernel, rope_positions)

    def forward(self, tokens: Tensor, document_ids: Tensor | None = None, labels: Tensor | None = None) -> Tensor:
        """``document_ids`` (bs, seqlen): which document of the window each token belongs to (see
        ``llama_module.documents``); needed by the block-causal mask, ignored by the causal one. ``labels``
        (bs, seqlen): the next tokens, -100 where unlabelled; the output is then the 0-dim fp32 cross-entropy summed
        over the labelled tokens, computed a chunk of tokens at a time without the full logits."""
        positions, mask = self.documents(document_ids)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        rope = self.rope()
        for block in self.layers.values():
            h = block(h, rope, positions, mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        return self.output(h) if labels is None else self.output(h, labels=labels)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None, fill: ParamFiller = fill_in_place) -> None:
        """Fill every parameter and buffer; works after ``to_empty``.

        Each parameter is drawn from its own generator seeded by (seed, parameter name), so the
        values depend neither on the order of construction nor on how the model is later split,
        sharded or placed. ``fill`` lets a caller hand each initializer a full-size tensor.
        ``seed=None`` takes ``torch.initial_seed()``, which ``seed_everything`` sets.
        """
        base_seed = torch.initial_seed() if seed is None else seed
        self.rope.reset_parameters()
        self.documents.reset_parameters()
        for name, param in self.named_parameters():
            generator = torch.Generator(device=param.device)
            generator.manual_seed((base_seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            fill(param, self._initializer(name, generator))

    def _initializer(self, name: str, generator: torch.Generator) -> Initializer:
        config = self.config
        if name.endswith("norm.weight"):
            return nn.init.ones_
        if name.startswith("tok_embeddings"):
            return lambda t: nn.init.normal_(t, std=1.0, generator=generator)
        if name.startswith("output"):
            std = config.dim**-0.5
            return lambda t: nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=generator)
        # Projections that write into the residual stream shrink with depth (GPT-2 style), so the
        # stream's variance does not grow with the number of blocks.
        layer_id = int(name.split(".")[1])
        writes_residual = name.endswith(("wo.weight", "w2.weight", "w3.weight"))
        std = 0.02 / math.sqrt(2 * (layer_id + 1)) if writes_residual else 0.02
        return lambda t: nn.init.trunc_normal_(t, std=std, a=-2 * std, b=2 * std, generator=generator)
