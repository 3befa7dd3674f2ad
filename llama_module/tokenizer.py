"""tiktoken tokenizer with Llama 3's split pattern and special tokens.

It reads any BPE file in tiktoken's format: Meta's Llama 3 ``tokenizer.model`` (128,000 ranks) or the
project's own 8k BPE, trained offline by ``scripts/train_bpe.py`` and shipped as the default.
"""

from __future__ import annotations

from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

__all__ = ["DEFAULT_BPE", "LLAMA3_SPLIT_PATTERN", "Tokenizer", "TransformersTokenizer", "load_tokenizer",
           "special_tokens"]

DEFAULT_BPE = Path(__file__).parent / "assets" / "titan_bpe_8k.model"

# Llama 3's pre-tokenizer: contractions, words with one leading non-letter, 1-3 digit groups,
# punctuation runs, newlines, and whitespace that is not followed by a word.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
NUM_SPECIAL_TOKENS = 256


def special_tokens() -> list[str]:
    """Llama 3's 256 special tokens, in rank order after the BPE ranks."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(2, 2 + NUM_SPECIAL_TOKENS - len(named))]
    return named + reserved


class Tokenizer:
    """Encode text to token ids and back.

    Args:
        path: a tiktoken-format BPE file (base64 token and rank per line), such as Llama 3's
            ``tokenizer.model``. None uses the project's offline 8k BPE.
    """

    def __init__(self, path: str | Path | None = None) -> None:
        path = Path(path) if path is not None else DEFAULT_BPE
        if not path.is_file():
            raise FileNotFoundError(f"Tokenizer file {path} does not exist; pass the path of a tiktoken BPE file "
                                    "(e.g. Llama 3's original/tokenizer.model) or leave it unset for the built-in BPE.")
        ranks = load_tiktoken_bpe(str(path))
        specials = {token: len(ranks) + i for i, token in enumerate(special_tokens())}
        self.model = tiktoken.Encoding(name=path.stem, pat_str=LLAMA3_SPLIT_PATTERN, mergeable_ranks=ranks,
                                       special_tokens=specials)
        self.bos_id = specials["<|begin_of_text|>"]
        self.eos_id = specials["<|end_of_text|>"]

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        # Special-token text inside documents is encoded as plain text, never as control tokens.
        ids = self.model.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(ids)


class TransformersTokenizer:
    """A transformers model directory's tokenizer (``AutoTokenizer``, offline), with ``Tokenizer``'s interface:
    what ``TextDataModule(tokenizer=<the directory>)`` uses for ``CausalLM(pretrained=<the directory>)``."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        self.model = AutoTokenizer.from_pretrained(str(directory))
        eos = self.model.eos_token_id
        self.bos_id = self.model.bos_token_id if self.model.bos_token_id is not None else eos
        self.eos_id = eos if eos is not None else self.bos_id
        if self.bos_id is None:
            raise ValueError(f"The tokenizer in {directory} has neither a BOS nor an EOS token, which packed windows "
                             "put between documents.")

    @property
    def vocab_size(self) -> int:
        return len(self.model)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.model.encode(text, add_special_tokens=False)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(ids)


def load_tokenizer(path: str | Path | None) -> Tokenizer | TransformersTokenizer:
    """A transformers model directory's tokenizer, or a tiktoken BPE file's (None: the built-in 8k BPE)."""
    if path is not None and Path(path).is_dir():
        return TransformersTokenizer(path)
    return Tokenizer(path)
