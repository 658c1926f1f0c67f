"""Atomic file writes and hashing: every file detinfer writes goes through here."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Iterator


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_writer`).

    A reader sees either the old file or the complete new one, never a partial write.
    """
    with atomic_writer(path) as f:
        f.write(data)


@contextmanager
def atomic_writer(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Stream a file to ``path`` atomically: yields a binary file in the same folder; on a clean exit it is
    flushed, fsynced and renamed over ``path`` (then the folder is fsynced so the rename survives a crash).

    If the body raises, the temp file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def read_json(path: str | os.PathLike, error: type[Exception], what: str):
    """Parse a JSON file; an unreadable or non-JSON file raises ``error`` with one line naming it as ``what``."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path} is not a JSON {what} ({e}); it may be truncated") from None


def fsync_dir(folder: Path) -> None:
    """fsync a folder so a rename inside it survives a crash (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # some platforms cannot open a folder; the rename is still atomic, only less durable
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 ``text`` to ``path`` (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()
