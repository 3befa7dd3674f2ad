"""Train the project's offline byte-level BPE and write it in tiktoken's format.

    python scripts/train_bpe.py --vocab 8192 --out llama_module/assets/titan_bpe_8k.model

Pre-tokenizes the offline corpus's English Wikipedia summaries (the shipped BPE's training text) with
Llama 3's split pattern, then learns merges greedily by pair frequency. Ranks 0-255 are the single
bytes; each merge adds one rank.
"""

from __future__ import annotations

import argparse
import base64
import collections
import logging
from pathlib import Path

import regex

from llama_module.data import offline_corpus_texts
from llama_module.tokenizer import LLAMA3_SPLIT_PATTERN

log = logging.getLogger(__name__)


def count_words(texts: list[str]) -> collections.Counter[bytes]:
    pattern = regex.compile(LLAMA3_SPLIT_PATTERN)
    counts: collections.Counter[bytes] = collections.Counter()
    for text in texts:
        counts.update(piece.encode("utf-8") for piece in pattern.findall(text))
    return counts


def train(counts: collections.Counter[bytes], vocab_size: int) -> list[bytes]:
    """Return the tokens in rank order: 256 bytes, then one per merge."""
    words = [[bytes([b]) for b in word] for word in counts]
    freqs = list(counts.values())
    pair_counts: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
    where: dict[tuple[bytes, bytes], set[int]] = collections.defaultdict(set)
    for index, word in enumerate(words):
        for pair in zip(word, word[1:]):
            pair_counts[pair] += freqs[index]
            where[pair].add(index)
    vocab = [bytes([b]) for b in range(256)]
    known = set(vocab)
    while len(vocab) < vocab_size and pair_counts:
        # Ties broken by the pair itself so that training is deterministic.
        best = max(pair_counts, key=lambda pair: (pair_counts[pair], pair))
        merged = best[0] + best[1]
        if merged not in known:
            vocab.append(merged)
            known.add(merged)
        for index in where.pop(best):
            _merge_word(words, index, best, merged, freqs[index], pair_counts, where)
        pair_counts.pop(best, None)
    return vocab


def _merge_word(words: list[list[bytes]], index: int, pair: tuple[bytes, bytes], merged: bytes, freq: int,
                pair_counts: collections.Counter, where: dict) -> None:
    word = words[index]
    for old in zip(word, word[1:]):
        pair_counts[old] -= freq
        if pair_counts[old] <= 0:
            del pair_counts[old]
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    words[index] = out
    for new in zip(out, out[1:]):
        pair_counts[new] += freq
        if new != pair:
            where[new].add(index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=8192, help="number of BPE ranks (bytes + merges)")
    parser.add_argument("--out", type=Path, default=Path("llama_module/assets/titan_bpe_8k.model"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    counts = count_words(offline_corpus_texts(languages=("en",)))
    log.info("%d distinct pre-tokens", len(counts))
    vocab = train(counts, args.vocab)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(vocab)))
    log.info("wrote %d ranks to %s", len(vocab), args.out)


if __name__ == "__main__":
    main()
