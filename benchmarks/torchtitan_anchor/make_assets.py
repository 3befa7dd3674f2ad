"""Generate the offline assets the torchtitan anchor runs need (benchmark kit only).

    python3 make_assets.py OUT_DIR [--docs N] [--words-per-doc W]

Writes
  OUT_DIR/tokenizer/tokenizer.json         WordLevel tokenizer, exactly 128256 ids
  OUT_DIR/tokenizer/tokenizer_config.json  bos/eos as torchtitan's HuggingFaceTokenizer reads them
  OUT_DIR/c4_test/data.json                synthetic C4-like JSON lines ({"text": ...})

Why synthetic: the real tests/assets/c4_test/data.json blob is missing from the
torchtitan mirror this kit was built from, and a 128256-entry tokenizer.json is
~3 MB, so both are generated here (deterministically, seed 0) instead of carried.

Token layout (mirrors Llama 3): ids 0..127999 are ordinary tokens (id 0 = "[UNK]",
ids 1..15 punctuation, the rest synthetic lower-case "words"), 128000 =
<|begin_of_text|> (bos), 128001 = <|end_of_text|> (eos), 128002..128255 reserved
special tokens.  The data is made only of vocabulary words, so every whitespace-
separated word is exactly one token (no [UNK]) and ids span the whole 0..127999
range with a Zipf-like frequency.  Only `tokenizers` (and the stdlib/numpy) needed.
"""

import argparse
import json
import os
import sys

N_REGULAR = 128000
VOCAB = 128256
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
PUNCT = [".", ",", ";", ":", "!", "?", "'", '"', "(", ")", "-", "/", "%", "$", "&"]
_CONS = "bcdfghjklmnprstvwz"  # 18
_VOW = "aeiou"  # 5 -> 90 syllables


def _word(i: int) -> str:
    """Unique lower-case alphabetic word for index i (1-3+ syllables, never empty)."""
    syl = [c + v for c in _CONS for v in _VOW]
    out = []
    i += 1
    while i > 0:
        i -= 1
        out.append(syl[i % len(syl)])
        i //= len(syl)
    return "".join(reversed(out))


def build_vocab() -> dict[str, int]:
    vocab = {"[UNK]": 0}
    for p in PUNCT:
        vocab[p] = len(vocab)
    k = 0
    while len(vocab) < N_REGULAR:
        vocab[_word(k)] = len(vocab)
        k += 1
    vocab[BOS] = N_REGULAR
    vocab[EOS] = N_REGULAR + 1
    for j in range(2, VOCAB - N_REGULAR):
        vocab[f"<|reserved_special_token_{j - 2}|>"] = N_REGULAR + j
    assert len(vocab) == VOCAB and len(set(vocab.values())) == VOCAB
    return vocab


def write_tokenizer(out: str, vocab: dict[str, int]) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins with spaces; cosmetic only
    specials = [t for t, i in vocab.items() if i >= N_REGULAR]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    # sanity: exactly 128256 ids, bos/eos at the Llama 3 positions, words -> 1 token each
    t2 = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert t2.get_vocab_size() == VOCAB, t2.get_vocab_size()
    assert t2.token_to_id(BOS) == 128000 and t2.token_to_id(EOS) == 128001
    enc = t2.encode(f"{_word(0)} {_word(127000)}, {_word(5)}.").ids
    assert 0 not in enc and len(enc) == 5, enc


def write_data(out: str, vocab: dict[str, int], docs: int, words_per_doc: int) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    words = [w for w, i in sorted(vocab.items(), key=lambda kv: kv[1]) if 16 <= i < N_REGULAR]
    ranks = np.arange(1, len(words) + 1, dtype=np.float64)
    p = 1.0 / (ranks + 20.0)
    p /= p.sum()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "data.json"), "w") as f:
        for d in range(docs):
            n = int(rng.integers(words_per_doc // 2, words_per_doc * 3 // 2))
            idx = rng.choice(len(words), size=n, p=p)
            parts, since = [], 0
            for j in idx:
                parts.append(words[j])
                since += 1
                if since > 8 and rng.random() < 0.08:
                    parts[-1] += "." if rng.random() < 0.7 else ","
                    since = 0
            if parts[-1][-1] not in ".,":
                parts[-1] += "."
            f.write(json.dumps({"text": " ".join(parts), "timestamp": "2019-04-25T12:57:54Z",
                                "url": f"https://example.invalid/doc{d}"}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--words-per-doc", type=int, default=500)
    a = ap.parse_args()
    vocab = build_vocab()
    write_tokenizer(os.path.join(a.out, "tokenizer"), vocab)
    write_data(os.path.join(a.out, "c4_test"), vocab, a.docs, a.words_per_doc)
    print(f"assets in {a.out}: tokenizer ({VOCAB} ids) + c4_test ({a.docs} docs)", file=sys.stderr)


if __name__ == "__main__":
    main()
