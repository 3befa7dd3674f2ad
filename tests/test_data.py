"""TextDataModule: packing, the global window order under any layout, exact and elastic resume, local files."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from llama_module.data import OFFLINE_CORPUS, TextDataModule, load_documents, offline_corpus_texts
from llama_module.packed_windows import PackedWindows
from llama_module.tokenizer import Tokenizer
from llama_module.window_order import ResumableLoader
from titan_strategy import ELASTIC_POSITION_KEY

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


def test_training_batches_number_their_documents_and_can_mask_the_boundary_labels(numbered_corpus: Path) -> None:
    plain, masked = (_module(str(numbered_corpus), mask_boundary_labels=mask) for mask in (False, True))
    for module in (plain, masked):
        module.setup("fit")
    bos = plain.tokenizer.bos_id
    for batch, masked_batch in zip(plain.train_dataloader(), masked.train_dataloader()):
        ids, labels = batch["document_ids"], batch["labels"]
        # a new document id exactly where a BOS token starts a document
        starts = torch.cat([torch.zeros_like(ids[:, :1]), ids.diff(dim=1)], dim=1)
        assert torch.equal(starts, (batch["input_ids"] == bos).long() * (torch.arange(16) > 0))
        crossing = torch.cat([ids.diff(dim=1) != 0, labels[:, -1:] == bos], dim=1)
        assert torch.equal(crossing, labels == bos) and crossing.any()
        assert torch.equal(masked_batch["labels"], labels.masked_fill(crossing, -100))
        break


def test_data_parallel_ranks_read_disjoint_shares_and_replicas_read_the_same(numbered_corpus: Path) -> None:
    rank0 = _document_numbers(_module(str(numbered_corpus), rank=0, world=2))
    rank1 = _document_numbers(_module(str(numbered_corpus), rank=1, world=2))
    assert rank0 and rank1 and not set(rank0) & set(rank1)
    # Together they cover the corpus (but for documents stuck in a last, incomplete window).
    assert set(range(36)) <= set(rank0) | set(rank1) <= set(range(40))
    # A TP/CP/PP peer has the same batch rank, so it reads exactly the same windows.
    assert _document_numbers(_module(str(numbered_corpus), rank=1, world=2)) == rank1


def _loader(source: str, rank: int = 0, world: int = 1, **kwargs) -> ResumableLoader:
    module = _module(source, rank, world, **kwargs)
    module.setup("fit")
    return module.train_dataloader()


def _trained(loader: ResumableLoader, batches: int) -> dict:
    """The state Lightning's loop saves after training on ``batches`` batches (it has fetched one more)."""
    iterator = iter(loader)
    for _ in range(batches + 1):
        next(iterator)
    return loader.state_dict()


def _global_windows(loaders: list[ResumableLoader], batches: int) -> dict[int, list[int]]:
    """Window id -> its tokens, over the next ``batches`` batches of every data-parallel rank's loader."""
    windows = {}
    for loader in loaders:
        for _, batch in zip(range(batches), loader):
            windows.update(zip(batch["window_id"].tolist(), batch["input_ids"].tolist()))
    return windows


def test_loader_position_resumes_exactly_despite_lightning_prefetch() -> None:
    uninterrupted = _global_windows([_loader("offline")], 9)
    resumed = _loader("offline")
    resumed.load_state_dict(_trained(_loader("offline"), 6))
    # Lightning trained on batches 0-5 and prefetched batch 6, so a resume starts at batch 6: windows 12 and 13.
    windows = _global_windows([resumed], 3)
    assert windows == {i: uninterrupted[i] for i in range(12, 18)}


def test_the_window_order_is_the_same_for_every_data_parallel_layout() -> None:
    one_rank = _global_windows([_loader("offline", batch_size=4)], 3)
    assert sorted(one_rank) == list(range(12))
    for world, batch_size in ((2, 2), (4, 1)):
        ranks = [_loader("offline", rank, world, batch_size=batch_size) for rank in range(world)]
        assert _global_windows(ranks, 3) == one_rank
    # Ranks take consecutive windows of each global batch.
    assert next(iter(_loader("offline", 1, 2, batch_size=2)))["window_id"].tolist() == [2, 3]


def _saved_ranks(world: int, batch_size: int, batches: int) -> dict:
    """What TitanStrategy hands every rank's loader at a resume: each saved rank's state."""
    states = [_trained(_loader("offline", rank, world, batch_size=batch_size), batches) for rank in range(world)]
    assert all(state[ELASTIC_POSITION_KEY] for state in states)
    return {ELASTIC_POSITION_KEY: True, "saved_ranks": states}


def _counting_packed_windows(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, torch.Tensor]]:
    """Every window any lane packs from now on."""
    packed: list[dict[str, torch.Tensor]] = []
    pack = PackedWindows.__iter__
    monkeypatch.setattr(PackedWindows, "__iter__", lambda self: (packed.append(w) or w for w in pack(self)))
    return packed


def _resumed(saved: dict, world: int, batch_size: int) -> list[ResumableLoader]:
    loaders = [_loader("offline", rank, world, batch_size=batch_size) for rank in range(world)]
    for loader in loaders:
        loader.load_state_dict(saved)
    return loaders


@pytest.mark.parametrize(("world", "batch_size"), [(4, 1), (1, 4), (2, 2)], ids=["dp4", "dp1", "dp2"])
def test_a_resume_on_another_layout_continues_the_order(world: int, batch_size: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    uninterrupted = _global_windows([_loader("offline", batch_size=4)], 5)
    resumed = _resumed(_saved_ranks(2, 2, batches=3), world, batch_size)
    packed = _counting_packed_windows(monkeypatch)
    windows = _global_windows(resumed, 2)
    assert sorted(windows) == list(range(12, 20))  # none repeated, none skipped
    assert windows == {i: uninterrupted[i] for i in range(12, 20)}
    # Each lane went on from where it stood, not from its first window (that would be correct, but slow).
    assert len(packed) == 8


def test_another_global_batch_continues_at_the_same_window(caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    uninterrupted = _global_windows([_loader("offline", batch_size=4)], 7)
    four = _saved_ranks(2, 2, batches=3)  # 4 lanes, 12 windows in
    with caplog.at_level("INFO"):
        six = _resumed(four, 2, 3)
    assert "at window 12 (token 204 of the order) with a global batch of 6 windows (2 ranks x 3); the " \
           "checkpoint's was 4" in caplog.text
    # Windows 12-17: rank 0 reads lanes 0-2, rank 1 lanes 3, 0 and 1, skipping what rank 0 took.
    assert _global_windows(_resumed(four, 2, 3), 1) == {i: uninterrupted[i] for i in range(12, 18)}
    saved = {ELASTIC_POSITION_KEY: True, "saved_ranks": [_trained(loader, 1) for loader in six]}
    # Back to 4 windows a step: each lane continues from the rank that read it furthest.
    packed = _counting_packed_windows(monkeypatch)
    assert _global_windows(_resumed(saved, 1, 4), 2) == {i: uninterrupted[i] for i in range(18, 26)}
    assert len(packed) == 8


def test_a_resume_with_another_seq_len_is_refused() -> None:
    saved = _saved_ranks(1, 2, batches=1)
    with pytest.raises(ValueError, match=r"hold seq_len=16 tokens, this run's 8: .* Resume with data.seq_len=16"):
        _loader("offline", seq_len=8).load_state_dict(saved)


def test_training_stream_repeats_past_the_end_of_the_corpus(numbered_corpus: Path) -> None:
    module = _module(str(numbered_corpus), seq_len=8, batch_size=1)
    per_epoch = len(list(module._windows(module.source, "train", repeat=False)))
    module.setup("fit")
    batches = [batch for batch, _ in zip(module.train_dataloader(), range(2 * per_epoch + 1))]
    text = "".join(module.tokenizer.decode(b["input_ids"][0].tolist() + b["labels"][0, -1:].tolist()) for b in batches)
    assert text.count("document 0 of the corpus.") == 2  # the second epoch reads the corpus again


def test_too_few_tokens_for_one_window_are_explained(numbered_corpus: Path) -> None:
    module = _module(str(numbered_corpus), seq_len=4096, batch_size=1)
    module.setup("fit")
    with pytest.raises(ValueError, match=r"fewer than seq_len \+ 1 = 4097 tokens in all"):
        next(iter(module.train_dataloader()))


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


def test_the_offline_corpus_comes_with_the_package_and_its_license() -> None:
    # A few million tokens of real text with a plain `pip install -e .`: no other package, no network.
    texts = offline_corpus_texts()
    english = offline_corpus_texts(languages=("en",))
    assert len(texts) == 26_227 and 10_000 <= len(english) < len(texts)
    tokens = sum(len(Tokenizer().encode(text)) for text in texts[::100]) * 100  # 1% is enough to count
    assert tokens > 3_000_000, f"about {tokens:,} tokens"
    license_text = (OFFLINE_CORPUS.parent / "LICENSE.wikipedia_summaries").read_text()
    assert "CC BY-SA 4.0" in license_text and "Wikipedia contributors" in license_text
