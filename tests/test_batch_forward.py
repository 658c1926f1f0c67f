"""Engine.forward_batch: one step over several sequences, each with its own KV cache and positions, gives every
sequence the bytes it gets alone (logits and KV), on both real models (Gemma 3: one KV head, sliding-window
layers), with decode rows, prefill chunks and draft windows mixed, in any order, at one and two threads. The
control: a row-order-dependent reduction (RMSNorm summed right to left whenever a step has more than one row) is
detected by the same comparison."""

from __future__ import annotations

import random

import numba
import numpy as np
import pytest

from detinfer.compute import kernels
from detinfer.compute.engine import Engine
from detinfer.compute.threads import fixed_threads
from detinfer.errors import InputError
from detinfer.records.selftest import _rmsnorm_reassociated

TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
         "Once upon a time, in a small village at the edge of a great forest, there lived a wise old woman.",
         '{"city": "Lyon", "high_c": 14, "low_c": 6, "conditions": "light rain"}'] * 2  # fmt: skip
# Per sequence: (tokens already in its cache, new tokens this step, all logits): decode rows, a prefill chunk from
# an empty cache, draft windows; the eight of them in one step.
SHAPES = [(12, 1, False), (0, 7, False), (20, 5, True), (3, 1, True), (15, 1, False), (0, 1, False), (9, 13, True), (18, 2, False)]


@pytest.fixture(scope="module")
def engine(real_model) -> Engine:
    _, path, _ = real_model
    return Engine.load(path, n_ctx=128)


def _sequences(engine: Engine) -> list[tuple[list[int], list[int], bool]]:
    """(cached prefix, new tokens, all_logits) per sequence of SHAPES."""
    out = []
    for text, (held, new, all_logits) in zip(TEXTS, SHAPES):
        ids = engine.tokenizer.encode(text + " " + text)
        assert len(ids) >= held + new
        out.append((ids[:held], ids[held : held + new], all_logits))
    return out


def _alone(engine: Engine, seqs) -> list[tuple[bytes, str]]:
    results = []
    for prefix, new, all_logits in seqs:
        cache = engine.new_cache()
        if prefix:
            engine.forward(prefix, cache)
        results.append((engine.forward(new, cache, all_logits=all_logits).tobytes(), cache.digest()))
    return results


def _batched(engine: Engine, seqs, order: list[int]) -> dict[int, tuple[bytes, str]]:
    """The sequences ``order`` names, in that order, in one step: {index: (logits bytes, KV digest)}."""
    caches = {}
    for i in order:
        caches[i] = engine.new_cache()
        if seqs[i][0]:
            engine.forward(seqs[i][0], caches[i])
    logits = engine.forward_batch([(seqs[i][1], caches[i], seqs[i][2]) for i in order])
    return {i: (out.tobytes(), caches[i].digest()) for i, out in zip(order, logits)}


@pytest.mark.parametrize("threads", [1, 2])
def test_every_sequence_gets_its_bytes_alone_beside_any_others_in_any_order(engine, threads):
    if threads > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("numba was started with one thread")
    seqs = _sequences(engine)
    with fixed_threads(threads):
        alone = _alone(engine, seqs)
        rng = random.Random(threads)
        for size in (2, 4, 8):  # a request beside 1, 3 and 7 others
            order = rng.sample(range(len(seqs)), size)
            got = _batched(engine, seqs, order)
            assert [got[i] for i in order] == [alone[i] for i in order], (size, order)


def test_negative_control_a_reduction_that_depends_on_the_rows_in_a_step_is_detected(engine, monkeypatch):
    seqs = _sequences(engine)[:4]
    with fixed_threads(1):
        alone = _alone(engine, seqs)
        original = kernels.rmsnorm_tokens
        monkeypatch.setattr(kernels, "rmsnorm_tokens", lambda x, w, eps, out: (
            _rmsnorm_reassociated if x.shape[0] > 1 else original)(x, w, eps, out))  # fmt: skip
        got = _batched(engine, seqs, [0, 1, 2, 3])
    decode = 0  # sequence 0 is one decode row: alone it never reaches the per-token kernels
    assert got[decode] != alone[decode]


def test_bad_batches_are_refused(engine):
    cache = engine.new_cache()
    with pytest.raises(InputError, match="empty batch"):
        engine.forward_batch([])
    with pytest.raises(InputError, match="one KV cache twice"):
        engine.forward_batch([([1], cache, False), ([2], cache, False)])
    with pytest.raises(InputError, match="outside the vocabulary"):
        engine.forward_batch([([1], cache, False), ([engine.config.n_vocab], engine.new_cache(), False)])
    assert cache.n_tokens == 0  # nothing ran
    np.testing.assert_equal(engine.forward_batch([([1, 2], cache, True)])[0].shape, (2, engine.config.n_vocab))
