"""numba's JIT cache, checked like every other derived file: each entry sealed to the key it was saved under.

numba (``numba.core.caching.IndexDataCacheFile``) keeps a kernel's compiled code as a pickle per entry (``.nbc``)
beside an index (``.nbi``) mapping each key (signature, compile target, bytecode hash) to its file, and trusts both:
a cut file raised ``UnpicklingError`` out of the first call (a traceback, and ``verify`` exited 1 as if the record did
not match), and nothing tied a data file to its key. :func:`seal_jit_cache` makes each entry ``MAGIC + sha256(key,
payload) + payload`` (payload: numba's own pickle of the entry) and, on load, uses an entry only if it is such a
blob for this key; an index that cannot be read counts as empty. Anything else is a cache miss: the kernel compiles
again (numba rewrites the entry) after one warning line naming the file (logger ``detinfer.cache``; an entry
written before the seal existed is compiled again without one). As for the other caches, a seal catches a cut,
damaged, swapped or foreign file, not someone who recomputes it on purpose (``--rederive`` compiles in a fresh
folder). ~5 ms of sha256 per warm start.
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

from ..fileio import warn_damaged_cache

FORMAT = 1  # of a sealed entry; in the CI cache key (integrations/ci_report.py): a cache of unsealed entries is not restored
MAGIC = f"detinfer-jit-entry-v{FORMAT}\n".encode("ascii")
_DIGEST = 32
_warned: set[str] = set()  # the files reported in this process: a warm-up looks an entry up more than once


def _warn(problem: str, path: str) -> None:
    if path not in _warned:
        _warned.add(path)
        warn_damaged_cache(problem, "the kernel's source")


def _digest(key: Any, payload: bytes) -> bytes:
    return hashlib.sha256(repr(key).encode("utf-8") + b"\0" + payload).digest()


def _seal(key: Any, payload: bytes) -> bytes:
    return MAGIC + _digest(key, payload) + payload


class _Unsealed(Exception):
    """An entry numba wrote without the seal (before detinfer sealed its cache): a plain miss, no warning."""


def _unseal(key: Any, blob: Any) -> Any:
    """The entry in ``blob`` if it is one sealed to ``key``; raises _Unsealed for an entry without a seal, ValueError
    for one whose seal does not check out."""
    if not (isinstance(blob, bytes) and blob.startswith(MAGIC)):
        raise _Unsealed
    digest, payload = blob[len(MAGIC) : len(MAGIC) + _DIGEST], blob[len(MAGIC) + _DIGEST :]
    if digest != _digest(key, payload):
        raise ValueError("its sha256 does not match its content and key")
    return pickle.loads(payload)


def seal_jit_cache() -> None:
    """Install the seal on numba's cache files (idempotent; before any kernel loads or compiles)."""
    from numba.core import caching, serialize

    cls = caching.IndexDataCacheFile
    if getattr(cls, "_detinfer_sealed", False):
        return
    save, load_index = cls.save, cls._load_index

    def sealed_save(self, key, data):
        save(self, key, _seal(key, serialize.dumps(data)))  # numba's own pickle of the entry, then the seal

    def sealed_load(self, key):
        name = self._load_index().get(key)
        if name is None:
            return None
        try:
            return _unseal(key, self._load_data(name))
        except (OSError, _Unsealed):  # removed while the index still names it (numba's own case); made before the seal
            return None
        except Exception as e:  # noqa: BLE001 - a cut or garbled pickle raises anything: a miss, compiled again
            _warn(f"numba cache file {self._data_path(name)} is damaged ({e})", self._data_path(name))
            return None

    def checked_index(self):
        try:
            overloads = load_index(self)
            if not isinstance(overloads, dict):
                raise ValueError(f"it holds {type(overloads).__name__}, not a dict")
            return overloads
        except Exception as e:  # noqa: BLE001 - as above
            _warn(f"numba cache index {self._index_path} cannot be read ({e})", self._index_path)
            return {}

    cls.save, cls.load, cls._load_index = sealed_save, sealed_load, checked_index
    cls._detinfer_sealed = True
