"""TextDataModule: documents from ``datasets`` -> tokens -> packed (seq_len + 1)-token windows.

Training windows come in one global order that does not depend on the data-parallel layout
(``window_order.py``): each data-parallel (``batch`` mesh) rank trains on its share of every global
batch, and ranks that only split the model (TP/CP/PP) get identical batches. The stream repeats
forever; its position is global, so a resumed run sees exactly the windows it would have seen, on
any number of data-parallel ranks.
"""

from __future__ import annotations

import glob
import json
import logging
import lzma
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from llama_module.packed_windows import PackedWindows
from llama_module.tokenizer import load_tokenizer
from llama_module.window_order import GlobalWindows, ResumableLoader

if TYPE_CHECKING:  # datasets (with pyarrow and pandas) takes a second to import: done where documents load
    import datasets

__all__ = ["TextDataModule", "load_documents", "offline_corpus_texts"]

log = logging.getLogger(__name__)

# Wikipedia summaries in English, French and Spanish (CC BY-SA 4.0: assets/LICENSE.wikipedia_summaries), 3.7M tokens.
OFFLINE_CORPUS = Path(__file__).parent / "assets" / "wikipedia_summaries.jsonl.xz"
_OFFLINE_SHARDS = 64  # divisible by every power-of-two data-parallel degree up to 64
_VALIDATION_EVERY = 50  # the offline corpus holds out every 50th document for validation
_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


def offline_corpus_texts(languages: tuple[str, ...] = ("en", "fr", "es")) -> list[str]:
    """The bundled Wikipedia summaries of ``languages`` ("en", "fr", "es"), in the asset's order."""
    with lzma.open(OFFLINE_CORPUS, "rt", encoding="utf-8") as lines:
        entries = [json.loads(line) for line in lines]
    return [entry["text"] for entry in entries if entry["lang"] in languages]


def _offline_documents(split: str, seed: int) -> datasets.IterableDataset:
    import datasets

    texts = offline_corpus_texts()
    keep = [t for i, t in enumerate(texts) if (i % _VALIDATION_EVERY == 0) == (split == "validation")]
    random.Random(seed).shuffle(keep)  # fixed order: a streaming shuffle buffer could not be resumed exactly
    return datasets.Dataset.from_dict({"text": keep}).to_iterable_dataset(num_shards=_OFFLINE_SHARDS)


def _file_format(files: list[str]) -> str:
    suffixes = {Path(f.removesuffix(".gz")).suffix for f in files}
    formats = {_FORMATS.get(suffix) for suffix in suffixes}
    if len(formats) != 1 or None in formats:
        raise ValueError(f"Cannot read {sorted(suffixes)} files together; "
                         f"use one of {sorted(_FORMATS)} (optionally .gz).")
    return formats.pop()


def load_documents(source: str, split: str, *, seed: int = 0) -> datasets.IterableDataset:
    """Stream documents from ``source``.

    Args:
        source: "offline" (the bundled Wikipedia summaries), "c4" (allenai/c4 en, needs network), or a
            local file, directory or glob of json/jsonl/parquet/txt files (.gz allowed).
        split: "train" or "validation"; local files only have "train".
        seed: order of the offline corpus.
    """
    import datasets

    if source == "offline":
        return _offline_documents(split, seed)
    if source == "c4":
        return datasets.load_dataset("allenai/c4", "en", split=split, streaming=True)
    path = Path(source)
    files = sorted(str(p) for p in path.rglob("*") if p.is_file()) if path.is_dir() else sorted(glob.glob(source))
    if not files:
        raise FileNotFoundError(f"source={source!r} matches no file; "
                                "give 'offline', 'c4', a file, a directory or a glob.")
    return datasets.load_dataset(_file_format(files), data_files=files, split="train", streaming=True)


class TextDataModule(L.LightningDataModule):
    """Packed next-token-prediction batches ``{"input_ids", "labels", "document_ids"}`` of shape (batch_size,
    seq_len), training batches also with ``window_id``; ``document_ids`` numbers each window's documents (what
    ``LlamaModule(attention_mask="block_causal")`` masks attention by, ``llama_module.documents``).

    Args:
        source: "offline", "c4", or local files (see ``load_documents``).
        seq_len: tokens per sample.
        batch_size: windows per batch on each data-parallel rank. The first run's global batch
            (``batch_size`` x data-parallel ranks) fixes the order of the training windows for good: a
            resumed run continues in it on any layout and global batch (``window_order.py``).
        tokenizer: path of a tiktoken BPE file (Llama 3's tokenizer.model), or a transformers model directory (its
            tokenizer, for ``CausalLM(pretrained=...)``); None: the built-in 8k BPE.
        val_source: documents for validation; None: the offline corpus's held-out split, C4's
            validation split, or no validation for local files.
        val_batches: validation batches per rank and validation run.
        text_field: the document field holding the text.
        seed: document order of the offline corpus.
        mask_boundary_labels: the label crossing from one document into the next (its BOS) is -100, so no token
            learns to predict across a boundary. The loss is a mean over labelled tokens, so this changes nothing
            else.
    """

    def __init__(self, source: str = "offline", seq_len: int = 256, batch_size: int = 8, tokenizer: str | None = None,
                 val_source: str | None = None, val_batches: int = 8, text_field: str = "text", seed: int = 0,
                 mask_boundary_labels: bool = False) -> None:
        super().__init__()
        if seq_len < 1 or batch_size < 1 or val_batches < 0:
            raise ValueError(f"seq_len={seq_len} and batch_size={batch_size} must be >= 1, "
                             f"val_batches={val_batches} >= 0.")
        self.save_hyperparameters()
        self.source = source
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_source = val_source
        self.val_batches = val_batches
        self.text_field = text_field
        self.seed = seed
        self.mask_boundary_labels = mask_boundary_labels
        self.tokenizer = load_tokenizer(tokenizer)
        self._train: GlobalWindows | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _data_parallel_rank(self) -> tuple[int, int]:
        """(rank, world) among ranks that get different data: the strategy's sampler view."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
        return kwargs.get("rank", 0), kwargs.get("num_replicas", 1)

    def _share(self, documents: datasets.IterableDataset, share: int, shares: int, repeat: bool) -> PackedWindows:
        from datasets.distributed import split_dataset_by_node

        documents = split_dataset_by_node(documents, rank=share, world_size=shares)
        return PackedWindows(documents, self.tokenizer, self.seq_len, text_field=self.text_field, repeat=repeat,
                             mask_boundary_labels=self.mask_boundary_labels)

    def _windows(self, source: str, split: str, repeat: bool) -> PackedWindows:
        """This data-parallel rank's share of the documents, packed (validation)."""
        return self._share(load_documents(source, split, seed=self.seed), *self._data_parallel_rank(), repeat=repeat)

    def setup(self, stage: str) -> None:
        if stage == "fit" and self._train is None:
            documents = load_documents(self.source, "train", seed=self.seed)
            self._train = GlobalWindows(lambda lane, lanes: self._share(documents, lane, lanes, repeat=True),
                                        self.seq_len, self.batch_size, *self._data_parallel_rank())

    def train_dataloader(self) -> ResumableLoader:
        assert self._train is not None, "setup('fit') builds the training stream"
        return ResumableLoader(self._train)

    def val_dataloader(self) -> DataLoader | list:
        source = self.val_source or self.source
        held_out = source in ("offline", "c4")  # these have a validation split; local files do not
        if self.val_batches == 0 or (self.val_source is None and not held_out):
            return []
        split = "validation" if held_out else "train"
        windows = _FirstWindows(self._windows(source, split, repeat=True), self.val_batches * self.batch_size)
        return DataLoader(windows, batch_size=self.batch_size, num_workers=0)


class _FirstWindows(IterableDataset):
    """The same first ``count`` windows on every validation run, so val_loss is comparable across runs."""

    def __init__(self, windows: PackedWindows, count: int) -> None:
        self.windows = windows
        self.count = count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        self.windows.rewind()
        for index, window in enumerate(self.windows):
            if index == self.count:
                return
            yield window
