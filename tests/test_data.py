"""TextDataModule: packing, per-rank sharding, exact resume, local files."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from llama_module.data import (
    PackedWindows,
    ResumableLoader,
    TextDataModule,
    load_documents,
)
from llama_module.tokenizer import Tokenizer

pytestmark = pytest.mark.unit


def _module(source: str, rank: int = 0, world: int = 1, **kwargs) -> TextDataModule:
    module = TextDataModule(source=source, **{"seq_len": 16, "batch_size": 2, **kwargs})
    module.trainer = SimpleNamespace(strategy=SimpleNamespace(distributed_sampler_kwargs={"rank": rank,
                                                                                          "num_replicas": world}))
    return module


@pytest.fixture()
def numbered_corpus(tmp_path: Path) -> Path:
    """8 jsonl.gz files of documents that say their own number."""
    for f in range(8):
        with gzip.open(tmp_path / f"part{f}.jsonl.gz", "wt") as out:
            for d in range(5):
                out.write(json.dumps({"text": f"document {f * 5 + d} of the corpus."}) + "\n")
    return tmp_path


def _document_numbers(module: TextDataModule) -> list[int]:
    windows = module._windows(module.source, "train", repeat=False)
    # A window's tokens are its inputs plus the last label; consecutive windows do not overlap.
    text = "".join(module.tokenizer.decode(w["input_ids"].tolist() + w["labels"][-1:].tolist()) for w in windows)
    return [int(n) for n in re.findall(r"document (\d+) ", text)]


def test_windows_are_shifted_slices_of_the_document_stream() -> None:
    tokenizer = Tokenizer()
    texts = ["first document here", "a second, longer document follows it"]
    documents = datasets.Dataset.from_dict({"text": texts}).to_iterable_dataset()
    windows = list(PackedWindows(documents, tokenizer, seq_len=5, repeat=False))
    stream = [t for text in texts for t in tokenizer.encode(text, bos=True, eos=True)]
    assert len(windows) == len(stream) // 6
    for i, window in enumerate(windows):
        assert window["input_ids"].tolist() == stream[6 * i : 6 * i + 5]
        assert window["labels"].tolist() == stream[6 * i + 1 : 6 * i + 6]


def test_data_parallel_ranks_read_disjoint_shares_and_replicas_read_the_same(numbered_corpus: Path) -> None:
    rank0 = _document_numbers(_module(str(numbered_corpus), rank=0, world=2))
    rank1 = _document_numbers(_module(str(numbered_corpus), rank=1, world=2))
    assert rank0 and rank1 and not set(rank0) & set(rank1)
    # Together they cover the corpus (but for documents stuck in a last, incomplete window).
    assert set(range(36)) <= set(rank0) | set(rank1) <= set(range(40))
    # A TP/CP/PP peer has the same batch rank, so it reads exactly the same windows.
    assert _document_numbers(_module(str(numbered_corpus), rank=1, world=2)) == rank1


def test_loader_position_resumes_exactly_despite_lightning_prefetch() -> None:
    def loader() -> ResumableLoader:
        module = _module("offline")
        module.setup("fit")
        return module.train_dataloader()

    first = loader()
    iterator = iter(first)
    batches = [next(iterator) for _ in range(7)]
    # Lightning has trained on batches 0-5 and prefetched batch 6, so a resume must replay batch 6.
    state = first.state_dict()
    following = [batches[6]] + [next(iterator) for _ in range(2)]
    resumed = loader()
    resumed.load_state_dict(state)
    replay = [batch for _, batch in zip(range(3), resumed)]
    for expected, got in zip(following, replay, strict=True):
        assert torch.equal(expected["input_ids"], got["input_ids"])


def test_training_stream_repeats_past_the_end_of_the_corpus(numbered_corpus: Path) -> None:
    module = _module(str(numbered_corpus), seq_len=8)
    module.setup("fit")
    per_epoch = len(list(module._windows(module.source, "train", repeat=False)))
    stream = iter(module._train)
    windows = [next(stream) for _ in range(2 * per_epoch + 1)]
    text = "".join(module.tokenizer.decode(w["input_ids"].tolist() + w["labels"][-1:].tolist()) for w in windows)
    assert text.count("document 0 of the corpus.") == 2  # the second epoch reads the corpus again


def test_validation_sees_the_same_held_out_windows_every_time() -> None:
    module = _module("offline", val_batches=2)
    first = [b["input_ids"] for b in module.val_dataloader()]
    second = [b["input_ids"] for b in module.val_dataloader()]
    assert len(first) == 2 and all(torch.equal(a, b) for a, b in zip(first, second))


def test_local_files_without_val_source_have_no_validation(numbered_corpus: Path) -> None:
    assert _module(str(numbered_corpus)).val_dataloader() == []


def test_real_c4_and_common_crawl_rows_load(fixtures_dir: Path) -> None:
    for pattern in ("olmo_c4-sample.*.json.gz", "dolma_cc_en_head-*.jsonl.gz"):
        module = _module(str(fixtures_dir / pattern), seq_len=64)
        module.setup("fit")
        batch = next(iter(module.train_dataloader()))
        assert batch["input_ids"].shape == (2, 64)
        assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])


@pytest.mark.parametrize(("source", "error", "message"), [
    ("{tmp}/nothing-*.jsonl", FileNotFoundError, r"matches no file; give 'offline', 'c4'"),
    ("{tmp}/mixed", ValueError, r"Cannot read \['.json', '.parquet'\] files together"),
])
def test_bad_sources_are_explained(source: str, error: type, message: str, tmp_path: Path) -> None:
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.json").write_text("{}")
    (tmp_path / "mixed" / "b.parquet").write_text("")
    with pytest.raises(error, match=message):
        load_documents(source.format(tmp=tmp_path), "train")


@pytest.mark.parametrize("suffix", ["parquet", "txt"])
def test_parquet_and_text_files_load(suffix: str, tmp_path: Path) -> None:
    texts = [f"line {i} of a local corpus file" for i in range(20)]
    if suffix == "parquet":
        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "corpus.parquet"))
    else:
        (tmp_path / "corpus.txt").write_text("\n".join(texts) + "\n")
    documents = list(load_documents(str(tmp_path / f"*.{suffix}"), "train"))
    assert [d["text"] for d in documents] == texts
