"""The KV cache: per-layer K and V for every position, append-only, truncatable, hashable, snapshottable.

Size: n_layer x positions x 2 (K and V) x kv_width x bytes_per_number, with kv_width = n_head_kv x head_dim.

Every layer here is an attention layer, whose state at position p depends only on tokens 0..p, so truncating
to an earlier position is exact. A recurrent-state layer (a running total such as Gated DeltaNet's) has no
per-position state and could not be truncated: such a cache would report ``truncatable = False`` and callers
fall back to recomputation (a snapshot of it would be reusable only at exactly its own length). No such layer
exists yet.

A :class:`KVSnapshot` is a compact, read-only copy of positions 0..n-1; restoring it into a cache and
continuing gives the same bytes as never having stopped, because the cache's contents depend only on its tokens.
"""

from __future__ import annotations

import hashlib
import mmap
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from ..errors import InputError, KVTypeError
from ..model.config import ModelConfig
from ..model.quants import F16_TO_F32

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


def available_memory() -> int | None:
    """Bytes this process can still commit: MemAvailable (/proc/meminfo), capped by the cgroup v2 limit
    (memory.max - memory.current) when one is set; None where neither is readable (non-Linux)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = room if avail is None else min(avail, room)
    except (OSError, ValueError):
        pass
    return avail


def check_kv_fits(cfg: ModelConfig, n_ctx: int, kv_type: str) -> int:
    """The KV bytes of ``n_ctx`` positions (formula in :meth:`ModelConfig.kv_bytes`), checked against
    :func:`available_memory` before anything is allocated.

    The cache is mapped lazily, so an oversized one would only fail (or be OOM-killed) mid-generation; this caps
    ``n_ctx``, and with it every ``max_tokens`` (generation stops at n_ctx), by memory up front.
    Raises InputError naming the size, the formula's factors and the fix.
    """
    per_number = kv_bytes_per_number(kv_type)
    need = cfg.kv_bytes(n_ctx, per_number)
    avail = available_memory()
    if avail is not None and need > avail:
        fix = "lower --ctx" + (" or use --kv-type f16" if kv_type == "f32" else "")
        raise InputError(
            f"a KV cache of {n_ctx} positions needs {need / 2**30:.2f} GiB ({cfg.n_layer} layers x {n_ctx} positions x 2 x "
            f"{cfg.kv_width} x {per_number} bytes) but only {avail / 2**30:.2f} GiB of memory is available; {fix}"
        )
    return need


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of leading token ids two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def canonical_layers(k: Sequence[np.ndarray], v: Sequence[np.ndarray], n: int) -> Iterator[np.ndarray]:
    """Positions 0..n-1 in the canonical order: for each layer, K then V, each a C-contiguous little-endian
    [n, n_head_kv, head_dim] array (independent of the in-memory layout).

    k[l]: [n_head_kv, head_dim, >= n]; v[l]: [n_head_kv, >= n, head_dim]. Used by the digest and by .detkv files,
    so a file's array section is exactly the bytes its digest hashes.
    """
    for kl, vl in zip(k, v):
        yield np.ascontiguousarray(kl[:, :, :n].transpose(2, 0, 1), dtype=kl.dtype.newbyteorder("<"))
        yield np.ascontiguousarray(vl[:, :n, :].transpose(1, 0, 2), dtype=vl.dtype.newbyteorder("<"))


def digest_prefix(kv_type: str, n_layer: int, n_head_kv: int, head_dim: int, n: int) -> bytes:
    """The header line the KV digest starts with (kv type, shape, number of positions)."""
    return f"detinfer-kv/1 {kv_type} {n_layer} {n_head_kv} {head_dim} {n}\n".encode()


def _digest(kv_type: str, k: Sequence[np.ndarray], v: Sequence[np.ndarray], n: int) -> str:
    n_head_kv, head_dim = k[0].shape[0], k[0].shape[1]
    h = hashlib.sha256(digest_prefix(kv_type, len(k), n_head_kv, head_dim, n))
    for a in canonical_layers(k, v, n):
        h.update(a.data)
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """A read-only copy of K and V for positions 0..n_tokens-1 of one sequence.

    k[l]: [n_head_kv, head_dim, n_tokens]; v[l]: [n_head_kv, n_tokens, head_dim] (the cache's layout, cut to
    n_tokens); dtype float32, or uint16 float16 bits for kv_type "f16". ``tokens``: the ids at those positions.
    Built by :meth:`KVCache.snapshot` or read from a .detkv file; raises InputError if the arrays do not agree
    with each other, the kv type or the tokens.
    """

    kv_type: str
    tokens: tuple[int, ...]
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]

    # Attention layers only, so any prefix of a snapshot is itself exact (see the module docstring).
    truncatable = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "k", tuple(self.k))
        object.__setattr__(self, "v", tuple(self.v))
        dtype = np.dtype(KV_TYPES[parse_kv_type(self.kv_type)])
        if not self.k or len(self.k) != len(self.v):
            raise InputError(f"a KV snapshot needs the same number (>= 1) of K and V layers, got {len(self.k)} and {len(self.v)}")
        n_head_kv, head_dim, n = self.k[0].shape if self.k[0].ndim == 3 else (0, 0, -1)
        for i, (kl, vl) in enumerate(zip(self.k, self.v)):
            if kl.shape != (n_head_kv, head_dim, n) or vl.shape != (n_head_kv, n, head_dim) or kl.dtype != dtype or vl.dtype != dtype:
                raise InputError(
                    f"KV snapshot layer {i}: K {kl.shape} {kl.dtype} / V {vl.shape} {vl.dtype} do not match "
                    f"[{n_head_kv}, {head_dim}, {n}] / [{n_head_kv}, {n}, {head_dim}] {dtype}"
                )
        if len(self.tokens) != n:
            raise InputError(f"a KV snapshot of {n} positions has {len(self.tokens)} token ids")

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_layer(self) -> int:
        return len(self.k)

    @property
    def n_head_kv(self) -> int:
        return self.k[0].shape[0]

    @property
    def head_dim(self) -> int:
        return self.k[0].shape[1]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_layer, n_head_kv, head_dim): what a cache must have to take this snapshot."""
        return (self.n_layer, self.n_head_kv, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of K and V held: n_layer x n_tokens x 2 x kv_width x bytes_per_number."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def digest(self, n: int | None = None) -> str:
        """sha256 hex of positions 0..n-1 (default all), equal to :meth:`KVCache.digest` of the cache it came from."""
        n = self.n_tokens if n is None else n
        if not 0 <= n <= self.n_tokens:
            raise InputError(f"cannot digest {n} positions of a KV snapshot of {self.n_tokens}")
        return _digest(self.kv_type, self.k, self.v, n)

    def prefix(self, n: int) -> "KVSnapshot":
        """The snapshot of positions 0..n-1 (views, no copy). Exact for attention layers; InputError if n is out of range."""
        if not 0 <= n <= self.n_tokens:
            raise InputError(f"cannot cut a KV snapshot of {self.n_tokens} tokens to {n}")
        if not self.truncatable and n != self.n_tokens:
            raise InputError("this KV snapshot holds recurrent state and cannot be cut to an earlier position")
        return KVSnapshot(self.kv_type, self.tokens[:n], tuple(a[:, :, :n] for a in self.k), tuple(a[:, :n, :] for a in self.v))


class _Memory:
    """The zeroed anonymous mapping behind a KVCache, as ``flat`` (``dtype``), and how many positions of it may have
    been written (``written``). Small pages only: with transparent huge pages, writing one position of the
    transposed K rows would commit every 2 MB page."""

    def __init__(self, nbytes: int, dtype: type):
        self.buf = mmap.mmap(-1, nbytes)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            self.buf.madvise(mmap.MADV_NOHUGEPAGE)
        self.flat = np.frombuffer(self.buf, dtype)
        self.written = 0


class KVPool:
    """The memory of one dropped KV cache, kept for the engine's next one, as llama.cpp keeps its context's KV
    buffer across sequences.

    A fresh mapping commits its pages on first write: each of the n_layer x n_head_kv x head_dim transposed K rows
    faults in a page at the first position (and again every 4 KB of positions), 15-20 ms for SmolLM2's 5,760 rows,
    more than a tenth of a 64-token prefill. A recycled one is zeroed back to what a fresh mapping reads (only its
    ``written`` positions, so the cost follows the work the last sequence did), and is recycled only if no array
    still views it: a dropped cache's arrays that the caller kept keep their bytes.
    """

    def __init__(self) -> None:
        self._spare: list[tuple[_Memory, tuple[int, int, int, int]]] = []

    def give(self, mem: _Memory, shape: tuple[int, int, int, int]) -> None:
        """Keep ``mem`` (of a cache of (n_layer, n_head_kv, head_dim, n_ctx) that was just dropped) as the spare."""
        self._spare[:] = [(mem, shape)]

    def take(self, nbytes: int, dtype: type) -> _Memory | None:
        """The spare memory zeroed, if it has ``nbytes`` of ``dtype`` and nothing views it any more; else None."""
        if not self._spare:
            return None
        mem, (n_layer, n_head_kv, head_dim, n_ctx) = self._spare.pop()
        # references: mem.flat and getrefcount's argument; any more are views of a dropped cache's arrays
        if len(mem.buf) != nbytes or mem.flat.dtype != dtype or sys.getrefcount(mem.flat) > 2:
            return None
        mem.flat.reshape(2, n_layer, n_head_kv, head_dim, n_ctx)[0, :, :, :, : mem.written] = 0
        mem.flat.reshape(2, n_layer, n_head_kv, n_ctx, head_dim)[1, :, :, : mem.written] = 0
        mem.written = 0
        return mem


class KVCache:
    """K and V for positions 0..n_tokens-1 of one sequence.

    k[l]: [n_head_kv, head_dim, n_ctx] (transposed: attention scores read positions contiguously);
    v[l]: [n_head_kv, n_ctx, head_dim]; dtype float32, or uint16 float16 bits for kv_type "f16".
    ``tokens`` are the token ids whose K/V are held, in position order.
    Arrays are allocated zeroed (untouched pages cost no memory) or, with a ``pool``, taken zeroed from the
    cache it last recycled, and never reallocated; positions past n_tokens are kept zero (truncate and restore
    clear what they drop).
    """

    # Attention layers: truncating to k < n_tokens is exact. A cache with a recurrent-state layer would set this
    # False (its state is a running total over all positions, with nothing to cut back to).
    truncatable = True

    def __init__(self, cfg: ModelConfig, n_ctx: int, kv_type: str = "f32", pool: KVPool | None = None):
        self.kv_type = parse_kv_type(kv_type)
        check_kv_fits(cfg, n_ctx, self.kv_type)
        self.n_ctx = n_ctx
        self.n_layer, self.n_head_kv, self.head_dim = cfg.n_layer, cfg.n_head_kv, cfg.head_dim
        dtype = KV_TYPES[self.kv_type]
        per_layer = cfg.n_head_kv * cfg.head_dim * n_ctx
        nbytes = 2 * cfg.n_layer * per_layer * np.dtype(dtype).itemsize
        self._mem = (pool.take(nbytes, dtype) if pool is not None else None) or _Memory(nbytes, dtype)
        block = self._mem.flat.reshape(2 * cfg.n_layer, per_layer)
        self.k = [block[i].reshape(cfg.n_head_kv, cfg.head_dim, n_ctx) for i in range(cfg.n_layer)]
        self.v = [block[cfg.n_layer + i].reshape(cfg.n_head_kv, n_ctx, cfg.head_dim) for i in range(cfg.n_layer)]
        self.tokens: list[int] = []
        # float16 -> float32 decode table for the kernels (a 1-element dummy for f32 storage)
        self.lut = F16_TO_F32 if self.kv_type == "f16" else np.zeros(1, np.float32)
        if pool is not None:
            weakref.finalize(self, pool.give, self._mem, (cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_ctx)).atexit = False

    def will_write(self, end: int) -> None:
        """Record that positions below ``end`` may be written (the engine calls it before a chunk's KV writes, so
        also for a forward that fails midway): memory recycled by :class:`KVPool` is zeroed that far."""
        self._mem.written = max(self._mem.written, end)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(n_layer, n_head_kv, head_dim)."""
        return (self.n_layer, self.n_head_kv, self.head_dim)

    @property
    def held_nbytes(self) -> int:
        """Bytes of the n_tokens positions held: the nbytes of :meth:`snapshot`."""
        return sum(a[:, :, : self.n_tokens].nbytes for a in self.k) + sum(a[:, : self.n_tokens].nbytes for a in self.v)

    @property
    def nbytes(self) -> int:
        """Allocated bytes for all n_ctx positions."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def keep_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest prefix of ``tokens`` this cache already holds, at most len(tokens) - 1 (the last token's
        logits are always computed), truncating what differs; returns its length. Exact: attention state at a
        position depends only on the tokens up to it."""
        n = max(0, min(common_prefix(self.tokens, tokens), len(tokens) - 1))
        if n < self.n_tokens:
            self.truncate(n)
        return n

    def truncate(self, n: int) -> None:
        """Forget positions n.. (exact: attention state at p depends only on tokens 0..p).

        Raises InputError if n is negative or beyond n_tokens. Stale bytes past n are zeroed so the cache's
        contents depend only on its tokens.
        """
        if not 0 <= n <= self.n_tokens:
            raise InputError(f"cannot truncate a KV cache of {self.n_tokens} tokens to {n}")
        if not self.truncatable and n != self.n_tokens:
            raise InputError("this KV cache holds recurrent state and cannot be truncated; recompute from the start")
        for k, v in zip(self.k, self.v):
            k[:, :, n : self.n_tokens] = 0
            v[:, n : self.n_tokens, :] = 0
        del self.tokens[n:]

    def digest(self, n: int | None = None) -> str:
        """sha256 hex of the cache contents for positions 0..n-1 (default: all held positions).

        Hashed in a canonical, layout-independent order: the line from :func:`digest_prefix` (kv type, shape, n),
        then for each layer K and V as [position, n_head_kv, head_dim] little-endian bytes.
        """
        n = self.n_tokens if n is None else n
        if not 0 <= n <= self.n_tokens:
            raise InputError(f"cannot digest {n} positions of a KV cache of {self.n_tokens}")
        return _digest(self.kv_type, self.k, self.v, n)

    def snapshot(self, n: int | None = None) -> KVSnapshot:
        """A read-only copy of positions 0..n-1 (default: all held positions), n_layer x n x 2 x kv_width numbers.

        Raises InputError if n is negative or beyond n_tokens.
        """
        n = self.n_tokens if n is None else n
        if not 0 <= n <= self.n_tokens:
            raise InputError(f"cannot snapshot {n} positions of a KV cache of {self.n_tokens}")
        if not self.truncatable and n != self.n_tokens:
            raise InputError("this KV cache holds recurrent state; only a snapshot of all its positions is possible")
        k = tuple(a[:, :, :n].copy() for a in self.k)
        v = tuple(a[:, :n, :].copy() for a in self.v)
        for a in k + v:
            a.flags.writeable = False  # shared by the prefix cache: nothing may change it in place
        return KVSnapshot(self.kv_type, tuple(self.tokens[:n]), k, v)

    def restore(self, snapshot: KVSnapshot, n: int | None = None) -> None:
        """Make this cache hold positions 0..n-1 of ``snapshot`` (default: all of it), whatever it held before.

        Equivalent to a cache that computed those tokens itself: same bytes, same digest, same continuation.
        Positions from n up to the previous n_tokens are zeroed. Raises InputError if the kv type or
        (n_layer, n_head_kv, head_dim) differ, or n is out of range or exceeds n_ctx.
        """
        n = snapshot.n_tokens if n is None else n
        if snapshot.kv_type != self.kv_type:
            raise InputError(f"the KV snapshot is kv type {snapshot.kv_type} but the cache is {self.kv_type}; use --kv-type {snapshot.kv_type}")
        if snapshot.shape != self.shape:
            raise InputError(
                f"the KV snapshot has (n_layer, n_head_kv, head_dim) = {snapshot.shape} but the cache has {self.shape}; "
                "it was made by another model"
            )
        if not 0 <= n <= snapshot.n_tokens:
            raise InputError(f"cannot restore {n} positions of a KV snapshot of {snapshot.n_tokens}")
        if n > self.n_ctx:
            raise InputError(f"the KV snapshot holds {n} positions but the cache has a context of {self.n_ctx}; raise --ctx")
        if n != snapshot.n_tokens and not (self.truncatable and snapshot.truncatable):
            raise InputError("this KV snapshot holds recurrent state and can only be restored whole")
        old = self.n_tokens
        self.will_write(n)
        for kc, vc, ks, vs in zip(self.k, self.v, snapshot.k, snapshot.v):
            kc[:, :, :n] = ks[:, :, :n]
            vc[:, :n, :] = vs[:, :n, :]
            if old > n:
                kc[:, :, n:old] = 0
                vc[:, n:old, :] = 0
        self.tokens[:] = snapshot.tokens[:n]
