"""A cold start's kernels compiled by this process and a helper process (compute/precompile.py): the helper's kernels
are loaded from the cache files it wrote (numba counts a cache hit and no compile for each), and a run whose helper
exits at once, which compiles them itself (the control: misses for the same kernels), gives the same bytes; and the
dry run's numpy steps, over arrays no kernel wrote, warn of nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numba
import numpy as np
import pytest

from detinfer.compute import precompile

PROBE = r"""
import hashlib, json, sys
import numpy as np
import detinfer
from detinfer.compute import engine as engine_module, kernels, precompile
if sys.argv[2] == "crash":  # the helper exits at once, having compiled nothing
    import subprocess, types
    crashed = lambda args, **kw: subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], **kw)
    precompile.subprocess = types.SimpleNamespace(Popen=crashed, TimeoutExpired=subprocess.TimeoutExpired, DEVNULL=subprocess.DEVNULL)
shared = []
warm = engine_module.warm
engine_module.warm = lambda run, calls=(): shared.append(warm(run, calls)) or shared[0]
llm = detinfer.load(sys.argv[1], n_ctx=256, threads=2)  # a helper needs a second thread
llm.warm_up()
ids = llm.engine.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
logits = llm.engine.forward(ids, llm.engine.new_cache(), all_logits=True, chunk_size=8)
result = llm.complete("Tell me a story.", max_tokens=8, temperature=0.8, top_p=0.9, seed=5)
s = shared[0]
cfg = llm.engine.config
rope = all(np.array_equal(t, r) for base, tables in llm.engine._rope_tables.items()
           for t, r in zip(tables, kernels.rope_table(llm.engine.n_ctx, cfg.n_rot, base)))
counts = {}
for name in json.loads(sys.argv[3]) or s.helper:
    module, _, qualname = name.rpartition(".")
    d = getattr(sys.modules[module], qualname)
    sigs = set(d.stats.cache_hits) | set(d.stats.cache_misses)
    counts[name] = {str(sig): [d.stats.cache_hits[sig], d.stats.cache_misses[sig]] for sig in sigs}
print(json.dumps({"here": s.here, "helper": s.helper, "merged": s.merged, "problem": s.problem, "counts": counts, "rope": rope,
                  "logits": hashlib.sha256(logits.tobytes()).hexdigest(), "tokens": result.tokens,
                  "kv": result.manifest.output.kv_sha256}))
"""


def _cold(model_path: Path, cache: Path, helper: str, count: list[str] | None = None) -> dict:
    """A warm-up and a run in a new process with an empty JIT cache, its compile helper "ok" or "crash"; ``count``:
    the kernels whose cache hits and misses to report (default: those the helper compiled)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    env.pop("DETINFER_COMPILE_HELPER", None)
    args = [sys.executable, "-c", PROBE, str(model_path), helper, json.dumps(count or [])]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one core: no helper")
def test_the_helpers_kernels_load_from_its_files_and_a_failed_helper_changes_no_byte(model_path: Path, tmp_path: Path):
    shared = _cold(model_path, tmp_path / "shared", "ok")
    assert shared["problem"] == "" and shared["here"] and shared["merged"], shared
    # (kernel, signature) this process loaded from the cache and never compiled: the helper's, merged
    loaded = [(name, sig) for name in shared["merged"] for sig, (hits, misses) in shared["counts"][name].items()
              if hits >= 1 and misses == 0]  # fmt: skip
    assert ("detinfer.compute.kernels.attention" in dict(loaded)) or len(loaded) >= 3, shared["counts"]
    # the control: the helper exits before it compiles anything, so this process compiles those same signatures
    alone = _cold(model_path, tmp_path / "alone", "crash", count=sorted({name for name, _ in loaded}))
    assert alone["problem"] == "the compile helper stopped: exit code 3" and not alone["merged"], alone["problem"]
    assert all(alone["counts"][name][sig][1] >= 1 for name, sig in loaded), alone["counts"]
    assert {k: shared[k] for k in ("logits", "tokens", "kv")} == {k: alone[k] for k in ("logits", "tokens", "kv")}
    # the RoPE tables are filled at the first forward pass, so their kernel compiled in the shared phase, after a
    # dry run that wrote nothing into them; the warm-up filled them anew (else they would hold unwritten memory)
    assert "detinfer.compute.kernels.rope_fill" in shared["here"] + shared["helper"], shared
    assert shared["rope"] and alone["rope"]


def test_the_dry_runs_numpy_steps_over_unwritten_arrays_warn_of_nothing():
    @numba.njit
    def fill(x):  # a kernel the dry run skips, so x keeps what an unwritten scratch buffer may hold
        x[:] = 1.0

    steps = []

    def run() -> None:
        x = np.full(4, 3e38, np.float32)
        fill(x)
        x *= np.float32(25.3)  # as Gemma's embedding scale
        steps.append(float(x[0]))

    with warnings.catch_warnings(record=True) as dry:
        warnings.simplefilter("always")
        precompile._dry_run(run)
    assert steps == [float("inf")] and dry == []
    # the control: the same steps where the kernel did not write warn of the overflow
    with warnings.catch_warnings(record=True) as plain, np.errstate(over="warn"):
        warnings.simplefilter("always")
        x = np.full(4, 3e38, np.float32)
        x *= np.float32(25.3)
    assert [w.category for w in plain] == [RuntimeWarning]

