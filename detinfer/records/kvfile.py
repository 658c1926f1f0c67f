"""KV snapshot files (.detkv): a KV cache's positions 0..n-1, bound to the model and tokenizer that made them.

File format, version 1, and version 2 for a hybrid model's cache (all integers little-endian)::

    offset   size        field
    0        8           magic b"DETKV\\0\\0\\0"
    8        4           format version, uint32 (1)
    12       8           header length H, uint64
    20       H           header: canonical JSON (UTF-8, sorted keys, no spaces), see KVHeader
    20+H     pad         zero bytes up to D, the next multiple of 64 (so the arrays are aligned)
    D        data_bytes  the arrays: for layer 0..n_layer-1, K then V, each [n_tokens, n_head_kv, head_dim]
                         in C order, little-endian float32 ("f32") or IEEE binary16 bits ("f16"); version 2
                         then the recurrent state, each array of ``state_shapes`` in C order, float32
    D+data   32          sha256 of every byte before it (offsets 0 .. D+data_bytes-1)

    data_bytes = n_layer x 2 x n_tokens x n_head_kv x head_dim x (4 for f32, 2 for f16) [+ 4 x the state's numbers]

Version 2 differs only by the header's ``state_shapes`` (the attention layers' KV first, then per Gated DeltaNet
layer its conv inputs and its delta-rule state, as :attr:`KVCache.state`); a cache without recurrent state is
still written as version 1, and both are read. The array section is exactly what :meth:`KVCache.digest` hashes
after its header line(s), so a file's KV digest (shown by :func:`inspect_kv`) equals the ``kv_sha256`` of the run
that produced the cache. The same cache always gives the same file bytes.

Files are written atomically (temp file in the same folder, fsync, rename). Loading checks the magic, the format
version, the checksum, the header, and that the file length is exactly what the header describes, before any
array is used; a file that fails is refused with a one-line KVFileError naming the reason.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..compute.kvcache import (
    KV_TYPES,
    KVCache,
    KVSnapshot,
    canonical_layers,
    digest_prefix,
)
from ..errors import InputError, KVFileError, first_error
from ..fileio import atomic_writer, open_input

MAGIC = b"DETKV\0\0\0"
FORMAT_VERSION = 2  # the newest this detinfer writes (for a cache with recurrent state) and reads
VERSIONS = (1, 2)
PRELUDE = struct.Struct("<8sIQ")  # magic, format version, header length
ALIGN = 64
CHECKSUM_BYTES = 32
LAYOUT = "per layer: K then V, each [n_tokens, n_head_kv, head_dim], C order"
MIN_FILE_BYTES = PRELUDE.size + CHECKSUM_BYTES
_HEX64 = r"^[0-9a-f]{64}$"
_READ_CHUNK = 1 << 22


class KVHeader(BaseModel):
    """The JSON header of a .detkv file (format version 1, or 2 with ``state_shapes``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model_sha256: str = Field(pattern=_HEX64)  # sha256 of the .gguf file the K/V were computed with
    tokenizer_sha256: str = Field(pattern=_HEX64)  # Tokenizer.hash of that model
    kv_type: Literal["f32", "f16"]
    n_layer: int = Field(ge=1)
    n_head_kv: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    n_tokens: int = Field(ge=0)
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]]  # token id at each position 0..n_tokens-1 (int32 in the KV cache)
    byte_order: Literal["little"]
    layout: Literal[LAYOUT]
    # version 2: the recurrent state's float32 arrays after the KV (at most 2 per layer: conv inputs, delta-rule state)
    state_shapes: list[list[Annotated[int, Field(ge=1, lt=2**31)]]] = Field(default_factory=list, max_length=2048)

    @model_validator(mode="after")
    def _tokens_match(self) -> "KVHeader":
        if len(self.tokens) != self.n_tokens:
            raise ValueError(f"{len(self.tokens)} token ids for n_tokens = {self.n_tokens}")
        if any(not 1 <= len(shape) <= 4 for shape in self.state_shapes):
            raise ValueError("a state array has 1 to 4 dimensions")
        return self

    @property
    def version(self) -> int:
        return 2 if self.state_shapes else 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_layer, self.n_head_kv, self.head_dim)

    @property
    def itemsize(self) -> int:
        return np.dtype(KV_TYPES[self.kv_type]).itemsize

    @property
    def array_bytes(self) -> int:
        """Bytes of one K (or V) array of one layer."""
        return self.n_tokens * self.n_head_kv * self.head_dim * self.itemsize

    @property
    def state_bytes(self) -> int:
        return sum(4 * int(np.prod(shape)) for shape in self.state_shapes)

    @property
    def data_bytes(self) -> int:
        return self.n_layer * 2 * self.array_bytes + self.state_bytes


def _data_offset(header_len: int) -> int:
    return -(-(PRELUDE.size + header_len) // ALIGN) * ALIGN


def save_kv(path: str | os.PathLike, source: KVSnapshot | KVCache, *, model_sha256: str, tokenizer_sha256: str) -> int:
    """Write ``source`` (a snapshot, or a cache's positions 0..n_tokens-1) to ``path`` atomically; returns the file size.

    ``model_sha256`` / ``tokenizer_sha256``: the model file's sha256 and its tokenizer hash, checked on load.
    Raises InputError for a malformed hash; OSError (unchanged) if the folder cannot be written, leaving any
    existing file at ``path`` as it was.
    """
    n = source.n_tokens
    header = KVHeader(
        model_sha256=_check_hex("model_sha256", model_sha256),
        tokenizer_sha256=_check_hex("tokenizer_sha256", tokenizer_sha256),
        kv_type=source.kv_type,
        n_layer=source.n_layer,
        n_head_kv=source.n_head_kv,
        head_dim=source.head_dim,
        n_tokens=n,
        tokens=[int(t) for t in source.tokens[:n]],
        byte_order="little",
        layout=LAYOUT,
        state_shapes=[list(a.shape) for a in source.state],
    )
    fields = header.model_dump(exclude=set() if source.state else {"state_shapes"})  # version 1 files keep their bytes
    head = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    offset = _data_offset(len(head))
    h = hashlib.sha256()
    with atomic_writer(path) as f:
        for part in (PRELUDE.pack(MAGIC, header.version, len(head)), head, bytes(offset - PRELUDE.size - len(head))):
            f.write(part)
            h.update(part)
        for a in [*canonical_layers(source.k, source.v, n), *(np.ascontiguousarray(s, dtype="<f4") for s in source.state)]:
            f.write(a.data)
            h.update(a.data)
        f.write(h.digest())
    return offset + header.data_bytes + CHECKSUM_BYTES


def _check_hex(name: str, value: str) -> str:
    if not (isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)):
        raise InputError(f"{name} must be 64 lowercase hex digits, got {value!r}")
    return value


def load_kv(
    path: str | os.PathLike,
    *,
    model_sha256: str | None = None,
    tokenizer_sha256: str | None = None,
    kv_type: str | None = None,
    shape: tuple[int, int, int] | None = None,
) -> KVSnapshot:
    """Read and verify a .detkv file; returns its snapshot (read-only arrays in the cache's layout).

    Each given expectation must match the file: ``model_sha256``, ``tokenizer_sha256``, ``kv_type`` ("f32"/"f16"),
    ``shape`` (n_layer, n_head_kv, head_dim). Raises KVFileError (one line) if the file is missing, not a .detkv
    file, of another format version, truncated or corrupt (checksum), or made for another model, tokenizer,
    kv type or shape.
    """
    path = Path(path)
    with _opened(path) as (f, size):
        header, h, _ = _read_header(path, f, size)
        k, v = [], []
        dtype = np.dtype(KV_TYPES[header.kv_type])
        file_dtype = dtype.newbyteorder("<")
        n, g, d = header.n_tokens, header.n_head_kv, header.head_dim
        buf = np.empty(header.array_bytes, np.uint8)
        for _ in range(header.n_layer):
            for out, axes in ((k, (1, 2, 0)), (v, (1, 0, 2))):
                _read_exact(path, f, buf, size)
                h.update(buf.data)
                # a copy always: with n_head_kv or n_tokens 1 the transposed view is already contiguous, and
                # ascontiguousarray would return a view of buf, which the next array overwrites
                a = np.array(buf.view(file_dtype).reshape(n, g, d).transpose(axes), dtype=dtype, order="C", copy=True)
                a.flags.writeable = False
                out.append(a)
        state = []
        for dims in header.state_shapes:
            a = np.empty(dims, "<f4")
            _read_exact(path, f, a.view(np.uint8).reshape(-1), size)
            h.update(a.data)
            a = a.astype(np.float32, copy=False)
            a.flags.writeable = False
            state.append(a)
        stored = f.read(CHECKSUM_BYTES)
    if stored != h.digest():
        raise KVFileError(f"{path}: checksum mismatch: the file is corrupt; save it again")
    _check_expected(path, header, model_sha256, tokenizer_sha256, kv_type, shape)
    try:
        return KVSnapshot(header.kv_type, tuple(header.tokens), tuple(k), tuple(v), tuple(state))
    except InputError as e:
        raise KVFileError(f"{path}: {e}") from None


def read_kv_header(path: str | os.PathLike) -> KVHeader:
    """The header of a .detkv file, with its magic, version and length checked but not its checksum (a file's
    arrays are checked when :func:`load_kv` reads them). Raises KVFileError as :func:`inspect_kv` does."""
    path = Path(path)
    with _opened(path) as (f, size):
        return _read_header(path, f, size)[0]


def inspect_kv(path: str | os.PathLike) -> dict[str, Any]:
    """Describe a .detkv file: format version, model, tokenizer, kv type, shape, tokens, sizes, checksum status and
    KV digest (``kv_sha256``, equal to the digest of the cache it was saved from).

    A file whose header and length are sound but whose checksum fails is still described (``checksum``:
    "mismatch", ``kv_sha256`` None). Raises KVFileError if the file is missing, not a .detkv file, of another
    format version, truncated, or its header cannot be read.
    """
    path = Path(path)
    with _opened(path) as (f, size):
        header, h, header_len = _read_header(path, f, size)
        kv = hashlib.sha256(digest_prefix(header.kv_type, *header.shape, header.n_tokens)
                            + (f"recurrent {len(header.state_shapes)}\n".encode() if header.state_shapes else b""))
        remaining = header.data_bytes
        while remaining:
            block = f.read(min(_READ_CHUNK, remaining))
            if not block:
                break
            h.update(block)
            kv.update(block)
            remaining -= len(block)
        ok = remaining == 0 and f.read(CHECKSUM_BYTES) == h.digest()
    return {
        "format_version": header.version,
        "file_bytes": size,
        "model_sha256": header.model_sha256,
        "tokenizer_sha256": header.tokenizer_sha256,
        "kv_type": header.kv_type,
        "n_layer": header.n_layer,
        "n_head_kv": header.n_head_kv,
        "head_dim": header.head_dim,
        "n_tokens": header.n_tokens,
        "bytes_per_token": 2 * header.n_layer * header.n_head_kv * header.head_dim * header.itemsize,
        "state_bytes": header.state_bytes,
        "data_offset": _data_offset(header_len),
        "data_bytes": header.data_bytes,
        "checksum": "ok" if ok else "mismatch",
        "kv_sha256": kv.hexdigest() if ok else None,
        "tokens": header.tokens,
    }


@contextmanager
def _opened(path: Path) -> Iterator[tuple[BinaryIO, int]]:
    """(file, size) of ``path`` opened for reading; a missing or unreadable file is a KVFileError."""
    if not os.path.lexists(path):
        raise KVFileError(f"{path}: no such KV snapshot file")
    with open_input(path, KVFileError, "KV snapshot") as f:
        yield f, os.fstat(f.fileno()).st_size


def _read_header(path: Path, f: BinaryIO, size: int) -> tuple[KVHeader, Any, int]:
    """Check magic and version, parse the header and check the file length; returns (header, sha256 state after
    the padding, header length). If the header or the length is wrong, the checksum decides which error is reported: a file
    whose checksum also fails is corrupt or truncated; one whose checksum holds was written wrong."""
    if size == 0:
        raise KVFileError(f"{path}: empty (0 bytes), not a .detkv KV snapshot; save it again")
    start = f.read(len(MAGIC))
    if start != MAGIC[: len(start)]:  # a file shorter than the magic is judged by what it has
        raise KVFileError(f"{path}: not a .detkv KV snapshot (starts with {start!r})")
    if size < MIN_FILE_BYTES:
        raise KVFileError(f"{path}: truncated: {size} bytes, a .detkv file has at least {MIN_FILE_BYTES}; save it again")
    prelude = start + f.read(PRELUDE.size - len(MAGIC))
    _, version, header_len = PRELUDE.unpack(prelude)
    if version not in VERSIONS:
        raise KVFileError(
            f"{path}: .detkv format version {version}; this detinfer reads versions {', '.join(map(str, VERSIONS))}"
            + ("; upgrade detinfer" if version > FORMAT_VERSION else "; save it again")
        )
    problem, header = None, None
    head = b""
    if PRELUDE.size + header_len + CHECKSUM_BYTES > size:
        problem = f"header length {header_len} runs past the end of the file ({size} bytes): truncated"
    else:
        head = f.read(header_len)
        try:
            header = KVHeader.model_validate_json(head)
        except ValidationError as e:
            problem = f"invalid header: {first_error(e)}"
    offset = _data_offset(header_len)
    if header is not None and header.version != version:
        problem, header = f"a version {version} file whose header is version {header.version}'s", None
    if header is not None:
        expected = offset + header.data_bytes + CHECKSUM_BYTES
        if size != expected:
            problem = f"{size} bytes, but its header describes {expected}" + (": truncated" if size < expected else "")
    if problem is None:
        pad = f.read(offset - PRELUDE.size - header_len)
        if pad.strip(b"\0"):
            problem = "nonzero padding after the header"
    if problem is None:
        return header, hashlib.sha256(prelude + head + pad), header_len
    if not _checksum_holds(f, size):
        raise KVFileError(f"{path}: checksum mismatch ({problem}): the file is corrupt or cut short; save it again")
    raise KVFileError(f"{path}: {problem}")


def _checksum_holds(f: BinaryIO, size: int) -> bool:
    """sha256 of bytes 0..size-33 equals the last 32 bytes (reads the whole file in 4 MiB blocks)."""
    f.seek(0)
    h = hashlib.sha256()
    remaining = size - CHECKSUM_BYTES
    while remaining > 0:
        block = f.read(min(_READ_CHUNK, remaining))
        if not block:
            return False
        h.update(block)
        remaining -= len(block)
    return f.read(CHECKSUM_BYTES) == h.digest()


def _read_exact(path: Path, f: BinaryIO, buf: np.ndarray, size: int) -> None:
    if f.readinto(buf.data) != buf.nbytes:  # the file shrank after its length was checked
        raise KVFileError(f"{path}: truncated while reading ({size} bytes when opened); save it again")


def _check_expected(path: Path, header: KVHeader, model_sha256, tokenizer_sha256, kv_type, shape) -> None:
    if model_sha256 is not None and header.model_sha256 != model_sha256:
        raise KVFileError(
            f"{path}: saved for model sha256 {header.model_sha256[:16]}..., not this model ({model_sha256[:16]}...); "
            "load it with that model or recompute the prompt"
        )
    if tokenizer_sha256 is not None and header.tokenizer_sha256 != tokenizer_sha256:
        raise KVFileError(
            f"{path}: saved with tokenizer {header.tokenizer_sha256[:16]}..., not this model's ({tokenizer_sha256[:16]}...); "
            "recompute the prompt"
        )
    if kv_type is not None and header.kv_type != kv_type:
        raise KVFileError(f"{path}: KV type {header.kv_type}, but the cache is {kv_type}; run with --kv-type {header.kv_type}")
    if shape is not None and header.shape != tuple(shape):
        raise KVFileError(
            f"{path}: (n_layer, n_head_kv, head_dim) = {header.shape}, but the cache has {tuple(shape)}; it was made by another model"
        )
