"""A folder of KV snapshots behind the server's prefix cache (``serve --kv-dir``), so a restarted server is warm.

Every snapshot the prefix cache keeps is also written as a .detkv file (kvfile.py), by a writer thread of its own,
never on the decode path. Its name is the sha256 of (model sha256, tokenizer hash, kv type, token ids), so a
prefix always has one name and, computed by any process, the same bytes: two servers sharing a folder never put
different data under one name. At start only the files' headers are read, into an index of token ids; a file is
loaded, with every check of :func:`load_kv` (checksum, model, tokenizer, kv type, shape) and its token ids compared
with the index, only when a lookup would use it. A file that fails a check is one warning and is never used
(the next write of that prefix replaces it). The folder's files of this model stay within ``max_bytes``: the
least recently written or used ones are deleted first (modification time; a load touches the file).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from pathlib import Path

import numpy as np

from ..compute.kvcache import KVSnapshot
from ..errors import DetinferError, InputError
from ..fileio import remove_dead_temp_files
from .kvfile import load_kv, read_kv_header, save_kv

_log = logging.getLogger("detinfer.kv_dir")
SUFFIX = ".detkv"
QUEUE_MAX = 16  # snapshots waiting for the writer; when it falls this far behind, newer ones are not persisted


class KVDir:
    """The snapshot store of one model and KV geometry in ``folder`` (the :class:`PrefixCache` ``store``).

    ``model_sha256`` / ``tokenizer_sha256``: what every file must be bound to; ``kv_type`` and ``shape``
    (n_layer, n_head_kv, head_dim): the cache's. Raises InputError if ``max_bytes`` is negative or ``folder``
    cannot be created or is not a folder.
    """

    def __init__(self, folder: str | os.PathLike, max_bytes: int, *, model_sha256: str, tokenizer_sha256: str,
                 kv_type: str, shape: tuple[int, int, int]):  # fmt: skip
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InputError(f"--kv-dir-bytes must be a whole number of bytes >= 0, got {max_bytes!r}")
        self.folder, self.max_bytes = Path(folder), max_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"--kv-dir {str(folder)!r} cannot be used as a folder ({e.strerror}); give a writable folder") from None
        self._expect = {"model_sha256": model_sha256, "tokenizer_sha256": tokenizer_sha256, "kv_type": kv_type,
                        "shape": tuple(shape)}  # fmt: skip
        self._lock = threading.Lock()
        self._index: dict[str, np.ndarray] = {}  # file name -> token ids, for files whose header matched
        remove_dead_temp_files(self.folder)
        for path in sorted(self.folder.glob("*" + SUFFIX)):
            try:
                header = read_kv_header(path)
            except DetinferError as e:
                _log.warning("%s; not used", e)
                continue
            if (header.model_sha256, header.tokenizer_sha256, header.kv_type, header.shape) == tuple(self._expect.values()) \
                    and path.name == self._name(header.tokens):  # fmt: skip
                self._index[path.name] = np.asarray(header.tokens, dtype=np.int64)
        self._queue: queue.Queue[KVSnapshot | None] = queue.Queue(QUEUE_MAX)
        self._writer = threading.Thread(target=self._write_loop, name="detinfer-kv-dir", daemon=True)
        self._writer.start()

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def _name(self, tokens) -> str:
        e = self._expect
        key = f"{e['model_sha256']}\n{e['tokenizer_sha256']}\n{e['kv_type']}\n{','.join(map(str, tokens))}"
        return hashlib.sha256(key.encode()).hexdigest() + SUFFIX

    def candidates(self) -> list[tuple[np.ndarray, str]]:
        """(token ids, handle) of every indexed file, for :meth:`PrefixCache.lookup`."""
        with self._lock:
            return [(ids, name) for name, ids in self._index.items()]

    def load(self, handle: str) -> KVSnapshot | None:
        """The snapshot in file ``handle`` after every check, or None (one warning; the file leaves the index)."""
        path = self.folder / handle
        with self._lock:
            ids = self._index.get(handle)
        if ids is None:
            return None
        e = self._expect
        try:
            snap = load_kv(path, model_sha256=e["model_sha256"], tokenizer_sha256=e["tokenizer_sha256"],
                           kv_type=e["kv_type"], shape=e["shape"])  # fmt: skip
            if snap.tokens != tuple(ids.tolist()):
                raise InputError(f"{path}: its token ids changed since the folder was indexed")
            os.utime(path)
            return snap
        except (DetinferError, OSError) as err:
            _log.warning("%s; not used", err)
            with self._lock:
                self._index.pop(handle, None)
            return None

    def save(self, snap: KVSnapshot) -> None:
        """Hand ``snap`` to the writer thread; never blocks (a full queue drops it: it stays in memory)."""
        try:
            self._queue.put_nowait(snap)
        except queue.Full:
            pass

    def close(self, timeout: float) -> None:
        """Let the writer finish what is queued, waiting at most ``timeout`` seconds (it is a daemon thread)."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._writer.join(timeout)

    def _write_loop(self) -> None:
        while (snap := self._queue.get()) is not None:
            name = self._name(snap.tokens)
            with self._lock:
                known = name in self._index
            path = self.folder / name
            try:
                if known and path.is_file():
                    os.utime(path)
                else:
                    save_kv(path, snap, model_sha256=self._expect["model_sha256"],
                            tokenizer_sha256=self._expect["tokenizer_sha256"])  # fmt: skip
                    with self._lock:
                        self._index[name] = np.asarray(snap.tokens, dtype=np.int64)
                self._evict()
            except OSError as e:  # a full disk or an unwritable folder: the snapshot stays in memory only
                _log.warning("--kv-dir: could not write %s (%s); the prefix stays in memory only", path, e.strerror or e)

    def _evict(self) -> None:
        """Delete this model's oldest files until the rest fit in ``max_bytes``."""
        with self._lock:
            names = list(self._index)
        files = []
        for name in names:
            try:
                st = (self.folder / name).stat()
            except OSError:
                continue
            files.append((st.st_mtime_ns, name, st.st_size))
        total = sum(size for _, _, size in files)
        for _, name, size in sorted(files):
            if total <= self.max_bytes:
                break
            with self._lock:
                self._index.pop(name, None)
            try:
                (self.folder / name).unlink()
            except OSError:
                pass
            total -= size
