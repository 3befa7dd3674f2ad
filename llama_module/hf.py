"""Hugging Face ``transformers`` interop for Llama: parameter names, the RoPE layout and config.json.

Our attention rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head (Meta's layout); HF's
``LlamaForCausalLM`` rotates ``(x[i], x[i + head_dim/2])``. The two agree once the rows of ``wq``
and ``wk`` are reordered within each head, which ``to_hf_state_dict`` and ``from_hf_state_dict`` do.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from llama_module.args import LlamaConfig, RopeScaling

__all__ = ["config_from_hf", "from_hf_state_dict", "hf_config", "to_hf_state_dict"]

_TOP_LEVEL = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_PER_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def _names(config: LlamaConfig) -> dict[str, str]:
    """Our parameter name -> HF's, for every parameter."""
    names = dict(_TOP_LEVEL)
    for block in range(config.n_layers):
        names |= {f"layers.{block}.{ours}": f"model.layers.{block}.{theirs}" for ours, theirs in _PER_BLOCK.items()}
    return names


def _rotary_heads(config: LlamaConfig, name: str) -> int | None:
    """How many RoPE heads a weight's rows hold (None: not rotated)."""
    if name.endswith("attention.wq.weight"):
        return config.n_heads
    if name.endswith("attention.wk.weight"):
        return config.n_kv_heads
    return None


def _pairs_to_halves(weight: Tensor, heads: int) -> Tensor:
    rows, columns = weight.shape
    return weight.view(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def _halves_to_pairs(weight: Tensor, heads: int) -> Tensor:
    rows, columns = weight.shape
    return weight.view(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def _check_names(given: set[str], expected: set[str], side: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise ValueError(f"The {side} state dict does not fit the config: missing {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                         f"{' ...' if len(unexpected) > 5 else ''}.")


def _convert(state: dict[str, Tensor], config: LlamaConfig, *, to_hf: bool) -> dict[str, Tensor]:
    names = _names(config)  # ours -> HF's
    _check_names(set(state), set(names.values() if not to_hf else names), "Llama" if to_hf else "Hugging Face")
    reorder = _pairs_to_halves if to_hf else _halves_to_pairs
    converted = {}
    for ours, theirs in names.items():
        source, target = (ours, theirs) if to_hf else (theirs, ours)
        heads = _rotary_heads(config, ours)
        converted[target] = (reorder(state[source], heads) if heads else state[source]).contiguous()
    return converted


def to_hf_state_dict(state: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """Our full (unsharded) state dict -> ``LlamaForCausalLM``'s."""
    return _convert(state, config, to_hf=True)


def from_hf_state_dict(state: dict[str, Tensor], config: LlamaConfig) -> dict[str, Tensor]:
    """``LlamaForCausalLM``'s state dict -> ours (rotary buffers HF may store are dropped)."""
    return _convert({name: tensor for name, tensor in state.items() if "rotary_emb" not in name}, config, to_hf=False)


def hf_config(config: LlamaConfig, torch_dtype: str = "bfloat16") -> dict[str, Any]:
    """config.json of the equivalent ``LlamaForCausalLM``."""
    hf: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.dim,
        "intermediate_size": config.ffn_dim, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "vocab_size": config.vocab_size, "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len, "rope_theta": config.rope_theta, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "torch_dtype": torch_dtype,
    }
    scaling = config.rope_scaling
    hf["rope_scaling"] = None if scaling is None else {
        "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor, "original_max_position_embeddings": scaling.original_max_seq_len,
    }
    return hf


def config_from_hf(hf: dict[str, Any]) -> LlamaConfig:
    """The ``LlamaConfig`` of a ``LlamaForCausalLM`` config.json; refuses what our Llama cannot represent."""
    if hf.get("model_type") != "llama":
        raise ValueError(f"config.json has model_type={hf.get('model_type')!r}; only 'llama' converts.")
    if hf.get("tie_word_embeddings"):
        raise ValueError("config.json ties the output layer to the embedding (tie_word_embeddings=true); this "
                         "Llama keeps them separate. Untie them before converting.")
    head_dim = hf.get("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
    if head_dim * hf["num_attention_heads"] != hf["hidden_size"]:
        raise ValueError(f"config.json has head_dim={head_dim} x num_attention_heads={hf['num_attention_heads']} != "
                         f"hidden_size={hf['hidden_size']}; this Llama needs head_dim = hidden_size / heads.")
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"config.json uses rope_type={rope_type!r}; only 'default' and 'llama3' convert.")
    scaling = None if rope_type == "default" else RopeScaling(
        factor=rope["factor"], low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"],
        original_max_seq_len=rope["original_max_position_embeddings"],
    )
    return LlamaConfig(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
        n_kv_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]), vocab_size=hf["vocab_size"],
        ffn_dim=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", 8192),
        norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=hf.get("rope_theta", rope.get("rope_theta", 500_000.0)),
        rope_scaling=scaling,
    )
