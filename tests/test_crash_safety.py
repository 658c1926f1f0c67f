"""Crash safety: a writer killed with SIGKILL at any moment leaves the previous file intact and loadable.

Every file detinfer writes goes through fileio's atomic writer (temp file in the same folder, fsync, rename).
A writer process rewrites a manifest, a session record and a .detkv snapshot in a loop and is killed at random
points; after each kill all three files must load, and leftover ``.*.tmp`` files must never be picked up.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import fuzz
import pytest

from detinfer.records.kvfile import load_kv
from detinfer.records.manifest import load_manifest
from detinfer.records.reader import collect
from detinfer.records.session import load_session

REPO = Path(__file__).resolve().parents[1]
TRIALS = 12

WRITER = r"""
import sys
from pathlib import Path
from detinfer.records.kvfile import load_kv, save_kv
from detinfer.records.manifest import load_manifest, write_manifest
from detinfer.records.session import load_session, write_session

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
manifest = load_manifest(src / "run.json")
session = load_session(src / "session.json")
snap = load_kv(src / "three.detkv")
sha, tok = manifest.model.sha256, manifest.tokenizer_sha256
print("ready", flush=True)
i = 0
while True:  # alternate contents so a torn write could not pass for the previous file
    m = manifest.model_copy(update={"informative": manifest.informative.model_copy(update={"cpu": "x" * (i % 5000)})})
    write_manifest(m, dst / "run.json")
    write_session(session.model_copy(update={"informative": {"i": i, "pad": "y" * (i % 7000)}}), dst / "session.json")
    save_kv(dst / "snap.detkv", snap if i % 2 else snap.prefix(1 + i % 3), model_sha256=sha, tokenizer_sha256=tok)
    i += 1
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> fuzz.Corpus:
    return fuzz.build_corpus(tmp_path_factory.mktemp("crash-corpus"))


def test_sigkill_during_rewrites_never_leaves_a_broken_file(corpus: fuzz.Corpus, tmp_path: Path) -> None:
    rng = random.Random(1234)  # fixed: the kill points are the same on every run
    dst = tmp_path / "out"
    dst.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    leftovers = 0
    for trial in range(TRIALS):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(corpus.folder), str(dst)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(rng.uniform(0.0, 0.4) if trial else 0.5)  # the first trial makes sure every file exists
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read()
        # The previous complete version of each file is there and passes every check.
        load_manifest(dst / "run.json")
        load_session(dst / "session.json")
        load_kv(dst / "snap.detkv")
        tmps = list(dst.glob(".*.tmp"))
        leftovers += len(tmps)
        assert collect([dst]) == [dst / "run.json", dst / "session.json"], "verify's folder scan must skip temp files"
    print(f"{TRIALS} kills, {leftovers} leftover temp file(s) seen and ignored")


def test_verify_never_reads_temp_leftovers(corpus: fuzz.Corpus, tmp_path: Path) -> None:
    """A half-written manifest left as ``.run.json.XXXX.tmp`` (what a killed writer leaves) is not collected."""
    data = (corpus.folder / "run.json").read_bytes()
    (tmp_path / ".run.json.abc123.tmp").write_bytes(data[: len(data) // 2])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".x.json.tmp").write_bytes(data[:10])
    (tmp_path / "run.json").write_bytes(data)
    assert collect([tmp_path]) == [tmp_path / "run.json"]


def test_writers_use_the_atomic_writer() -> None:
    """No module writes a file except through detinfer.fileio (the registry's download has its own temp + fsync +
    rename, checked by hand: it streams hundreds of MB with a progress bar)."""
    writes = re.compile(r"\.write_(text|bytes)\(|(?<![\w.])open\([^)]*['\"][wax]|os\.fdopen\(|\.tofile\(|mode=['\"][wr]\+")
    offenders = [
        f"{path.name}:{i}: {line.strip()}"
        for path in sorted((REPO / "detinfer").glob("*.py"))
        if path.name not in ("fileio.py", "registry.py")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if writes.search(line)
    ]
    assert not offenders, offenders
