"""Prefix cache: KV snapshots of earlier prompts, found by token-id prefix, bounded by bytes, evicted LRU.

Reuse is exact because a position's K/V depend only on the tokens up to it: restoring the first k positions of
any snapshot whose tokens agree with the new prompt on those k tokens gives the same cache, byte for byte, as
computing them (a snapshot longer than the shared part is cut to it, which is exact for attention layers).
One PrefixCache serves one model and KV type; the snapshots carry no model identity of their own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import InputError
from .kvcache import KVCache, KVSnapshot


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Number of leading equal entries of two int64 arrays."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class SnapshotStore(Protocol):
    """Where a PrefixCache keeps its snapshots beyond memory and process (records/kv_dir.py): ``candidates`` lists
    (token ids, handle) of what it holds, ``load`` returns a handle's checked snapshot or None,
    ``save`` keeps a snapshot without blocking; a snapshot with recurrent state serves only its whole length."""

    def candidates(self) -> list[tuple[np.ndarray, Any]]: ...

    def load(self, handle: Any) -> KVSnapshot | None: ...

    def save(self, snap: KVSnapshot) -> None: ...


class PrefixCache:
    """An in-memory LRU map from token-id sequences to KV snapshots, holding at most ``max_bytes`` of K/V.

    A stored snapshot whose tokens are a prefix of another stored (truncatable) one is redundant and is dropped,
    since the longer one serves every lookup the shorter would. With ``store``, every snapshot kept is also saved
    there, and a lookup uses a stored snapshot when it serves a longer prefix than memory does (it is then kept in
    memory too). Raises InputError if ``max_bytes`` is negative.
    """

    def __init__(self, max_bytes: int, store: SnapshotStore | None = None):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, (int, np.integer)) or max_bytes < 0:
            raise InputError(f"prefix cache size must be a whole number of bytes >= 0, got {max_bytes!r}")
        self.max_bytes = int(max_bytes)
        self._entries: OrderedDict[tuple[int, ...], tuple[np.ndarray, KVSnapshot]] = OrderedDict()  # oldest first
        self._nbytes = 0
        self._geometry: tuple[str, tuple[int, int, int]] | None = None
        self.backing = store

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held (sum of the snapshots' nbytes), never above max_bytes."""
        return self._nbytes

    def keys(self) -> list[tuple[int, ...]]:
        """Token sequences held, least recently used first."""
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._nbytes = 0
        self._geometry = None

    def lookup(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, KVSnapshot | None]:
        """The longest reusable prefix of ``tokens``: (k, snapshot) where snapshot.tokens[:k] == tokens[:k], or (0, None).

        ``limit`` caps k (default len(tokens)). A truncatable snapshot serves any k up to the tokens it shares; a
        non-truncatable one only its full length. Ties go to the most recently used snapshot. The snapshot found
        becomes the most recently used. Restore it with ``cache.restore(snapshot, k)``.
        """
        query = np.asarray(tokens, dtype=np.int64).reshape(-1)
        limit = query.shape[0] if limit is None else min(int(limit), query.shape[0])
        best_k, best_key = 0, None
        for key, (ids, snap) in reversed(self._entries.items()):  # most recent first: it wins ties
            shared = _shared_prefix(ids, query)
            if snap.truncatable:
                k = min(shared, limit)
            else:
                k = ids.shape[0] if shared == ids.shape[0] and ids.shape[0] <= limit else 0
            if k > best_k:
                best_k, best_key = k, key
        if self.backing is not None:
            stored = sorted(((min(_shared_prefix(ids, query), limit), i, handle)
                             for i, (ids, handle) in enumerate(self.backing.candidates())), reverse=True)  # fmt: skip
            for k, _, handle in stored:
                if k <= best_k:
                    break
                snap = self.backing.load(handle)
                if snap is not None and (snap.truncatable or k == snap.n_tokens):  # recurrent state: whole, or not at all
                    self._keep(snap)
                    return k, snap
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best_k, self._entries[best_key][1]

    def restore_longest(self, cache: KVCache, tokens: Sequence[int]) -> None:
        """Restore into ``cache`` the best snapshot's prefix of ``tokens`` when it is longer than what ``cache``
        already holds of them (at most len(tokens) - 1: the last token is always computed). Exact either way."""
        ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
        limit = ids.shape[0] - 1
        held = min(_shared_prefix(np.asarray(cache.tokens, dtype=np.int64), ids), limit)
        k, snap = self.lookup(ids, limit=limit)
        if snap is not None and k > held:
            cache.restore(snap, k)

    def store(self, source: KVCache | KVSnapshot) -> bool:
        """Keep a snapshot of ``source`` (a cache is snapshotted whole), evicting least recently used entries to stay
        within max_bytes. Returns False if it was not kept: empty, larger than max_bytes, or already covered by a
        longer stored snapshot (which then becomes most recently used).

        Raises InputError if its kv type or shape differs from the snapshots already held.
        """
        geometry = (source.kv_type, source.shape)
        if self._entries and geometry != self._geometry:
            raise InputError(f"this prefix cache holds {self._geometry} snapshots, not {geometry}; use one prefix cache per model")
        if source.n_tokens == 0:
            return False
        ids = np.asarray(source.tokens, dtype=np.int64)
        truncatable = source.truncatable
        covered = []
        for other, (other_ids, other_snap) in self._entries.items():
            shared = _shared_prefix(ids, other_ids)
            if shared == ids.shape[0] and other_snap.truncatable:  # an equal or longer snapshot serves it already
                self._entries.move_to_end(other)
                return False
            if shared == other_ids.shape[0] and truncatable:  # the new one serves every lookup this shorter one does
                covered.append(other)
        if (source.held_nbytes if isinstance(source, KVCache) else source.nbytes) > self.max_bytes:
            return False
        snap = source.snapshot() if isinstance(source, KVCache) else source
        for other in covered:
            self._drop(other)
        self._add(ids, snap)
        if self.backing is not None:
            self.backing.save(snap)
        return True

    def _keep(self, snap: KVSnapshot) -> None:
        """Hold a snapshot loaded from the store in memory too (not saved back), if it fits."""
        if (snap.kv_type, snap.shape) != (self._geometry or (snap.kv_type, snap.shape)) or snap.nbytes > self.max_bytes:
            return
        ids = np.asarray(snap.tokens, dtype=np.int64)
        for other in [key for key, (other_ids, _) in self._entries.items()
                      if _shared_prefix(ids, other_ids) == other_ids.shape[0]]:  # fmt: skip
            self._drop(other)
        self._add(ids, snap)

    def _add(self, ids: np.ndarray, snap: KVSnapshot) -> None:
        self._entries[tuple(snap.tokens)] = (ids, snap)
        self._nbytes += snap.nbytes
        self._geometry = (snap.kv_type, snap.shape)
        while self._nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        _, snap = self._entries.pop(key)
        self._nbytes -= snap.nbytes
