"""A standard Lightning project that happens to be a Llama 3 (model, module, data, tokenizer), and ``CausalLM`` for
any transformers causal LM on the same data."""

from llama_module.args import FLAVORS, LlamaConfig, RopeScaling
from llama_module.causal_lm import CausalLM
from llama_module.data import TextDataModule
from llama_module.model import Llama
from llama_module.module import LlamaModule
from llama_module.tokenizer import Tokenizer

__all__ = ["FLAVORS", "CausalLM", "Llama", "LlamaConfig", "LlamaModule", "RopeScaling", "TextDataModule", "Tokenizer"]
