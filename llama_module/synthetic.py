"""Random token windows cut into documents of real C4 lengths: what benchmarks and ``titan rehearse`` train on
when the point is the shape of the work, not what is learned."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.utils.data import Dataset

__all__ = ["C4_LENGTHS", "RandomTokens", "document_ids"]

# Token lengths of 40 real C4 documents (mean 528, median 423); the file says how they were measured.
C4_LENGTHS: list[int] = json.loads((Path(__file__).parent / "assets" / "c4_document_lengths.json").read_text())[
    "lengths"]


def document_ids(index: int, seq_len: int) -> torch.Tensor:
    """Window ``index`` cut into documents of C4's lengths, drawn at random (the first starts partway in)."""
    generator = torch.Generator().manual_seed(index)
    draws = torch.randint(0, len(C4_LENGTHS), (seq_len,), generator=generator)
    lengths = torch.tensor(C4_LENGTHS)[draws]
    lengths[0] = torch.randint(1, int(lengths[0]) + 1, (), generator=generator)
    return torch.repeat_interleave(torch.arange(seq_len), lengths)[:seq_len]


class RandomTokens(Dataset):
    """``length`` windows of ``seq_len`` random tokens below ``vocab``; with ``documents``, also their
    ``document_ids`` (C4 lengths), for the block-causal mask."""

    def __init__(self, length: int, seq_len: int, vocab: int, documents: bool = False) -> None:
        self.length, self.seq_len, self.vocab, self.documents = length, seq_len, vocab, documents

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=torch.Generator().manual_seed(index))
        sample = {"input_ids": tokens[:-1], "labels": tokens[1:]}
        return {**sample, "document_ids": document_ids(index, self.seq_len)} if self.documents else sample
