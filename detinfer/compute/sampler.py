"""Sampler: a pure function (logits, params, position, history) -> token id.

No hidden RNG state: the uniform draw of a step is a hash of (seed, position), so any step can be redone
alone and a session can be resumed or replayed from any position.

Pipeline, in this fixed order (llama.cpp's filters, composed as in mlx-lm):

    repetition penalty -> temperature -> top-k -> softmax -> top-p -> min-p -> renormalize -> inverse-CDF draw

temperature == 0 is greedy: argmax of the penalized logits, ties to the lowest token id.

Candidate order: descending penalized logit, ties by ascending token id (what a stable sort gives). Top-k,
top-p and the draw all walk this order. It comes from exact uint32 keys (IEEE bits made monotone) with the
token id as tie-break, ordered by a stable radix sort, so it never depends on a sort implementation; only
the key bucket where a threshold is crossed is ever sorted (see below).

Exact arithmetic (part of the determinism contract). l = penalized float32 logits, C = candidates
(all ids, or the first top_k in candidate order), r = repetition_penalty, T = temperature, F = 40:

    l_i   = f32(f64(logit_i) / r) if logit_i > 0 else f32(f64(logit_i) * r)    (each distinct id of the window)
    x_i   = f32((f64(l_i) - f64(l_max)) / T)          float64 ops, one rounding to float32; x = 0 at the max
    w_i   = exp32(x_i)                                float32, detinfer.numerics (no libm); w = 1 at the max;
                                                      taken as 0 when x_i < -30 (exp < 2**-40 there: q_i = 0 anyway)
    q_i   = floor(w_i * 2**F)                         int64 fixed-point weight, exact (no floor) for w >= 2**-17
    S     = sum of q_i over C                         exact integer sum: order-free, p_i = q_i / S
    kept  = i in C with q_i > 0 and w_i >= min_p      min-p: p_i >= min_p * p_max since w_i = p_i / p_max
                                                      (q_i = 0, i.e. w_i < 2**-40, is never drawn)
    C_j   = q_0 + ... + q_j over kept, candidate order (exact integers)
    top-p : m = shortest prefix with C_{m-1} >= top_p * S (exact rational comparison); top_p = 1 keeps all
    R     = C_{m-1}                                   renormalization: p_j / R over the m kept tokens
    draw  : b = uniform_bits(seed, position) (53 bits); t = floor(b * R / 2**53) (exact integer);
            token = first j in candidate order with C_j > t    (inverse CDF with u = b / 2**53 in [0, 1))

Integer weights are the int8 trick of llama2.c applied to the CDF: their sums are exact in any order, so the
CDF needs no written summation order, and the crossing point of a threshold can be found by bucketing
without sorting the whole vocabulary. Subtracting l_max before dividing by T (llama.cpp divides first)
keeps every x_i finite or -inf for any finite T > 0. Top-p and min-p both keep a candidate-order prefix of
one distribution, so applying them one after the other keeps the shorter prefix.

Sources: repetition penalty from Keskar et al. 2019, "CTRL" (arXiv:1909.05858) section 4.1, as llama.cpp
applies it (``llama_sampler_penalties_apply``: logit <= 0 multiplied, > 0 divided; each distinct token of
the window once); top-k from Fan et al. 2018 (arXiv:1805.04833); top-p (nucleus) from Holtzman et al. 2019
(arXiv:1904.09751); min-p from Nguyen et al. 2024 (arXiv:2407.01082).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Sequence

import numpy as np
from numba import njit

from ..errors import InputError
from .numerics import exp32, log32
from .sampling import U64, SamplingParams

WEIGHT_BITS = 40  # F above: q = floor(w * 2**F); S <= n_vocab * 2**F must fit int64
MAX_VOCAB = 2 ** (63 - WEIGHT_BITS)
BUCKET_SHIFT = 20  # crossing search buckets keys by their top 12 bits (sign, exponent, 3 mantissa bits)

# Domain tag of the counter-based RNG (blake2b personalization, at most 16 bytes). Changing it changes every
# sampled token: it is part of the determinism contract, like the rest of ``uniform_bits``.
RNG_PERSON = b"detinfer.sample"


# --------------------------------------------------------------------------------------------- RNG


def uniform_bits(seed: int, position: int) -> int:
    """53 random bits b, a pure function of (seed, position); the step's uniform is u = b / 2**53 in [0, 1).

    h = blake2b(seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8,
    person=b"detinfer.sample") read as a little-endian uint64; b = h >> 11.
    """
    msg = seed.to_bytes(8, "little") + position.to_bytes(8, "little")
    h = int.from_bytes(hashlib.blake2b(msg, digest_size=8, person=RNG_PERSON).digest(), "little")
    return h >> 11


def uniform(seed: int, position: int) -> float:
    """u = uniform_bits(seed, position) / 2**53 in [0, 1), exact in float64."""
    return uniform_bits(seed, position) * (1.0 / 2**53)


# --------------------------------------------------------------------------------------------- kernels
# Kernels work on the penalized logits (float32[n]) and their sort keys (uint32[n], see _key). Scratch of
# vocabulary size is allocated by numpy in the caller (numba's large allocations cost ~0.1 ms each).
# With top-k, the candidates are the ids with (key_i, i) <= (kkey, kid), the k-th token in candidate order.

NB = 1 << (32 - BUCKET_SHIFT)  # buckets of the crossing search


@njit(cache=True)
def _scan(logits):
    """(argmax with ties to the lowest id, index of the first NaN or +inf, else -1) of float32[n]; serial."""
    best = logits[0]
    arg = 0
    for i in range(logits.shape[0]):
        x = logits[i]
        if x != x or x == np.inf:
            return arg, i
        if x > best:
            best = x
            arg = i
    return arg, -1


@njit(cache=True)
def _penalize(logits, ids, penalty):
    """In place on float32[n], for distinct int64[w] ids: l > 0 -> l / r, else l * r (CTRL, as llama.cpp).

    float64 arithmetic, one rounding to float32 (r is not rounded to float32 first, unlike llama.cpp).
    Returns the first id whose logit overflowed to +inf, or -1.
    """
    for j in range(ids.shape[0]):
        t = ids[j]
        v = np.float64(logits[t])
        logits[t] = np.float32(v / penalty) if v > 0.0 else np.float32(v * penalty)
        if logits[t] == np.inf:
            return t
    return -1


@njit(cache=True)
def _key(b):
    """uint32 sort key of a float32 given by its uint32 bits: ascending key = descending value, -0.0 == +0.0.

    Negative floats (sign bit set) order by their bits already: key = bits. Non-negative: key = 0x7FFFFFFF - bits.
    -0.0 (0x80000000) gets the key of +0.0. Integer arithmetic in int64, so no unsigned promotion surprises.
    """
    v = np.int64(b)
    k = v ^ ((1 - (v >> 31)) * 0x7FFFFFFF)  # branchless: the sign of logits is unpredictable
    return np.uint32(k - (v == 0x80000000))  # -0.0 -> key of +0.0 (0x7FFFFFFF), adjacent to it


@njit(cache=True)
def _weight(logit, l_max, temperature):
    """(w, q) of one logit: w = exp32(f32((f64(l) - l_max) / T)) (detinfer.numerics), q = floor(w * 2**F)."""
    x = np.float32((np.float64(logit) - l_max) / temperature)
    if x < np.float32(-30.0):  # exp(-30) ~ 9.4e-14 < 2**-40: q would be 0, skip the exp (same result)
        return np.float32(0.0), np.int64(0)
    w = exp32(x)  # float32 in and out
    return w, np.int64(np.float64(w) * np.float64(2.0**WEIGHT_BITS))  # exact product; int64() = floor, w >= 0


@njit(cache=True)
def _radix_argsort(keys):
    """Stable ascending argsort of uint32[m]: LSD radix, digits of 11/11/10 bits; int64[m] permutation.

    Stable: equal keys keep their input order (ascending token id, as every caller passes them).
    """
    n = keys.shape[0]
    idx = np.arange(n)
    if n == 0:
        return idx
    k = keys.copy()
    idx2 = np.empty(n, np.int64)
    k2 = np.empty(n, np.uint32)
    cnt = np.empty(2048, np.int64)
    for p in range(3):
        shift = np.uint32(11 * p)
        cnt[:] = 0
        for i in range(n):
            cnt[(k[i] >> shift) & np.uint32(2047)] += 1
        if cnt[(k[0] >> shift) & np.uint32(2047)] == n:  # digit shared by all keys: order unchanged
            continue
        total = 0
        for d in range(2048):
            c = cnt[d]
            cnt[d] = total
            total += c
        for i in range(n):
            d = (k[i] >> shift) & np.uint32(2047)
            pos = cnt[d]
            cnt[d] = pos + 1
            idx2[pos] = idx[i]
            k2[pos] = k[i]
        idx, idx2 = idx2, idx
        k, k2 = k2, k
    return idx


@njit(cache=True)
def _keys(bits, keys):
    """keys[i] = _key(bits[i]) for uint32[n] logit bits, into uint32[n] keys."""
    for i in range(bits.shape[0]):
        keys[i] = _key(bits[i])


@njit(cache=True)
def _kth(keys, k, cnt):
    """(key, id) of the k-th token (1-based) in candidate order, from uint32[n] keys; cnt: int64[NB] zeros.

    Counts per key bucket, then sorts only the bucket holding the k-th token.
    """
    n = keys.shape[0]
    for i in range(n):
        cnt[keys[i] >> np.uint32(BUCKET_SHIFT)] += 1
    acc = 0
    b = 0
    while acc + cnt[b] < k:
        acc += cnt[b]
        b += 1
    pos = np.empty(cnt[b], np.int64)
    j = 0
    for i in range(n):
        if keys[i] >> np.uint32(BUCKET_SHIFT) == b:
            pos[j] = i
            j += 1
    j = pos[_radix_argsort(keys[pos])[k - acc - 1]]
    return keys[j], j


@njit(cache=True)
def _mass(logits, cand, l_max, temperature, min_p, q):
    """(S, K): exact sums of q over the candidates int64[c] (ascending ids) and over the kept ones.

    Writes the kept tokens' weights (q > 0 and w >= min_p) into int64[n] q, which must be zeros elsewhere.
    The loop runs over the candidates only: a loop over all ids that skips non-candidates measured as slow
    as computing every exp (LLVM hoists the exp out of the branch).
    """
    s = 0
    kept = 0
    for j in range(cand.shape[0]):
        i = cand[j]
        w, qc = _weight(logits[i], l_max, temperature)
        s += qc
        qi = qc if qc > 0 and np.float64(w) >= min_p else np.int64(0)
        q[i] = qi
        kept += qi
    return s, kept


@njit(cache=True)
def _mass_all(logits, l_max, temperature, min_p, q):
    """_mass with every id a candidate (top-k off), without an index array."""
    s = 0
    kept = 0
    for i in range(logits.shape[0]):
        w, qc = _weight(logits[i], l_max, temperature)
        s += qc
        qi = qc if qc > 0 and np.float64(w) >= min_p else np.int64(0)
        q[i] = qi
        kept += qi
    return s, kept


@njit(cache=True)
def _buckets(keys, q, bsum, bcnt):
    """Per key bucket (top 12 bits), the sum and count of the kept weights q into int64[NB] zeros bsum, bcnt.

    A separate loop: fused into the exp loop, the bucket updates stall it (measured 2x slower).
    """
    for i in range(keys.shape[0]):
        qi = q[i]
        if qi > 0:
            b = keys[i] >> np.uint32(BUCKET_SHIFT)
            bsum[b] += qi
            bcnt[b] += 1


@njit(cache=True)
def _cross(keys, q, bsum, bcnt, thr):
    """(id, C_j) of the first kept token j in candidate order with C_j >= thr; 1 <= thr <= K.

    C_j are exact integer prefix sums, so whole buckets (bsum, bcnt from _buckets) are skipped and only
    the bucket holding the crossing is gathered and sorted.
    """
    acc = 0
    b = 0
    while acc + bsum[b] < thr:
        acc += bsum[b]
        b += 1
    pos = np.empty(bcnt[b], np.int64)
    j = 0
    for i in range(keys.shape[0]):
        if keys[i] >> np.uint32(BUCKET_SHIFT) == b and q[i] > 0:
            pos[j] = i
            j += 1
    for j in _radix_argsort(keys[pos]):
        i = pos[j]
        acc += q[i]
        if acc >= thr:
            return i, acc
    return -1, acc  # unreachable when 1 <= thr <= K


@njit(cache=True)
def _kept_sorted(keys, q):
    """int64[k] ids of every kept token (q > 0), in candidate order: the full-sort reference path."""
    pos = np.nonzero(q > 0)[0]
    return pos[_radix_argsort(keys[pos])]


@njit(cache=True)
def _candidates(keys, kkey, kid, k):
    """int64[k] ids with (key, id) <= (kkey, kid) (exactly k of them: the top-k), in ascending id order."""
    ids = np.empty(k, np.int64)
    j = 0
    for i in range(keys.shape[0]):
        kk = keys[i]
        if kk < kkey or (kk == kkey and i <= kid):
            ids[j] = i
            j += 1
    return ids


# --------------------------------------------------------------------------------------------- public API


def _check_logits(logits) -> np.ndarray:
    if not isinstance(logits, np.ndarray) or logits.ndim != 1 or not 0 < logits.shape[0] <= MAX_VOCAB:
        shape = getattr(logits, "shape", None)
        raise InputError(
            f"logits must be a 1-D numpy array of 1 to {MAX_VOCAB} values, got {type(logits).__name__} shape {shape}"
        )
    if logits.dtype != np.float32:
        raise InputError(f"logits must be float32, got {logits.dtype}")
    return np.ascontiguousarray(logits)


def _argmax_checked(logits: np.ndarray) -> int:
    """Argmax (ties to the lowest id) of finite-or--inf logits; InputError for NaN, +inf or all -inf."""
    arg, bad = _scan(logits)
    if bad >= 0:
        raise InputError(f"logit of token {bad} is {float(logits[bad])}: logits must be finite or -inf")
    if logits[arg] == -np.inf:
        raise InputError("all logits are -inf: no token can be sampled")
    return int(arg)


def _check_params(params) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise InputError(f"params must be SamplingParams, got {type(params).__name__}")
    return params


def _check_position(position: int) -> int:
    try:
        if isinstance(position, bool):
            raise TypeError
        p = operator.index(position)
    except TypeError:
        raise InputError(f"position must be an int, got {position!r}") from None
    if not 0 <= p < U64:
        raise InputError(f"position {p} is outside [0, 2**64)")
    return p


def _penalized(logits: np.ndarray, params: SamplingParams, history: Sequence[int]) -> np.ndarray:
    """The logits after the repetition penalty: a new array if the penalty applies, else ``logits`` itself."""
    if params.repetition_penalty == 1.0 or params.repeat_last_n == 0 or len(history) == 0:
        return logits
    window = np.asarray(history[-params.repeat_last_n :])
    if window.ndim != 1 or window.dtype.kind not in "iu":
        raise InputError(f"history must be a sequence of integer token ids, got dtype {window.dtype}")
    n = logits.shape[0]
    bad = (window < 0) | (window >= n)
    if bad.any():
        raise InputError(f"history token id {int(window[np.argmax(bad)])} is outside the vocabulary [0, {n})")
    out = logits.copy()
    inf_id = _penalize(out, np.unique(window).astype(np.int64), float(params.repetition_penalty))
    if inf_id >= 0:
        raise InputError(
            f"repetition_penalty={params.repetition_penalty!r} overflows the logit of token {inf_id} "
            f"({float(logits[inf_id])}) to +inf"
        )
    return out


def _prepare(logits, params: SamplingParams, history: Sequence[int]) -> tuple[np.ndarray, int]:
    """(penalized logits, their argmax); validates the logits and history."""
    logits = _check_logits(logits)
    arg = _argmax_checked(logits)  # NaN/+inf in the raw logits are rejected before any penalty
    lp = _penalized(logits, params, history)
    return lp, (_argmax_checked(lp) if lp is not logits else arg)


class _Step:
    """One sampling step's filtered distribution, kept implicit: keys, kept weights q, S, K and R."""

    def __init__(self, lp: np.ndarray, arg: int, params: SamplingParams):
        n = lp.shape[0]
        # Scratch of vocabulary size comes from numpy: numba's large allocations cost ~0.1 ms each.
        self.keys = np.empty(n, np.uint32)
        _keys(lp.view(np.uint32), self.keys)
        self.q = np.zeros(n, np.int64)
        l_max, temp, min_p = float(lp[arg]), float(params.temperature), float(params.min_p)
        k = params.top_k
        if 0 < k < n:
            kkey, kid = _kth(self.keys, k, np.zeros(NB, np.int64))
            S, K = _mass(lp, _candidates(self.keys, kkey, kid, k), l_max, temp, min_p, self.q)
        else:
            S, K = _mass_all(lp, l_max, temp, min_p, self.q)
        self.S, self.K = int(S), int(K)
        self.bsum = np.zeros(NB, np.int64)
        self.bcnt = np.zeros(NB, np.int64)
        _buckets(self.keys, self.q, self.bsum, self.bcnt)
        self.R = self.K
        if params.top_p < 1.0:
            a, b = float(params.top_p).as_integer_ratio()
            thr = -(-a * self.S // b)  # ceil(top_p * S), exact; >= 1 since the max has q = 2**F
            if thr <= self.K:
                self.R = int(self._cross(thr)[1])

    def _cross(self, thr: int) -> tuple[int, int]:
        return _cross(self.keys, self.q, self.bsum, self.bcnt, np.int64(thr))

    def draw(self, bits53: int) -> int:
        """First kept token in candidate order with C_j > floor(bits53 * R / 2**53)."""
        t = (bits53 * self.R) >> 53  # exact integer, 0 <= t < R
        return int(self._cross(t + 1)[0])

    def kept(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, q) of the m tokens after top-p, in candidate order, by a full sort (reference path)."""
        ids = _kept_sorted(self.keys, self.q)
        q = self.q[ids]
        m = int(np.searchsorted(np.cumsum(q), self.R)) + 1  # C_{m-1} == R
        return ids[:m], q[:m]


def sample(logits: np.ndarray, params: SamplingParams, position: int, history: Sequence[int]) -> int:
    """Sample the token at absolute ``position`` from float32[n_vocab] ``logits``; a pure function.

    history: the token ids before ``position`` (prompt + generated so far), read only by the repetition
    penalty (its last ``repeat_last_n`` entries). Greedy (temperature 0): argmax after the penalty, ties
    to the lowest id. Otherwise the pipeline and exact arithmetic of the module docstring, with
    uniform_bits(params.seed, position).
    Raises InputError for logits that are not a non-empty 1-D float32 array or hold NaN, +inf or only -inf;
    history ids outside [0, n_vocab); a position outside [0, 2**64); a penalty that overflows a logit.
    """
    params = _check_params(params)
    position = _check_position(position)
    lp, arg = _prepare(logits, params, history)
    if params.greedy:
        return arg
    return _Step(lp, arg, params).draw(uniform_bits(params.seed, position))


def distribution(
    logits: np.ndarray, params: SamplingParams, history: Sequence[int]
) -> tuple[np.ndarray, np.ndarray]:
    """The filtered distribution ``sample`` draws from: (int64[m] ids in candidate order, float64[m] probs).

    probs[j] = q_j / R (the renormalized weights; they sum to 1 up to float64 rounding). Greedy gives
    ([argmax], [1.0]). Sorts every kept token: meant for tests and reports, not the decode loop.
    Raises InputError like ``sample``.
    """
    params = _check_params(params)
    lp, arg = _prepare(logits, params, history)
    if params.greedy:
        return np.array([arg], np.int64), np.array([1.0])
    step = _Step(lp, arg, params)
    ids, q = step.kept()
    return ids, q / step.R


def top_logits(logits: np.ndarray, k: int = 5) -> list[tuple[int, float]]:
    """The k highest (token id, logit) of raw float32[n_vocab] logits, highest first, ties by lowest id.

    k is clipped to n_vocab; k = 0 gives []. Raises InputError for k < 0 or logits holding NaN or +inf.
    """
    logits = _check_logits(logits)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InputError(f"top_logits k must be an int >= 0, got {k!r}")
    _, bad = _scan(logits)
    if bad >= 0:
        raise InputError(f"logit of token {bad} is {float(logits[bad])}: logits must be finite or -inf")
    k = min(k, logits.shape[0])
    if k == 0:
        return []
    keys = np.empty(logits.shape[0], np.uint32)
    _keys(logits.view(np.uint32), keys)
    kkey, kid = _kth(keys, k, np.zeros(NB, np.int64))
    ids = _candidates(keys, kkey, kid, k)
    return [(int(i), float(logits[i])) for i in ids[_radix_argsort(keys[ids])]]


@njit(cache=True)
def _log_softmax_at(logits, ids, out):
    """out[j] = log-softmax of float32[n] logits at int64[k] ids, in the fixed order of ``log_softmax_at``."""
    m = logits[0]
    for i in range(logits.shape[0]):
        if logits[i] > m:
            m = logits[i]
    m64 = np.float64(m)
    z = 0.0
    for i in range(logits.shape[0]):  # id order, float64 accumulator
        z += np.float64(exp32(np.float32(np.float64(logits[i]) - m64)))
    lz = np.float64(log32(np.float32(z)))
    for j in range(ids.shape[0]):
        out[j] = (np.float64(logits[ids[j]]) - m64) - lz


def log_softmax_at(logits: np.ndarray, ids: Sequence[int]) -> list[float]:
    """Log-probabilities of ``ids`` under softmax(logits) of raw float32[n_vocab] logits (no penalty, temperature
    or filters), as float64 values.

    Exact arithmetic (part of the determinism contract), l = logits:

        m      = max_i l_i                                          float32
        x_i    = f32(f64(l_i) - f64(m))                             one rounding to float32
        z      = sum over i = 0 .. n-1, in id order, of f64(exp32(x_i))   float64 accumulator, sequential
        lz     = f64(log32(f32(z)))                                 float32, 1 <= z <= n
        out_j  = (f64(l_id) - f64(m)) - lz                          float64 operations

    exp32 and log32 are detinfer's own (detinfer.numerics: IEEE basic operations only, the same bits on every
    machine). The top token's value is -lz <= 0; a -inf logit gives -inf.
    Raises InputError for logits that are not a non-empty 1-D float32 array, hold NaN, +inf or only -inf, or an
    id outside [0, n_vocab).
    """
    logits = _check_logits(logits)
    _argmax_checked(logits)
    idx = np.asarray(list(ids), dtype=np.int64).reshape(-1)
    n = logits.shape[0]
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise InputError(f"log_softmax_at: token id outside the vocabulary [0, {n})")
    out = np.empty(idx.shape[0], np.float64)
    _log_softmax_at(logits, idx, out)
    return [float(v) for v in out]


def warm_up(n_vocab: int) -> None:
    """Compile (or load from numba's cache) the sampling kernels a generation calls, on zero logits of ``n_vocab``
    tokens: a greedy and a sampled pick (every filter on), the top logits and log-probabilities."""
    logits = np.zeros(n_vocab, np.float32)
    sampled = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1)
    for params in (SamplingParams(), sampled):
        sample(logits, params, 0, [0])
    top_logits(logits, 5)
    log_softmax_at(logits, [0])
