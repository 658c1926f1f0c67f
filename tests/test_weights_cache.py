"""The on-disk store of repacked weights (detinfer.weights_cache): a mapped load gives the same bytes, the same numba
types and the same logits as a repack, and a damaged, foreign or malformed store is never used."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf_factory import write_tiny_gguf

from detinfer.compute.engine import Engine
from detinfer.fileio import seal
from detinfer.model import weights_cache
from detinfer.model.config import ModelConfig
from detinfer.model.gguf_file import ModelFile
from detinfer.model.tokenizer import Tokenizer
from detinfer.model.weights import Weights, open_store, wait_for_store_saves


def _load(mf: ModelFile) -> Weights:
    cfg = ModelConfig.from_model(mf)
    return Weights.load(mf, cfg, open_store(mf, cfg))


def _arrays(w: Weights) -> list[np.ndarray]:
    return [a for m in w.matrices for a in m.arrays if isinstance(a, np.ndarray)]


def _same_bytes(a: Weights, b: Weights) -> bool:
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in zip(_arrays(a), _arrays(b), strict=True))


@pytest.fixture
def store(monkeypatch, tmp_path: Path, model_path: Path) -> Path:
    """An empty store folder, filled by one repack of the default model."""
    monkeypatch.setenv("DETINFER_WEIGHTS_CACHE", str(tmp_path / "weights"))
    mf = ModelFile(model_path)
    assert open_store(mf, ModelConfig.from_model(mf)) is None
    _load(ModelFile(model_path))
    wait_for_store_saves()
    return tmp_path / "weights"


def test_mapped_store_gives_the_repack_bytes_types_and_logits(store: Path, model_path: Path):
    mf = ModelFile(model_path)
    (data,) = store.glob("*.bin")
    assert data.name.startswith(mf.header_key) and data.stat().st_size >= weights_cache.MIN_BYTES
    mapped = _load(mf)
    repacked = Weights.load(mf, ModelConfig.from_model(mf))  # no store: repacked from the file
    assert not any(a.flags.owndata for a in _arrays(mapped)) and any(a.flags.owndata for a in _arrays(repacked))
    assert _same_bytes(mapped, repacked)
    # the kernels see the same types (writable, aligned, C-contiguous), so numba reuses the same compiled code
    assert [numba.typeof(a) for a in _arrays(mapped)] == [numba.typeof(a) for a in _arrays(repacked)]
    assert all(a.flags.writeable and a.flags.aligned and a.flags.c_contiguous for a in _arrays(mapped))

    def logits(weights: Weights) -> bytes:
        engine = Engine(mf, n_ctx=16)
        engine.weights = weights
        cache = engine.new_cache()
        return engine.forward([1, 2, 3, 4], cache).tobytes()

    assert logits(mapped) == logits(repacked)


def _flip_a_weight_byte(store: Path) -> None:
    (data,) = store.glob("*.bin")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))


def _edit_descriptor(store: Path, edit) -> None:
    (desc,) = store.glob("*.json")
    d = json.loads(desc.read_text())
    edit(d)
    desc.write_text(json.dumps(d))


def _first_array(d: dict) -> dict:
    return next(a for m in d["matrices"].values() for a in m["arrays"] if isinstance(a, dict))


DAMAGE = {
    "a flipped bit in the .bin": _flip_a_weight_byte,
    "the store of another GGUF with the same header": lambda s: _edit_descriptor(s, lambda d: d.update(gguf_sha256="0" * 64)),
    "an array past the end of the .bin": lambda s: _edit_descriptor(s, lambda d: _first_array(d).update(offset=d["data_bytes"])),
    "a misaligned array": lambda s: _edit_descriptor(s, lambda d: _first_array(d).update(offset=_first_array(d)["offset"] + 1)),
    "a descriptor that is not JSON": lambda s: next(s.glob("*.json")).write_text("{"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_or_foreign_store_is_not_used(store: Path, model_path: Path, damage: str):
    mf = ModelFile(model_path)
    fresh = Weights.load(mf, ModelConfig.from_model(mf))
    wait_for_store_saves()  # a repack also rewrites the store
    DAMAGE[damage](store)
    loaded = _load(mf)
    assert _same_bytes(loaded, fresh)
    assert any(a.flags.owndata for a in _arrays(loaded)), "repacked from the file"
    wait_for_store_saves()
    assert not any(a.flags.owndata for a in _arrays(_load(mf))), "the next load maps a good store again"


def test_flipped_bit_would_change_the_weights_without_the_check(store: Path, model_path: Path, monkeypatch):
    """Negative control: with the sha256 check switched off, the damaged store is used and its bytes differ."""
    mf = ModelFile(model_path)
    fresh = Weights.load(mf, ModelConfig.from_model(mf))
    wait_for_store_saves()
    _flip_a_weight_byte(store)
    monkeypatch.setattr(weights_cache.Mapped, "_hash", lambda self, data, expected: setattr(self, "_ok", True))
    assert not _same_bytes(_load(mf), fresh)


def test_unwritable_store_folder_is_not_an_error(monkeypatch, tmp_path: Path, model_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DETINFER_WEIGHTS_CACHE", str(blocker / "weights"))
    mf = ModelFile(model_path)
    assert _same_bytes(_load(mf), Weights.load(mf, ModelConfig.from_model(mf)))
    wait_for_store_saves()
    assert blocker.read_text() == "not a folder"


def test_store_off_writes_and_maps_nothing(monkeypatch, tmp_path: Path, model_path: Path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DETINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("DETINFER_WEIGHTS_CACHE", "off")
    mf = ModelFile(model_path)
    loaded = _load(mf)
    wait_for_store_saves()
    assert any(a.flags.owndata for a in _arrays(loaded)), "repacked"
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file() and "index" not in p.parts) == []
    monkeypatch.setenv("DETINFER_WEIGHTS_CACHE", str(tmp_path / "weights"))  # control: the same load, store on
    _load(mf)
    wait_for_store_saves()
    assert len(list((tmp_path / "weights").glob("*.bin"))) == 1


def test_small_models_are_not_stored(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("DETINFER_WEIGHTS_CACHE", str(tmp_path / "weights"))
    _load(ModelFile(write_tiny_gguf(tmp_path / "tiny.gguf")))
    wait_for_store_saves()
    assert not (tmp_path / "weights").exists()


@pytest.mark.parametrize("kept", ["absent", "valid", "garbage"])
def test_tokenizer_hash_kept_beside_the_index_is_the_computed_one(monkeypatch, tmp_path: Path, model_path: Path, kept: str):
    monkeypatch.setenv("DETINFER_HOME", str(tmp_path))
    computed = Tokenizer.from_model(ModelFile(model_path, use_index=False)).hash  # not indexed: nothing kept
    mf = ModelFile(model_path)
    path, source = mf.derived_cache_path("tokenizer-sha256-v2")
    if kept == "valid":
        path.write_bytes(seal(computed.encode(), source))
    elif kept == "garbage":
        path.write_bytes(seal(b"not a hash", source))
    assert Tokenizer.from_model(mf).hash == computed
    assert path.read_bytes() == seal(computed.encode(), source)
    path.write_bytes(seal(b"f" * 64, source))  # control: a kept value that checks out is what the next load reports
    assert Tokenizer.from_model(ModelFile(model_path)).hash == "f" * 64


def test_the_command_waits_for_the_store_it_writes(monkeypatch, tmp_path: Path, model_path: Path):
    """`detinfer` ends without tearing the interpreter down (cli._quick_exit), after joining the thread that saves
    a repack: the store a one-token run starts writing is complete and valid once the process is gone."""
    monkeypatch.setenv("DETINFER_WEIGHTS_CACHE", str(tmp_path / "weights"))
    args = ["run", "--model", str(model_path), "--prompt", "Hi", "--max-tokens", "1", "--quiet"]
    r = subprocess.run([sys.executable, "-m", "detinfer.cli", *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    mf = ModelFile(model_path)
    store = open_store(mf, ModelConfig.from_model(mf))
    assert store is not None and store.records(mf.sha256) is not None


@pytest.mark.parametrize("path_fixture", ["model_path", "gemma_path"])
def test_home_that_cannot_be_written_is_not_an_error(monkeypatch, tmp_path: Path, request, path_fixture: str):
    """The caches under DETINFER_HOME (the GGUF index, the tokenizer's hash and SentencePiece merge table) are written
    best effort (fileio.write_cache): a home that cannot be written costs their time, never the run."""
    path = request.getfixturevalue(path_fixture)
    monkeypatch.setenv("DETINFER_HOME", str(tmp_path / "home"))
    expected = Tokenizer.from_model(ModelFile(path))
    written = {p.name.split(".", 1)[1] for p in (tmp_path / "home" / "index").iterdir()}  # control: all are written
    assert {"index-v3", "tokenizer-sha256-v2"} <= written and (path_fixture == "model_path" or any("spm-merges" in w for w in written))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("DETINFER_HOME", str(blocker / "home"))
    tok = Tokenizer.from_model(ModelFile(path))
    assert tok.hash == expected.hash and tok.encode("Hello, world!") == expected.encode("Hello, world!")
    assert blocker.read_text() == "not a folder"
