"""Repacked weights kept on disk, so that a warm start maps the matrices instead of repacking the GGUF again.

Repacking moves every code of every matrix into the kernels' layout (:mod:`detinfer.weights`). For Gemma 3's
247 MB that is about 1 s at each start on a 2-core machine, most of it first touches of fresh memory; mapping the
same bytes from a file takes milliseconds, and processes on one machine share the mapped pages.

A store is two files in :func:`store_dir`: ``<header key>-<layout key>.bin`` (every array at an offset aligned
to ALIGN bytes) and a ``.json`` descriptor beside it (the header key, the GGUF's sha256 and the layout key it was
made from, each matrix's fields, each array's dtype, shape and offset, and one sha256 of the ``.bin``'s bytes
followed by the canonical JSON of every other field of the descriptor). The header key
(:attr:`ModelFile.header_key`) finds the store before the GGUF's own sha256 is known; the layout key hashes the
code that defines the layout, so a detinfer that repacks differently never loads an older store.

Before anything is mapped, every field of the descriptor is compared with what a repack of this GGUF would
produce (:func:`open_store`'s ``expected``, from the GGUF's tensor table): the same matrices, fields, dtypes and
shapes, and offsets aligned, in order, not overlapping and inside the ``.bin``. So a damaged descriptor can never
map an array of another shape, or allocate anything. A later load maps the ``.bin`` copy-on-write, so the kernels
see writable, aligned, C-contiguous arrays, as after a repack, and numba reuses the same compiled code. It hashes
the whole store in a background thread (hashing releases the GIL, so the check overlaps the tokenizer build), and
nothing mapped is used unless that hash matches and the descriptor's GGUF sha256 is this GGUF's. A store that
does not check out is reported (one warning line, :func:`detinfer.fileio.warn_damaged_cache`), deleted and
rebuilt by a repack; the store of another GGUF with the same header (fine-tunes that differ only in weights) is
replaced silently: the two take turns in one store. A folder that cannot be written is not an error; every load
then repacks. ``DETINFER_WEIGHTS_CACHE=off`` turns the store off. A load also deletes the temporary files of
store writes that were killed mid-way (:func:`detinfer.fileio.remove_dead_temp_files`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
from pathlib import Path
from typing import Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, NonNegativeInt, ValidationError

from ..fileio import DamagedCache, load_json, remove_dead_temp_files, warn_damaged_cache, write_cache
from ..paths import detinfer_home

ALIGN = 64  # byte alignment of every array in a .bin (numba types an array aligned to its dtype; a cache line)
MIN_BYTES = 16 << 20  # smaller models repack in well under 0.1 s: not worth a file
DTYPES = ("uint8", "int8", "uint16", "int32", "uint32", "float32")
STORE_VERSION = 2
OFF = "off"  # $DETINFER_WEIGHTS_CACHE=off: every load repacks, nothing is written (the store costs the model's size)

# A matrix: (fields, arrays), fields JSON scalars, arrays a tuple of C-contiguous ndarrays, None or ints.
Record = tuple[dict, tuple]
# What a repack of a matrix produces, by matrix name: (fields, arrays), each array as (dtype name, shape), None or int.
Expected = dict[str, tuple[dict, tuple]]


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
    header_key: str
    gguf_sha256: str
    layout: str
    data_bytes: NonNegativeInt
    matrices: dict[str, _Matrix]
    sha256: str  # of the .bin's bytes, then of _body(): the whole store

    def body(self) -> bytes:
        """The canonical JSON of every field but ``sha256``: what the store's sha256 covers after the .bin."""
        return json.dumps(self.model_dump(exclude={"sha256"}), sort_keys=True, separators=(",", ":")).encode("utf-8")


def _paths(header_key: str, layout: str) -> tuple[Path, Path] | None:
    folder = store_dir()
    if folder is None:
        return None
    base = folder / f"{header_key}-{layout}"
    return base.with_suffix(".bin"), base.with_suffix(".json")


class Mapped:
    """The matrices of a store, mapped from its ``.bin``, and the background check of the whole store's sha256."""

    def __init__(self, paths: tuple[Path, Path], d: _Descriptor, records: dict[str, Record], data: mmap.mmap, model: str):
        self._paths = paths
        self._gguf_sha256 = d.gguf_sha256
        self._records = records
        self._model = model
        self._ok = False
        self._check = threading.Thread(target=self._hash, args=(data, d), daemon=True, name="weights-check")
        self._check.start()

    def _hash(self, data: mmap.mmap, d: _Descriptor) -> None:
        h = hashlib.sha256(data)  # one call: the GIL is released for all of it
        h.update(d.body())
        self._ok = h.hexdigest() == d.sha256

    def records(self, gguf_sha256: str) -> dict[str, Record] | None:
        """The matrices by name once the store's sha256 matched and the store is that of the GGUF with
        ``gguf_sha256``; else None (and the store is deleted; a damaged one is reported)."""
        self._check.join()
        if self._ok and gguf_sha256 == self._gguf_sha256:
            return self._records
        if not self._ok:
            warn_damaged_cache(f"weights store {self._paths[1]} does not match its sha256 (the .bin or the descriptor "
                               "was edited or cut short)", self._model)  # fmt: skip
        for p in self._paths:
            p.unlink(missing_ok=True)
        return None


def _check_descriptor(d: _Descriptor, expected: Expected, bin_bytes: int) -> None:
    """DamagedCache naming the first field of ``d`` that is not what a repack produces (``expected``), or an array
    that is misaligned, out of order, overlapping or outside the ``bin_bytes`` of the .bin."""
    if d.data_bytes != bin_bytes:
        raise DamagedCache(f"says the .bin has {d.data_bytes} bytes, it has {bin_bytes}")
    if d.matrices.keys() != expected.keys():
        missing, extra = sorted(expected.keys() - d.matrices.keys()), sorted(d.matrices.keys() - expected.keys())
        raise DamagedCache(f"lists other matrices than the model has (missing {missing[:2]}, extra {extra[:2]})")
    end = 0
    for name, m in d.matrices.items():
        fields, arrays = expected[name]
        if m.fields != fields or len(m.arrays) != len(arrays):
            raise DamagedCache(f"describes matrix {name!r} as {m.fields}, a repack gives {fields}")
        for i, (a, want) in enumerate(zip(m.arrays, arrays)):
            if not isinstance(want, tuple):
                if a != want or type(a) is not type(want):
                    raise DamagedCache(f"holds {a!r} as field {i} of matrix {name!r}, a repack gives {want!r}")
                continue
            if not isinstance(a, _Array) or (a.dtype, tuple(a.shape)) != want:
                got = (a.dtype, tuple(a.shape)) if isinstance(a, _Array) else a
                raise DamagedCache(f"describes array {i} of matrix {name!r} as {got}, a repack gives {want}")
            if a.offset % ALIGN or a.offset < end:
                raise DamagedCache(f"puts array {i} of matrix {name!r} at offset {a.offset}: misaligned, out of order or "
                                   "overlapping the one before")  # fmt: skip
            end = a.offset + int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
            if end > bin_bytes:
                raise DamagedCache(f"puts array {i} of matrix {name!r} past the end of the .bin")


def open_store(header_key: str, layout: str, expected: Expected, model: str) -> Mapped | None:
    """Map the store of a GGUF header and a layout and start the check of its sha256; None if there is none, the
    store is off, or it does not check out against ``expected`` (what a repack of the GGUF named ``model`` gives;
    then it is reported with one warning line and deleted). Temporary files of killed store writes are removed."""
    if (paths := _paths(header_key, layout)) is None:
        return None
    data_path, json_path = paths
    remove_dead_temp_files(json_path.parent)
    if not json_path.exists():
        return None  # no store (or a save killed between its two files: the .bin is replaced by the next save)
    try:
        raw = load_json(json_path, DamagedCache, "weights store descriptor")
    except DamagedCache as e:  # its message names the file
        return _reject(paths, str(e), model)
    try:
        d = _Descriptor.model_validate(raw)
        if (d.header_key, d.layout) != (header_key, layout):
            raise DamagedCache(f"was made for header {d.header_key[:16]}… and layout {d.layout}")
        _check_descriptor(d, expected, data_path.stat().st_size)
        with open(data_path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except ValidationError as e:
        problem = f"is not a valid descriptor ({' '.join(str(e.errors()[0]['msg']).split())})"
    except (OSError, ValueError) as e:
        problem = f"has no .bin beside it that can be mapped ({getattr(e, 'strerror', None) or e})"
    except DamagedCache as e:
        problem = str(e)
    else:
        records = {name: (m.fields, tuple(
            np.frombuffer(data, a.dtype, int(np.prod(a.shape, dtype=np.int64)), a.offset).reshape(a.shape)
            if isinstance(a, _Array) else a for a in m.arrays)) for name, m in d.matrices.items()}  # fmt: skip
        return Mapped(paths, d, records, data, model)
    return _reject(paths, f"weights store {json_path} {problem}", model)


def _reject(paths: tuple[Path, Path], problem: str, model: str) -> None:
    """Report a store that does not check out (one warning line) and delete it: the next repack rebuilds it."""
    warn_damaged_cache(problem, model)
    for p in paths:
        p.unlink(missing_ok=True)


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
    d = _Descriptor(version=STORE_VERSION, header_key=header_key, gguf_sha256=gguf_sha256, layout=layout,
                    data_bytes=offset, matrices=matrices, sha256="")  # fmt: skip
    h.update(d.body())
    d.sha256 = h.hexdigest()
    if not write_cache(json_path, d.model_dump_json().encode("utf-8")):
        return
    try:  # one store per model: the stores of other layouts for the same header go
        for old in data_path.parent.glob(f"{header_key}-*"):
            if old.stem != data_path.stem:
                old.unlink(missing_ok=True)
    except OSError:
        pass
