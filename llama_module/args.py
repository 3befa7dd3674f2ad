"""LlamaConfig: the shape of a Llama 3 / 3.1 model, and its named flavors."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LlamaConfig", "RopeScaling", "FLAVORS", "get_flavor"]


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 RoPE frequency scaling: long wavelengths are slowed down by ``factor``."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama 3 decoder.

    The output projection is never tied to the embedding (as in Llama 3 / 3.1 8B-405B); the 1B and
    3B flavors keep the Llama 3.2 shapes but untie it too, so every flavor shards the same way.

    Its parameter and FLOP counts are the model's only ones: ``LlamaModule.flops_per_token`` (the
    Throughput callback's MFU) returns them, and the planner takes a config as its ``ModelShape``.
    """

    dim: int
    """Width of the residual stream."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query heads; ``dim`` must be divisible by it."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); divides ``n_heads``."""
    vocab_size: int
    """Rows of the embedding and of the output projection."""
    ffn_dim: int
    """Hidden width of the SwiGLU feed-forward network."""
    max_seq_len: int = 8192
    """Length of the precomputed RoPE table: the longest sequence the model accepts."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500_000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    """Llama 3.1 frequency scaling; ``None`` gives plain Llama 3 RoPE."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name}={getattr(self, name)} must be >= 1.")
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim={self.dim} must be divisible by n_heads={self.n_heads}.")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}."
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig head_dim={self.head_dim} (dim / n_heads) must be even for RoPE.")

    @classmethod
    def from_dict(cls, values: dict) -> LlamaConfig:
        """The inverse of ``dataclasses.asdict`` (how hyper-parameters and YAML spell a config)."""
        scaling = values.get("rope_scaling", {})
        return cls(**{**values, "rope_scaling": RopeScaling(**scaling) if isinstance(scaling, dict) else scaling})

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block: the four attention projections, the three of SwiGLU, two RMSNorms."""
        attention = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        return attention + 3 * self.dim * self.ffn_dim + 2 * self.dim

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameter count, computed from the shape alone (no model is built).

        Args:
            exclude_embedding: leave out the embedding table (a lookup, no matmul); the output projection,
                which is not tied to it, still counts.
        """
        embedding = self.vocab_size * self.dim
        total = self.n_layers * self.block_params + self.dim + 2 * embedding
        return total - embedding if exclude_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Model FLOPs of training on one token of a ``seq_len``-token sequence.

        6 per non-embedding parameter (forward 2, backward 4) plus attention's score and value matmuls,
        12 * layers * dim * seq_len, counted over the full (not causal-halved) score matrix, as the
        PaLM paper and torchtitan count it. Recomputation under activation checkpointing is not counted.
        """
        outside_blocks = self.num_params(exclude_embedding=True) - self.n_layers * self.block_params
        return self.n_layers * self.block_flops_per_token(seq_len) + 6 * outside_blocks

    def block_flops_per_token(self, seq_len: int) -> int:
        """One block's share of ``flops_per_token``: 6 per parameter, plus attention's 12 * dim * seq_len."""
        return 6 * self.block_params + 12 * self.dim * seq_len


_LLAMA_3_2 = RopeScaling(factor=32.0)

FLAVORS: dict[str, LlamaConfig] = {
    # Small enough to train on two CPU cores; its vocabulary is the project's own offline BPE.
    "debug": LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8448, ffn_dim=768, max_seq_len=2048),
    "1B": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                      max_seq_len=131072, rope_scaling=_LLAMA_3_2),
    "3B": LlamaConfig(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                      max_seq_len=131072, rope_scaling=_LLAMA_3_2),
    "8B": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                      max_seq_len=131072),
    "70B": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672,
                       max_seq_len=131072),
    "405B": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256, ffn_dim=53248,
                        max_seq_len=131072),
}


def get_flavor(name: str) -> LlamaConfig:
    """Return the named flavor, or raise listing the valid names."""
    try:
        return FLAVORS[name]
    except KeyError:
        raise ValueError(f"Unknown Llama flavor {name!r}; choose one of {sorted(FLAVORS)}.") from None
