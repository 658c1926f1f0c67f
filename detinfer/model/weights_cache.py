"""Repacked weights kept on disk, so that a warm start maps the matrices instead of repacking the GGUF again.

Repacking moves every code of every matrix into the kernels' layout (:mod:`detinfer.weights`). For Gemma 3's
247 MB that is about 1 s at each start on a 2-core machine, most of it first touches of fresh memory; mapping the
same bytes from a file takes milliseconds, and processes on one machine share the mapped pages.

A store is two files in :func:`store_dir`: ``<header key>-<layout key>.bin`` (every array at an offset aligned
to ALIGN bytes) and a ``.json`` descriptor beside it (the GGUF's sha256, each matrix's fields, each array's dtype,
shape and offset, and the ``.bin``'s own sha256). The header key (:attr:`ModelFile.header_key`) finds the store
before the GGUF's own sha256 is known; the layout key hashes the code that defines the layout, so a detinfer
that repacks differently never loads an older store.

A later load maps the ``.bin`` copy-on-write, so the kernels see writable, aligned, C-contiguous arrays, as after
a repack, and numba reuses the same compiled code. It hashes the ``.bin`` in a background thread (hashing
releases the GIL, so the check overlaps the tokenizer build), and nothing mapped is used unless that hash and the
GGUF's sha256 both match the descriptor: otherwise the store is deleted and the model repacked (two GGUFs with
one header, such as fine-tunes that differ only in weights, take turns in one store). A folder that cannot be
written is not an error; every load then repacks. ``DETINFER_WEIGHTS_CACHE=off`` turns the store off.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from pathlib import Path
from typing import Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from ..errors import DetinferError, GGUFError
from ..fileio import load_json, write_cache
from ..paths import detinfer_home

ALIGN = 64  # byte alignment of every array in a .bin (numba types an array aligned to its dtype; a cache line)
MIN_BYTES = 16 << 20  # smaller models repack in well under 0.1 s: not worth a file
DTYPES = ("uint8", "int8", "uint16", "int32", "uint32", "float32")
STORE_VERSION = 1
OFF = "off"  # $DETINFER_WEIGHTS_CACHE=off: every load repacks, nothing is written (the store costs the model's size)

# A matrix: (fields, arrays), fields JSON scalars, arrays a tuple of C-contiguous ndarrays, None or ints.
Record = tuple[dict, tuple]


def store_dir() -> Path | None:
    """``$DETINFER_WEIGHTS_CACHE``, else ``$DETINFER_HOME/weights``; None when the variable is ``off``."""
    folder = os.environ.get("DETINFER_WEIGHTS_CACHE")
    if folder == OFF:
        return None
    return Path(folder or detinfer_home() / "weights")


class _Array(BaseModel):
    model_config = ConfigDict(extra="forbid")
    dtype: Literal[DTYPES]  # type: ignore[valid-type]
    shape: list[NonNegativeInt]
    offset: NonNegativeInt


class _Matrix(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fields: dict[str, Union[int, str]]
    arrays: list[Union[_Array, int, None]]


class _Descriptor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Literal[STORE_VERSION]  # type: ignore[valid-type]
    gguf_sha256: str
    layout: str
    data_bytes: NonNegativeInt
    data_sha256: str
    matrices: dict[str, _Matrix]


def _paths(header_key: str, layout: str) -> tuple[Path, Path] | None:
    folder = store_dir()
    if folder is None:
        return None
    base = folder / f"{header_key}-{layout}"
    return base.with_suffix(".bin"), base.with_suffix(".json")


class Mapped:
    """The matrices of a store, mapped from its ``.bin``, and the background check of its sha256."""

    def __init__(self, paths: tuple[Path, Path], gguf_sha256: str, records: dict[str, Record], data: mmap.mmap,
                 data_sha256: str):  # fmt: skip
        self._paths = paths
        self._gguf_sha256 = gguf_sha256
        self._records = records
        self._ok = False
        self._check = threading.Thread(target=self._hash, args=(data, data_sha256), daemon=True, name="weights-check")
        self._check.start()

    def _hash(self, data: mmap.mmap, expected: str) -> None:
        self._ok = hashlib.sha256(data).hexdigest() == expected  # one call: the GIL is released for all of it

    def records(self, gguf_sha256: str) -> dict[str, Record] | None:
        """The matrices by name once the ``.bin``'s sha256 matched and the store is that of the GGUF with
        ``gguf_sha256``; else None (and the store is deleted)."""
        self._check.join()
        if self._ok and gguf_sha256 == self._gguf_sha256:
            return self._records
        for p in self._paths:
            p.unlink(missing_ok=True)
        return None


def open_store(header_key: str, layout: str) -> Mapped | None:
    """Map the store of a GGUF header and a layout and start its check; None if there is none, it is malformed or
    the store is off."""
    if (paths := _paths(header_key, layout)) is None:
        return None
    data_path, json_path = paths
    try:
        d = _Descriptor.model_validate(load_json(json_path, GGUFError, "weights cache descriptor"))
        if d.layout != layout or data_path.stat().st_size != d.data_bytes:
            return None
        with open(data_path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (DetinferError, ValidationError, OSError, ValueError):
        return None
    records: dict[str, Record] = {}
    for name, m in d.matrices.items():
        arrays = []
        for a in m.arrays:
            if not isinstance(a, _Array):
                arrays.append(a)
                continue
            dtype = np.dtype(a.dtype)
            count = int(np.prod(a.shape, dtype=np.int64))
            if a.offset % ALIGN or a.offset + count * dtype.itemsize > d.data_bytes:
                return None
            arrays.append(np.frombuffer(data, dtype, count, a.offset).reshape(a.shape))
        records[name] = (m.fields, tuple(arrays))
    return Mapped((data_path, json_path), d.gguf_sha256, records, data, d.data_sha256)


def save_store(header_key: str, gguf_sha256: str, layout: str, records: dict[str, Record]) -> None:
    """Write the store of a GGUF (its header key and sha256) and a layout: the ``.bin``, then its descriptor,
    each atomically; then delete the stores of other layouts for the same header (one store per model). Nothing
    is written for under MIN_BYTES of arrays or an array that is not C-contiguous; a folder that cannot be
    written is ignored."""
    arrays = [a for _, arrs in records.values() for a in arrs if isinstance(a, np.ndarray)]
    if sum(a.nbytes for a in arrays) < MIN_BYTES or not all(a.flags.c_contiguous and a.dtype.name in DTYPES
                                                            for a in arrays):  # fmt: skip
        return
    if (paths := _paths(header_key, layout)) is None:
        return
    data_path, json_path = paths
    h, matrices = hashlib.sha256(), {}
    offset = 0

    def write_arrays(f) -> None:
        nonlocal offset
        for name, (fields, arrs) in records.items():
            specs = []
            for a in arrs:
                if not isinstance(a, np.ndarray):
                    specs.append(a)
                    continue
                pad = b"\0" * (-offset % ALIGN)
                for chunk in (pad, memoryview(a).cast("B")):
                    f.write(chunk)
                    h.update(chunk)
                offset += len(pad)
                specs.append({"dtype": a.dtype.name, "shape": list(a.shape), "offset": offset})
                offset += a.nbytes
            matrices[name] = {"fields": fields, "arrays": specs}

    if not write_cache(data_path, write_arrays):
        return
    d = _Descriptor(version=STORE_VERSION, gguf_sha256=gguf_sha256, layout=layout, data_bytes=offset,
                    data_sha256=h.hexdigest(), matrices=matrices)  # fmt: skip
    if not write_cache(json_path, d.model_dump_json().encode("utf-8")):
        return
    try:  # one store per model: the stores of other layouts for the same header go
        for old in data_path.parent.glob(f"{header_key}-*"):
            if old.stem != data_path.stem:
                old.unlink(missing_ok=True)
    except OSError:
        pass
