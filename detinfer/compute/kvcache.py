"""The KV cache: per-layer K and V for every position, append-only, truncatable, hashable, snapshottable.

Size: n_layer x positions x 2 (K and V) x kv_width x bytes_per_number, with kv_width = n_head_kv x head_dim.

An attention layer's state at position p depends only on tokens 0..p, so truncating to an earlier position is
exact. A hybrid model's recurrent (Gated DeltaNet) layers keep instead a fixed-size running state per sequence
(the causal conv's last inputs and the delta-rule state), updated in place, with nothing to cut back to: its cache
reports ``truncatable = False``, and a snapshot of it is reusable only at exactly its own length. It keeps instead
**checkpoints**: copies of the state at a few positions (after every prompt, and whenever a forward crosses a
multiple of CHECKPOINT_EVERY positions; the CHECKPOINTS most recent, so at most CHECKPOINTS x state bytes), and one
**mark** (speculative decoding's draft window start), and can be cut back to any of them: the attention layers' K/V
are truncated there and the state is the copy, exactly what computing those tokens again gives. Its digest covers the KV of the attention layers and every recurrent state.

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

CHECKPOINT_EVERY = 256  # positions between two recurrent-state checkpoints (one is also taken after every prompt)
CHECKPOINTS = 4  # checkpoints a cache with recurrent state keeps, the most recent ones; each costs its state bytes

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
    need = cfg.kv_bytes(n_ctx, per_number) + cfg.state_bytes
    avail = available_memory()
    if avail is not None and need > avail:
        fix = "lower --ctx" + (" or use --kv-type f16" if kv_type == "f32" else "")
        state = f" + {cfg.state_bytes} bytes of recurrent state" if cfg.state_bytes else ""
        raise InputError(
            f"a KV cache of {n_ctx} positions needs {need / 2**30:.2f} GiB ({cfg.n_attn_layer} layers x {n_ctx} positions x 2 x "
            f"{cfg.kv_width} x {per_number} bytes{state}) but only {avail / 2**30:.2f} GiB of memory is available; {fix}"
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


def _digest(kv_type: str, k: Sequence[np.ndarray], v: Sequence[np.ndarray], n: int, state: Sequence[np.ndarray] = ()) -> str:
    """The KV digest; with a recurrent ``state`` (conv, then delta-rule state, per recurrent layer), a second header
    line naming their count and their float32 little-endian bytes after the KV."""
    n_head_kv, head_dim = k[0].shape[0], k[0].shape[1]
    h = hashlib.sha256(digest_prefix(kv_type, len(k), n_head_kv, head_dim, n))
    if state:
        h.update(f"recurrent {len(state)}\n".encode())
    for a in canonical_layers(k, v, n):
        h.update(a.data)
    for a in state:
        h.update(np.ascontiguousarray(a, dtype="<f4").data)
    return h.hexdigest()


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """A read-only copy of K and V for positions 0..n_tokens-1 of one sequence.

    k[l]: [n_head_kv, head_dim, n_tokens]; v[l]: [n_head_kv, n_tokens, head_dim] (the cache's layout, cut to
    n_tokens; attention layers only); dtype float32, or uint16 float16 bits for kv_type "f16". ``tokens``: the ids
    at those positions. ``state``: a hybrid model's recurrent state after them (float32 arrays, as
    :attr:`KVCache.state`), empty otherwise. Built by :meth:`KVCache.snapshot` or read from a .detkv file; raises
    InputError if the arrays do not agree with each other, the kv type or the tokens.
    """

    kv_type: str
    tokens: tuple[int, ...]
    k: tuple[np.ndarray, ...]
    v: tuple[np.ndarray, ...]
    state: tuple[np.ndarray, ...] = ()

    @property
    def truncatable(self) -> bool:
        """Whether any prefix of this snapshot is itself exact: attention layers only (see the module docstring)."""
        return not self.state

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "k", tuple(self.k))
        object.__setattr__(self, "v", tuple(self.v))
        object.__setattr__(self, "state", tuple(self.state))
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
    def shape(self) -> tuple:
        """(n_layer, n_head_kv, head_dim), and the recurrent state's array shapes for a hybrid model: what a cache
        must have to take this snapshot."""
        return (self.n_layer, self.n_head_kv, self.head_dim) + ((tuple(a.shape for a in self.state),) if self.state else ())

    @property
    def nbytes(self) -> int:
        """Bytes held: K and V (n_layer x n_tokens x 2 x kv_width x bytes_per_number) and any recurrent state."""
        return sum(a.nbytes for a in self.k + self.v + self.state)

    def digest(self, n: int | None = None) -> str:
        """sha256 hex of positions 0..n-1 (default all), equal to :meth:`KVCache.digest` of the cache it came from."""
        n = self.n_tokens if n is None else n
        if not 0 <= n <= self.n_tokens or (self.state and n != self.n_tokens):
            raise InputError(f"cannot digest {n} positions of a KV snapshot of {self.n_tokens}")
        return _digest(self.kv_type, self.k, self.v, n, self.state)

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

    def __init__(self, cfg: ModelConfig, n_ctx: int, kv_type: str = "f32", pool: KVPool | None = None):
        self.kv_type = parse_kv_type(kv_type)
        check_kv_fits(cfg, n_ctx, self.kv_type)
        self.n_ctx = n_ctx
        n_layer = cfg.n_attn_layer  # the KV of the attention layers, in layer order
        self.n_layer, self.n_head_kv, self.head_dim = n_layer, cfg.n_head_kv, cfg.head_dim
        dtype = KV_TYPES[self.kv_type]
        per_layer = cfg.n_head_kv * cfg.head_dim * n_ctx
        nbytes = 2 * n_layer * per_layer * np.dtype(dtype).itemsize
        self._mem = (pool.take(nbytes, dtype) if pool is not None else None) or _Memory(nbytes, dtype)
        block = self._mem.flat.reshape(2 * n_layer, per_layer)
        self.k = [block[i].reshape(cfg.n_head_kv, cfg.head_dim, n_ctx) for i in range(n_layer)]
        self.v = [block[n_layer + i].reshape(cfg.n_head_kv, n_ctx, cfg.head_dim) for i in range(n_layer)]
        # per recurrent layer (in layer order): the conv's last K - 1 inputs [ssm_conv_width, K - 1] (oldest first),
        # then the delta-rule state [n_v_head, head_k, head_v] (S_h[i, m]: key i, value m)
        self.state: list[np.ndarray] = []
        for _ in range(sum(cfg.recurrent_layers)):
            self.state += [np.zeros((cfg.ssm_conv_width, cfg.ssm_conv_kernel - 1), np.float32),
                           np.zeros((cfg.ssm_n_v_head, cfg.ssm_head_k, cfg.ssm_head_v), np.float32)]  # fmt: skip
        # attention layers only: truncating to k < n_tokens is exact; a recurrent state only to its checkpoints
        self.truncatable = not self.state
        self.checkpoints: dict[int, tuple[np.ndarray, ...]] = {}  # position -> copy of the state after that many tokens
        self._mark: tuple[int, tuple[np.ndarray, ...]] | None = None  # a draft window's start (mark)
        self.tokens: list[int] = []
        # float16 -> float32 decode table for the kernels (a 1-element dummy for f32 storage)
        self.lut = F16_TO_F32 if self.kv_type == "f16" else np.zeros(1, np.float32)
        if pool is not None:
            weakref.finalize(self, pool.give, self._mem, (n_layer, cfg.n_head_kv, cfg.head_dim, n_ctx)).atexit = False

    def will_write(self, end: int) -> None:
        """Record that positions below ``end`` may be written (the engine calls it before a chunk's KV writes, so
        also for a forward that fails midway): memory recycled by :class:`KVPool` is zeroed that far."""
        self._mem.written = max(self._mem.written, end)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def shape(self) -> tuple:
        """(n_layer, n_head_kv, head_dim), and the recurrent state's array shapes for a hybrid model (as
        :attr:`KVSnapshot.shape`)."""
        return (self.n_layer, self.n_head_kv, self.head_dim) + ((tuple(a.shape for a in self.state),) if self.state else ())

    @property
    def held_nbytes(self) -> int:
        """Bytes of the n_tokens positions held, and of any recurrent state: the nbytes of :meth:`snapshot`."""
        kv = sum(a[:, :, : self.n_tokens].nbytes for a in self.k) + sum(a[:, : self.n_tokens].nbytes for a in self.v)
        return kv + sum(a.nbytes for a in self.state)

    @property
    def nbytes(self) -> int:
        """Allocated bytes for all n_ctx positions, and the recurrent state."""
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v) + sum(a.nbytes for a in self.state)

    def checkpoint(self) -> None:
        """Keep a copy of the recurrent state at the current position (dropping the oldest beyond CHECKPOINTS); a
        no-op for a cache without recurrent state, or when empty or already kept."""
        n = self.n_tokens
        if self.state and n and n not in self.checkpoints:
            self.checkpoints[n] = tuple(a.copy() for a in self.state)
            while len(self.checkpoints) > CHECKPOINTS:
                del self.checkpoints[next(iter(self.checkpoints))]

    def mark(self) -> None:
        """Keep a copy of the recurrent state here, apart from the checkpoints (speculative decoding's draft window
        start: :meth:`truncate` can go back to it); a no-op without recurrent state."""
        if self.state:
            self._mark = (self.n_tokens, tuple(a.copy() for a in self.state))

    @property
    def marked(self) -> int | None:
        """The position :meth:`mark` kept, if any."""
        return self._mark[0] if self._mark is not None else None

    def forwarded(self, start: int) -> None:
        """The engine ran positions ``start``..n_tokens-1: checkpoint the state if they crossed a multiple of
        CHECKPOINT_EVERY."""
        if self.state and self.n_tokens // CHECKPOINT_EVERY > start // CHECKPOINT_EVERY:
            self.checkpoint()

    def keep_prefix(self, tokens: Sequence[int]) -> int:
        """Keep the longest prefix of ``tokens`` this cache already holds, at most len(tokens) - 1 (the last token's
        logits are always computed), truncating what differs; returns its length. Exact: attention state at a
        position depends only on the tokens up to it. A cache with recurrent state keeps all it holds, or goes
        back to its latest checkpoint within that prefix (or to empty)."""
        n = max(0, min(common_prefix(self.tokens, tokens), len(tokens) - 1))
        if not self.truncatable and n < self.n_tokens:
            n = max((p for p in self.checkpoints if p <= n), default=0)
        if n < self.n_tokens:
            self.truncate(n)
        return n

    def truncate(self, n: int) -> None:
        """Forget positions n.. (exact: attention state at p depends only on tokens 0..p).

        Raises InputError if n is negative or beyond n_tokens, or, for a cache with recurrent state, anything but
        n_tokens, 0 (which empties it, state zeroed) or one of its checkpoints (whose state it takes). Stale bytes
        past n are zeroed so the cache's contents depend only on its tokens.
        """
        if not 0 <= n <= self.n_tokens:
            raise InputError(f"cannot truncate a KV cache of {self.n_tokens} tokens to {n}")
        kept = self.checkpoints.get(n) or (self._mark[1] if self.marked == n else None)
        if not self.truncatable and n not in (0, self.n_tokens) and kept is None:
            raise InputError("this KV cache holds recurrent state and cannot be truncated there (no checkpoint); recompute from the start")
        for k, v in zip(self.k, self.v):
            k[:, :, n : self.n_tokens] = 0
            v[:, n : self.n_tokens, :] = 0
        if self.state and n < self.n_tokens:
            for a, copy in zip(self.state, kept or (0,) * len(self.state)):
                a[...] = copy
            self.checkpoints = {p: c for p, c in self.checkpoints.items() if p <= n}
            if self.marked is not None and self.marked > n:
                self._mark = None
        del self.tokens[n:]

    def digest(self, n: int | None = None) -> str:
        """sha256 hex of the cache contents for positions 0..n-1 (default: all held positions).

        Hashed in a canonical, layout-independent order: the line from :func:`digest_prefix` (kv type, shape, n),
        then for each layer K and V as [position, n_head_kv, head_dim] little-endian bytes.
        """
        n = self.n_tokens if n is None else n
        if not 0 <= n <= self.n_tokens or (self.state and n != self.n_tokens):
            raise InputError(f"cannot digest {n} positions of a KV cache of {self.n_tokens}")
        return _digest(self.kv_type, self.k, self.v, n, self.state)

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
        state = tuple(a.copy() for a in self.state)
        for a in k + v + state:
            a.flags.writeable = False  # shared by the prefix cache: nothing may change it in place
        return KVSnapshot(self.kv_type, tuple(self.tokens[:n]), k, v, state)

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
        for mine, theirs in zip(self.state, snapshot.state):
            mine[...] = theirs
        self.checkpoints, self._mark = {}, None
        self.tokens[:] = snapshot.tokens[:n]
