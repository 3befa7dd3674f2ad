"""Tokenizer: the built-in BPE, Llama 3 special tokens, other tiktoken files, and the BPE trainer."""

from __future__ import annotations

import base64
import collections
import importlib.util
from pathlib import Path

import pytest

from llama_module.tokenizer import DEFAULT_BPE, Tokenizer, special_tokens

pytestmark = pytest.mark.unit

TEXT = "Lightning trains Llama 3 on 2 CPUs: 1234 tokens/s, naïve café — ok?\n\nYes."


def test_builtin_bpe_round_trips_and_has_llama3_layout() -> None:
    tokenizer = Tokenizer()
    assert tokenizer.vocab_size == 8192 + 256
    assert (tokenizer.bos_id, tokenizer.eos_id) == (8192, 8193)
    ids = tokenizer.encode(TEXT, bos=True, eos=True)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert tokenizer.decode(ids[1:-1]) == TEXT
    english = "The history of the city began in the early nineteenth century, when settlers built a small port."
    assert len(tokenizer.encode(english)) < len(english) / 3  # trained on English prose, it compresses it


def test_special_token_text_in_documents_stays_plain_text() -> None:
    tokenizer = Tokenizer()
    ids = tokenizer.encode("<|end_of_text|>")
    assert tokenizer.eos_id not in ids and tokenizer.decode(ids) == "<|end_of_text|>"


def test_special_tokens_follow_llama3() -> None:
    tokens = special_tokens()
    assert len(tokens) == len(set(tokens)) == 256
    assert tokens[:2] == ["<|begin_of_text|>", "<|end_of_text|>"] and tokens[9] == "<|eot_id|>"
    # The ids that chat formats rely on sit where Llama 3 has them (offset 128000 there).
    assert [tokens.index(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|python_tag|>")] \
        == [6, 7, 8, 10]
    assert all(t.startswith("<|reserved_special_token_") for t in tokens[11:])


def test_reads_another_tiktoken_file(fixtures_dir: Path) -> None:
    tokenizer = Tokenizer(fixtures_dir / "torchtitan_test_tiktoken.model")
    assert tokenizer.vocab_size == 2256
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_missing_tokenizer_file_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer.model.*leave it unset"):
        Tokenizer(tmp_path / "nope.model")


def _load_trainer():
    spec = importlib.util.spec_from_file_location("train_bpe", DEFAULT_BPE.parents[2] / "scripts" / "train_bpe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bpe_trainer_learns_frequent_merges_and_writes_a_loadable_file(tmp_path: Path) -> None:
    trainer = _load_trainer()
    counts = trainer.count_words(["the cat sat on the mat with the hat"] * 20 + ["unrelated words"])
    vocab = trainer.train(counts, 256 + 12)
    assert vocab[:256] == [bytes([b]) for b in range(256)]
    assert len(vocab) == len(set(vocab)) == 268
    assert b" the" in vocab or b"the" in vocab  # the most frequent word is merged early
    path = tmp_path / "tiny.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(vocab)))
    tokenizer = Tokenizer(path)
    assert tokenizer.decode(tokenizer.encode("the cat")) == "the cat"
    assert trainer.train(collections.Counter(counts), 268) == vocab  # deterministic
