"""GGUF loading: parse and validate a .gguf file into metadata plus memory-mapped tensor views.

The file is parsed with the ``gguf`` package's reader (GGUF spec:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). Parsing a 49k-token vocabulary with the
reader takes over a second (Gemma 3's 262k tokens, several), so the parsed result (metadata with each value's
GGUF type, and the tensor table; never weights) is kept in an index under
``$DETINFER_HOME/index/header-<key>.index-v3``, the key a sha256 of the file's size and its first
HEADER_KEY_BYTES bytes. An index is only kept for a file whose header (everything before the tensor data) lies
inside those bytes. A kept index is used only once it checks out: its seal (a sha256 of the content and the key,
:func:`detinfer.fileio.seal`) matches, and what it says, encoded again the way gguf-py's writer encodes a header
(:func:`header_image`), is byte for byte the file's header; this costs a tenth of a parse. Anything else is
rebuilt from the file with a one-line warning (:func:`detinfer.fileio.warn_damaged_cache`), never used.
Weights stay quantized in the memory map. The sha256 of the whole file, which run manifests record, is
computed by a background thread meanwhile (:attr:`ModelFile.sha256` waits for it).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from pydantic import BaseModel, ConfigDict, ValidationError

from ..errors import GGUFError
from ..fileio import (
    DamagedCache,
    parse_json,
    read_sealed_cache,
    remove_dead_temp_files,
    sha256_file,
    warn_damaged_cache,
    write_sealed_cache,
)
from ..paths import detinfer_home
from .quants import SUPPORTED_TYPES, supported_type_names

INDEX_VERSION = 3
HEADER_KEY_BYTES = 16 << 20  # Gemma 3's 262k-token header is ~6 MB


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    ne: GGUF dimensions, innermost (contiguous) first, as in the file.
    shape: numpy order (``ne`` reversed), e.g. ``(n_rows, n_cols)`` for a matrix.
    offset: absolute byte offset of the data in the file; nbytes: its length in bytes.
    """

    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.ne))

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class _PlainReader(GGUFReader):
    """The gguf reader over a plain ndarray view of its memory map: same parse, ~3x faster
    (numpy's memmap subclass pays a Python-level hook on every one of ~10^6 small slices), and bounded.

    The reader builds a Python list entry per array element from counts stored in the file, and its reads past
    the end return empty arrays instead of failing: one corrupt count made it allocate until the kernel killed
    the process (found by ``make fuzz``). Here a read past the end of the file, or more than ``MAX_READS`` reads
    in one parse, raises ValueError, so a corrupt count costs bounded memory (~150 bytes per read).
    """

    # Gemma 3's 262k-token vocabulary takes ~1.05 million reads (text, length, score, type per token).
    MAX_READS = 1 << 23

    def __init__(self, path: Path):
        self._reads = 0
        super().__init__(path)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        self._reads += 1
        if self._reads > self.MAX_READS:
            raise ValueError(f"more than {self.MAX_READS} metadata items; a count in the file is corrupt")
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if int(count) < 0 or end > self._plain.shape[0]:
            raise ValueError(f"a read of bytes {offset}..{end} runs past the end of the file ({self._plain.shape[0]} bytes)")
        return super()._get(offset, dtype, count, override_order)

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def _tensor_nbytes(ggml_type: GGMLQuantizationType, ne: tuple[int, ...]) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = int(np.prod(ne, dtype=np.int64))
    if ne[0] % block_size:
        raise GGUFError(f"row length {ne[0]} is not a multiple of the {ggml_type.name} block size {block_size}")
    return n // block_size * type_size


def _parse(path: Path) -> dict[str, Any]:
    """Parse ``path`` with the gguf reader into a JSON-able index: metadata and tensor table."""
    try:
        reader = _PlainReader(path)
    except Exception as e:  # the reader raises ValueError, IndexError, OverflowError... on malformed input
        detail = " ".join(str(e).split())  # one line, whatever the reader's message holds
        raise GGUFError(
            f"{path.name}: not a valid GGUF file, truncated or malformed ({type(e).__name__}: {detail}); "
            "re-download or re-convert it"
        ) from None
    metadata: dict[str, Any] = {}
    types: dict[str, list[int]] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except Exception as e:
            raise GGUFError(f"{path.name}: metadata key {key!r} cannot be read ({e})") from None
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            value = value.item()
        metadata[key] = value
        # an array's item type is the first part of its value, after the key's length, the key and the value's
        # type (the reader lists it in ``types`` only when the array has items)
        types[key] = [int(field.types[0])] + ([int(field.parts[3][0])] if field.types[0] == GGUFValueType.ARRAY else [])
    tensors = []
    for t in reader.tensors:
        try:
            ggml_type = GGMLQuantizationType(int(t.tensor_type))
        except ValueError:
            raise GGUFError(f"{path.name}: tensor {t.name!r} has unknown type id {int(t.tensor_type)}") from None
        tensors.append([t.name, int(ggml_type), [int(x) for x in t.shape], int(t.data_offset)])
    return {"index_version": INDEX_VERSION, "gguf_version": int(reader.fields["GGUF.version"].contents()),
            "header_bytes": int(reader.data_offset), "metadata": metadata, "types": types, "tensors": tensors}  # fmt: skip


MAX_INDEX_BYTES = 1 << 30  # a cached index holds the whole vocabulary and merges


class _Index(BaseModel):
    """A cached index as :func:`_parse` writes it: metadata values and their GGUF types ([type] or [ARRAY, item
    type]), and (name, ggml type id, dims, absolute data offset) per tensor."""

    model_config = ConfigDict(extra="forbid")
    index_version: Literal[INDEX_VERSION]  # type: ignore[valid-type]
    gguf_version: int
    header_bytes: int
    metadata: dict[str, Any]
    types: dict[str, list[int]]
    tensors: list[tuple[str, int, list[int], int]]


# gguf-py's writer: the struct format of each scalar value type (GGUFWriter._pack_val), and the Python type the
# reader gives for it; numpy's little-endian dtype of the same format encodes an array of them at once.
_FORMATS = {GGUFValueType(t): f for t, f in GGUFWriter._simple_value_packing.items()}
_PY_TYPES = {t: float if f in "fd" else bool if f == "?" else int for t, f in _FORMATS.items()}
_DTYPES = {t: np.dtype("?" if f == "?" else "<" + f) for t, f in _FORMATS.items()}
_U64 = struct.Struct("<Q").pack


def _gguf_string(text: Any) -> bytes:
    if type(text) is not str:
        raise ValueError(f"{text!r} is not a string")
    data = text.encode("utf-8")
    return _U64(len(data)) + data


def _gguf_value(vtype: GGUFValueType, value: Any) -> bytes:
    """A scalar or string value as gguf-py's writer encodes it (little-endian, without its type id). ValueError
    if ``value`` is not exactly a value of ``vtype`` (another Python type, out of range, or not representable:
    a float that float32 would round)."""
    if vtype == GGUFValueType.STRING:
        return _gguf_string(value)
    fmt = "<" + _FORMATS[vtype]
    if type(value) is not _PY_TYPES[vtype]:
        raise ValueError(f"{value!r} is not a {vtype.name}")
    data = struct.pack(fmt, value)
    if struct.unpack(fmt, data)[0] != value:
        raise ValueError(f"{value!r} is not exactly a {vtype.name}")
    return data


def _gguf_array(item: GGUFValueType, values: Any) -> bytes:
    """An array value's item type, count and items, encoded as gguf-py's writer would (numeric items at once)."""
    if type(values) is not list:
        raise ValueError("an array value is not a list")
    head = struct.pack("<IQ", item, len(values))
    if item == GGUFValueType.STRING:  # str.encode refuses anything but a str
        return head + b"".join([_U64(len(b)) + b for b in map(str.encode, values)])
    if item not in _FORMATS:
        raise ValueError(f"arrays of {item.name} are not kept in an index")
    if not set(map(type, values)) <= {_PY_TYPES[item]}:
        raise ValueError(f"an array of {item.name} holds another type")
    dtype = _DTYPES[item]
    if dtype.kind == "b":
        return head + np.array(values, dtype).tobytes()
    wide = np.array(values, np.float64 if dtype.kind == "f" else np.int64)  # exact for JSON's floats and ints
    array = wide.astype(dtype)
    if dtype.kind == "f" and not np.array_equal(array, wide):
        raise ValueError(f"an array of {item.name} holds values {item.name} would round")
    if dtype.kind in "iu" and wide.size and not np.iinfo(dtype).min <= wide.min() <= wide.max() <= np.iinfo(dtype).max:
        raise ValueError(f"an array of {item.name} holds values outside the type")
    return head + array.tobytes()


def header_image(index: dict[str, Any]) -> bytes:
    """The bytes a GGUF header holding ``index``'s metadata and tensor infos starts with, encoded as gguf-py's
    writer writes one (magic, version, counts, key-value pairs, tensor infos; the padding to the data is left
    out). A parse of a little-endian GGUF gives back the file's own bytes; a metadata value, type, tensor name,
    dims, type or offset changed anywhere changes them. ValueError (or TypeError, OverflowError, struct.error,
    KeyError, UnicodeError) for an index no GGUF file can hold."""
    metadata, types = index["metadata"], index["types"]
    if list(types) != list(metadata):
        raise ValueError("the value types do not list the metadata keys in order")
    parts = [b"GGUF", struct.pack("<IQQ", index["gguf_version"], len(index["tensors"]), len(metadata))]
    for key, value in metadata.items():
        vtype, *item = (GGUFValueType(t) for t in types[key])
        parts += [_gguf_string(key), struct.pack("<I", vtype)]
        if vtype == GGUFValueType.ARRAY and len(item) == 1:
            parts.append(_gguf_array(item[0], value))
        elif not item:
            parts.append(_gguf_value(vtype, value))
        else:
            raise ValueError(f"metadata key {key!r} has the types {types[key]}")
    data_start = index["header_bytes"]
    for name, type_id, ne, offset in index["tensors"]:
        if not all(type(x) is int for x in (type_id, offset, *ne)):
            raise ValueError(f"tensor {name!r} has a field that is not an integer")
        parts += [_gguf_string(name), struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, type_id, offset - data_start)]
    return b"".join(parts)


def _header_mismatch(index: dict[str, Any], head: bytes) -> str | None:
    """Why ``index`` is not what the file whose first bytes are ``head`` says (None: it is exactly that)."""
    try:
        image = header_image(index)
    except (ValueError, TypeError, OverflowError, KeyError, UnicodeError, struct.error) as e:
        return f"holds what no GGUF header can ({' '.join(str(e).split())[:200]})"
    if not head.startswith(image):
        n = min(len(image), len(head))
        differs = np.flatnonzero(np.frombuffer(image, np.uint8, n) != np.frombuffer(head, np.uint8, n))
        return f"differs from the model file's header at byte {int(differs[0]) if differs.size else n}"
    alignment = index["metadata"].get("general.alignment", 32)
    if index["header_bytes"] != -(-len(image) // alignment) * alignment:
        return "puts the tensor data elsewhere than the model file's header does"
    return None


def _header_key(size: int, head: bytes) -> str:
    h = hashlib.sha256(b"%d:" % size)
    h.update(head)
    return h.hexdigest()


def check_magic(path: Path) -> None:
    """Raise GGUFError unless the file at ``path`` starts with the GGUF magic (a cheap check before a long job)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path.name}: wrong magic {magic!r} (expected b'GGUF'); this is not a GGUF file")


class ModelFile:
    """A validated GGUF file: metadata, tensor table and zero-copy tensor data.

    Raises GGUFError if the file is missing, not GGUF, truncated, has overlapping or out-of-file tensors,
    or stores a tensor whose byte size does not match its type and dimensions.

    ``use_index`` False reads and writes no derived file at all: the header is parsed, and nothing keyed by the
    header (:attr:`indexed` is False: no tokenizer caches, no store of repacked weights) is used or kept; this is
    ``--rederive`` (:meth:`detinfer.compute.engine.Engine.load`), and what the fuzzer opens its inputs with.
    """

    def __init__(self, path: str | os.PathLike, *, use_index: bool = True):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"model file not found: {self.path}; run `detinfer pull` or pass a path to a .gguf file")
        self.size = self.path.stat().st_size
        check_magic(self.path)
        self._sha256: list[str] = []
        self._hashing = threading.Thread(target=self._hash, daemon=True, name="gguf-sha256")
        self._hashing.start()
        index = head = None
        if use_index:
            with open(self.path, "rb") as f:
                head = f.read(HEADER_KEY_BYTES)
            self.header_key = _header_key(self.size, head)  # sets the cached property: the file is read once
            remove_dead_temp_files(self._index_path().parent)
            index = self._load_index(head)
        if index is None:
            index = _parse(self.path)
            self._validate_index(index)
            # kept only if its key covers it and it encodes back to the header (not so for a big-endian file)
            if head is not None and index["header_bytes"] <= HEADER_KEY_BYTES and _header_mismatch(index, head) is None:
                write_sealed_cache(self._index_path(), json.dumps(index).encode("utf-8"), self._index_source())
        # whether caches keyed by header_key may hold values derived from this file (not for fuzzed inputs)
        self.indexed = use_index and index["header_bytes"] <= HEADER_KEY_BYTES
        self.metadata: dict[str, Any] = index["metadata"]
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")

    def _hash(self) -> None:
        try:
            self._sha256.append(sha256_file(self.path))
        except OSError:
            pass  # reported by sha256 below, in the caller's thread

    @property
    def sha256(self) -> str:
        """Hex sha256 of the whole file (waits for the background hash started when the file was opened).

        Raises GGUFError if the file can no longer be read."""
        self._hashing.join()
        if not self._sha256:  # the read failed, or this is a forked child, in which the thread never ran
            try:
                self._sha256.append(sha256_file(self.path))
            except OSError as e:
                raise GGUFError(f"{self.path.name}: cannot read the file to hash it ({e.strerror or e})") from None
        return self._sha256[0]

    @cached_property
    def header_key(self) -> str:
        """Hex sha256 of the file's size and first HEADER_KEY_BYTES bytes: the key of its cached index."""
        with open(self.path, "rb") as f:
            return _header_key(self.size, f.read(HEADER_KEY_BYTES))

    def _index_path(self) -> Path:
        return self._header_path(f"index-v{INDEX_VERSION}")

    def _index_source(self) -> str:
        """What the index and every other file keyed by the header are derived from (their seal's source)."""
        return f"gguf-header {self.header_key}"

    def _header_path(self, suffix: str) -> Path:
        return detinfer_home() / "index" / f"header-{self.header_key}.{suffix}"

    def derived_cache_path(self, name: str) -> tuple[Path, str] | None:
        """Where to cache a value computed from this file's metadata only (``index/header-<key>.<name>``) and the
        source to seal it to (:func:`detinfer.fileio.write_sealed_cache`), or None if the file is not indexed
        (opened with ``use_index=False``, or a header past HEADER_KEY_BYTES)."""
        return (self._header_path(name), self._index_source()) if self.indexed else None

    def _load_index(self, head: bytes) -> dict[str, Any] | None:
        """The kept index if there is one and it checks out (its seal; bounded JSON of the _Index schema; within
        the bytes its key covers; exactly the file's header, :func:`header_image`), else None. One that does not
        check out is reported (one warning line) and rebuilt by the caller."""
        path = self._index_path()
        try:
            payload = read_sealed_cache(path, self._index_source(), max_bytes=MAX_INDEX_BYTES)
            if payload is None:
                return None
            index = parse_json(payload, DamagedCache, "GGUF index", path)
            try:
                _Index.model_validate(index)
            except ValidationError as e:
                raise DamagedCache(f"cache file {path} is not a GGUF index: {' '.join(str(e.errors()[0]['msg']).split())}") from None
            if not 0 < index["header_bytes"] <= min(HEADER_KEY_BYTES, self.size):
                raise DamagedCache(f"cache file {path} describes bytes its key does not cover")
            if (problem := _header_mismatch(index, head)) is not None:
                raise DamagedCache(f"cache file {path} {problem}")
            try:
                self._validate_index(index)
            except (GGUFError, ValueError) as e:
                raise DamagedCache(f"cache file {path}: {e}") from None
            return index
        except DamagedCache as e:
            warn_damaged_cache(str(e), self.path.name)
            return None

    def _validate_index(self, index: dict[str, Any]) -> None:
        self.tensors: dict[str, TensorInfo] = {}
        for name, type_id, ne, offset in index["tensors"]:
            ggml_type = GGMLQuantizationType(type_id)
            ne = tuple(ne)
            if any(d <= 0 for d in ne):
                raise GGUFError(f"{self.path.name}: tensor {name!r} has an empty dimension {ne}")
            try:
                nbytes = _tensor_nbytes(ggml_type, ne)
            except GGUFError as e:
                raise GGUFError(f"{self.path.name}: tensor {name!r}: {e}") from None
            if offset < 0 or offset + nbytes > self.size:
                raise GGUFError(
                    f"{self.path.name}: tensor {name!r} ends at byte {offset + nbytes} but the file has "
                    f"{self.size} bytes; the file is truncated, re-download it"
                )
            if name in self.tensors:
                raise GGUFError(f"{self.path.name}: tensor {name!r} appears twice")
            self.tensors[name] = TensorInfo(name, ggml_type, ne, offset, nbytes)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                raise GGUFError(f"{self.path.name}: tensors {a!r} and {b!r} overlap")

    @cached_property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def require(self, key: str) -> Any:
        """Metadata value for ``key``; GGUFError naming the key if absent."""
        if key not in self.metadata:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is missing")
        return self.metadata[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_data(self, name: str) -> np.ndarray:
        """Raw bytes of tensor ``name`` as a read-only uint8 view of the memory map, shape (n_rows, row_bytes).

        Raises GGUFError if the tensor is missing or its type is not supported by the engine.
        """
        info = self.supported_tensor(name)
        raw = self._mmap[info.offset : info.offset + info.nbytes]
        n_rows = int(np.prod(info.ne[1:], dtype=np.int64)) if len(info.ne) > 1 else 1
        return raw.view(np.ndarray).reshape(n_rows, info.nbytes // n_rows)

    def read_tensor(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A private copy of rows ``start:stop`` (default all) of tensor ``name``, uint8 (n_rows, row_bytes),
        read from the file.

        Used for weights that are repacked at load: reading (not mapping) keeps the file's pages out of the
        process's resident set once the repacked copy exists.
        """
        view = self.tensor_data(name)[start:stop]
        with open(self.path, "rb") as f:
            f.seek(self.tensor(name).offset + start * view.shape[1])
            data = np.fromfile(f, dtype=np.uint8, count=view.size)
        if data.size != view.size:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is cut short; the file is truncated, re-download it")
        return data.reshape(view.shape)

    def tensor(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing")
        return self.tensors[name]

    def supported_tensor(self, name: str) -> TensorInfo:
        """The TensorInfo of ``name``; raises GGUFError if it is missing or of a type detinfer does not run."""
        info = self.tensor(name)
        if info.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{self.path.name}: tensor {name!r} has type {info.type_name}, which detinfer does not support "
                f"(supported: {supported_type_names()})"
            )
        return info

    def type_counts(self) -> dict[str, int]:
        """Number of tensors of each type, e.g. {'F32': 61, 'Q4_1': 210, 'Q8_0': 1}."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return dict(sorted(counts.items()))

    def n_params(self) -> int:
        return sum(int(np.prod(t.ne, dtype=np.int64)) for t in self.tensors.values())
