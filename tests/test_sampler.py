"""Sampler tests: parameter validation, each filter against hand-built distributions, purity, and the fast
bucketed path against a slow oracle written from the module docstring (numpy + the correctly rounded float32 exp)."""

from __future__ import annotations

import hashlib
import math
from fractions import Fraction

import numpy as np
import pytest
from pydantic import ValidationError

from detinfer.compute.sampler import (
    _penalized,
    _prepare,
    _Step,
    distribution,
    sample,
    top_logits,
    uniform,
    uniform_bits,
)
from detinfer.compute.sampling import SamplingParams
from detinfer.errors import InputError


def P(**kw) -> SamplingParams:
    return SamplingParams.create(**kw)


def logits_of(probs) -> np.ndarray:
    """float32 logits whose softmax at T = 1 is (close to) ``probs``."""
    return np.log(np.asarray(probs, np.float64)).astype(np.float32)


def draws(logits, params, positions, history=()) -> np.ndarray:
    return np.array([sample(logits, params, p, history) for p in positions])


# --------------------------------------------------------------------------------------------- oracle

def oracle(logits: np.ndarray, params: SamplingParams, position: int, history) -> int:
    """The module docstring's formulas, written out with a full stable sort and Python integers."""
    lp = logits.copy()
    if params.repetition_penalty != 1.0 and params.repeat_last_n > 0:
        for t in set(list(history)[-params.repeat_last_n :]):
            v = float(lp[t])
            lp[t] = np.float32(v / params.repetition_penalty if v > 0 else v * params.repetition_penalty)
    if params.temperature == 0:
        return int(np.argmax(lp))
    order = np.argsort(-lp, kind="stable")  # descending logit, ties by ascending id
    if 0 < params.top_k < len(lp):
        order = order[: params.top_k]
    l_max = float(lp[order[0]])
    x = [np.float32((float(lp[i]) - l_max) / params.temperature) for i in order]
    # float64 exp rounded once to float32: the correctly rounded exp, which exp32 is on every float32 input
    # (bench/numerics_accuracy.py)
    w = [float(np.float32(math.exp(float(v)))) for v in x]
    q = [math.floor(wi * 2**40) for wi in w]
    S = sum(q)
    keep = [qi > 0 and wi >= params.min_p for qi, wi in zip(q, w)]
    m = sum(keep)
    assert all(keep[:m]) and not any(keep[m:]), "kept tokens must be a prefix of candidate order"
    ids, qk = order[:m], q[:m]
    C = list(np.cumsum(np.array(qk, dtype=object)))
    if params.top_p < 1.0:
        thr = Fraction(params.top_p) * S
        m = next((j + 1 for j, c in enumerate(C) if c >= thr), m)
    R = C[m - 1]
    h = hashlib.blake2b(
        params.seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8, person=b"detinfer.sample"
    ).digest()
    t = ((int.from_bytes(h, "little") >> 11) * R) >> 53
    return int(next(ids[j] for j in range(m) if C[j] > t))




# --------------------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_p": 0},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_p": float("nan")},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_k": True},
        {"min_p": -0.1},
        {"min_p": 1.0},
        {"min_p": float("nan")},
        {"repetition_penalty": 0},
        {"repetition_penalty": -1.0},
        {"repetition_penalty": float("nan")},
        {"repeat_last_n": -1},
        {"seed": -1},
        {"seed": 2**64},
        {"unknown": 1},
    ],
)
def test_invalid_params_are_rejected(kw):
    (name, value) = next(iter(kw.items()))
    with pytest.raises(InputError) as e:
        P(**kw)
    msg = str(e.value)
    assert "\n" not in msg and name in msg and repr(value) in msg
    with pytest.raises(ValidationError):  # records are validated, not created: pydantic's error, with its location
        SamplingParams(**kw)


def test_valid_params_kept_as_given():
    p = P(temperature=1, top_k=40, top_p=1, min_p=0, repetition_penalty=1.3, repeat_last_n=0, seed=2**64 - 1)
    assert p.temperature == 1.0 and p.top_k == 40 and p.top_p == 1.0 and p.seed == 2**64 - 1
    assert P() == SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0)
    assert P().greedy and not P(temperature=1e-30).greedy
    with pytest.raises(Exception):
        p.temperature = 2.0  # frozen


# --------------------------------------------------------------------------------------------- RNG


def test_uniform_construction_is_pinned():
    # Part of the determinism contract: changing these values changes every sampled token.
    assert uniform_bits(0, 0) == 4903620496845028
    assert uniform_bits(12345, 678) == 1634021186614792
    assert uniform(0, 0) == 4903620496845028 / 2**53
    us = [uniform(s, p) for s in range(20) for p in range(50)]
    assert all(0.0 <= u < 1.0 for u in us) and len(set(us)) == len(us)
    assert uniform_bits(2**64 - 1, 2**64 - 1) < 2**53


# --------------------------------------------------------------------------------------------- greedy


def test_greedy_ties_go_to_lowest_id():
    logits = np.array([1.0, 3.0, -2.0, 3.0, 3.0, 0.5], np.float32)
    assert sample(logits, P(), 0, []) == 1
    assert sample(np.array([0.0, -0.0, 0.0], np.float32)[::-1].copy(), P(), 0, []) == 0
    assert sample(np.array([-np.inf, -5.0, -5.0], np.float32), P(), 0, []) == 1
    assert distribution(logits, P(), [])[0].tolist() == [1]


def test_greedy_ignores_seed_and_position():
    logits = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    got = {sample(logits, P(seed=s, top_p=0.5, top_k=3), pos, []) for s in range(5) for pos in (0, 7, 2**40)}
    assert got == {int(np.argmax(logits))}


def test_top_k_1_equals_greedy():
    rng = np.random.default_rng(2)
    for trial in range(20):
        logits = rng.integers(-3, 4, 500).astype(np.float32)  # many ties
        want = sample(logits, P(), 0, [])
        for seed in range(5):
            assert sample(logits, P(temperature=1.5, top_k=1, seed=seed), trial, []) == want


# --------------------------------------------------------------------------------------------- repetition penalty


def test_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([2.0, -2.0, 3.0, 0.5, 0.0], np.float32)
    lp = _penalized(logits, P(repetition_penalty=2.0), [0, 1, 0, 4])
    assert lp.tolist() == [1.0, -4.0, 3.0, 0.5, 0.0]  # each distinct token once
    assert logits.tolist() == [2.0, -2.0, 3.0, 0.5, 0.0]  # input untouched
    # The penalty factor is not rounded to float32 first: f32(f64(l) / r).
    lp = _penalized(np.array([1.0, -1.0], np.float32), P(repetition_penalty=1.1), [0, 1])
    assert lp.tolist() == [float(np.float32(1.0 / 1.1)), float(np.float32(-1.1))]


def test_penalty_changes_greedy_choice():
    assert sample(np.array([2.0, 1.5], np.float32), P(repetition_penalty=2.0), 0, [0]) == 1
    assert sample(np.array([-1.0, -1.5], np.float32), P(repetition_penalty=2.0), 0, [0]) == 1
    assert sample(np.array([-1.0, -1.5], np.float32), P(repetition_penalty=0.5), 0, [1]) == 1  # < 1 favours


def test_penalty_window_is_last_repeat_last_n():
    logits = np.array([4.0, 4.0, 4.0, 4.0], np.float32)
    assert _penalized(logits, P(repetition_penalty=2.0, repeat_last_n=1), [0, 1, 2, 3]).tolist() == [4, 4, 4, 2]
    assert _penalized(logits, P(repetition_penalty=2.0, repeat_last_n=2), [0, 1, 2, 3]).tolist() == [4, 4, 2, 2]
    assert _penalized(logits, P(repetition_penalty=2.0, repeat_last_n=99), [0, 1]).tolist() == [2, 2, 4, 4]
    assert _penalized(logits, P(repetition_penalty=2.0, repeat_last_n=0), [0, 1]) is logits
    assert _penalized(logits, P(repetition_penalty=1.0), [0, 1]) is logits
    assert _penalized(logits, P(repetition_penalty=2.0), np.array([3], np.int32)).tolist() == [4, 4, 4, 2]
    # Greedy on equal logits: the penalized ones lose, the lowest unpenalized id wins.
    assert sample(logits, P(repetition_penalty=2.0, repeat_last_n=2), 0, [0, 1, 2, 0]) == 1


# --------------------------------------------------------------------------------------------- purity


def test_same_seed_and_position_same_token():
    logits = np.random.default_rng(3).standard_normal(49152).astype(np.float32) * 2
    p = P(temperature=1.0, top_p=0.95, seed=42)
    first = [sample(logits, p, pos, []) for pos in range(30)]
    assert [sample(logits, p, pos, []) for pos in range(30)] == first
    assert [sample(logits.copy(), P(temperature=1.0, top_p=0.95, seed=42), pos, []) for pos in range(30)] == first
    assert len(set(first)) > 5


def test_different_seeds_draw_differently():
    logits = np.zeros(16, np.float32)  # uniform over 16 tokens
    a = draws(logits, P(temperature=1.0, seed=1), range(400))
    b = draws(logits, P(temperature=1.0, seed=2), range(400))
    assert (a == b).mean() < 0.2  # 1/16 expected
    per_seed = [sample(logits, P(temperature=1.0, seed=s), 5, []) for s in range(400)]
    assert len(set(per_seed)) == 16


def _toy_logits(history, n_vocab=3000) -> np.ndarray:
    """A deterministic stand-in for a model: logits from a hash of the last token and the length."""
    key = (history[-1] if history else 0) * 1000003 + len(history)
    return np.random.default_rng(key).standard_normal(n_vocab).astype(np.float32) * 3


def test_single_step_redone_alone_equals_step_in_loop():
    p = P(temperature=0.9, top_k=200, top_p=0.9, min_p=0.01, repetition_penalty=1.3, repeat_last_n=8, seed=7)
    prompt = [5, 17, 5, 99]
    tokens = list(prompt)
    for _ in range(40):
        tokens.append(sample(_toy_logits(tokens), p, len(tokens), tokens))
    for pos in (len(prompt), len(prompt) + 13, len(tokens) - 1):
        history = tokens[:pos]
        assert sample(_toy_logits(history), p, pos, history) == tokens[pos]
    assert len(set(tokens[len(prompt) :])) > 10


def test_logits_and_history_not_mutated():
    logits = np.random.default_rng(4).standard_normal(500).astype(np.float32)
    before = logits.copy()
    history = [1, 2, 3]
    sample(logits, P(temperature=1.0, repetition_penalty=1.5, top_k=10), 3, history)
    distribution(logits, P(temperature=1.0, repetition_penalty=1.5), history)
    assert np.array_equal(logits, before) and history == [1, 2, 3]


# --------------------------------------------------------------------------------------------- filters


PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize(
    "top_p, nucleus",
    [(0.45, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_exactly_the_nucleus(top_p, nucleus):
    logits = logits_of(PROBS)[::-1].copy()  # ids 3, 2, 1, 0 hold 0.5, 0.3, 0.15, 0.05
    want = [3 - i for i in nucleus]
    p = P(temperature=1.0, top_p=top_p, seed=3)
    ids, probs = distribution(logits, p, [])
    assert ids.tolist() == want
    kept = np.array([PROBS[i] for i in nucleus])
    np.testing.assert_allclose(probs, kept / kept.sum(), rtol=1e-6)
    assert set(draws(logits, p, range(600)).tolist()) == set(want)


@pytest.mark.parametrize("min_p, kept", [(0.0, 4), (0.05, 4), (0.2, 3), (0.5, 2), (0.7, 1)])
def test_min_p_drops_tokens_below_min_p_times_max(min_p, kept):
    logits = logits_of(PROBS)  # p_max = 0.5: keep p >= min_p * 0.5
    p = P(temperature=1.0, min_p=min_p, seed=9)
    ids, probs = distribution(logits, p, [])
    assert ids.tolist() == list(range(kept))
    np.testing.assert_allclose(probs, np.array(PROBS[:kept]) / sum(PROBS[:kept]), rtol=1e-6)
    assert set(draws(logits, p, range(600)).tolist()) == set(range(kept))


def test_top_k_keeps_k_highest_ties_by_lowest_id():
    logits = np.array([1.0, 5.0, 3.0, 5.0, 3.0, 3.0, -1.0], np.float32)
    ids, _ = distribution(logits, P(temperature=100.0, top_k=4), [])
    assert ids.tolist() == [1, 3, 2, 4]
    ids, probs = distribution(np.zeros(1000, np.float32), P(temperature=1.0, top_k=3), [])
    assert ids.tolist() == [0, 1, 2] and np.allclose(probs, 1 / 3)
    assert set(draws(np.zeros(1000, np.float32), P(temperature=1.0, top_k=3), range(300)).tolist()) == {0, 1, 2}


def test_filters_compose_in_order():
    # top-k keeps 3 of 4, softmax over those: (0.5, 0.3, 0.15) / 0.95; top-p 0.8 over that keeps 2.
    ids, probs = distribution(logits_of(PROBS), P(temperature=1.0, top_k=3, top_p=0.8), [])
    assert ids.tolist() == [0, 1]
    np.testing.assert_allclose(probs, [0.5 / 0.8, 0.3 / 0.8], rtol=1e-6)


def test_temperature_scales_logits():
    logits = logits_of(PROBS)
    _, probs = distribution(logits, P(temperature=0.5), [])
    sharp = np.array(PROBS) ** 2
    np.testing.assert_allclose(probs, sharp / sharp.sum(), rtol=1e-5)
    _, probs = distribution(logits, P(temperature=1e6), [])
    np.testing.assert_allclose(probs, 0.25, rtol=1e-4)


def test_neg_inf_logits_are_never_drawn():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0, -np.inf], np.float32)
    assert set(draws(logits, P(temperature=2.0), range(200)).tolist()) == {1, 3}
    assert distribution(logits, P(temperature=2.0), [])[0].tolist() == [1, 3]


def test_empirical_frequencies_match_the_filtered_distribution():
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal(2000) * 2).astype(np.float32)
    p = P(temperature=0.7, top_k=50, top_p=0.9, seed=11)
    ids, probs = distribution(logits, p, [])
    assert 3 <= len(ids) <= 50
    n = 6000
    got = draws(logits, p, range(n))
    assert set(got.tolist()) <= set(ids.tolist())
    counts = np.array([(got == i).sum() for i in ids])
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 3), (counts, n * probs)
    # Over seeds at one position, too.
    got = np.array([sample(logits, P(temperature=0.7, top_k=50, top_p=0.9, seed=s), 0, []) for s in range(n)])
    counts = np.array([(got == i).sum() for i in ids])
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma + 3)


# --------------------------------------------------------------------------------------------- fast path == oracle


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.3, "top_k": 40, "top_p": 0.95},
        {"temperature": 0.8, "min_p": 0.05},
        {"temperature": 0.9, "top_k": 100, "top_p": 0.8, "min_p": 0.02, "repetition_penalty": 1.2, "repeat_last_n": 16},
        {"temperature": 0.05, "top_p": 0.999},
        {"temperature": 0.0, "repetition_penalty": 1.5},
    ],
)
def test_sample_equals_oracle(kw):
    rng = np.random.default_rng(6)
    for trial in range(4):
        n = [300, 2000, 49152, 1000][trial]
        logits = (rng.standard_normal(n) * 3).astype(np.float32)
        if trial == 3:
            logits = np.round(logits).astype(np.float32)  # heavy ties, across and inside buckets
            logits[::7] = -np.inf
        history = rng.integers(0, n, 50).tolist()
        p = P(seed=int(rng.integers(0, 2**63)), **kw)
        positions = range(100 * trial, 100 * trial + (6 if n > 10000 else 25))
        assert [sample(logits, p, pos, history) for pos in positions] == [
            oracle(logits, p, pos, history) for pos in positions
        ]


def test_bucketed_draw_equals_full_sort_for_every_u():
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(49152) * 2.5 - 2).astype(np.float32)
    logits[rng.integers(0, 49152, 30)] += 12
    for kw in ({"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.0, "top_k": 500}):
        p = P(**kw)
        lp, arg = _prepare(logits, p, [])
        step = _Step(lp, arg, p)
        ids, q = step.kept()
        C = np.cumsum(q)
        assert C[-1] == step.R
        for bits in np.linspace(0, 2**53 - 1, 257).astype(np.int64).tolist() + [0, 2**53 - 1]:
            t = (bits * step.R) >> 53
            assert step.draw(bits) == ids[np.searchsorted(C, t, side="right")]


# --------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "logits",
    [
        np.zeros(4, np.float64),
        np.zeros((2, 3), np.float32),
        np.zeros(0, np.float32),
        [0.0, 1.0],
        np.array([0.0, np.nan], np.float32),
        np.array([0.0, np.inf], np.float32),
        np.array([-np.inf, -np.inf], np.float32),
    ],
)
def test_bad_logits_rejected(logits):
    for p in (P(), P(temperature=1.0)):
        with pytest.raises(InputError):
            sample(logits, p, 0, [])


def test_bad_history_position_and_overflow_rejected():
    logits = np.array([1.0, 2.0, 3.0], np.float32)
    pen = P(repetition_penalty=1.5)
    with pytest.raises(InputError, match="outside the vocabulary"):
        sample(logits, pen, 3, [0, 3])
    with pytest.raises(InputError, match="outside the vocabulary"):
        sample(logits, pen, 3, [-1])
    with pytest.raises(InputError, match="integer token ids"):
        sample(logits, pen, 3, [0.0, 1.0])
    with pytest.raises(InputError, match="position"):
        sample(logits, P(), -1, [])
    with pytest.raises(InputError, match="position"):
        sample(logits, P(), 2**64, [])
    with pytest.raises(InputError, match="position"):
        sample(logits, P(), 1.0, [])
    with pytest.raises(InputError, match="overflows"):
        sample(np.array([1e30, 1.0], np.float32), P(repetition_penalty=1e-20), 1, [0])
    with pytest.raises(InputError, match="SamplingParams"):
        sample(logits, {"temperature": 1.0}, 0, [])


# --------------------------------------------------------------------------------------------- top_logits


def test_top_logits():
    logits = np.array([1.0, 5.0, 3.0, 5.0, -0.0, 0.0, -np.inf], np.float32)
    assert top_logits(logits, 3) == [(1, 5.0), (3, 5.0), (2, 3.0)]
    assert top_logits(logits, 6)[3:] == [(0, 1.0), (4, -0.0), (5, 0.0)]  # -0.0 ties +0.0: lowest id first
    assert [i for i, _ in top_logits(logits, 100)] == [1, 3, 2, 0, 4, 5, 6]
    assert top_logits(logits, 0) == []
    big = np.random.default_rng(8).standard_normal(49152).astype(np.float32)
    want = np.argsort(-big, kind="stable")[:5]
    assert top_logits(big) == [(int(i), float(big[i])) for i in want]
    with pytest.raises(InputError):
        top_logits(logits, -1)
    with pytest.raises(InputError):
        top_logits(np.array([np.nan], np.float32))
