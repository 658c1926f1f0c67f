"""``detinfer warm-up`` and ``DETINFER_CPU_LEVEL``: kernels compiled once for an x86-64 level load in a later run of
that level without compiling anything (no cache file is added), while another target in the same cache compiles
anew (the control: numba's cache keys the target); both targets give the same bytes. A level that cannot be used is
one clear error before anything compiles."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import one_error_line

from detinfer.compute import jit
from detinfer.errors import InputError
from detinfer.integrations import ci_report


def _detinfer(*args, cache: Path, level: str | None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", jit.LEVEL_ENV)}
    env |= {"NUMBA_CACHE_DIR": str(cache), "COLUMNS": "200"} | ({jit.LEVEL_ENV: level} if level else {})
    return subprocess.run([sys.executable, "-m", "detinfer.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def _files(cache: Path) -> set[Path]:
    return {p for p in cache.rglob("*") if p.is_file()}


def _output(manifest: Path) -> dict:
    out = json.loads(manifest.read_text())["output"]
    return {k: out[k] for k in ("token_ids", "text", "kv_sha256", "logits_digests", "top_logits")}


@pytest.mark.skipif(jit.host_level() not in ("x86-64-v3", "x86-64-v4"), reason="needs an x86-64-v3 CPU")
def test_warm_up_for_a_level_then_run_compiles_nothing_and_another_target_does(model_path: Path, tmp_path: Path):
    cache, level = tmp_path / "jit", "x86-64-v3"
    warm = _detinfer("warm-up", model_path, cache=cache, level=level)
    assert warm.returncode == 0, warm.stderr
    assert "new JIT cache files (target x86-64-v3)" in warm.stdout and "compiling kernels" in warm.stderr
    kept = _files(cache)
    assert kept
    run = ("run", "--model", model_path, "--prompt", "Tell me a story.", "--max-tokens", "12", "--temperature", "0.8",
           "--seed", "3", "--quiet")  # fmt: skip
    at_level = _detinfer(*run, "--out", tmp_path / "level.json", cache=cache, level=level)
    assert at_level.returncode == 0, at_level.stderr
    assert _files(cache) == kept  # every kernel (prefill, decode, sampling) came from the warm-up
    assert "compiled the kernels in" not in at_level.stderr
    again = _detinfer("warm-up", model_path, cache=cache, level=level)
    assert "every kernel loaded from the JIT cache" in again.stdout and _files(cache) == kept
    host = _detinfer(*run, "--out", tmp_path / "host.json", cache=cache, level=None)
    assert host.returncode == 0, host.stderr
    assert _files(cache) > kept  # the control: the host's target is another key, so it compiled its own
    assert re.search(r"compiled the kernels in \d+\.\d s; numba's JIT cache keeps them", host.stderr), host.stderr
    assert _output(tmp_path / "host.json") == _output(tmp_path / "level.json")


@pytest.mark.parametrize("env, needles", [
    ({jit.LEVEL_ENV: "x86-64-v9"}, ["x86-64-v9", "is not a level", "x86-64-v2, x86-64-v3, x86-64-v4"]),
    ({jit.LEVEL_ENV: "x86-64-v3", "NUMBA_CPU_NAME": "haswell"}, ["both choose the compile target"]),
])  # fmt: skip
def test_a_level_that_cannot_be_used_is_one_error(env: dict, needles: list, model_path: Path, tmp_path: Path):
    environ = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "jit"), COLUMNS="200", **env)
    for args in (["warm-up", model_path], ["run", "--model", model_path, "--prompt", "hi"], ["cache-key"]):
        result = subprocess.run([sys.executable, "-m", "detinfer.cli", *map(str, args)], env=environ,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        one_error_line(result, *needles)
    assert not list((tmp_path / "jit").rglob("*.nb[ic]"))  # refused before anything compiled


def test_a_level_above_the_cpu_and_one_set_after_import_are_refused(monkeypatch):
    monkeypatch.setattr(jit, "host_level", lambda: "x86-64-v3")
    monkeypatch.setenv(jit.LEVEL_ENV, "x86-64-v4")
    with pytest.raises(InputError, match="this CPU is x86-64-v3, which lacks that level's instructions"):
        jit.cpu_level()
    monkeypatch.setenv(jit.LEVEL_ENV, "x86-64-v2")
    assert jit.cpu_level() == "x86-64-v2"
    with pytest.raises(InputError, match="set after detinfer was imported"):  # this process compiles for its host
        jit.check_target()
    monkeypatch.delenv(jit.LEVEL_ENV)
    jit.check_target()


def test_the_cache_key_names_the_level_not_the_cpu(monkeypatch):
    host, host_target = ci_report.cache_key(), ci_report.cache_target()
    monkeypatch.setenv(jit.LEVEL_ENV, "x86-64-v2")
    key = ci_report.cache_key()
    assert host.endswith("-" + host_target) and host_target != "x86-64-v2"
    assert key == host[: -len(host_target)] + "x86-64-v2"
