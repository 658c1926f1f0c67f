"""The determinism contract, checked by bytes: chunk sizes, decode vs prefill, prefix reuse, threads, processes,
KV types; for every architecture's forward path: SmolLM2 (llama), Gemma 3 270M (gemma3), and a tiny gemma3 file
whose 5-position sliding window the prompt crosses many times (the real model's 512-position window is longer
than the prompt)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numba
import numpy as np
import pytest
from gguf_factory import write_tiny_gguf
from test_kvcache import prefill_with_reuse

from detinfer.compute.engine import Engine
from detinfer.compute.prefix_cache import PrefixCache
from detinfer.compute.threads import fixed_threads
from detinfer.records.selftest import DEFAULT_TEXT, fingerprint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"smollm2": "model_path", "gemma3": "gemma_path", "tiny-gemma3": "tiny_gemma_path"}


@pytest.fixture(scope="module")
def tiny_gemma_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "gemma3.gguf", architecture="gemma3", matrix_type="Q8_0")


@pytest.fixture(scope="module", params=list(MODELS))
def model_path_any(request):
    """Each model in turn (one engine alive at a time: module-scoped fixtures are grouped by parameter)."""
    return request.getfixturevalue(MODELS[request.param])


@pytest.fixture(scope="module")
def engine(model_path_any):
    return Engine.load(model_path_any, n_ctx=512)


@pytest.fixture(scope="module")
def tokens(engine):
    ids = engine.tokenizer.encode(DEFAULT_TEXT)
    assert len(ids) > 64, "the prompt must span more than one 64-token chunk"
    return ids


def _all_logits(engine, tokens, chunk_size):
    cache = engine.new_cache()
    logits = engine.forward(tokens, cache, all_logits=True, chunk_size=chunk_size)
    return logits, cache


def _first_diff(a: np.ndarray, b: np.ndarray) -> str:
    rows = np.nonzero((a.view(np.uint32) != b.view(np.uint32)).any(axis=1))[0]
    if len(rows) == 0:
        return "identical"
    r = rows[0]
    return f"position {r} differs first; max |delta| {np.abs(a - b).max():.3g}"


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("length", ["multiple_of_4", "odd"])
def test_chunk_sizes_give_identical_bytes(model_path_any, engine, tokens, kv_type, length):
    """Prompt lengths a multiple of 4 and not, so that kernels blocking tokens in 2s or 4s meet every remainder."""
    prompt = tokens[: len(tokens) // 4 * 4 - (1 if length == "odd" else 0)]
    eng = engine if kv_type == "f32" else Engine.load(model_path_any, n_ctx=512, kv_type=kv_type)
    base, base_cache = _all_logits(eng, prompt, len(prompt))
    for chunk in (1, 3, 7, 64):
        logits, cache = _all_logits(eng, prompt, chunk)
        assert np.array_equal(logits.view(np.uint32), base.view(np.uint32)), f"chunk {chunk}: {_first_diff(logits, base)}"
        assert cache.digest() == base_cache.digest(), f"chunk {chunk}: KV bytes differ"
        for layer in range(eng.config.n_layer):
            assert np.array_equal(cache.k[layer], base_cache.k[layer]) and np.array_equal(cache.v[layer], base_cache.v[layer])


def test_decode_equals_prefill_and_prefix_continuation(engine, tokens):
    """A prefix prefilled, then the rest appended one token at a time, equals the whole prompt at once."""
    whole, whole_cache = _all_logits(engine, tokens, 64)
    split = 37
    cache = engine.new_cache()
    parts = [engine.forward(tokens[:split], cache, all_logits=True)]
    parts += [engine.forward([t], cache, all_logits=True) for t in tokens[split:]]
    stitched = np.concatenate(parts)
    assert np.array_equal(stitched.view(np.uint32), whole.view(np.uint32)), _first_diff(stitched, whole)
    assert cache.digest() == whole_cache.digest()


def test_prefix_reuse_is_exact(engine, tokens):
    """A prompt sharing 50 tokens with a stored one reuses them and gives the bytes of a fresh prefill."""
    whole, whole_cache = _all_logits(engine, tokens, 64)
    store = PrefixCache(max_bytes=1 << 30)
    other = engine.new_cache()
    engine.forward(tokens[:50] + [17, 18, 19], other)
    assert store.store(other)
    cache = engine.new_cache()
    last, n_reused = prefill_with_reuse(engine, tokens, store, cache, chunk_size=7)
    assert n_reused == 50
    assert np.array_equal(last.view(np.uint32), whole[-1].view(np.uint32)), _first_diff(last[None], whole[-1:])
    assert cache.digest() == whole_cache.digest()


def test_truncate_then_recompute_is_exact(engine, tokens):
    whole, whole_cache = _all_logits(engine, tokens, 64)
    cache = engine.new_cache()
    engine.forward(tokens[:50] + [17, 18, 19], cache)
    cache.truncate(50)
    rest = engine.forward(tokens[50:], cache, all_logits=True)
    assert np.array_equal(rest.view(np.uint32), whole[50:].view(np.uint32)), _first_diff(rest, whole[50:])
    assert cache.digest() == whole_cache.digest()


def test_thread_count_does_not_change_bytes_in_process(engine, tokens):
    limit = numba.config.NUMBA_NUM_THREADS
    results = []
    for n in sorted({1, limit}):
        with fixed_threads(n):
            results.append(fingerprint(engine, tokens, chunk_size=64))
    assert all(r == results[0] for r in results)


def _probe(model_path, *, threads: int, extra_env: dict | None = None) -> dict:
    env = dict(os.environ, **(extra_env or {}))
    env["NUMBA_NUM_THREADS"] = str(max(threads, 2))
    proc = subprocess.run(
        [sys.executable, "-m", "detinfer.records.selftest", "--model", str(model_path), "--threads", str(threads)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_threads_1_vs_2_in_separate_processes(model_path_any, engine, tokens):
    one = _probe(model_path_any, threads=1)
    two = _probe(model_path_any, threads=2)
    assert one == two
    # and both equal this process's own run: processes do not change bytes either
    assert one == fingerprint(engine, tokens, chunk_size=64)


def test_sampled_continuation_is_not_trivial(engine, tokens):
    """Guard against a fingerprint that cannot fail: another seed must give other tokens."""
    a = fingerprint(engine, tokens, chunk_size=64, seed=7)
    b = fingerprint(engine, tokens, chunk_size=64, seed=8)
    assert a["prompt_logits_sha256"] == b["prompt_logits_sha256"]
    assert a["generated"] != b["generated"]
