"""Documents -> packed (seq_len + 1)-token windows: each document wrapped in BOS/EOS, concatenated, and cut into
windows whose labels are the inputs shifted by one, with the document each token belongs to."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset

from llama_module.tokenizer import Tokenizer

if TYPE_CHECKING:  # datasets (with pyarrow and pandas) takes a second to import: done where documents load
    import datasets

__all__ = ["PackedWindows", "packed_window"]


def packed_window(tokens: torch.Tensor, bos_id: int, mask_boundary_labels: bool = False) -> dict[str, torch.Tensor]:
    """A (seq_len + 1)-token window of BOS-led documents as a sample: ``input_ids``, ``labels`` (shifted by one) and
    ``document_ids`` (0 for the window's first, possibly partial, document, then 1, 2... at each BOS).

    With ``mask_boundary_labels`` the label that crosses into the next document (its BOS, predicted from the
    previous document's last token) is -100.
    """
    documents = torch.cumsum(tokens == bos_id, 0)
    documents -= documents[0].clone()
    labels = tokens[1:].clone()
    if mask_boundary_labels:
        labels[documents[1:] != documents[:-1]] = -100
    return {"input_ids": tokens[:-1], "labels": labels, "document_ids": documents[:-1]}


class PackedWindows(IterableDataset):
    """Concatenates tokenized documents (each wrapped in BOS/EOS) and cuts (seq_len + 1)-token windows.

    Yields ``packed_window``'s ``{"input_ids", "labels", "document_ids"}``, each [seq_len].
    """

    def __init__(self, documents: datasets.IterableDataset, tokenizer: Tokenizer, seq_len: int, *,
                 text_field: str = "text", repeat: bool = True, mask_boundary_labels: bool = False) -> None:
        self.documents = documents
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.text_field = text_field
        self.repeat = repeat
        self.mask_boundary_labels = mask_boundary_labels
        self._start = documents.state_dict()
        self._buffer: list[int] = []
        self._epoch = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        empty_passes = 0  # the first pass may start at a resumed position, the second starts at the top
        while True:
            windows = 0
            for document in self.documents:
                self._buffer.extend(self.tokenizer.encode(document[self.text_field], bos=True, eos=True))
                while len(self._buffer) > self.seq_len:
                    window = torch.tensor(self._buffer[: self.seq_len + 1])
                    del self._buffer[: self.seq_len + 1]
                    windows += 1
                    yield packed_window(window, self.tokenizer.bos_id, self.mask_boundary_labels)
            if not self.repeat:
                return
            empty_passes = 0 if windows else empty_passes + 1
            if empty_passes == 2:
                raise ValueError(f"These documents hold fewer than seq_len + 1 = {self.seq_len + 1} tokens in all: "
                                 "too few for one window. Use a larger corpus, a shorter seq_len or (each slot of "
                                 "the global batch reads its own share of the corpus) a smaller global batch.")
            # A datasets stream restarts from its last loaded state, not from the top: rewind explicitly.
            self._epoch += 1
            self.documents.load_state_dict(self._start)

    def rewind(self) -> None:
        """Back to the first window of the first epoch."""
        self.load_state_dict({"documents": self._start, "buffer": [], "epoch": 0})

    def state_dict(self) -> dict[str, Any]:
        return {"documents": self.documents.state_dict(), "buffer": list(self._buffer), "epoch": self._epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.documents.load_state_dict(state["documents"])
        self._buffer = list(state["buffer"])
        self._epoch = state["epoch"]
