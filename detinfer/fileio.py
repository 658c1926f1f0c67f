"""Atomic file writes and hashing: every file detinfer writes goes through here."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from .errors import InputError


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

    If the body raises, the temp file is removed and ``path`` is left as it was. A ``path`` that exists and is not
    a regular file (symbolic link, device, FIFO, directory...) is never replaced, and a folder that cannot be made
    or written is reported: InputError, one line.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """:func:`atomic_writer` for a library that opens its output by name (gguf-py's ``GGUFWriter``): yields the path
    of an empty temp file in ``path``'s folder to write; on a clean exit that file is fsynced and renamed over
    ``path``. Same guarantees and errors as :func:`atomic_writer`; a write that fails for want of space (a full
    disk, a quota, a file-size limit) is an InputError naming the path and the space left, and the old file stays.
    """
    path = Path(path)
    if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
        raise InputError(f"{path} is {_kind(os.lstat(path).st_mode)}; detinfer writes only regular files or new paths")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:  # a parent that is a file, a read-only place...
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        _lock(fd)  # held until the rename: remove_dead_temp_files never takes a live writer's file
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the mode open() would
        yield Path(tmp)
        os.fsync(fd)  # the writes went through another descriptor of the same file
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in _FULL:
            raise InputError(f"cannot write {path}: {e.strerror} ({_free(path.parent)} free in {path.parent}); "
                             "free some space or write elsewhere") from None  # fmt: skip
        raise
    finally:
        os.close(fd)
    fsync_dir(path.parent)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit


def _free(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:,.1f} MiB"
    except OSError:
        return "unknown space"


def publish_new(path: str | os.PathLike, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if nothing is there yet (a file, a symbolic link, anything): the bytes are
    written to a temp file in the same folder, fsynced, then hard-linked to ``path``, which fails if the name exists.
    So two writers racing for one name never replace each other, and a reader sees the whole file or none.
    Returns False if ``path`` exists; raises OSError for a folder that cannot be written (ENOSPC included)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def _lock(fd: int, *, wait: bool = True) -> None:
    """flock ``fd`` exclusively; a filesystem without flock (some network mounts) is not an error for a writer."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        if not wait:
            raise


DEAD_TEMP_AGE_S = 10.0  # a temp file younger than this may be one whose writer has not taken its lock yet


def remove_dead_temp_files(folder: Path) -> None:
    """Delete the ``.*.tmp`` files that atomic writes in ``folder`` left when their process was killed mid-write.

    A live writer holds an flock on its temp file until the rename (:func:`atomic_path`), and the kernel drops the
    lock when the process dies; so a temp file whose lock can be taken belongs to no one, and one that is locked is
    left alone. A file modified in the last DEAD_TEMP_AGE_S seconds is left alone too: its writer may be between
    creating it and locking it. Where flock is not supported nothing is removed. Nothing here raises."""
    try:
        candidates = list(folder.glob(".*.tmp"))
    except OSError:
        return
    for tmp in candidates:
        try:
            fd = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > DEAD_TEMP_AGE_S:
                _lock(fd, wait=False)  # BlockingIOError: its writer is alive
                tmp.unlink()
        except OSError:
            pass
        finally:
            os.close(fd)


def read_json(path: str | os.PathLike, error: type[Exception], what: str):
    """Parse a JSON file (see :func:`load_json`: a regular file, bounded size, depth and integers); an unreadable
    or non-JSON file raises ``error`` with one line naming it as ``what``."""
    return load_json(path, error, what)


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


def write_cache(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], object]) -> bool:
    """Atomically write a cache file, best effort: ``data`` (bytes, or a function writing to the open file). A
    value that can be recomputed is not worth failing a run for, so a folder that cannot be made or written, a
    full disk or a ``path`` that is not a regular file only returns False; True once the file is in place."""
    try:
        with atomic_writer(path) as f:
            data(f) if callable(data) else f.write(data)
    except (OSError, InputError):
        return False
    return True


# ------------------------------------------------------------------------------------------ derived (cache) files

SEAL = b"detinfer-cache-v1"  # first word of a sealed cache file
_cache_log = logging.getLogger("detinfer.cache")


class DamagedCache(Exception):
    """A cache file that does not check out; the message (one line) names the file and what is wrong with it."""


def seal(payload: bytes, source: str) -> bytes:
    """``payload`` behind one line that binds it to ``source`` (what it was derived from, e.g. a GGUF's header key):
    ``detinfer-cache-v1 <sha256 of source, newline, payload> <source>\n``, then the payload."""
    h = hashlib.sha256(source.encode("utf-8") + b"\n")
    h.update(payload)
    return b"%s %s %s\n" % (SEAL, h.hexdigest().encode("ascii"), source.encode("utf-8")) + payload


def write_sealed_cache(path: str | os.PathLike, payload: bytes, source: str) -> bool:
    """:func:`write_cache` of ``payload`` sealed to ``source`` (:func:`seal`); read it back with :func:`read_sealed_cache`."""
    return write_cache(path, seal(payload, source))


def read_sealed_cache(path: str | os.PathLike, source: str, *, max_bytes: int) -> bytes | None:
    """The payload of the sealed cache file ``path`` made from ``source``, or None if there is no such file.

    Raises DamagedCache (one line naming the file) if it is not a readable regular file of at most ``max_bytes``,
    has no seal line, was made from another source, or its payload does not match the seal's sha256 (truncated,
    edited, or written by a version of detinfer that derives it differently)."""
    if not os.path.lexists(path):
        return None
    data = read_input(path, DamagedCache, "cache file", max_bytes=max_bytes)
    line, newline, payload = data.partition(b"\n")
    parts = line.split(b" ", 2)
    if not newline or len(parts) != 3 or parts[0] != SEAL:
        raise DamagedCache(f"cache file {path} has no detinfer-cache seal (truncated or overwritten)")
    _, digest, sealed_source = parts
    if sealed_source != source.encode("utf-8"):
        raise DamagedCache(f"cache file {path} was derived from {sealed_source[:100].decode('utf-8', 'replace')!r}, "
                           f"not from {source!r}")  # fmt: skip
    h = hashlib.sha256(sealed_source + b"\n")
    h.update(payload)
    if h.hexdigest().encode("ascii") != digest:
        raise DamagedCache(f"cache file {path} does not match its sha256 (truncated or edited)")
    return payload


def warn_damaged_cache(problem: str, model: str) -> None:
    """One warning line (logger ``detinfer.cache``; without logging configured, Python prints it on stderr as is)
    for a cache file that was not used: ``problem`` names the file and what is wrong, ``model`` what rebuilds it."""
    _cache_log.warning("%s; not used, rebuilt from %s", " ".join(problem.split()), model)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Atomically write UTF-8 ``text`` to ``path`` (see :func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 25) -> str:
    """Hex sha256 of a file's bytes, read into one 32 MiB buffer. Reads and hashing release the GIL; few large
    chunks mean few waits for it when the hash runs beside a thread that holds it (ModelFile hashes in the
    background while the tokenizer is built)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------- inputs from paths

MAX_INPUT_BYTES = 64 * 1024 * 1024  # default cap of a prompt, messages, template, script, manifest or record file
MAX_JSON_DEPTH = 64  # nesting levels of arrays and objects in any JSON input


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def open_input(path: str | os.PathLike, error: type[Exception], what: str) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file (symbolic links to one are followed).

    A FIFO, device, socket or directory is refused at once: the file is opened non-blocking, so a FIFO without a
    writer cannot hang. Raises ``error`` with one line naming ``what`` and the path (not found, unreadable, not a
    regular file).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error(f"cannot read {what} {path}: file not found") from None
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"cannot read {what} {path}: it is {_kind(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _read_upto(f: BinaryIO, limit: int, first: int) -> bytes:
    """At most ``limit`` bytes of ``f``, read ``first`` bytes at a time at first, then 1 MiB at a time: ``read(n)``
    allocates n bytes before it reads, so one read of a 1 GiB limit asked the OS for 1 GiB even for a 2 MB file (a
    MemoryError under ``ulimit -v`` or on a small machine)."""
    chunks, n, want = [], 0, first
    while n < limit and (block := f.read(min(want, limit - n))):
        chunks.append(block)
        n += len(block)
        want = 1 << 20
    return b"".join(chunks)


def read_input(path: str | os.PathLike, error: type[Exception], what: str, *, max_bytes: int = MAX_INPUT_BYTES,
               stdin: bool = False) -> bytes:  # fmt: skip
    """The bytes of the regular file ``path`` (see :func:`open_input`; ``-`` reads stdin when ``stdin``), at most
    ``max_bytes``; ``error`` (one line) if it is not a readable regular file or is larger."""
    if stdin and str(path) == "-":
        data = _read_upto(sys.stdin.buffer, max_bytes + 1, 1 << 20)
        if len(data) > max_bytes:
            raise error(f"{what} on stdin is larger than the limit of {max_bytes:,} bytes")
        return data
    with open_input(path, error, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise error(f"{what} {path} has {size:,} bytes, more than the limit of {max_bytes:,}")
        try:
            data = _read_upto(f, max_bytes + 1, size + 1)
        except OSError as e:
            raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    if len(data) > max_bytes:  # the file grew while being read
        raise error(f"{what} {path} is larger than the limit of {max_bytes:,} bytes")
    return data


def read_input_text(path: str | os.PathLike, error: type[Exception], what: str, **kw: Any) -> str:
    """:func:`read_input` decoded as UTF-8; invalid UTF-8 raises ``error`` naming the byte and its offset."""
    data = read_input(path, error, what, **kw)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {path} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start}") from None


def utf8_error(text: str) -> str | None:
    """None if ``text`` encodes as UTF-8, else what stops it and where: an undecodable byte of a command-line
    argument (Python decodes one as a lone surrogate U+DC80-U+DCFF, so ``$'\\xff'`` reads "byte 0xff") or a lone
    surrogate (a JSON ``\\ud800`` escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate \\u{code:04x}"
        return f"{what} at character {e.start}"
    return None


class _JSONLimit(ValueError):
    pass


_CONTAINERS = frozenset({list, dict})  # json.loads makes no subclasses


def _check_depth(data: Any) -> None:
    """At most MAX_JSON_DEPTH levels of arrays and objects (checked level by level: big flat arrays stay cheap)."""
    level, depth = [data] if isinstance(data, (list, dict)) else [], 1
    while level:
        if depth > MAX_JSON_DEPTH:
            raise _JSONLimit(f"is nested deeper than {MAX_JSON_DEPTH} levels")
        inner: list = []
        for c in level:
            values = c.values() if isinstance(c, dict) else c
            if not _CONTAINERS.isdisjoint(map(type, values)):  # C-speed test first: a 262k-token list holds none
                inner.extend([v for v in values if isinstance(v, (list, dict))])
        level, depth = inner, depth + 1


# A lone surrogate can only come from a \\u escape without its pair: counting escapes and pairs (fast, even on a
# cached index of 260k tokens) tells whether the slow check of every string is needed.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_PAIR = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F]")


def _check_utf8(data: Any) -> None:
    """Every string (keys too) encodable as UTF-8: no lone surrogate, which JSON can write as a \\u escape."""
    todo = [data]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise _JSONLimit(f"holds a string with the lone surrogate \\u{ord(value[e.start]):04x} (not valid UTF-8)") from None
        elif isinstance(value, dict):
            todo.extend(value.keys())
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)


def parse_json(text: str | bytes, error: type[Exception], what: str, where: str | os.PathLike | None = None) -> Any:
    """Parse the JSON ``what`` read from ``where`` (None: ``what`` names it, as for a request body) with bounded
    nesting (MAX_JSON_DEPTH), integers (Python's limit of 4,300 digits; the pydantic models bound each value) and
    valid UTF-8 strings; a violation or syntax error raises ``error``, one line."""
    subject = f"{where}: the {what}" if where is not None else f"the {what}"
    invalid = f"{where} is not a JSON {what}" if where is not None else f"the {what} is not valid JSON"
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        data = json.loads(text)
        _check_depth(data)
        if len(_SURROGATE_ESCAPE.findall(text)) != 2 * len(_SURROGATE_PAIR.findall(text)):
            _check_utf8(data)
    except RecursionError:
        raise error(f"{subject} is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except _JSONLimit as e:
        raise error(f"{subject} {e}") from None
    except json.JSONDecodeError as e:
        if not e.doc.strip():
            raise error(f"{invalid}: {'it is empty' if not e.doc else 'it holds only white space'}") from None
        at = f"line {e.lineno} column {e.colno}" if e.lineno > 1 or "\n" in e.doc.strip() else f"column {e.colno}"
        # parsing stopped where the text does, or in a string never closed: the rest may be missing
        ended = e.pos >= len(e.doc.rstrip()) or e.msg.startswith("Unterminated string")
        msg = e.msg.removesuffix(" starting at")
        raise error(f"{invalid}: invalid JSON at {at} ({msg}){'; it may be truncated' * ended}") from None
    except UnicodeDecodeError as e:
        raise error(f"{invalid}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})") from None
    except ValueError as e:  # an integer past Python's limit of 4,300 digits
        if "integer string conversion" in str(e):
            raise error(f"{subject} holds an integer of more than {sys.get_int_max_str_digits():,} digits") from None
        raise error(f"{invalid} ({' '.join(str(e).split())[:200]})") from None
    return data


def load_json(path: str | os.PathLike, error: type[Exception], what: str, *, max_bytes: int = MAX_INPUT_BYTES) -> Any:
    """A JSON file read with :func:`read_input` and parsed with :func:`parse_json`; ``error`` (one line) otherwise."""
    return parse_json(read_input(path, error, what, max_bytes=max_bytes), error, what, path)


# --------------------------------------------------------------------------------------------- output paths


def check_output(path: str | os.PathLike, what: str) -> Path:
    """``path`` if detinfer may write a file there: a regular file (replaced atomically) or a new path in a folder
    it can write. Never a symbolic link, directory, device, FIFO or socket, and never a path under a file.

    Raises InputError (one line naming ``what``) otherwise; writes nothing but a probe file it removes at once.
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):  # a new path, or one under a file (check_output_dir names it)
        st = None
    except OSError as e:
        raise InputError(f"{what} {path}: cannot write there ({e.strerror or e})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {path} is {_kind(st.st_mode)}; detinfer writes only regular files or new paths")
    check_output_dir(path.parent, what, given=path)
    return path


def check_output_dir(folder: str | os.PathLike, what: str, *, given: str | os.PathLike | None = None) -> Path:
    """``folder`` if files can be created in it (or in its nearest existing ancestor, when it does not exist yet:
    the missing folders are created when the file is written); InputError (one line, naming ``given``, the path the
    user passed, default ``folder``) if it or an ancestor is not a directory or cannot be written."""
    folder = Path(folder)
    shown = folder if given is None else given
    existing = folder
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{what} {shown}: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".detinfer-probe-")
    except OSError as e:
        raise InputError(f"{what} {shown}: cannot create files in {existing} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)
    return folder
