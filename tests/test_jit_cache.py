"""numba's JIT cache is checked like every other derived file (compute/jit_cache.py): a cut, bit-flipped or swapped
entry file, or a cut index, is one warning line and a recompile with the same results, never a traceback; plain
numba (the negative control) fails on the cut file. A small cached kernel in its own module and cache folder stands
in for detinfer's: the check is on numba's cache file class, which every cached kernel goes through."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

KERNEL = """
from numba import njit


@njit(cache=True)
def f(x):
    return x + 1
"""
RUN = "import sys; sys.path.insert(0, sys.argv[1]); {first}import kern; print(kern.f(1), kern.f(1.5))"


def _run(folder: Path, cache: Path, sealed: bool = True) -> subprocess.CompletedProcess:
    # one compile target with and without detinfer (whose own target on an AVX-512 host keys other entries)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="")
    code = RUN.format(first="import detinfer; " if sealed else "")
    return subprocess.run([sys.executable, "-c", code, str(folder)], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[Path, Path]:
    """A module of one cached kernel and a cache folder holding its two entries (int64 and float64)."""
    folder = tmp_path_factory.mktemp("kernel")
    (folder / "kern.py").write_text(KERNEL)
    cache = folder / "cache"
    r = _run(folder, cache)
    assert (r.returncode, r.stdout, r.stderr) == (0, "2 2.5\n", "")
    return folder, cache


def _files(cache: Path, pattern: str) -> list[Path]:
    return sorted(cache.rglob(pattern))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:100])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_suffix(".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


@pytest.mark.parametrize("damage, what", [
    (lambda c: _cut(_files(c, "*.1.nbc")[0]), "is damaged (pickle data was truncated)"),
    (lambda c: _flip(_files(c, "*.2.nbc")[0]), "does not match its content and key"),
    (lambda c: _swap(*_files(c, "*.nbc")), "does not match its content and key"),  # each file is the other key's
    (lambda c: _cut(_files(c, "*.nbi")[0]), "cannot be read"),
], ids=["cut-entry", "flipped-entry", "swapped-entries", "cut-index"])  # fmt: skip
def test_a_damaged_cache_file_is_one_warning_and_a_recompile(compiled, tmp_path, damage, what):
    folder, good = compiled
    cache = tmp_path / "cache"
    shutil.copytree(good, cache)
    damage(cache)
    r = _run(folder, cache)
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and r.stdout == "2 2.5\n", r.stderr
    assert lines and all("numba cache" in line and what in line and "not used" in line for line in lines), r.stderr
    again = _run(folder, cache)  # the entry was written anew
    assert (again.returncode, again.stdout, again.stderr) == (0, "2 2.5\n", "")


def test_plain_numba_fails_on_a_cut_entry(compiled, tmp_path):
    """The negative control: without detinfer's check, numba's loader raises out of the kernel's first call."""
    folder, good = compiled
    cache = tmp_path / "cache"
    shutil.copytree(good, cache)
    _cut(_files(cache, "*.1.nbc")[0])
    r = _run(folder, cache, sealed=False)
    assert r.returncode != 0 and "UnpicklingError" in r.stderr, r.stderr[-2000:]
