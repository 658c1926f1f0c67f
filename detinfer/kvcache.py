"""The KV cache: per-layer K and V for every position, append-only, truncatable, hashable.

Size: n_layer x positions x 2 (K and V) x kv_width x bytes_per_number, with kv_width = n_head_kv x head_dim.

Every layer here is an attention layer, whose state at position p depends only on tokens 0..p, so truncating
to an earlier position is exact. A recurrent-state layer (a running total such as Gated DeltaNet's) has no
per-position state and could not be truncated: such a cache would report ``truncatable = False`` and callers
fall back to recomputation.
"""

from __future__ import annotations

import hashlib

import numpy as np

from .config import ModelConfig
from .errors import InputError, KVTypeError
from .quants import F16_TO_F32

# Storage dtype of each KV type; f16 is held as IEEE half bits (uint16) and rounded to nearest even.
KV_TYPES = {"f32": np.float32, "f16": np.uint16}
QUANTIZED_KV_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")

KV_QUANT_REASON = (
    "a quantized KV cache makes results depend on where chunk and cache boundaries fall, "
    "so warm and cold runs stop matching; use --kv-type f32 (default) or f16"
)


def parse_kv_type(kv_type: str) -> str:
    """Validate a KV cache type name: "f32" or "f16".

    Raises KVTypeError for a quantized type (with the reason it breaks the contract), InputError for anything else.
    """
    name = str(kv_type).lower()
    if name in KV_TYPES:
        return name
    if name in QUANTIZED_KV_TYPES:
        raise KVTypeError(f"KV cache type {kv_type!r} is rejected: {KV_QUANT_REASON}")
    raise InputError(f"unknown KV cache type {kv_type!r}; use f32 or f16")


def kv_bytes_per_number(kv_type: str) -> int:
    return np.dtype(KV_TYPES[parse_kv_type(kv_type)]).itemsize


class KVCache:
    """K and V for positions 0..n_tokens-1 of one sequence.

    k[l]: [n_head_kv, head_dim, n_ctx] (transposed: attention scores read positions contiguously);
    v[l]: [n_head_kv, n_ctx, head_dim]; dtype float32, or uint16 float16 bits for kv_type "f16".
    ``tokens`` are the token ids whose K/V are held, in position order.
    Arrays are allocated zeroed (untouched pages cost no memory) and never reallocated.
    """

    truncatable = True

    def __init__(self, cfg: ModelConfig, n_ctx: int, kv_type: str = "f32"):
        self.kv_type = parse_kv_type(kv_type)
        self.n_ctx = n_ctx
        self.n_layer, self.n_head_kv, self.head_dim = cfg.n_layer, cfg.n_head_kv, cfg.head_dim
        dtype = KV_TYPES[self.kv_type]
        self.k = [np.zeros((cfg.n_head_kv, cfg.head_dim, n_ctx), dtype) for _ in range(cfg.n_layer)]
        self.v = [np.zeros((cfg.n_head_kv, n_ctx, cfg.head_dim), dtype) for _ in range(cfg.n_layer)]
        self.tokens: list[int] = []
        # float16 -> float32 decode table for the kernels (a 1-element dummy for f32 storage)
        self.lut = F16_TO_F32 if self.kv_type == "f16" else np.zeros(1, np.float32)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Allocated bytes for all n_ctx positions."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def truncate(self, n: int) -> None:
        """Forget positions n.. (exact: attention state at p depends only on tokens 0..p).

        Raises InputError if n is negative or beyond n_tokens. Stale bytes past n are zeroed so the cache's
        contents depend only on its tokens.
        """
        if not 0 <= n <= self.n_tokens:
            raise InputError(f"cannot truncate a KV cache of {self.n_tokens} tokens to {n}")
        for k, v in zip(self.k, self.v):
            k[:, :, n : self.n_tokens] = 0
            v[:, n : self.n_tokens, :] = 0
        del self.tokens[n:]

    def digest(self, n: int | None = None) -> str:
        """sha256 hex of the cache contents for positions 0..n-1 (default: all held positions).

        Hashed in a canonical, layout-independent order: kv type and shape header, then for each layer K and
        V as [position, n_head_kv, head_dim] little-endian bytes.
        """
        n = self.n_tokens if n is None else n
        h = hashlib.sha256()
        h.update(f"detinfer-kv/1 {self.kv_type} {self.n_layer} {self.n_head_kv} {self.head_dim} {n}\n".encode())
        for k, v in zip(self.k, self.v):
            h.update(np.ascontiguousarray(k[:, :, :n].transpose(2, 0, 1)).astype(k.dtype.newbyteorder("<")).tobytes())
            h.update(np.ascontiguousarray(v[:, :n, :].transpose(1, 0, 2)).astype(v.dtype.newbyteorder("<")).tobytes())
        return h.hexdigest()
