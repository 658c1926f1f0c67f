"""KV snapshots, .detkv files and the prefix cache: every reuse path gives the bytes of recomputation.

Oracle: the uninterrupted forward pass on a fresh cache (logits compared as uint32 bits, KV by digest).
File-format refusals run on a tiny synthetic snapshot so that every byte of a file can be flipped cheaply.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest

from detinfer.compute.engine import Engine
from detinfer.compute.kvcache import KVCache, KVSnapshot
from detinfer.compute.prefix_cache import PrefixCache
from detinfer.errors import InputError, KVFileError
from detinfer.records import kvfile
from detinfer.records.kvfile import inspect_kv, load_kv, save_kv

OTHER_SHA = "0" * 64


def prefill_with_reuse(engine: Engine, tokens: list[int], prefix_cache: PrefixCache, cache: KVCache, **kw):
    """What generate does with a prefix cache before its first sample, and after: restore the longest known prefix
    (the cache's own, or a stored snapshot's), compute the rest, store the result. (last logits, reused tokens)."""
    prefix_cache.restore_longest(cache, tokens)
    reused = cache.keep_prefix(tokens)
    logits = engine.forward(tokens[reused:], cache, **kw)
    prefix_cache.store(cache)
    return logits, reused
TEXT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, n_ctx=256)


@pytest.fixture(scope="module")
def ids(engine):
    """A 14-token sequence: a 10-token sentence and a 4-token continuation."""
    return engine.tokenizer.encode(TEXT) + engine.tokenizer.encode(" It was tired.")


@pytest.fixture(scope="module")
def reference(engine, ids):
    """Uninterrupted run of ``ids``: (logits [n, n_vocab], cache)."""
    cache = engine.new_cache()
    return engine.forward(ids, cache, all_logits=True), cache


@pytest.fixture(scope="module")
def recompute(engine, ids, reference):
    """Memoized uninterrupted run of a prompt on a fresh cache: (last-token logits, cache)."""
    memo = {tuple(ids): (reference[0][-1], reference[1])}

    def run(prompt):
        if tuple(prompt) not in memo:
            cache = engine.new_cache()
            memo[tuple(prompt)] = (engine.forward(prompt, cache), cache)
        return memo[tuple(prompt)]

    return run


def _ids_of(engine) -> dict[str, str]:
    return {"model_sha256": engine.model_file.sha256, "tokenizer_sha256": engine.tokenizer.hash}


def _assert_same_bits(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    a, e = actual.view(np.uint32).reshape(-1, expected.shape[-1]), expected.view(np.uint32).reshape(-1, expected.shape[-1])
    rows = np.nonzero((a != e).any(axis=1))[0]
    assert rows.size == 0, f"{what}: logits row {rows[0] if rows.size else None} differs first"


def _assert_same_cache(actual: KVCache, expected: KVCache, what: str) -> None:
    """Same tokens, same digest, and the same bytes in every position (including zeros past n_tokens)."""
    assert actual.tokens == expected.tokens, f"{what}: tokens differ"
    assert actual.digest() == expected.digest(), f"{what}: KV digest differs"
    for layer in range(len(expected.k)):
        assert np.array_equal(actual.k[layer], expected.k[layer]), f"{what}: K of layer {layer} differs (stale positions?)"
        assert np.array_equal(actual.v[layer], expected.v[layer]), f"{what}: V of layer {layer} differs (stale positions?)"


def _synthetic(tokens, *, kv_type="f32", n_layer=2, n_head_kv=1, head_dim=4, seed=0) -> KVSnapshot:
    """A small snapshot with seeded random contents (no model needed)."""
    rng = np.random.default_rng(seed)
    n = len(tokens)
    dtype = np.float32 if kv_type == "f32" else np.uint16

    def arr(shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return x if kv_type == "f32" else x.astype(np.float16).view(np.uint16)

    k = tuple(arr((n_head_kv, head_dim, n)).astype(dtype) for _ in range(n_layer))
    v = tuple(arr((n_head_kv, n, head_dim)).astype(dtype) for _ in range(n_layer))
    return KVSnapshot(kv_type, tuple(tokens), k, v)


def _error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg, f"error is not one line: {msg!r}"
    return msg


# ---------------------------------------------------------------- snapshot / restore


def _bits(a: np.ndarray) -> bytes:
    return a.view(np.uint32).tobytes()


def test_recycled_cache_memory_is_zeroed_and_gives_the_same_bytes(engine, ids, reference):
    """Engine.new_cache recycles the memory of the last cache dropped (KVPool): it reads as a new mapping does, all
    zero, and a forward on it gives the bytes of a cache that was never pooled."""
    cache = engine.new_cache()
    engine.forward(ids, cache)
    mem = cache._mem
    del cache
    recycled = engine.new_cache()
    assert recycled._mem is mem, "the dropped cache's memory was recycled"
    assert not any(a.any() for a in recycled.k + recycled.v)
    unpooled = KVCache(engine.config, engine.n_ctx, engine.kv_type)
    for c in (recycled, unpooled):
        assert _bits(engine.forward(ids, c, all_logits=True)) == _bits(reference[0])
    assert recycled.digest() == unpooled.digest() == reference[1].digest()
    assert all(np.array_equal(a, b) for a, b in zip(recycled.k + recycled.v, unpooled.k + unpooled.v, strict=True))
    del recycled
    restored = engine.new_cache()  # a cache filled by restore, not by the engine, is zeroed as far too
    restored.restore(reference[1].snapshot())
    del restored
    again = engine.new_cache()
    assert not any(a.any() for a in again.k + again.v)


def test_without_the_written_mark_recycled_memory_would_hold_stale_bytes(engine, ids, monkeypatch):
    """Negative control of the test above: the zeroing reaches as far as the engine said it may write."""
    monkeypatch.setattr(KVCache, "will_write", lambda self, end: None)
    cache = engine.new_cache()
    engine.forward(ids, cache)
    del cache
    recycled = engine.new_cache()
    assert any(a.any() for a in recycled.k + recycled.v)
    recycled._mem.written = engine.n_ctx  # so the next test's cache is zeroed whole


@pytest.mark.parametrize("keep_view", [True, False])
def test_memory_still_viewed_is_not_recycled(engine, ids, keep_view):
    """An array of a dropped cache that the caller still holds keeps its bytes: its memory is not recycled."""
    cache = engine.new_cache()
    engine.forward(ids, cache)
    mem, view = cache._mem, cache.k[0][:, :, : len(ids)]
    before = view.copy()
    if not keep_view:
        del view
    del cache
    other = engine.new_cache()
    engine.forward(ids[::-1], other)
    assert (other._mem is mem) is not keep_view  # control (False): with no view left, the memory is recycled
    if keep_view:
        assert view.any() and np.array_equal(view, before)


def test_snapshot_restore_continues_bit_identically(engine, ids, reference):
    ref_logits, ref_cache = reference
    cache = engine.new_cache()
    engine.forward(ids[:10], cache)
    snap = cache.snapshot()
    assert snap.n_tokens == 10 and snap.tokens == tuple(ids[:10]) and snap.kv_type == "f32"
    assert snap.nbytes == engine.kv_bytes(10) == cache.held_nbytes
    assert snap.digest() == cache.digest() == ref_cache.digest(10)
    assert snap.prefix(6).digest() == ref_cache.digest(6)
    assert not snap.k[0].flags.writeable and not snap.v[0].flags.writeable

    # The original cache moves on; the snapshot must not.
    engine.forward(ids[10:], cache)
    assert snap.digest() == ref_cache.digest(10)

    fresh = engine.new_cache()
    fresh.restore(snap)
    logits = engine.forward(ids[10:], fresh, all_logits=True)
    _assert_same_bits(logits, ref_logits[10:], "restored then continued")
    _assert_same_cache(fresh, ref_cache, "restored then continued")


def test_restore_over_a_longer_cache_and_partial_restore(engine, ids, reference):
    """Restoring into a cache holding other, longer content clears the stale positions; restore(snap, k) == restore + truncate."""
    ref_logits, ref_cache = reference
    snap = ref_cache.snapshot()
    dirty = engine.new_cache()
    engine.forward(engine.tokenizer.encode("Bonjour, le monde entier est grand et beau ce matin!"), dirty)
    assert dirty.n_tokens > 6
    dirty.restore(snap, 6)
    assert dirty.tokens == ids[:6]
    logits = engine.forward(ids[6:], dirty, all_logits=True)
    _assert_same_bits(logits, ref_logits[6:], "partial restore over a dirty cache")
    _assert_same_cache(dirty, ref_cache, "partial restore over a dirty cache")


def test_snapshot_and_restore_refusals(engine, ids, reference):
    _, ref_cache = reference
    cfg = engine.config
    cache = engine.new_cache()
    with pytest.raises(InputError) as e:
        ref_cache.snapshot(ref_cache.n_tokens + 1)
    _error(e)
    with pytest.raises(InputError) as e:
        cache.restore(_synthetic([1, 2], kv_type="f16", n_layer=cfg.n_layer, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim))
    assert "kv type f16" in _error(e)
    with pytest.raises(InputError) as e:
        cache.restore(_synthetic([1, 2], n_layer=2, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim))
    assert "another model" in _error(e)
    small = KVCache(cfg, 4)
    with pytest.raises(InputError) as e:
        small.restore(ref_cache.snapshot())
    assert "context of 4" in _error(e)
    with pytest.raises(InputError) as e:
        cache.restore(ref_cache.snapshot(3), 4)
    _error(e)
    assert cache.n_tokens == 0 and small.n_tokens == 0
    with pytest.raises(InputError):
        KVSnapshot("f32", (1, 2, 3), ref_cache.snapshot(2).k, ref_cache.snapshot(2).v)  # 3 ids for 2 positions


# ---------------------------------------------------------------- .detkv files


def test_save_load_round_trip_continues_bit_identically(engine, ids, reference, tmp_path):
    ref_logits, ref_cache = reference
    cache = engine.new_cache()
    engine.forward(ids[:10], cache)
    path = tmp_path / "prefix.detkv"
    size = save_kv(path, cache, **_ids_of(engine))
    assert size == path.stat().st_size == kvfile._data_offset(len(_header_bytes(path))) + engine.kv_bytes(10) + 32
    # The same K/V give the same file bytes, whether saved from the cache or from a snapshot.
    save_kv(tmp_path / "again.detkv", cache.snapshot(), **_ids_of(engine))
    assert (tmp_path / "again.detkv").read_bytes() == path.read_bytes()

    cfg = engine.config
    snap = load_kv(path, kv_type="f32", shape=(cfg.n_layer, cfg.n_head_kv, cfg.head_dim), **_ids_of(engine))
    assert snap.tokens == tuple(ids[:10]) and snap.digest() == cache.digest()
    for a, b in zip(snap.k + snap.v, cache.snapshot().k + cache.snapshot().v):
        assert a.dtype == b.dtype and np.array_equal(a, b)

    fresh = engine.new_cache()
    fresh.restore(snap)
    logits = engine.forward(ids[10:], fresh, all_logits=True)
    _assert_same_bits(logits, ref_logits[10:], "loaded from .detkv then continued")
    _assert_same_cache(fresh, ref_cache, "loaded from .detkv then continued")

    info = inspect_kv(path)
    assert info["checksum"] == "ok" and info["kv_sha256"] == cache.digest()
    assert info["model_sha256"] == engine.model_file.sha256 and info["tokens"] == ids[:10]
    assert info["n_tokens"] == 10 and info["bytes_per_token"] == engine.kv_bytes(1) and info["file_bytes"] == size


def test_f16_cache_saved_loaded_and_continued(engine, ids, tmp_path):
    whole = KVCache(engine.config, 32, "f16")
    ref_logits = engine.forward(ids, whole, all_logits=True)
    part = KVCache(engine.config, 32, "f16")
    engine.forward(ids[:9], part)
    path = tmp_path / "f16.detkv"
    save_kv(path, part, **_ids_of(engine))
    assert inspect_kv(path)["bytes_per_token"] == engine.kv_bytes(1, "f16")
    snap = load_kv(path, kv_type="f16", **_ids_of(engine))
    assert snap.k[0].dtype == np.uint16
    fresh = KVCache(engine.config, 32, "f16")
    fresh.restore(snap)
    _assert_same_bits(engine.forward(ids[9:], fresh, all_logits=True), ref_logits[9:], "f16 loaded then continued")
    _assert_same_cache(fresh, whole, "f16 loaded then continued")
    with pytest.raises(KVFileError) as e:
        load_kv(path, kv_type="f32")
    assert "--kv-type f16" in _error(e)


def _header_bytes(path) -> bytes:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 12)
    return data[20 : 20 + n]


def _reseal(data: bytes) -> bytes:
    """``data`` with its trailing checksum recomputed (a well-formed file that says something else)."""
    body = data[:-32]
    return body + hashlib.sha256(body).digest()


def _with_header(data: bytes, header: dict) -> bytes:
    """Rebuild a file around ``header`` (same arrays), correctly padded and sealed."""
    (n,) = struct.unpack_from("<Q", data, 12)
    arrays = data[kvfile._data_offset(n) : -32]
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    pad = bytes(kvfile._data_offset(len(head)) - 20 - len(head))
    return _reseal(data[:12] + struct.pack("<Q", len(head)) + head + pad + arrays + bytes(32))


@pytest.fixture
def small_file(tmp_path):
    """A tiny valid .detkv file: 3 tokens, 2 layers, 1 KV head of width 4."""
    path = tmp_path / "small.detkv"
    save_kv(path, _synthetic([5, 6, 7]), model_sha256="a" * 64, tokenizer_sha256="b" * 64)
    return path


def test_synthetic_round_trip_both_kv_types(tmp_path):
    for kv_type in ("f32", "f16"):
        snap = _synthetic([9, 8, 7, 6], kv_type=kv_type, n_layer=3, n_head_kv=2, head_dim=8, seed=1)
        path = tmp_path / f"{kv_type}.detkv"
        save_kv(path, snap, model_sha256="a" * 64, tokenizer_sha256="b" * 64)
        back = load_kv(path, model_sha256="a" * 64, tokenizer_sha256="b" * 64, kv_type=kv_type, shape=(3, 2, 8))
        assert back.digest() == snap.digest() and back.tokens == snap.tokens
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(back.k + back.v, snap.k + snap.v))
        assert inspect_kv(path)["kv_sha256"] == snap.digest()
    empty = tmp_path / "empty.detkv"
    save_kv(empty, _synthetic([]), model_sha256="a" * 64, tokenizer_sha256="b" * 64)
    assert load_kv(empty).n_tokens == 0


@pytest.mark.parametrize("n_head_kv, tokens", [(1, [5, 6, 7]), (2, [5]), (1, [5])], ids=["one-head", "one-token", "both"])
def test_round_trip_when_a_transposed_array_is_contiguous(tmp_path, n_head_kv, tokens):
    """With one KV head (Gemma 3 270M) or one token, a layer read from the file is already contiguous after its
    transpose: every layer must still be its own copy (a view of the read buffer held the last layer's V in all).
    The control is the two-head, several-token round trip above."""
    snap = _synthetic(tokens, n_layer=3, n_head_kv=n_head_kv, head_dim=4, seed=2)
    path = tmp_path / "x.detkv"
    save_kv(path, snap, model_sha256="a" * 64, tokenizer_sha256="b" * 64)
    back = load_kv(path)
    assert all(np.array_equal(a, b) for a, b in zip(back.k + back.v, snap.k + snap.v)) and back.digest() == snap.digest()


def test_every_flipped_byte_is_refused(small_file):
    data = small_file.read_bytes()
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x01 if i % 2 else 0xFF
        small_file.write_bytes(bytes(bad))
        with pytest.raises(KVFileError) as e:
            load_kv(small_file)
        msg = _error(e)
        region = "not a .detkv" if i < 8 else "format version" if i < 12 else "checksum mismatch"
        assert region in msg, f"byte {i} flipped: {msg}"
        if i >= 12:
            assert inspect_kv_fails_or_reports_mismatch(small_file), f"byte {i}: inspect did not notice"


def inspect_kv_fails_or_reports_mismatch(path) -> bool:
    try:
        return inspect_kv(path)["checksum"] == "mismatch"
    except KVFileError:
        return True


def test_truncated_files_are_refused(small_file):
    data = small_file.read_bytes()
    (n,) = struct.unpack_from("<Q", data, 12)
    offset = kvfile._data_offset(n)
    for cut in (0, 7, 19, 20 + n // 2, offset, offset + 5, len(data) - 32, len(data) - 1):
        small_file.write_bytes(data[:cut])
        with pytest.raises(KVFileError) as e:
            load_kv(small_file)
        assert "truncated" in _error(e), f"cut at {cut}: {e.value}"
        with pytest.raises(KVFileError):
            inspect_kv(small_file)
    small_file.write_bytes(_reseal(data + bytes(32)))  # extra bytes, resealed: still not what the header says
    with pytest.raises(KVFileError) as e:
        load_kv(small_file)
    assert "header describes" in _error(e)
    small_file.write_text('{"a": [1, 2]}')  # short, and no snapshot at all: said so, not "truncated"
    with pytest.raises(KVFileError, match=r"not a \.detkv KV snapshot \(starts with b'\{\"a\": \[1'\)"):
        inspect_kv(small_file)


def test_refusals_with_a_valid_checksum(small_file, tmp_path):
    data = small_file.read_bytes()
    header = json.loads(_header_bytes(small_file))

    def refused(blob: bytes, **expect) -> str:
        small_file.write_bytes(blob)
        with pytest.raises(KVFileError) as e:
            load_kv(small_file, **expect)
        return _error(e)

    assert "format version 3" in refused(_reseal(data[:8] + struct.pack("<I", 3) + data[12:]))
    assert "a version 2 file whose header is version 1's" in refused(_reseal(data[:8] + struct.pack("<I", 2) + data[12:]))
    assert "saved for model" in refused(data, model_sha256=OTHER_SHA)
    assert "tokenizer" in refused(data, tokenizer_sha256=OTHER_SHA)
    assert "KV type f32" in refused(data, kv_type="f16")
    assert "(n_layer, n_head_kv, head_dim) = (2, 1, 4)" in refused(data, shape=(30, 3, 64))
    assert "invalid header: surprise" in refused(_with_header(data, {**header, "surprise": 1}))
    assert "invalid header: byte_order" in refused(_with_header(data, {**header, "byte_order": "big"}))
    assert "invalid header" in refused(_with_header(data, {**header, "tokens": [5, 6]}))
    assert "header describes" in refused(_with_header(data, {**header, "n_tokens": 2, "tokens": [5, 6]}))
    for big in (2**31, 10**30):  # a token id no int32 KV cache holds: a refusal, not an OverflowError
        assert "invalid header: tokens.1" in refused(_with_header(data, {**header, "tokens": [5, big, 7]}))
    small_file.write_bytes(_with_header(data, {**header, "tokens": [5, 2**31 - 1, 7]}))
    assert load_kv(small_file).tokens == (5, 2**31 - 1, 7)  # control: the largest int32 id is read
    with pytest.raises(KVFileError) as e:
        load_kv(tmp_path / "missing.detkv")
    assert "no such KV snapshot" in _error(e)
    small_file.write_bytes(data)
    assert load_kv(small_file, model_sha256="a" * 64, tokenizer_sha256="b" * 64).tokens == (5, 6, 7)


def test_save_rejects_malformed_hashes(tmp_path):
    with pytest.raises(InputError) as e:
        save_kv(tmp_path / "x.detkv", _synthetic([1]), model_sha256="ABC", tokenizer_sha256="b" * 64)
    assert "model_sha256" in _error(e)
    assert os.listdir(tmp_path) == []


def test_atomic_write_leaves_old_file_and_no_temp_files(small_file, monkeypatch):
    folder = small_file.parent
    old = small_file.read_bytes()
    save_kv(small_file, _synthetic([1, 2, 3, 4], seed=3), model_sha256="a" * 64, tokenizer_sha256="b" * 64)
    assert sorted(os.listdir(folder)) == ["small.detkv"]
    new = small_file.read_bytes()
    assert new != old

    def failing(k, v, n):  # dies after the first array has been written
        yield np.zeros(4, np.float32)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kvfile, "canonical_layers", failing)
    with pytest.raises(InputError, match=f"cannot write {small_file}: No space left on device"):
        save_kv(small_file, _synthetic([1, 2]), model_sha256="a" * 64, tokenizer_sha256="b" * 64)
    with pytest.raises(InputError, match="MiB free in"):
        save_kv(folder / "fresh.detkv", _synthetic([1, 2]), model_sha256="a" * 64, tokenizer_sha256="b" * 64)
    assert sorted(os.listdir(folder)) == ["small.detkv"], "a temp file or partial file was left behind"
    assert small_file.read_bytes() == new


# ---------------------------------------------------------------- prefix cache


def test_prefix_reuse_is_bit_identical_to_recomputation(engine, recompute):
    tok = engine.tokenizer.encode
    base = tok(TEXT)
    p1 = base + tok(" It was tired.")
    p2 = base + tok(" Then it slept.")
    unrelated = tok("Bonjour, le monde.")
    # (prompt, expected tokens reused): miss, partial use of a longer snapshot, exact hit, shorter prefix, miss
    plan = [(p1, 0), (p2, len(base)), (p1, len(p1) - 1), (p1[:6], 5), (unrelated, 0), (p2 + tok(" Good."), len(p2))]
    pc = PrefixCache(max_bytes=10**9)
    for prompt, expect in plan:
        cache = engine.new_cache()
        logits, reused = prefill_with_reuse(engine, prompt, pc, cache)
        assert reused == expect, f"{prompt}: reused {reused}, expected {expect}"
        expected, fresh = recompute(prompt)
        _assert_same_bits(logits, expected, f"reuse of {reused} tokens")
        _assert_same_cache(cache, fresh, f"reuse of {reused} tokens")
    # p1[:6] is covered by p1, and p2 by p2 + " Good.": only the longest of each line is kept
    assert sorted(len(k) for k in pc.keys()) == sorted([len(p1), len(unrelated), len(p2) + len(tok(" Good."))])
    assert pc.nbytes == sum(engine.kv_bytes(len(k)) for k in pc.keys())


def test_prefix_reuse_keeps_what_the_cache_already_holds(engine):
    """A session's own cache is reused as is (no snapshot needed); a differing tail is cut off."""
    tok = engine.tokenizer.encode
    first = tok(TEXT)
    cache = engine.new_cache()
    pc = PrefixCache(max_bytes=0)  # stores nothing
    assert prefill_with_reuse(engine, first, pc, cache)[1] == 0 and len(pc) == 0 and pc.nbytes == 0
    follow = first[:8] + tok(" cat.")
    logits, reused = prefill_with_reuse(engine, follow, pc, cache)
    assert reused == 8
    fresh = engine.new_cache()
    _assert_same_bits(logits, engine.forward(follow, fresh), "own cache reused")
    _assert_same_cache(cache, fresh, "own cache reused")


def test_prefix_cache_under_a_tiny_budget(engine, recompute):
    """Room for one prompt: every store evicts the last, the budget is never exceeded, results stay exact."""
    tok = engine.tokenizer.encode
    base = tok(TEXT)
    prompts = [base + tok(" It was tired."), base + tok(" Then it slept."), base[:7] + tok(" cat sat."), base + tok(" It ran.")]
    budget = engine.kv_bytes(max(len(p) for p in prompts))
    pc = PrefixCache(max_bytes=budget)
    reused_all = []
    for prompt in prompts:
        cache = engine.new_cache()
        logits, reused = prefill_with_reuse(engine, prompt, pc, cache)
        reused_all.append(reused)
        assert pc.nbytes <= budget and len(pc) == 1 and pc.keys()[0] == tuple(prompt)
        expected, fresh = recompute(prompt)
        _assert_same_bits(logits, expected, f"prompt {len(reused_all)}")
        _assert_same_cache(cache, fresh, f"prompt {len(reused_all)}")
    assert reused_all == [0, len(base), 7, 7]


def test_lru_eviction_and_coverage_rules():
    per_token = _synthetic([1]).nbytes
    pc = PrefixCache(max_bytes=6 * per_token)
    a, b, c, d = [1, 2], [3, 4], [5, 6], [7, 8]
    for s in (a, b, c):
        assert pc.store(_synthetic(s))
    assert pc.nbytes == 6 * per_token and pc.keys() == [tuple(a), tuple(b), tuple(c)]
    assert pc.lookup([1, 2, 9]) == (2, pc._entries[tuple(a)][1])  # a becomes most recently used
    assert pc.store(_synthetic(d))  # evicts b, the least recently used
    assert pc.keys() == [tuple(c), tuple(a), tuple(d)] and pc.nbytes <= pc.max_bytes
    assert pc.lookup([3, 4]) == (0, None)
    # coverage: a longer line replaces its prefix, a prefix of a held line is not stored again
    assert pc.store(_synthetic([1, 2, 3]))
    assert tuple(a) not in pc.keys() and (1, 2, 3) in pc.keys()
    assert not pc.store(_synthetic([1, 2]))
    k, snap = pc.lookup([1, 2, 3, 4], limit=2)
    assert k == 2 and snap.tokens == (1, 2, 3)
    assert not pc.store(_synthetic(list(range(7))))  # larger than the whole budget
    assert not pc.store(_synthetic([]))
    with pytest.raises(InputError):
        pc.store(_synthetic([1], kv_type="f16"))
    pc.clear()
    assert len(pc) == 0 and pc.nbytes == 0
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(InputError):
            PrefixCache(bad)


def test_non_truncatable_snapshots_are_reused_only_whole():
    """A recurrent-state snapshot (none exists yet) cannot be cut: only its full length is reusable."""

    class Recurrent(KVSnapshot):
        truncatable = False

    base = _synthetic([1, 2, 3])
    pc = PrefixCache(max_bytes=10**6)
    pc.store(Recurrent(base.kv_type, base.tokens, base.k, base.v))
    assert pc.lookup([1, 2, 3, 4])[0] == 3
    assert pc.lookup([1, 2, 9]) == (0, None)
    assert pc.lookup([1, 2, 3], limit=2) == (0, None)
    with pytest.raises(InputError):
        pc.lookup([1, 2, 3, 4])[1].prefix(2)


# ------------------------------------------------------------------------------- a KV folder (serve --kv-dir)


def _kv_dir(folder, max_bytes=1 << 20, model="a"):
    from detinfer.records.kv_dir import KVDir

    return KVDir(folder, max_bytes, model_sha256=model * 64, tokenizer_sha256="b" * 64, kv_type="f32", shape=(2, 1, 4))


def test_a_kv_folder_is_shared_bound_and_bounded(tmp_path):
    """Two stores on one folder write one prefix under one name with the same bytes; a prefix cache backed by a
    fresh store finds it; a file re-headed with other tokens (checksum resealed) or made for another model is
    never indexed nor deleted; the budget deletes the least recently used file first."""
    from detinfer.records.kv_dir import KVDir

    a, b = _kv_dir(tmp_path), _kv_dir(tmp_path)
    for store in (a, b):
        store.save(_synthetic([5, 6, 7]))
        store.close(timeout=10)
    [path] = list(tmp_path.glob("*.detkv"))
    original = path.read_bytes()
    assert load_kv(path).tokens == (5, 6, 7)

    cache = PrefixCache(1 << 20, store=_kv_dir(tmp_path))
    k, snap = cache.lookup([5, 6, 7, 8])
    assert k == 3 and snap.digest() == _synthetic([5, 6, 7]).digest() and len(cache) == 1
    assert PrefixCache(1 << 20).lookup([5, 6, 7, 8]) == (0, None)  # the control: no store, nothing found

    header = kvfile.inspect_kv(path)
    forged = {key: header[key] for key in ("model_sha256", "tokenizer_sha256", "kv_type", "n_layer", "n_head_kv",
                                           "head_dim", "n_tokens", "tokens")}  # fmt: skip
    path.write_bytes(_with_header(original, dict(forged, tokens=[5, 6, 9], byte_order="little", layout=kvfile.LAYOUT)))
    assert load_kv(path).tokens == (5, 6, 9)  # a well-formed file ...
    assert PrefixCache(1 << 20, store=_kv_dir(tmp_path)).lookup([5, 6, 9, 1]) == (0, None)  # ... under another's name
    path.write_bytes(original)

    other = _kv_dir(tmp_path, model="c")
    assert len(other) == 0  # another model's server sees none of these files
    other.save(_synthetic([1, 2]))
    other.close(timeout=10)
    assert len(list(tmp_path.glob("*.detkv"))) == 2 and len(_kv_dir(tmp_path)) == 1

    one = path.stat().st_size
    tight = KVDir(tmp_path / "tight", 2 * one, model_sha256="a" * 64, tokenizer_sha256="b" * 64, kv_type="f32", shape=(2, 1, 4))
    for tokens in ([5, 6, 7], [1, 1, 1], [2, 2, 2]):
        tight.save(_synthetic(tokens))
    tight.close(timeout=10)
    kept = sorted(load_kv(p).tokens for p in (tmp_path / "tight").glob("*.detkv"))
    assert kept == [(1, 1, 1), (2, 2, 2)]
