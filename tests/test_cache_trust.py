"""Issue 32, requirements 1 and 8: no damaged file under $DETINFER_HOME can change an output.

Every derived file (the parsed-GGUF index, the tokenizer's metadata hash, the SentencePiece merge table, the store
of repacked weights) is damaged here in the ways an independent tester did (swapped offsets, edited shapes, a shape
of [2**32, 2**32], wrong dtypes, a removed matrix, edited metadata values and token texts, edited tensor offsets,
types and dims, truncation); then a run on that home must give a clean home's contract bytes (token ids, KV hash,
logits digests, tokenizer hash), print one warning line naming the file, and rebuild it (a second run has no
warning and finds the file as a clean home has it). Each damage has a negative control: with the check that
catches it switched off, the damaged file is used and the outcome changes (other logits, other token ids, other
weights, or the run fails). Also: ``--rederive`` ignores a damaged home entirely, and the temporary files of
writes killed mid-way are removed at the next load while a live writer's file is kept.

SmolLM2 for most cases (its clean home is built once per module and copied per test), Gemma 3 for the
SentencePiece merge table. Warnings are read from the ``detinfer.cache`` logger in-process, and from stderr for
the CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

import detinfer
from detinfer.errors import GGUFError
from detinfer.fileio import seal
from detinfer.model import gguf_file, weights_cache
from detinfer.model.config import ModelConfig
from detinfer.model.gguf_file import ModelFile, header_image
from detinfer.model.quants import QK_K, SUPPORTED_TYPES
from detinfer.model.tokenizer import Tokenizer
from detinfer.model.weights import QMatrix, open_store

PROMPT = "The capital of France is"
MAX_TOKENS = 6
CACHE_LOG = "detinfer.cache"


def _saved() -> None:
    """Wait for the background write of a store (Weights.load starts one after a repack)."""
    for t in threading.enumerate():
        if t.name == "weights-cache-save":
            t.join()


def _isolate(mp: pytest.MonkeyPatch, home: Path) -> None:
    """All derived files in ``home`` (conftest points the weights store at the shared home by default)."""
    mp.setenv("DETINFER_HOME", str(home))
    mp.delenv("DETINFER_WEIGHTS_CACHE", raising=False)


def _contract(model: Path, **load) -> dict:
    """The contract sections of a greedy run's manifest (every byte a verify compares)."""
    llm = detinfer.load(model, n_ctx=64, threads=1, **load)
    result = llm.complete(PROMPT, max_tokens=MAX_TOKENS)
    _saved()
    return result.manifest.contract()


def _files(home: Path) -> dict[str, bytes]:
    return {str(p.relative_to(home)): p.read_bytes() for p in sorted(home.rglob("*")) if p.is_file()}


class Home:
    """A copy of a clean home (index, tokenizer hash, merge table, store), its files by kind, and the clean run."""

    def __init__(self, clean: Path, root: Path, contract: dict):
        self.path = root
        shutil.copytree(clean, root)
        self.contract = contract
        index = root / "index"
        self.index = next(index.glob("header-*.index-v3"))
        self.tokenizer_hash = next(index.glob("header-*.tokenizer-sha256-v2"))
        self.merges = next(index.glob("tokenizer-*.spm-merges-v2"), None)
        self.descriptor = next((root / "weights").glob("*.json"), None)
        self.bin = self.descriptor and self.descriptor.with_suffix(".bin")


@pytest.fixture(scope="module")
def clean_smollm2(tmp_path_factory, model_path: Path) -> tuple[Path, dict]:
    """A clean home after a cold and a warm run of SmolLM2 (which must agree), and that run's contract."""
    home = tmp_path_factory.mktemp("clean-smollm2")
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, home)
        cold = _contract(model_path)
        assert _contract(model_path) == cold
    return home, cold


@pytest.fixture
def home(tmp_path: Path, monkeypatch, clean_smollm2) -> Home:
    clean, contract = clean_smollm2
    h = Home(clean, tmp_path / "home", contract)
    _isolate(monkeypatch, h.path)
    yield h
    shutil.rmtree(h.path, ignore_errors=True)  # a rebuilt store is ~100 MB


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CACHE_LOG]


def _assert_recovers(home: Home, model: Path, caplog, damaged: Path, clean_bytes: dict[str, bytes]) -> None:
    """A run on the damaged home gives the clean contract and one warning line naming ``damaged``; the file is
    rebuilt as a clean home has it, and a second run gives the same bytes without a warning."""
    caplog.clear()
    assert _contract(model) == home.contract
    (warning,) = _warnings(caplog)
    assert str(damaged) in warning and "\n" not in warning and "rebuilt from" in warning, warning
    caplog.clear()
    assert _contract(model) == home.contract
    assert _warnings(caplog) == []
    assert _files(home.path) == clean_bytes, "every derived file is back to what a clean home holds"


# ------------------------------------------------------------------------------------------ the store of repacked weights


def _edit_descriptor(home: Home, edit: Callable[[dict], None]) -> None:
    d = json.loads(home.descriptor.read_text())
    edit(d)
    home.descriptor.write_text(json.dumps(d))


def _arrays(d: dict) -> list[dict]:
    return [a for m in d["matrices"].values() for a in m["arrays"] if isinstance(a, dict)]


def _twins(d: dict) -> tuple[dict, dict]:
    """The first array of layer 0's and layer 1's ffn_down: same dtype and shape at different offsets."""
    return d["matrices"]["blk.0.ffn_down.weight"]["arrays"][0], d["matrices"]["blk.1.ffn_down.weight"]["arrays"][0]


def _swap_offsets(d: dict) -> None:
    a, b = _twins(d)
    a["offset"], b["offset"] = b["offset"], a["offset"]


def _edit_shape(d: dict) -> None:
    a = _arrays(d)[0]
    a["shape"] = [a["shape"][1], a["shape"][0], *a["shape"][2:]]  # same element count, another layout


def _huge_shape(d: dict) -> None:
    _arrays(d)[0]["shape"] = [2**32, 2**32]


def _wrong_dtype(d: dict) -> None:
    _arrays(d)[0]["dtype"] = "int32"  # uint32 codes read as signed: same size, other values


def _remove_matrix(d: dict) -> None:
    del d["matrices"]["blk.3.attn_output.weight"]


def _truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


STORE_DAMAGE: dict[str, tuple[Callable[[Home], None], str | None]] = {
    # name: (damage, what the damage does if the checks are off: "logits", "weights", "raises" or None)
    "swapped offsets": (lambda h: _edit_descriptor(h, _swap_offsets), "logits"),
    "edited shape": (lambda h: _edit_descriptor(h, _edit_shape), "weights"),
    "huge shape": (lambda h: _edit_descriptor(h, _huge_shape), "raises"),
    "wrong dtype": (lambda h: _edit_descriptor(h, _wrong_dtype), "weights"),
    # A matrix the descriptor leaves out is repacked from the GGUF even unchecked, and a cut .json or .bin cannot be
    # mapped at all: no output could change; the point is the warning and the rebuild.
    "removed matrix": (lambda h: _edit_descriptor(h, _remove_matrix), None),
    "truncated .json": (lambda h: _truncate(h.descriptor), None),
    "truncated .bin": (lambda h: _truncate(h.bin), None),
}


def _unchecked_store(monkeypatch) -> None:
    """Switch off every check of a store: the descriptor against the repack, and the sha256 of the whole store."""
    monkeypatch.setattr(weights_cache, "_check_descriptor", lambda d, expected, bin_bytes: None)
    monkeypatch.setattr(weights_cache.Mapped, "_hash", lambda self, data, d: setattr(self, "_ok", True))


def _store_arrays(mf: ModelFile) -> list[tuple[str, tuple, bytes]]:
    store = open_store(mf, ModelConfig.from_model(mf))
    assert store is not None
    records = store.records(mf.sha256)
    return [(a.dtype.name, a.shape, a.tobytes()) for _, arrays in records.values() for a in arrays if isinstance(a, np.ndarray)]


@pytest.mark.parametrize("damage", [d for d, (_, control) in STORE_DAMAGE.items() if control])
def test_store_damage_would_change_the_outcome_unchecked(home: Home, model_path: Path, monkeypatch, damage: str):
    """Negative control: with the store's checks off, the damaged descriptor is used and the outcome differs."""
    mf = ModelFile(model_path)
    clean = _store_arrays(mf)
    STORE_DAMAGE[damage][0](home)
    _unchecked_store(monkeypatch)
    control = STORE_DAMAGE[damage][1]
    if control == "raises":  # what the tester saw: every later run a traceback until the folder was deleted
        with pytest.raises(ValueError):
            _store_arrays(mf)
    elif control == "weights":
        assert _store_arrays(mf) != clean
    else:
        assert _store_arrays(mf) != clean
        assert _contract(model_path)["output"] != home.contract["output"]


@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES), ids=lambda t: t.name)
def test_the_expected_store_layout_is_what_a_repack_gives(ggml_type: GGMLQuantizationType):
    """QMatrix.specs, which every descriptor is checked against before mapping, is what QMatrix.from_raw makes."""
    n_in = 2 * QK_K
    block, size = GGML_QUANT_SIZES[ggml_type]
    for n_out in (1, 64, 130):
        raw = np.random.default_rng(n_out).integers(0, 256, (n_out, n_in // block * size), dtype=np.uint8)
        if ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            raw[:] = 0  # no NaN patterns: only the layout matters here
        m = QMatrix.from_raw("w", ggml_type, raw, n_in)
        made = tuple((a.dtype.name, a.shape) if isinstance(a, np.ndarray) else a for a in m.arrays)
        assert QMatrix.specs(ggml_type, n_out, n_in) == (m.kind, made)


# ------------------------------------------------------------------------------------------ the parsed-GGUF index


def _sealed(path: Path) -> tuple[str, bytes]:
    line, _, payload = path.read_bytes().partition(b"\n")
    return line.split(b" ", 2)[2].decode(), payload


def _edit_index(home: Home, edit: Callable[[dict], None]) -> None:
    """Edit the index and seal it again, as a writer with a bug would: the checksum holds, so only the comparison
    with the GGUF's header can catch the edit."""
    source, payload = _sealed(home.index)
    index = json.loads(payload)
    edit(index)
    home.index.write_bytes(seal(json.dumps(index).encode(), source))


def _tensor(index: dict, name: str) -> list:
    return next(t for t in index["tensors"] if t[0] == name)


def _rope_base(index: dict) -> None:
    index["metadata"]["llama.rope.freq_base"] *= 2


def _swap_token_texts(prompt_ids: list[int]) -> Callable[[dict], None]:
    def edit(index: dict) -> None:
        tokens = index["metadata"]["tokenizer.ggml.tokens"]
        a, b = prompt_ids[1], prompt_ids[1] + 1
        tokens[a], tokens[b] = tokens[b], tokens[a]

    return edit


def _swap_norm_offsets(index: dict) -> None:
    a, b = _tensor(index, "blk.0.attn_norm.weight"), _tensor(index, "blk.1.attn_norm.weight")
    a[3], b[3] = b[3], a[3]


def _norm_type(index: dict) -> None:
    _tensor(index, "blk.0.attn_norm.weight")[1] = int(GGMLQuantizationType.F16)


def _q_dims(index: dict) -> None:
    _tensor(index, "blk.0.attn_q.weight")[2][1] //= 2


INDEX_DAMAGE: dict[str, tuple[Callable[[Home], None], str | None]] = {
    "rope.freq_base": (lambda h: _edit_index(h, _rope_base), "logits"),
    "token text": (lambda h: _edit_index(h, _swap_token_texts(h.contract["prompt"]["token_ids"])), "prompt"),
    "tensor offset": (lambda h: _edit_index(h, _swap_norm_offsets), "logits"),
    "tensor type": (lambda h: _edit_index(h, _norm_type), "fails"),
    "tensor dims": (lambda h: _edit_index(h, _q_dims), "fails"),
    "truncated": (lambda h: _truncate(h.index), None),  # not even JSON: unusable, checked or not
}


@pytest.mark.parametrize("kind, damage", [("store", d) for d in STORE_DAMAGE] + [("index", d) for d in INDEX_DAMAGE])
def test_damaged_store_or_index_is_rebuilt_and_changes_nothing(home: Home, model_path: Path, caplog, kind: str, damage: str):
    clean_bytes = _files(home.path)
    (STORE_DAMAGE if kind == "store" else INDEX_DAMAGE)[damage][0](home)
    _assert_recovers(home, model_path, caplog, home.descriptor if kind == "store" else home.index, clean_bytes)


@pytest.mark.parametrize("damage", [d for d, (_, control) in INDEX_DAMAGE.items() if control])
def test_index_damage_would_change_the_outcome_unchecked(home: Home, model_path: Path, monkeypatch, damage: str):
    """Negative control: without the comparison with the header, the edited index is used and the outcome differs
    (other logits, other prompt token ids, or a run that fails: with the old trust-by-key, every run until the file
    was deleted)."""
    INDEX_DAMAGE[damage][0](home)
    monkeypatch.setattr(gguf_file, "_header_mismatch", lambda index, head: None)
    control = INDEX_DAMAGE[damage][1]
    if control == "fails":
        with pytest.raises(GGUFError):
            _contract(model_path)
        return
    got = _contract(model_path)
    if control == "prompt":
        assert got["prompt"]["token_ids"] != home.contract["prompt"]["token_ids"]
    else:
        assert got["prompt"] == home.contract["prompt"] and got["output"] != home.contract["output"]


def test_plain_edit_of_the_index_is_caught_by_its_seal(home: Home, model_path: Path, caplog):
    """An edit that does not reseal the file (what a person or a bit flip does) fails the checksum first."""
    home.index.write_bytes(home.index.read_bytes().replace(b'"llama.rope.freq_base": 100000.0', b'"llama.rope.freq_base": 200000.0'))
    assert b"200000.0" in home.index.read_bytes()
    assert _contract(model_path) == home.contract
    (warning,) = _warnings(caplog)
    assert "does not match its sha256" in warning


def test_header_image_is_the_files_own_header(model_path: Path):
    """What the index check compares: a parse encoded again is byte for byte the file's header (for Gemma 3's
    262k-token header too: its clean home below only holds an index because it encodes back to the header)."""
    index = gguf_file._parse(model_path)
    image = header_image(index)
    with open(model_path, "rb") as f:
        assert f.read(len(image)) == image
    index["metadata"]["general.name"] += "x"  # control: any edit moves the bytes
    assert not model_path.read_bytes()[: len(image) + 1].startswith(header_image(index))


# ------------------------------------------------------------------------------------------ the tokenizer's files


def test_damaged_tokenizer_hash_is_rebuilt(home: Home, model_path: Path, caplog, monkeypatch):
    clean_bytes = _files(home.path)
    source, payload = _sealed(home.tokenizer_hash)
    home.tokenizer_hash.write_bytes(home.tokenizer_hash.read_bytes().replace(payload, b"f" * 64))
    _assert_recovers(home, model_path, caplog, home.tokenizer_hash, clean_bytes)
    # negative control: the same damaged value, had it been used, is what every manifest records as the tokenizer
    home.tokenizer_hash.write_bytes(seal(b"f" * 64, source))
    assert _contract(model_path)["tokenizer_sha256"] == "f" * 64 != home.contract["tokenizer_sha256"]


@pytest.fixture(scope="module")
def clean_gemma(tmp_path_factory, gemma_path: Path) -> tuple[Path, dict]:
    """A clean home of Gemma 3 without a weights store (this test is about the tokenizer; repacking is ~1 s)."""
    home = tmp_path_factory.mktemp("clean-gemma")
    with pytest.MonkeyPatch.context() as mp:
        _isolate(mp, home)
        mp.setenv("DETINFER_WEIGHTS_CACHE", "off")
        contract = _contract(gemma_path)
    return home, contract


def test_damaged_spm_merge_table_is_rebuilt(tmp_path: Path, monkeypatch, caplog, clean_gemma, gemma_path: Path):
    """Gemma 3's SentencePiece merge table with the merges that make one of the prompt's words removed (the seal
    not updated): rebuilt, same bytes; had the damaged table been used (sealed again), the prompt's token ids
    differ."""
    clean, contract = clean_gemma
    home = Home(clean, tmp_path / "home", contract)
    _isolate(monkeypatch, home.path)
    monkeypatch.setenv("DETINFER_WEIGHTS_CACHE", "off")
    clean_bytes = _files(home.path)
    tokens = json.loads(_sealed(home.index)[1])["metadata"]["tokenizer.ggml.tokens"]
    word = tokens[contract["prompt"]["token_ids"][2]]  # "▁capital"
    source, payload = _sealed(home.merges)
    merges = np.frombuffer(payload, "<i4").reshape(-1, 2)
    kept = merges[[tokens[a] + tokens[b] != word for a, b in merges.tolist()]]
    assert 0 < len(merges) - len(kept) < 10
    home.merges.write_bytes(home.merges.read_bytes().replace(payload, kept.tobytes()))
    _assert_recovers(home, gemma_path, caplog, home.merges, clean_bytes)
    home.merges.write_bytes(seal(kept.tobytes(), source))  # negative control: the tokenizer is enough to see it
    assert Tokenizer.from_model(ModelFile(gemma_path)).encode(PROMPT) != contract["prompt"]["token_ids"]


# ------------------------------------------------------------------------------------------ the CLI: one line, same bytes


def _detinfer(home: Path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "DETINFER_WEIGHTS_CACHE"}
    return subprocess.run([sys.executable, "-m", "detinfer.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=dict(base, DETINFER_HOME=str(home), COLUMNS="200", **(env or {})))  # fmt: skip


def _run_args(model: Path, out: Path) -> list:
    return ["run", "--model", model, "--prompt", PROMPT, "-n", MAX_TOKENS, "--ctx", 64, "--threads", 1, "--quiet", "--out", out]


def _manifest_contract(path: Path) -> dict:
    from detinfer.records.manifest import load_manifest

    return load_manifest(path).contract()


def test_cli_run_on_the_testers_damage_warns_once_and_gives_the_clean_bytes(home: Home, model_path: Path, tmp_path: Path):
    """The tester's case: two offsets swapped in the descriptor. `detinfer run` exits 0 with the clean bytes and
    one warning line on stderr naming the file, and the next run has none."""
    _edit_descriptor(home, _swap_offsets)
    r = _detinfer(home.path, *_run_args(model_path, tmp_path / "run.json"))
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    warned = [line for line in r.stderr.splitlines() if str(home.descriptor) in line]
    assert len(warned) == 1 and "not used, rebuilt from" in warned[0], r.stderr
    assert _manifest_contract(tmp_path / "run.json") == home.contract
    again = _detinfer(home.path, *_run_args(model_path, tmp_path / "again.json"))
    assert again.returncode == 0 and "rebuilt from" not in again.stderr, again.stderr


def _damage_everything(home: Home) -> dict[str, bytes]:
    _edit_descriptor(home, _swap_offsets)
    _edit_index(home, _rope_base)
    source, _ = _sealed(home.tokenizer_hash)
    home.tokenizer_hash.write_bytes(seal(b"f" * 64, source))  # sealed again: even this one would be used
    return _files(home.path)


def test_rederive_ignores_a_damaged_home(home: Home, model_path: Path, caplog):
    """``rederive`` reads no derived file (not even resealed, consistent-looking ones), writes none, and gives the
    clean bytes; the control is the same home without it (see the negative controls above for what each damage
    does when used)."""
    damaged = _damage_everything(home)
    assert _contract(model_path, rederive=True) == home.contract
    assert _warnings(caplog) == [] and _files(home.path) == damaged
    assert _contract(model_path)["tokenizer_sha256"] == "f" * 64, "control: a normal load reads the home"


def test_cli_rederive_compiles_into_a_fresh_jit_cache(home: Home, model_path: Path, tmp_path: Path):
    """`detinfer run --rederive` on a damaged home: the clean bytes, no warning, nothing in the home touched, and
    every kernel compiled into a fresh NUMBA_CACHE_DIR (numba says where it saved each one) that is gone after."""
    damaged = _damage_everything(home)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    r = _detinfer(home.path, *_run_args(model_path, tmp_path / "run.json"), "--rederive",
                  env={"TMPDIR": str(scratch), "NUMBA_DEBUG_CACHE": "1"})  # fmt: skip
    assert r.returncode == 0 and "rebuilt from" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert _manifest_contract(tmp_path / "run.json") == home.contract
    assert _files(home.path) == damaged
    saved = [line for line in r.stdout.splitlines() if "data saved to" in line]
    assert saved and all(str(scratch / "detinfer-jit-") in line for line in saved), r.stdout[-2000:]
    assert list(scratch.iterdir()) == [], "the fresh JIT cache is removed at exit"


@pytest.mark.parametrize("verb", ["verify", "batch"])
def test_cli_rederive_is_refused_with_ray(home: Home, tmp_path: Path, verb: str):
    """A Ray worker would load its node's derived files, so `--rederive --ray` is one line and exit 2 before any
    work: nothing written, no address contacted (the port is closed)."""
    record = tmp_path / "in.jsonl"
    record.write_text("{}\n")
    args = [verb, record, "--rederive", "--ray", "127.0.0.1:9"]
    if verb == "batch":
        args += ["--out-dir", tmp_path / "out"]
    r = _detinfer(home.path, *args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--rederive" in lines[0] and "drop --ray" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()
    # negative control: without --ray the same command gets past that check (and fails on the record instead)
    r = _detinfer(home.path, *args[:3], *args[5:])
    assert r.returncode == 2 and "drop --ray" not in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ writes killed mid-way

WRITER = textwrap.dedent("""
    import sys, time
    from detinfer.fileio import write_cache

    def body(f):
        f.write(b"x" * (1 << 20))
        f.flush()
        print("writing", flush=True)
        time.sleep(600)

    write_cache(sys.argv[1], body)
""")


def _writer(target: Path) -> subprocess.Popen:
    """A process in the middle of a cache write to ``target`` (its temp file exists once it says so)."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "writing\n"
    return p


def test_leftovers_of_killed_writes_are_removed_at_the_next_load(home: Home, model_path: Path):
    index, store = home.index.parent, home.descriptor.parent
    live = _writer(store / "live.bin")
    killed = [_writer(index / "killed.json"), _writer(store / "killed.bin")]
    try:
        for p in killed:
            p.send_signal(signal.SIGKILL)
            p.wait()
        left = sorted(p.name for folder in (index, store) for p in folder.glob(".*.tmp"))
        assert len(left) == 3 and sum("killed" in n for n in left) == 2, left
        for folder in (index, store):  # past the age under which a file may not be locked by its writer yet
            for tmp in folder.glob(".*.tmp"):
                os.utime(tmp, (0, 0))
        _contract(model_path)  # a load: the index folder with the GGUF's index, the store folder with the store
        kept = sorted(p.name for folder in (index, store) for p in folder.glob(".*.tmp"))
        assert kept == [n for n in left if "live" in n], "the dead writers' files go, the live writer's stays"
    finally:
        live.send_signal(signal.SIGKILL)
        live.wait()
    young = _writer(store / "young.bin")  # killed, but too recent to be told from a writer about to lock its file
    young.send_signal(signal.SIGKILL)
    young.wait()
    _contract(model_path)
    assert [p.name for p in store.glob(".*.tmp")] == [n for n in os.listdir(store) if n.startswith(".young.bin.")], \
        "once its writer is gone, the next load removes the live writer's file too; a file seconds old stays"
