"""Documents in a packed window: which keys each query may attend, and the RoPE position of each token.

A batch says where documents start with ``document_ids``, a LongTensor (batch, seq_len) in the batch dict next
to ``input_ids``: tokens with the same id in one unbroken run belong to one document (``TextDataModule`` numbers
the documents of each window 0, 1, 2...; any labelling whose runs mark the documents does). With
``attention_mask="block_causal"`` a token attends to the earlier tokens of its own document only, and, with
``rope_positions="document"``, its RoPE position counts from its document's first token; a document in a packed
window then gets the very logits it would get alone. ``attention_mask="causal"`` ignores ``document_ids``.

The mask is built once per forward from the batch, in the form the attention kernel takes (a dense boolean
mask for SDPA, a block-sparse ``BlockMask`` for FlexAttention), and handed to every block. Nothing here knows
about parallelism: a context-parallel rank holds some of the sequence's tokens, and swaps ``token_index`` (each
held token's index in the window, a buffer) for its own; keys and values then come whole from every rank.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.nn.attention.flex_attention import flex_attention as _flex_attention

from titan_strategy import check_choice, simulating_ranks

__all__ = ["AttentionMask", "AttentionMaskKind", "DocumentMasking", "RopePositions", "check_document_ids",
           "check_masking", "flex_attention"]

AttentionMask = Tensor | BlockMask
AttentionMaskKind = Literal["causal", "block_causal"]
RopePositions = Literal["document", "window"]

_compiled_flex_attention = torch.compile(_flex_attention, dynamic=False)


def flex_attention(query: Tensor, key: Tensor, value: Tensor, mask: BlockMask) -> Tensor:
    """FlexAttention under ``mask``, compiled (uncompiled it materializes every score); inside a compiled block
    the block's compilation takes it in."""
    attend = _flex_attention if torch.compiler.is_compiling() else _compiled_flex_attention
    return attend(query, key, value, block_mask=mask, enable_gqa=query.size(1) != key.size(1))


def check_masking(attention_mask: str, rope_positions: str) -> None:
    """A ValueError naming the allowed values, for an unknown mask or RoPE-position rule."""
    check_choice("attention_mask", attention_mask, AttentionMaskKind)
    check_choice("rope_positions", rope_positions, RopePositions)


def check_document_ids(document_ids: Tensor | None, input_ids: Tensor | None = None) -> Tensor:
    """``document_ids`` as the block-causal mask needs them, or a ValueError that names the fix."""
    if document_ids is None:
        raise ValueError("attention_mask='block_causal' needs the batch's 'document_ids' (batch, seq_len), which "
                         "TextDataModule gives; add them to your batches (a LongTensor numbering each window's "
                         "documents), or use LlamaModule(attention_mask='causal').")
    if document_ids.dtype != torch.long or document_ids.ndim != 2:
        raise ValueError(f"document_ids must be a LongTensor (batch, seq_len); got {document_ids.dtype} of shape "
                         f"{tuple(document_ids.shape)}. Make it with torch.long, one id per token.")
    if input_ids is not None and document_ids.shape != input_ids.shape:
        raise ValueError(f"document_ids has shape {tuple(document_ids.shape)}, but input_ids has "
                         f"{tuple(input_ids.shape)}; give one document id per input token.")
    return document_ids


def _runs(document_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For every token: the number of its document's run in the window, and the index of the run's first token."""
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    index = torch.arange(document_ids.shape[1], device=document_ids.device)
    return starts.cumsum(1), torch.where(starts, index, 0).cummax(1).values


class DocumentMasking(nn.Module):
    """``document_ids -> (positions, mask)``, what every block's attention takes.

    Args:
        max_seq_len: the longest window.
        attention_mask: ``causal`` (every earlier token of the window) or ``block_causal`` (earlier tokens of the
            same document).
        kernel: the attention kernel the mask is built for (``sdpa``: dense; ``flex``: ``BlockMask``).
        rope_positions: under ``block_causal``, ``document`` restarts RoPE positions at each document, ``window``
            keeps the window's positions. Causal attention always uses the window's.

    ``positions`` is each token's row of the RoPE table: (seqlen,) shared by the batch, or (batch, seqlen);
    ``mask`` is None for causal attention.
    """

    def __init__(self, max_seq_len: int, attention_mask: str = "causal", kernel: str = "sdpa",
                 rope_positions: str = "document") -> None:
        super().__init__()
        check_masking(attention_mask, rope_positions)
        self.max_seq_len = max_seq_len
        self.attention_mask = attention_mask
        self.kernel = kernel
        self.rope_positions = rope_positions
        # Each held token's index in the window; a context-parallel rank swaps in its own tokens' indices.
        self.register_buffer("token_index", torch.arange(max_seq_len), persistent=False)

    def reset_parameters(self) -> None:
        self.token_index.copy_(torch.arange(self.max_seq_len, device=self.token_index.device))

    def forward(self, document_ids: Tensor | None) -> tuple[Tensor, AttentionMask | None]:
        if self.attention_mask == "causal":
            return self.token_index, None
        document_ids = check_document_ids(document_ids)
        seq_len = document_ids.shape[1]
        if seq_len > self.max_seq_len:
            raise ValueError(f"Sequence length {seq_len} exceeds max_seq_len={self.max_seq_len}; raise "
                             "LlamaModule(max_seq_len=...) or shorten the data's seq_len.")
        queries = self.token_index[:seq_len]  # the window's tokens this rank holds (all of them without CP)
        runs, run_starts = _runs(document_ids)
        positions = queries - run_starts[:, queries] if self.rope_positions == "document" else queries
        return positions, self._mask(runs, queries)

    def _mask(self, runs: Tensor, queries: Tensor) -> AttentionMask:
        """Query ``i`` (window index ``queries[i]``) may attend key ``j`` of the window: same run, not later."""
        if self.kernel == "flex":
            if simulating_ranks():
                raise ValueError("attention_kernel='flex' compiles its kernel and mask, which simulated ranks' "
                                 "tensors cannot go through; simulate block-causal attention with "
                                 "attention_kernel='sdpa' (a dense mask).")

            def same_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                query = queries[q]
                return (runs[b, query] == runs[b, kv]) & (query >= kv)

            return create_block_mask(same_document_causal, runs.shape[0], None, queries.shape[0], runs.shape[1],
                                     device=runs.device, _compile=runs.device.type == "cuda")
        keys = torch.arange(runs.shape[1], device=runs.device)
        same_document = runs[:, queries, None] == runs[:, None, :]  # (batch, queries, keys)
        return (same_document & (queries[:, None] >= keys[None, :]))[:, None]  # (batch, 1, queries, keys)
