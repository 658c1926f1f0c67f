"""Model config: one frozen object read once from the GGUF ``{arch}.*`` metadata.

Key names follow the GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, "LLM" section).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError, GGUFError
from .gguf_file import ModelFile

SUPPORTED_ARCHITECTURES = ("llama",)


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer.

    n_vocab: vocabulary size (rows of token_embd); n_ctx_train: context length it was trained for;
    n_embd: hidden width; n_layer: number of blocks; n_head / n_head_kv: query / key-value heads
    (grouped-query attention when they differ); head_dim: width of one head; n_ff: FFN inner width;
    rope_freq_base: RoPE theta base; rms_norm_eps: RMSNorm epsilon; tied_embeddings: logits use token_embd
    when the file has no ``output.weight``.
    """

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_freq_base: float
    rms_norm_eps: float
    tied_embeddings: bool

    @property
    def kv_width(self) -> int:
        """Numbers stored per position per layer for K (and again for V): n_head_kv * head_dim."""
        return self.n_head_kv * self.head_dim

    def kv_bytes(self, n_positions: int, bytes_per_number: int) -> int:
        """KV cache size in bytes: n_layer x positions x 2 (K and V) x kv_width x bytes_per_number."""
        return self.n_layer * n_positions * 2 * self.kv_width * bytes_per_number

    @classmethod
    def from_model(cls, mf: ModelFile) -> "ModelConfig":
        """Read the config from ``mf``'s metadata.

        Raises ConfigError naming the architecture if it is unsupported, or the key if one is missing or invalid.
        """
        arch = mf.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{mf.path.name}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def key(name: str, default=None, kind: type = int):
            """The value of ``{arch}.{name}`` as ``kind``: an int must be stored as an integer, a float as a finite
            number; a list, string, bool or fractional value is rejected, never truncated."""
            full = f"{arch}.{name}"
            if full not in mf.metadata:
                if default is None:
                    raise ConfigError(f"{mf.path.name}: metadata key {full!r} is missing")
                return default
            value = mf.metadata[full]
            if kind is int and isinstance(value, int) and not isinstance(value, bool):
                return value
            if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return float(value)
            expected = "an integer" if kind is int else "a finite number"
            raise ConfigError(f"{mf.path.name}: metadata key {full!r} is {value!r:.60}, expected {expected}")

        try:
            n_embd = key("embedding_length")
            n_head = key("attention.head_count")
            embd = mf.tensor("token_embd.weight")
        except GGUFError as e:
            raise ConfigError(str(e)) from None
        if n_embd <= 0 or n_head <= 0 or n_embd % n_head:
            raise ConfigError(f"{mf.path.name}: embedding_length {n_embd} is not divisible by head_count {n_head}")
        n_head_kv = key("attention.head_count_kv", n_head)
        if n_head_kv <= 0 or n_head % n_head_kv:
            raise ConfigError(f"{mf.path.name}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        head_dim = key("attention.key_length", n_embd // n_head)
        if head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"{mf.path.name}: head_dim {head_dim} must be even for RoPE")
        cfg = cls(
            arch=arch,
            n_vocab=key("vocab_size", embd.ne[1] if len(embd.ne) > 1 else 0),
            n_ctx_train=key("context_length"),
            n_embd=n_embd,
            n_layer=key("block_count"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=key("feed_forward_length"),
            rope_freq_base=key("rope.freq_base", 10000.0, float),
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", None, float),
            tied_embeddings="output.weight" not in mf.tensors,
        )
        for name in ("n_vocab", "n_ctx_train", "n_layer", "n_ff"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"{mf.path.name}: {name} must be positive, got {getattr(cfg, name)}")
        if cfg.rope_freq_base <= 0 or cfg.rms_norm_eps < 0:
            raise ConfigError(
                f"{mf.path.name}: rope.freq_base {cfg.rope_freq_base} must be > 0 and layer_norm_rms_epsilon "
                f"{cfg.rms_norm_eps} must be >= 0"
            )
        return cfg
