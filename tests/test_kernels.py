"""Kernels against plain numpy in float64, plus the determinism properties the forward pass relies on.

Tolerances are worst-case float32 rounding bounds (Higham, "Accuracy and Stability of Numerical Algorithms",
section 3.1): a sum of n float32 terms computed in any fixed order is within n * u * sum(|term|) of the exact
sum, u = 2**-24. Each bound is taken relative to the *magnitude* of the sum (sum of |terms|), not to the
result, so cancellation cannot make it too tight; it is 1e-5 to 1e-4 of that magnitude, while the bugs it
guards against (wrong nibble, wrong scale, wrong pair, wrong KV head, missing mask) move results by O(1) of
the result itself (the matmul oracle test checks this against a nibble-order bug).
The matmuls' documented summation order (including its explicit FMAs) and the determinism properties
(chunk = one-token calls, 1 thread = 2 threads) are bitwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numba
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf_factory import write_tiny_gguf
from test_quants import BLOCK_DTYPES, K_QUANTS

from detinfer.compute import kernels
from detinfer.compute.linear import Activations, matmul
from detinfer.compute.numerics import fma32
from detinfer.model import weights
from detinfer.model.gguf_file import ModelFile
from detinfer.model.quants import F16_TO_F32, SUPPORTED_TYPES
from detinfer.model.weights import QMatrix

U = 2.0**-24  # unit roundoff of float32
QK = kernels.QK
R = kernels.ROWS
MATRIX_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.F32, Q.F16, Q.BF16]
# (n_out, n_in): fewer rows than one group, a ragged last group, and the SmolLM2 ffn_down shape with a ragged tail;
# k-quants need whole 256-element super-blocks, so their n_in is rounded up (at least two per row).
MATRIX_SHAPES = [(7, 64), (3 * R + 5, 576), (R + 1, 1536)]


def row_length(qtype: Q, n_in: int) -> int:
    """n_in, rounded up to a multiple of 512 (two super-blocks) for k-quants."""
    return -(-n_in // 512) * 512 if qtype in K_QUANTS else n_in


@pytest.fixture
def restore_threads():
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


def two_threads_or_skip() -> None:
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba was started with one thread")


def assert_bytes_equal(got: np.ndarray, want: np.ndarray, what: str, axes: tuple[str, ...] = ()) -> None:
    """Bitwise equality; on failure name the first differing index ([token, column]), labelled by ``axes``."""
    assert got.shape == want.shape and got.dtype == want.dtype, (
        f"{what}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    )
    g = np.ascontiguousarray(got).view(np.uint32)
    w = np.ascontiguousarray(want).view(np.uint32)
    bad = np.argwhere(g != w)
    if len(bad):
        idx = tuple(int(v) for v in bad[0])
        where = ", ".join(f"{a} {i}" for a, i in zip(axes, idx)) if len(axes) == len(idx) else str(idx)
        pytest.fail(
            f"{what}: {len(bad)} of {got.size} values differ; first at {where}: {got[idx]!r} vs {want[idx]!r} "
            f"(bits {int(g[idx]):#010x} vs {int(w[idx]):#010x})"
        )


def assert_within(got: np.ndarray, ref: np.ndarray, tol: np.ndarray, what: str) -> None:
    """|got - ref| <= tol elementwise (tol broadcast); on failure name the first offending [token, column]."""
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    err = np.abs(got.astype(np.float64) - ref)
    tol = np.broadcast_to(tol, err.shape)
    bad = np.argwhere(~(err <= tol))  # NaN in got fails too
    if len(bad):
        idx = tuple(int(v) for v in bad[0])
        pytest.fail(
            f"{what}: {len(bad)} of {got.size} values off; first at {idx}: got {got[idx]!r}, float64 {ref[idx]!r}, "
            f"|diff| {err[idx]:.3e} > tol {tol[idx]:.3e}"
        )


def activations(rng: np.random.Generator, T: int, n: int) -> np.ndarray:
    """float32 [T, n] like a residual stream: unit normal with a few large outlier channels."""
    x = rng.standard_normal((T, n))
    x[:, rng.choice(n, 3, replace=False)] *= 30.0
    return x.astype(np.float32)


# ---- matmuls ------------------------------------------------------------------------------------------


def random_matrix(qtype: Q, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF rows (uint8 [n_out, row_bytes]) of ``qtype`` with realistic scales; signs of d both ways.

    Quantized types: random bytes (codes, high bits, packed sub-block scales), then finite f16 scales.
    """
    if qtype in BLOCK_DTYPES:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        nb = n_out * n_in // block_size
        blocks = rng.integers(0, 256, nb * type_size, dtype=np.uint8).view(BLOCK_DTYPES[qtype])
        sign = rng.choice([-1.0, 1.0], nb)
        if qtype in (Q.Q4_K, Q.Q5_K):  # sub-block scales d * sc, dmin * m with 6-bit sc, m
            blocks["d"] = rng.uniform(1e-3, 0.02, nb) / 63 * sign
            blocks["dmin"] = rng.uniform(1e-3, 0.1, nb) / 63
        elif qtype == Q.Q6_K:  # d * sc with int8 sc
            blocks["d"] = rng.uniform(1e-3, 0.02, nb) / 127 * sign
        else:
            blocks["d"] = rng.uniform(1e-3, 0.02, nb) * sign
        if qtype in (Q.Q4_1, Q.Q5_1):
            blocks["m"] = rng.uniform(-0.15, 0.05, nb)
        return blocks.view(np.uint8).reshape(n_out, -1)
    w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
    if qtype == Q.F32:
        return w.view(np.uint8)
    if qtype == Q.F16:
        return w.astype(np.float16).view(np.uint8)
    return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # BF16: the top half of each float32


def _k_scale_min(scales: np.ndarray):
    """Q4_K/Q5_K packed scales uint8 [..., 12] -> (sc, m) [..., 8] (ggml-quants.c get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def block_fields(qtype: Q, raw: np.ndarray, n_in: int):
    """Per 32-element block: (codes float64 [n_out, nb, 32] in element order, d float64 [n_out, nb, 2], m
    float64 [n_out, nb]) as the kernels use them, decoded from the file layout independently of detinfer.

    d[..., 0] scales elements 0-15, d[..., 1] elements 16-31 (equal except in Q6_K). Nibble formats: byte j
    holds element j in its low nibble and element j+16 in its high one, Q5 bit 4 of element e is bit e of qh.
    Offsets: Q4_1/Q5_1 m, Q4_K/Q5_K -(dmin * m); Q4_0, Q5_0 and Q6_K have signed codes q - 8, q - 16, q - 32 and
    no offset (m None), like Q8_0.
    """
    n_out = raw.shape[0]
    block_size = GGML_QUANT_SIZES[qtype][0]
    blk = raw.reshape(-1).view(BLOCK_DTYPES[qtype]).reshape(n_out, n_in // block_size)
    nb = n_in // QK
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        d = blk["d"].astype(np.float64)
        if qtype == Q.Q8_0:
            codes, m = blk["qs"].astype(np.float64), None
        else:
            codes = np.concatenate([blk["qs"] & 15, blk["qs"] >> 4], axis=-1).astype(np.float64)
            if qtype in (Q.Q5_0, Q.Q5_1):
                qh = blk["qh"].view("<u4")[..., 0]
                codes += 16 * ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1)
            if qtype in (Q.Q4_0, Q.Q5_0):  # zero point 8 or 16: signed codes, no offset
                codes, m = codes - (8.0 if qtype == Q.Q4_0 else 16.0), None
            else:
                m = blk["m"].astype(np.float64)
        return codes, np.stack([d, d], axis=-1), m
    if qtype == Q.Q6_K:
        # element 128 h + 64 n + l: nibble n of ql[64 h + l]; element 128 h + 32 k + l: bits 2k, 2k+1 of qh[32 h + l]
        ql, qh = blk["ql"].reshape(n_out, -1, 2, 64), blk["qh"].reshape(n_out, -1, 2, 32)
        lo = np.stack([ql & 15, ql >> 4], axis=-2).reshape(n_out, -1, 256)
        hi = np.stack([(qh >> (2 * k)) & 3 for k in range(4)], axis=-2).reshape(n_out, -1, 256)
        codes = (lo | (hi << 4)).astype(np.float64) - 32.0
        d = blk["d"].astype(np.float64)[..., None] * blk["scales"].astype(np.float64)  # [n_out, n_sb, 16]
        return codes.reshape(n_out, nb, QK), d.reshape(n_out, nb, 2), None
    sc, mn = _k_scale_min(blk["scales"])
    d = blk["d"].astype(np.float64)[..., None] * sc  # [n_out, n_sb, 8]
    m = -blk["dmin"].astype(np.float64)[..., None] * mn
    qs = blk["qs"].reshape(n_out, -1, 4, 32)  # 64-element chunks: low nibbles first, then high nibbles
    codes = np.stack([qs & 15, qs >> 4], axis=-2).reshape(n_out, -1, 8, 32).astype(np.float64)
    if qtype == Q.Q5_K:
        codes += 16 * ((blk["qh"][:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1)
    d = d.reshape(n_out, nb)
    return codes.reshape(n_out, nb, QK), np.stack([d, d], axis=-1), m.reshape(n_out, nb)


def quantize_ref(x: np.ndarray):
    """kernels.quantize_blocks as its docstring defines it, in numpy: (xq int64 [T, n], dx float32 [T, n // 32],
    sx int64 [T, n // 16]). numpy's float32 / and * round once, np.rint rounds half to even."""
    f = np.float32
    xb = x.reshape(x.shape[0], -1, QK)
    amax = np.abs(xb).max(axis=2)
    finite = np.isfinite(xb).all(axis=2)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        dx = np.where(amax > 0, amax / f(127), f(0)).astype(f)
        inv = np.where(amax > 0, f(127) / amax, f(0)).astype(f)
        xq = np.clip(np.rint((xb * inv[..., None]).astype(f)), -127, 127)
    dx[~finite] = np.nan
    xq = np.where(finite[..., None] & ~np.isnan(xq), xq, 0).astype(np.int64)  # NaN (0 * inf) -> code 0
    sx = xq.reshape(x.shape[0], -1, 2, QK // 2).sum(axis=3).reshape(x.shape[0], -1)
    return xq.reshape(x.shape), dx, sx


def quantized_terms(qtype: Q, raw: np.ndarray, n_in: int, x: np.ndarray):
    """Exact per-block integers of the quantized matmuls, from block_fields and quantize_ref: (S [T, n_out, nb, 2]
    half dots of signed codes and activation codes, int64; dx [T, nb]; d, m from block_fields; sx [T, nb, 2])."""
    codes, d, m = block_fields(qtype, raw, n_in)
    xq, dx, sx = quantize_ref(x)
    T, n_out, nb = x.shape[0], codes.shape[0], codes.shape[1]
    c = codes.astype(np.int64).reshape(n_out, nb, 2, QK // 2)
    S = np.einsum("rbhe,tbhe->trbh", c, xq.reshape(T, nb, 2, QK // 2))
    return S, dx, d, m, sx.reshape(T, nb, 2)


def magnitude(qtype: Q, raw: np.ndarray, n_in: int, x: np.ndarray) -> np.ndarray:
    """[T, n_out] sum of |terms| the kernel adds: per block |dx| (|d| sum|c xq| (per half for Q6_K) + |m| |sx|),
    or sum |w x| for dense."""
    ax = np.abs(x.astype(np.float64))
    if qtype not in BLOCK_DTYPES:
        return ax @ np.abs(gguf_dequantize(raw, qtype).astype(np.float64)).T
    codes, d, m = block_fields(qtype, raw, n_in)
    xq, dx, sx = quantize_ref(x)
    T, n_out, nb = x.shape[0], codes.shape[0], codes.shape[1]
    a = np.einsum("rbhe,tbhe->trbh", np.abs(codes).reshape(n_out, nb, 2, QK // 2),
                  np.abs(xq).reshape(T, nb, 2, QK // 2).astype(np.float64))  # fmt: skip
    per_block = np.einsum("rbh,trbh->trb", np.abs(d), a)
    if m is not None:
        per_block += np.abs(m)[None] * np.abs(sx.reshape(T, nb, 2).sum(axis=2))[:, None, :]
    return np.einsum("tb,trb->tr", np.abs(dx.astype(np.float64)), per_block)


def run_matmul(mat: QMatrix, x: np.ndarray) -> np.ndarray:
    """out[T, n_out] through linear.matmul, as the engine calls it: the activation codes in views into wider
    buffers, out pre-filled with NaN so an unwritten element shows."""
    T, n_in = x.shape
    nb = n_in // QK
    acts = Activations(
        np.full((T, n_in + 64), 99, np.int8)[:, :n_in], np.full((T, nb + 7), np.nan, np.float32)[:, :nb],
        np.full((T, 2 * nb + 7), 99, np.int32)[:, : 2 * nb],
    )  # fmt: skip
    kernels.quantize_blocks(x, *acts)
    out = np.full((T, mat.n_out), np.nan, np.float32)
    matmul(mat, x, acts, out)
    return out


def test_every_supported_type_has_matmul_tests():
    """The types a model file may hold (quants.SUPPORTED_TYPES) are exactly those the matmul tests cover."""
    assert set(MATRIX_TYPES) == SUPPORTED_TYPES


@pytest.mark.parametrize("n_out, n_in", MATRIX_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", MATRIX_TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_oracle(qtype, n_out, n_in):
    """Quantized types against float64 of the dequantized weights times the dequantized activation codes (the
    product the integer dots define); dense types against float64 of x itself."""
    n_in = row_length(qtype, n_in)
    rng = np.random.default_rng([int(qtype), n_out, n_in])
    raw = random_matrix(qtype, n_out, n_in, rng)
    mat = QMatrix.from_raw("w", qtype, raw, n_in)
    assert (mat.n_out, mat.n_in) == (n_out, n_in)
    w64 = gguf_dequantize(raw, qtype).astype(np.float64)
    nb = n_in // QK
    # Per block: the exact integer dot, then at most three roundings (m * sx, the fma with d, the fma with dx);
    # then nb block adds. Dense: n_in products and adds. Plus 2u for gguf-py rounding d*q + m to float32 in the oracle.
    n_ops = nb + 6 if qtype in BLOCK_DTYPES else n_in + 2
    # A nibble-order bug (elements j and j+16 of every block swapped, i.e. high and low nibble exchanged; for
    # dense weights a layout bug of the same shape): the tolerance must reject it at nearly every output.
    # (Comparing tol with max|ref| instead is not a property of the bound: for n_in random-sign terms
    # |ref| ~ magnitude / sqrt(n_in), so that ratio drifts with n_in and the draw.)
    w64_bug = w64.reshape(n_out, nb, 2, QK // 2)[:, :, ::-1].reshape(n_out, n_in)
    for T in (1, 3, 5):
        x = activations(rng, T, n_in)
        got = run_matmul(mat, x)
        if qtype in BLOCK_DTYPES:
            xq, dx, _ = quantize_ref(x)
            x64 = (xq.reshape(T, nb, QK) * dx[..., None].astype(np.float64)).reshape(T, n_in)
        else:
            x64 = x.astype(np.float64)
        ref = x64 @ w64.T
        tol = n_ops * U * magnitude(qtype, raw, n_in, x)
        caught = np.mean(np.abs(x64 @ w64_bug.T - ref) > tol)
        assert caught >= 0.9, f"tolerance too loose: a nibble-order bug passes at {1 - caught:.0%} of outputs"
        assert_within(got, ref, tol, f"{qtype.name} {n_out}x{n_in} T={T}")


def fma32_emulated(a, b, c) -> np.ndarray:
    """Exactly rounded float32 a * b + c (IEEE fusedMultiplyAdd), elementwise in numpy.

    a * b of two float32 is exact in float64 (48 significant bits). The float64 sum p + c is made exact
    with TwoSum (s + e = p + c), then rounded to odd (if inexact and s is even, step to the neighbour towards
    e); rounding that to float32 is then correct, since 53 >= 24 + 2 bits (Boldo & Melquiond 2008). A plain
    float32(float64 fma) would round twice and miss ties (see test_fma32_emulation_is_exactly_rounded).
    """
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    fix = (e != 0) & ((s.view(np.int64) & 1) == 0)
    return np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s).astype(np.float32)


def exact_fma_f32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c in exact rational arithmetic, rounded once to the nearest float32 (ties to even)."""
    v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    f = np.float32(float(v))  # rounded twice, so at most one float32 ulp off: pick among f and its neighbours
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(cands, key=lambda y: (abs(Fraction(float(y)) - v), int(np.float32(y).view(np.uint32)) & 1))


def fma_test_triples(rng: np.random.Generator, n: int):
    """Random float32 (a, b, c): wide exponents, near-cancelling c = -a*b, and a*b within an ulp of half an
    ulp of c (where rounding p + c to float64 first lands on a float32 tie), plus one hand-made tie."""

    def wide(lo, hi):
        return (rng.standard_normal(n) * 2.0 ** rng.integers(lo, hi, n)).astype(np.float32)

    a1, b1, c1 = wide(-10, 10), wide(-10, 10), wide(-20, 20)
    a2, b2 = wide(-5, 5), wide(-5, 5)
    c2 = (-(a2.astype(np.float64) * b2)).astype(np.float32)
    c3 = wide(-3, 3)
    half_ulp = np.spacing(np.abs(c3)).astype(np.float64) / 2
    a3 = (half_ulp * (1 + 2.0**-23 * rng.integers(-3, 4, n))).astype(np.float32)
    b3 = (1 + 2.0**-23 * rng.integers(-3, 4, n)).astype(np.float32)
    # (1 + 2^-23) + 2^-24 (1 - 2^-46): just below a tie, but float64 rounds it onto the tie, which goes up
    a4, b4, c4 = np.float32(2.0**-24 * (1 + 2.0**-23)), np.float32(1 - 2.0**-23), np.float32(1 + 2.0**-23)
    a = np.concatenate([a1, a2, a3, [a4]]).astype(np.float32)
    b = np.concatenate([b1, b2, b3, [b4]]).astype(np.float32)
    c = np.concatenate([c1, c2, c3, [c4]]).astype(np.float32)
    return a, b, c


def test_fma32_emulation_is_exactly_rounded():
    a, b, c = fma_test_triples(np.random.default_rng(10), 1000)
    want = np.array([exact_fma_f32(*t) for t in zip(a, b, c)], np.float32)
    assert_bytes_equal(fma32_emulated(a, b, c), want, "fma32_emulated vs exact rational a*b+c")
    double_rounded = (a.astype(np.float64) * b + c).astype(np.float32)
    assert not np.array_equal(double_rounded.view(np.uint32), want.view(np.uint32)), "no tie cases in the test data"


@numba.njit(cache=False)
def _fma32_elementwise(a, b, c, out):
    for i in range(a.shape[0]):
        out[i] = fma32(a[i], b[i], c[i])


def test_kernel_fma32_is_exactly_rounded():
    """numerics.fma32 (llvm.fma.f32) is one rounding, as its docstring says: equal to the emulation."""
    a, b, c = fma_test_triples(np.random.default_rng(11), 20000)
    out = np.full_like(a, np.nan)
    _fma32_elementwise(a, b, c, out)
    assert_bytes_equal(out, fma32_emulated(a, b, c), "fma32 vs exactly rounded fma")


def emulate_matmul_f32(qtype: Q, raw: np.ndarray, n_in: int, x: np.ndarray) -> np.ndarray:
    """The documented order of the matmul kernels in float32 numpy: the block dots as exact integers, every
    + and * rounded (numpy never fuses), every fma exactly rounded (:func:`fma32_emulated`)."""
    f = np.float32
    T = x.shape[0]
    if qtype not in BLOCK_DTYPES:  # dense: acc = acc + w[r, k] * x[t, k], k left to right, from +0
        w = gguf_dequantize(raw, qtype)  # exact float32 values of F32/F16/BF16 weights
        acc = np.zeros((T, w.shape[0]), f)
        for k in range(n_in):
            acc = acc + w[None, :, k] * x[:, k, None]
        return acc
    S, dx, d, m, sx = quantized_terms(qtype, raw, n_in, x)  # S: dots of signed codes (z already subtracted)
    d = d.astype(f)
    acc = np.zeros((T, S.shape[1]), f)
    for b in range(S.shape[2]):  # blocks left to right
        if qtype == Q.Q6_K:  # u = fma(d_hi, float(hi), d_lo * float(lo))
            u = fma32_emulated(d[None, :, b, 1], S[:, :, b, 1].astype(f), d[None, :, b, 0] * S[:, :, b, 0].astype(f))
        elif m is None:  # u = d * float(lo + hi)
            u = d[None, :, b, 0] * S[:, :, b].sum(axis=2).astype(f)
        else:  # u = fma(d, float(lo + hi), m * float(s0 + s1))
            mx = m.astype(f)[None, :, b] * sx[:, b].sum(axis=1).astype(f)[:, None]
            u = fma32_emulated(d[None, :, b, 0], S[:, :, b].sum(axis=2).astype(f), mx)
        acc = fma32_emulated(dx[:, b, None], u, acc)  # acc = fma(dx, u, acc)
    return acc


@pytest.mark.parametrize("T", [1, 2, 3, 5], ids=lambda t: f"T{t}")  # decode; one pair; pair + odd; 2 pairs + odd
@pytest.mark.parametrize("qtype", MATRIX_TYPES, ids=lambda t: t.name)
def test_matmul_follows_documented_summation_order(qtype, T):
    """Bitwise equal to a float32 emulation of the order in the kernels' docstrings (part of the spec)."""
    n_out, n_in = 3 * R + 5, row_length(qtype, 576)  # a ragged last row group
    rng = np.random.default_rng([int(qtype) + 100, T])
    raw = random_matrix(qtype, n_out, n_in, rng)
    x = activations(rng, T, n_in)
    got = run_matmul(QMatrix.from_raw("w", qtype, raw, n_in), x)
    want = emulate_matmul_f32(qtype, raw, n_in, x)
    assert_bytes_equal(got, want, f"{qtype.name} T={T} vs documented order", axes=("token", "row"))


# f16 scale bits the kernels widen in vector registers: zeros, subnormals, the smallest and largest normals, ordinary
F16_EDGES = np.array([0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x83FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0x2E66], np.uint16)
_MATMUL_CASE = """
import sys
import numpy as np
from detinfer.compute import jit
from detinfer.compute.linear import Activations, matmul
from detinfer.model.weights import QMatrix
from gguf import GGMLQuantizationType
f = np.load(sys.argv[1])
mat = QMatrix.from_raw("w", GGMLQuantizationType(int(f["qtype"])), f["raw"], f["x"].shape[1])
out = np.empty((f["x"].shape[0], mat.n_out), np.float32)
matmul(mat, f["x"], Activations.of(f["x"]), out)
np.save(sys.argv[2], out)
print(jit.int_dot_tier())
"""


def _run_case_on(tmp_path: Path, cpu: str, jit_dir: Path) -> tuple[np.ndarray, str]:
    """Run tmp_path/case.npz through _MATMUL_CASE in a fresh process compiled for numba CPU ``cpu``:
    (output, the process's integer-dot tier)."""
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(jit_dir)}
    proc = subprocess.run([sys.executable, "-c", _MATMUL_CASE, str(tmp_path / "case.npz"), str(tmp_path / "out.npy")],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return np.load(tmp_path / "out.npy"), proc.stdout.strip()


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_matmul_widens_every_f16_scale_exactly(tmp_path, qtype):
    """The 32-element block types' f16 d and m reach the kernel as bits and are widened in it: on the host's
    tier (x86: F16C) and on the plain-IR tier (integer operations, compiled for numba's generic target in a fresh
    process and cache), scales that are zero, subnormal or the largest normals give the documented order's
    bytes. Control: flushing the subnormal scales to zero changes the expected bytes, so the data exercise them."""
    n_out, n_in, T = R + 5, 256, 3
    rng = np.random.default_rng(int(qtype) + 700)
    raw = random_matrix(qtype, n_out, n_in, rng)
    blocks = raw.reshape(-1).view(BLOCK_DTYPES[qtype])
    for field in ("d", "m") if qtype == Q.Q4_1 else ("d",):
        blocks[field] = rng.choice(F16_EDGES, blocks.shape).view(np.float16)
    x = activations(rng, T, n_in)
    want = emulate_matmul_f32(qtype, raw, n_in, x)
    assert_bytes_equal(run_matmul(QMatrix.from_raw("w", qtype, raw, n_in), x), want, f"{qtype.name} host tier")
    np.savez(tmp_path / "case.npz", qtype=int(qtype), raw=raw, x=x)
    got, tier = _run_case_on(tmp_path, "generic", tmp_path / "jit")
    assert tier == "generic"
    assert_bytes_equal(got, want, f"{qtype.name} plain-IR tier")
    bits = blocks["d"].view(np.uint16)
    blocks["d"][(bits & 0x7C00 == 0) & (bits & 0x3FF != 0)] = 0.0
    assert not np.array_equal(emulate_matmul_f32(qtype, raw, n_in, x).view(np.uint32), want.view(np.uint32))


@pytest.fixture(scope="module")
def pair_tier_jit(tmp_path_factory) -> Path:
    """One JIT cache for the module's processes compiled for haswell (the vpmaddubsw tier)."""
    return tmp_path_factory.mktemp("jit-haswell")


@pytest.mark.parametrize("qtype", [t for t in MATRIX_TYPES if t in BLOCK_DTYPES], ids=lambda t: t.name)
def test_matmul_exact_at_the_largest_codes(tmp_path, pair_tier_jit, qtype):
    """Every code at its largest magnitude (15, 31 or 63; Q8_0's -128) against activation codes of 127: the
    integer dots reach the bounds the kernels rely on (vpmaddubsw's int16 pair sums, added for several code
    words before one vpmaddwd), and still give the documented order's bytes, on the host's tier and on the
    vpmaddubsw tier (numba's haswell target, in a fresh process). Control: the data attain those bounds."""
    n_out, n_in, T = R + 5, row_length(qtype, 256), 2
    raw = random_matrix(qtype, n_out, n_in, np.random.default_rng(int(qtype) + 900))
    blocks = raw.reshape(-1).view(BLOCK_DTYPES[qtype])
    for field in {"qs", "ql", "qh"} & set(blocks.dtype.names):
        blocks[field] = -128 if qtype == Q.Q8_0 else 0xFF
    x = np.ones((T, n_in), np.float32)
    codes, _, _ = block_fields(qtype, raw, n_in)  # c - z: all bits set, less the zero point
    largest = {Q.Q4_0: 7, Q.Q4_1: 15, Q.Q4_K: 15, Q.Q5_0: 15, Q.Q5_1: 31, Q.Q5_K: 31, Q.Q6_K: 31, Q.Q8_0: 128}[qtype]
    assert np.all(quantize_ref(x)[0] == 127) and np.all(np.abs(codes) == largest)
    want = emulate_matmul_f32(qtype, raw, n_in, x)
    assert_bytes_equal(run_matmul(QMatrix.from_raw("w", qtype, raw, n_in), x), want, f"{qtype.name} host tier")
    np.savez(tmp_path / "case.npz", qtype=int(qtype), raw=raw, x=x)
    got, tier = _run_case_on(tmp_path, "haswell", pair_tier_jit)
    assert tier == "avx2"
    assert_bytes_equal(got, want, f"{qtype.name} vpmaddubsw tier")


@pytest.mark.parametrize("qtype", MATRIX_TYPES, ids=lambda t: t.name)
def test_matmul_chunk_equals_one_token_calls(qtype):
    n_out, n_in = 3 * R + 5, row_length(qtype, 576)
    rng = np.random.default_rng(int(qtype) + 200)
    mat = QMatrix.from_raw("w", qtype, random_matrix(qtype, n_out, n_in, rng), n_in)
    x = activations(rng, 5, n_in)
    singles = np.concatenate([run_matmul(mat, x[t : t + 1].copy()) for t in range(5)])
    for T in (2, 3, 4, 5):  # pairs only, and pairs plus the odd last token
        chunk = run_matmul(mat, x[:T])
        assert_bytes_equal(chunk, singles[:T], f"{qtype.name} T={T} chunk vs one-token calls", axes=("token", "row"))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_matmul_same_bytes_whatever_token_slices(qtype, monkeypatch):
    """A chunk cut into token slices (jobs of a row group and a run of tokens) gives the documented order's bytes,
    for even, uneven and empty last slices (21 tokens in 2, 3 or 8 runs of whole TOKENS)."""
    n_out, n_in, T = 2 * R + 3, row_length(qtype, 576), 21
    rng = np.random.default_rng(int(qtype) + 350)
    raw = random_matrix(qtype, n_out, n_in, rng)
    mat = QMatrix.from_raw("w", qtype, raw, n_in)
    x = activations(rng, T, n_in)
    want = emulate_matmul_f32(qtype, raw, n_in, x)
    for slices in (1, 2, 3, 8):
        monkeypatch.setattr(kernels, "token_slices", lambda n_groups, T, s=slices: s)
        assert_bytes_equal(run_matmul(mat, x), want, f"{qtype.name} {slices} token slices", axes=("token", "row"))


def test_token_slices_balance_the_threads(restore_threads):
    """Slices only where they even out the jobs: threads that do not divide the row groups, a long chunk."""
    two_threads_or_skip()
    numba.set_num_threads(2)
    assert kernels.token_slices(9, 512) == 2  # SmolLM2's 576 outputs: 9 groups
    assert kernels.token_slices(10, 512) == 1  # Gemma 3's 640: 5 + 5 already
    assert kernels.token_slices(9, 4 * kernels.TOKENS - 1) == kernels.token_slices(9, 1) == 1  # decode, short chunks
    numba.set_num_threads(1)
    assert kernels.token_slices(9, 512) == 1


# T=21 with an odd number of row groups: two threads split the chunk's tokens as well (slices of 12 and 9 tokens,
# the second with a tail of one), so both threads get the same number of (group, slice) jobs.
@pytest.mark.parametrize("T", [3, 21], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("qtype", MATRIX_TYPES, ids=lambda t: t.name)
def test_matmul_same_bytes_at_one_and_two_threads(qtype, T, restore_threads):
    two_threads_or_skip()
    n_out, n_in = 4 * R + 3, row_length(qtype, 576)  # 5 row groups, so two threads really split the work
    rng = np.random.default_rng(int(qtype) + 300)
    mat = QMatrix.from_raw("w", qtype, random_matrix(qtype, n_out, n_in, rng), n_in)
    x = activations(rng, T, n_in)
    numba.set_num_threads(1)
    one = run_matmul(mat, x)
    numba.set_num_threads(2)
    two = run_matmul(mat, x)
    assert_bytes_equal(two, one, f"{qtype.name} 2 threads vs 1", axes=("token", "row"))


# ---- block sums, rmsnorm, swiglu, add -----------------------------------------------------------------


def test_quantize_blocks_follows_its_definition_and_reconstructs_x():
    rng = np.random.default_rng(1)
    x = activations(rng, 5, 1536)
    x[1, 64:96] = 0.0  # an all-zero block: codes 0, scale 0
    x[2, 32:64] *= 1e-30  # tiny values: still 127 steps of the block's own scale
    x[3, 0] = np.inf  # non-finite blocks: codes 0, scale NaN (NaN outputs, as float arithmetic would give)
    x[4, 40] = np.nan
    a = Activations.of(x)
    xq, dx, sx = quantize_ref(x)
    assert_bytes_equal(a.dx, dx, "block scales vs their definition")
    assert np.array_equal(a.xq, xq) and np.array_equal(a.sx, sx), "codes or half sums differ from the definition"
    finite = np.isfinite(dx)
    assert not finite[3, 0] and not finite[4, 1] and finite.sum() == finite.size - 2
    assert dx[1, 2] == 0 and not xq[1, 64:96].any() and not xq[3, :32].any() and np.abs(xq).max() == 127
    # every finite element within half a step of its code (plus the rounding of x * inv), per block
    xb = x.reshape(5, -1, QK).astype(np.float64)
    err = np.abs(xb - xq.reshape(5, -1, QK) * dx[..., None].astype(np.float64))
    step = dx[..., None].astype(np.float64)
    assert (err[finite] <= (0.5 + 1e-5) * step[finite]).all()
    # negative control: codes rounded down instead of to nearest break the half-step bound
    with np.errstate(divide="ignore", invalid="ignore"):
        down = np.floor(xb * (127 / np.abs(xb).max(axis=2, keepdims=True)))
    assert not (np.abs(xb - down * step)[finite] <= (0.5 + 1e-5) * step[finite]).all()


def test_quantize_blocks_of_blocks_too_small_for_their_scale():
    # amax below 127 / FLT_MAX: inv = 127 / amax is inf, so nonzero x saturate at +-127 and 0 * inf (NaN) gets code 0
    x = np.zeros((1, 96), np.float32)
    x[0, :32] = np.float32(1e-45) * np.arange(-16, 16, dtype=np.float32)  # denormals and one zero: d underflows to 0
    x[0, 32:64] = np.float32(1e-38) * np.linspace(-1, 1, 32, dtype=np.float32)
    x[0, 64:96] = -0.0  # -0.0 everywhere: an all-zero block, scale 0
    a = Activations.of(x)
    xq, dx, sx = quantize_ref(x)
    assert_bytes_equal(a.dx, dx, "block scales vs their definition")
    assert np.array_equal(a.xq, xq) and np.array_equal(a.sx, sx), "codes or half sums differ from the definition"
    assert a.xq[0, 16] == 0 and (np.abs(a.xq[0, :16]) == 127).all() and dx[0, 0] == 0 and not a.xq[0, 64:].any()
    # negative control: without the NaN rule the reference's code for 0 * inf is not 0
    with np.errstate(invalid="ignore", over="ignore"):
        raw = np.clip(np.rint(x[0, :32] * (np.float32(127) / np.abs(x[0, :32]).max())), -127, 127)
    assert np.isnan(raw[16]) and not np.array_equal(raw, a.xq[0, :32])


def test_rmsnorm_matches_float64():
    rng = np.random.default_rng(2)
    n = 576
    x = activations(rng, 5, n)
    x[1] *= 50.0  # a large row
    x[2] = rng.standard_normal(n) * 3e-3  # mean(x^2) ~ 1e-5: eps = 1e-5 is half the denominator here
    x[3, :] = 0.0  # all zero: 0 * 1/sqrt(eps), no NaN
    w = (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)
    eps = np.float32(1e-5)
    out_buf = np.full((7, n), np.nan, np.float32)
    out = out_buf[1:6]  # a row slice, as the engine normalizes only the last rows before the output matrix
    kernels.rmsnorm(x, w, eps, out)
    x64 = x.astype(np.float64)
    scale = 1.0 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + np.float64(eps))
    ref = x64 * scale * w.astype(np.float64)
    # sum of squares: n roundings (relative, all terms positive), halved by sqrt; then ~6 more roundings
    assert_within(out, ref, (n / 2 + 8) * U * np.abs(ref), "rmsnorm")
    assert np.isnan(out_buf[[0, 6]]).all(), "rmsnorm wrote outside its output rows"


def test_swiglu_matches_float64():
    rng = np.random.default_rng(3)
    n_ff = 1536
    gate_up = (rng.standard_normal((5, 2 * n_ff)) * 3.0).astype(np.float32)
    gate_up[0, :8] = [-100.0, -89.0, -87.0, -20.0, 20.0, 89.0, 100.0, 0.0]  # expf overflow and saturation
    gate, up = gate_up[:, :n_ff], gate_up[:, n_ff:]
    out = np.full((5, n_ff), np.nan, np.float32)
    kernels.swiglu(gate_up, out)
    g, u = gate.astype(np.float64), up.astype(np.float64)
    ref = g / (1.0 + np.exp(-g)) * u
    # expf (< 1 ulp), 1 + e, the division and the product: a few roundings relative to the result; silu(g)
    # for g < -88.7 is g / inf = -0 in float32 while the exact value is below 1e-36.
    assert_within(out, ref, 8 * U * np.abs(ref) + 1e-30, "swiglu")


def test_add_inplace_is_correctly_rounded_sum():
    rng = np.random.default_rng(4)
    x = activations(rng, 5, 576)
    y = (rng.standard_normal((5, 576)) * 0.1).astype(np.float32)
    # float32 + float32 is exact in float64 unless the exponents are 29+ apart; then one rounding to float32
    want = (x.astype(np.float64) + y.astype(np.float64)).astype(np.float32)
    kernels.add_inplace(x, y)
    assert_bytes_equal(x, want, "add_inplace vs float32(float64 sum)")


# ---- RoPE ---------------------------------------------------------------------------------------------


def test_rope_table_is_float64_rounded_once():
    n_ctx, n_rot, base = 4096, 64, 100000.0
    cos, sin = kernels.rope_table(n_ctx, n_rot, base)
    assert cos.dtype == sin.dtype == np.float32 and cos.shape == sin.shape == (n_ctx, n_rot // 2)
    p = np.arange(n_ctx, dtype=np.float64)[:, None]
    angle = p * base ** (-2.0 * np.arange(n_rot // 2) / n_rot)
    for name, got, ref in (("cos", cos, np.cos(angle)), ("sin", sin, np.sin(angle))):
        # one rounding to float32 (half a float32 ulp), plus float64 slack for pow, p * f and libm's cos/sin
        # (angles up to 4096 rad): computing the angle in float32 would be off by ~1e-4 at the far end
        tol = 0.5 * np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64) + 8 * 2.0**-53 * (angle + 1.0)
        assert_within(got, ref, tol, f"rope_table {name}")


def test_rope_norm_rotates_adjacent_pairs():
    n_head, n_kv, hd = 9, 3, 64
    cos, sin = kernels.rope_table(4096, hd, 100000.0)
    rng = np.random.default_rng(5)
    positions = np.array([0, 1, 2, 17, 4095], np.int64)
    qkv = rng.standard_normal((5, (n_head + 2 * n_kv) * hd)).astype(np.float32)
    before = qkv.copy()
    q = qkv[:, : n_head * hd]  # a column view, as the engine rotates q and k inside the fused qkv buffer
    kernels.rope_norm(q, positions, n_head, hd, cos, sin)
    x = before[:, : n_head * hd].astype(np.float64).reshape(5, n_head, hd // 2, 2)
    c = cos[positions].astype(np.float64)[:, None, :]
    s = sin[positions].astype(np.float64)[:, None, :]
    ref = np.empty_like(x)
    ref[..., 0] = x[..., 0] * c - x[..., 1] * s  # llama.cpp "normal" mode: (x[2i], x[2i+1]) is one pair
    ref[..., 1] = x[..., 0] * s + x[..., 1] * c
    tol = 3 * U * (np.abs(x[..., 0]) + np.abs(x[..., 1]))[..., None]
    assert_within(q.reshape(5, n_head, hd // 2, 2), ref, np.broadcast_to(tol, ref.shape), "rope_norm")
    assert_bytes_equal(qkv[0, : n_head * hd], before[0, : n_head * hd], "rope at position 0 must be the identity")
    assert_bytes_equal(qkv[:, n_head * hd :], before[:, n_head * hd :], "rope_norm touched columns outside q")


# ---- KV cache and attention ---------------------------------------------------------------------------

N_HEAD, N_KV, HD, N_CTX = 9, 3, 64, 24
SCALE = np.float32(1.0 / np.sqrt(HD))


def new_cache(kv_type: str):
    dtype = np.float32 if kv_type == "f32" else np.uint16
    lut = F16_TO_F32 if kv_type == "f16" else np.zeros(1, np.float32)
    return np.zeros((N_KV, HD, N_CTX), dtype), np.zeros((N_KV, N_CTX, HD), dtype), lut


def kv_write(kc, vc, k, v, pos0, kernel=kernels.kv_write):
    """kernels.kv_write with K and V in one q|k|v-like buffer, a spare column before each as the engine's q is."""
    T, w = k.shape
    qkv = np.full((T, 2 * w + 2), np.nan, np.float32)
    qkv[:, 1 : 1 + w], qkv[:, 2 + w :] = k, v
    kernel(kc, vc, qkv, 1, 2 + w, pos0)


@pytest.mark.parametrize("kernel", [kernels.kv_write, kernels.kv_write_tokens], ids=lambda f: f.__name__)
@pytest.mark.parametrize("T", [1, 3, kernels.KV_TILE, N_CTX - 5])  # K is written in tiles of KV_TILE positions
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_kv_write_layout_and_rounding(kv_type, T, kernel):
    rng = np.random.default_rng(6)
    kc, vc, _ = new_cache(kv_type)
    k = (rng.standard_normal((T, N_KV * HD)) * 4).astype(np.float32)
    v = (rng.standard_normal((T, N_KV * HD)) * 4).astype(np.float32)
    pos0 = 5
    kv_write(kc, vc, k, v, pos0, kernel)
    kk = k.reshape(T, N_KV, HD)
    vv = v.reshape(T, N_KV, HD)
    want_k = kk.transpose(1, 2, 0)  # [n_kv, hd, T]: K is stored transposed
    want_v = vv.transpose(1, 0, 2)  # [n_kv, T, hd]
    if kv_type == "f16":
        want_k = want_k.astype(np.float16).view(np.uint16)  # round to nearest even, as numpy casts
        want_v = want_v.astype(np.float16).view(np.uint16)
    assert np.array_equal(kc[:, :, pos0 : pos0 + T], want_k), "K cache layout or rounding is wrong"
    assert np.array_equal(vc[:, pos0 : pos0 + T, :], want_v), "V cache layout or rounding is wrong"
    untouched = np.ones(N_CTX, bool)
    untouched[pos0 : pos0 + T] = False
    assert not kc[:, :, untouched].any() and not vc[:, untouched, :].any(), "kv_write wrote other positions"


def fill_cache(kv_type: str, rng: np.random.Generator, n: int):
    """A cache with K/V written at positions 0..n-1 and garbage (huge values) after, which the mask must skip."""
    kc, vc, lut = new_cache(kv_type)
    k = rng.standard_normal((N_CTX, N_KV * HD)).astype(np.float32)
    v = rng.standard_normal((N_CTX, N_KV * HD)).astype(np.float32)
    kv_write(kc, vc, k[:n], v[:n], 0)
    kv_write(kc, vc, np.full_like(k[n:], 1e4), np.full_like(v[n:], 1e4), n)
    return kc, vc, lut


def attention_oracle(q: np.ndarray, kc, vc, lut, pos0: int) -> np.ndarray:
    """float64 causal softmax attention with GQA from the values the cache holds; also returns the tolerance."""
    K = (lut[kc] if kc.dtype == np.uint16 else kc).astype(np.float64)  # [n_kv, hd, n_ctx]
    V = (lut[vc] if vc.dtype == np.uint16 else vc).astype(np.float64)  # [n_kv, n_ctx, hd]
    T = q.shape[0]
    qh = q.astype(np.float64).reshape(T, N_HEAD, HD)
    out = np.empty((T, N_HEAD, HD))
    tol = np.empty((T, N_HEAD, 1))
    group = N_HEAD // N_KV
    for t in range(T):
        n = pos0 + t + 1
        for h in range(N_HEAD):
            g = h // group
            s = (qh[t, h] @ K[g, :, :n]) * np.float64(SCALE)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, h] = p @ V[g, :n]
            # score error: hd products and adds, times scale; the softmax turns an absolute score error e
            # into a relative weight error of about 2e (4e both ways), plus n adds in z and in each output
            # sum, the division and expf's ulp; all relative to max|v|.
            ds = (HD + 2) * U * np.float64(SCALE) * (np.abs(qh[t, h]) @ np.abs(K[g, :, :n])).max()
            tol[t, h] = (4 * ds + (2 * n + 8) * U) * np.abs(V[g, :n]).max() * 1.5
    return out.reshape(T, N_HEAD * HD), np.broadcast_to(tol, (T, N_HEAD, HD)).reshape(T, N_HEAD * HD)


def run_attention(q, kc, vc, lut, pos0, heads_per_job=1):
    out = np.full(q.shape, np.nan, np.float32)
    kernels.attention(q, kc, vc, pos0, N_HEAD, SCALE, lut, out, 0, heads_per_job)
    return out


GROUP = N_HEAD // N_KV


@pytest.mark.parametrize("heads_per_job", [1, GROUP], ids=lambda h: f"heads{h}")
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("pos0, T", [(0, 1), (0, 5), (7, 1), (7, 3), (18, 5)])
def test_attention_matches_float64_oracle(kv_type, pos0, T, heads_per_job):
    rng = np.random.default_rng([pos0, T, len(kv_type)])
    kc, vc, lut = fill_cache(kv_type, rng, pos0 + T)
    q = (rng.standard_normal((T, N_HEAD * HD)) * 3).astype(np.float32)  # scores with std ~3: peaked softmax
    got = run_attention(q, kc, vc, lut, pos0, heads_per_job)
    ref, tol = attention_oracle(q, kc, vc, lut, pos0)
    v_max = np.abs(lut[vc] if kv_type == "f16" else vc)[:, : pos0 + T].max()
    assert tol.max() < 1e-3 * v_max, "tolerance too loose to catch anything"
    assert_within(got, ref, tol, f"attention {kv_type} pos0={pos0} T={T}")


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_attention_chunk_equals_one_token_calls(kv_type):
    """Prefill of a chunk (write all K/V, attend) equals decode (write one, attend one) at each position."""
    rng = np.random.default_rng(8)
    pos0, T = 6, 5
    kc, vc, lut = fill_cache(kv_type, rng, pos0)
    kc2, vc2 = kc.copy(), vc.copy()
    k = rng.standard_normal((T, N_KV * HD)).astype(np.float32)
    v = rng.standard_normal((T, N_KV * HD)).astype(np.float32)
    q = (rng.standard_normal((T, N_HEAD * HD)) * 3).astype(np.float32)
    kv_write(kc, vc, k, v, pos0)
    chunk = run_attention(q, kc, vc, lut, pos0, GROUP)  # as the engine runs chunks
    singles = []
    for t in range(T):
        kv_write(kc2, vc2, k[t : t + 1], v[t : t + 1], pos0 + t)
        singles.append(run_attention(q[t : t + 1].copy(), kc2, vc2, lut, pos0 + t))
    n = pos0 + T
    assert np.array_equal(kc[:, :, :n], kc2[:, :, :n]) and np.array_equal(vc[:, :n], vc2[:, :n]), "KV bytes differ"
    assert_bytes_equal(chunk, np.concatenate(singles), f"attention {kv_type}: chunk of {T} vs one-token calls")


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_attention_same_bytes_whatever_heads_per_job(kv_type):
    """A job attends with 1 or a whole group of query heads (one pass over the keys and values for all of them):
    every byte is the same. Control: one query element scaled by 1 + 2^-10 changes the output."""
    rng = np.random.default_rng(12)
    kc, vc, lut = fill_cache(kv_type, rng, 20)
    q = (rng.standard_normal((6, N_HEAD * HD)) * 3).astype(np.float32)
    one = run_attention(q, kc, vc, lut, 14)
    assert not np.isnan(one).any()
    assert_bytes_equal(run_attention(q, kc, vc, lut, 14, GROUP), one, f"attention {kv_type}: {GROUP} heads per job vs 1")
    nudged = q.copy()
    nudged[3, HD + 5] *= np.float32(1 + 2**-10)
    assert not np.array_equal(run_attention(nudged, kc, vc, lut, 14, GROUP).view(np.uint32), one.view(np.uint32))


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_attention_same_bytes_at_one_and_two_threads(kv_type, restore_threads):
    two_threads_or_skip()
    rng = np.random.default_rng(9)
    kc, vc, lut = fill_cache(kv_type, rng, 20)
    q = (rng.standard_normal((5, N_HEAD * HD)) * 3).astype(np.float32)
    numba.set_num_threads(1)
    one = run_attention(q, kc, vc, lut, 15, GROUP)
    numba.set_num_threads(2)
    two = run_attention(q, kc, vc, lut, 15, GROUP)
    assert_bytes_equal(two, one, f"attention {kv_type}: 2 threads vs 1")


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0", "F16"])  # the types the tiny-model writer fills with data
def test_matrix_repacked_in_slices_equals_one_repacked_whole(tmp_path, monkeypatch, qtype: str) -> None:
    """Weights repack a tensor SLICE_ROWS rows at a time into arrays allocated once; with slices of one row group
    (299 rows: 4 whole groups and a partial one) every array equals the whole tensor repacked at once."""
    mf = ModelFile(write_tiny_gguf(tmp_path / "m.gguf", matrix_type=qtype), use_index=False)
    monkeypatch.setattr(weights, "SLICE_ROWS", kernels.ROWS)
    name = "token_embd.weight"
    info = mf.tensor(name)
    sliced = weights._matrix(mf, name)
    whole = QMatrix.from_raw(name, info.ggml_type, mf.read_tensor(name), info.shape[1])
    assert info.shape[0] == 299 and (sliced.kind, sliced.n_out) == (whole.kind, whole.n_out)
    for a, b in zip(sliced.arrays, whole.arrays, strict=True):
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        else:
            assert a == b  # None (no such array) or the zero point


_COMPILES = """
import json, sys
import numpy as np
from numba.core.registry import CPUDispatcher
from detinfer.compute import kernels
from detinfer.compute.engine import Engine
from detinfer.compute.linear import Activations, matmul

def signatures():
    return {n: len(f.signatures) for n, f in vars(kernels).items() if isinstance(f, CPUDispatcher) and f.signatures}

e = Engine.load(sys.argv[1], n_ctx=256)
cache = e.new_cache()
logits = e.forward(list(range(1, 70)), cache)  # chunks of 64 and 5 tokens
e.forward([int(logits.argmax())], cache)  # one decode step
mats = [e.weights.output] + [m for layer in e.weights.layers
                             for p in (layer.attn_qkv, layer.attn_output, layer.ffn_gate_up, layer.ffn_down) for m in p.mats]
found = {"types": len({m.ggml_type for m in mats if m.kind == "q"}), "run": signatures()}
# negative control: codes in a non-contiguous view (rows of a wider buffer) are another layout, another compile
m = e.weights.output
wide = Activations.empty(2, 2 * m.n_in)
x = np.ones((2, m.n_in), np.float32)
view = Activations(wide.xq[:, : m.n_in], wide.dx[:, : m.n_in // kernels.QK], wide.sx[:, : m.n_in // 16])
kernels.quantize_blocks(x, *view)
matmul(m, x, view, np.empty((2, m.n_out), np.float32))
found["control"] = signatures()
print(json.dumps(found))
"""


@pytest.mark.parametrize("model", ["model_path", "gemma_path"])
def test_prefill_and_decode_compile_each_kernel_once(request, model: str) -> None:
    """Chunks and decode give every kernel arrays of one layout, so each compiles once (matmul_q once per weight
    type): a non-contiguous view where the other path passes a contiguous array is a second compile of seconds
    in a cold start. Counted in a fresh process that loads the kernels from the JIT cache (a compiling one also
    lists the signatures the *_tokens wrappers compile inside themselves); the first run fills the cache. The
    control passes one such view and must add a compile."""
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _COMPILES, str(request.getfixturevalue(model))],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout)
    run, control = found["run"], found["control"]
    assert run["matmul_q"] == found["types"] >= 2
    assert {n: c for n, c in run.items() if n != "matmul_q"} == dict.fromkeys(set(run) - {"matmul_q"}, 1)
    assert control["matmul_q"] == run["matmul_q"] + 1
