"""detinfer.numerics: own exp/log/sin/cos/pow of IEEE basic operations (the exhaustive scan is bench/numerics_accuracy.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import math

import numpy as np
import pytest
from numba import njit

from detinfer.compute.kernels import rope_table
from detinfer.compute.numerics import exp32, log32, sincos64


@njit(cache=True)
def _apply(fn_id, xs, out):
    for i in range(xs.shape[0]):
        out[i] = exp32(xs[i]) if fn_id == 0 else log32(xs[i])


def _run(fn_id: int, xs: np.ndarray) -> np.ndarray:
    out = np.empty_like(xs)
    _apply(fn_id, xs, out)
    return out


# every 4099th float32 bit pattern: ~10^6 inputs across every binade, both signs, subnormals, inf and NaN
GRID = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _correctly_rounded(fn, xs: np.ndarray) -> np.ndarray:
    """float64 libm value rounded once to float32: equal to the correctly rounded result for every input of this grid
    (bench/numerics_accuracy.py confirms it for all float32 inputs)."""
    with np.errstate(all="ignore"):
        return np.array([fn(float(x)) for x in xs], dtype=np.float64).astype(np.float32)


def test_exp32_is_correctly_rounded_on_the_grid():
    xs = GRID[np.isfinite(GRID) & (GRID >= -104) & (GRID <= 89)]
    assert xs.size > 400_000
    assert np.array_equal(_run(0, xs).view(np.uint32), _correctly_rounded(math.exp, xs).view(np.uint32))


def test_log32_is_correctly_rounded_on_the_grid():
    xs = GRID[np.isfinite(GRID) & (GRID > 0)]
    assert np.array_equal(_run(1, xs).view(np.uint32), _correctly_rounded(math.log, xs).view(np.uint32))


def test_special_values():
    inf, nan = np.float32(np.inf), np.float32(np.nan)
    e = _run(0, np.array([nan, inf, -inf, 0.0, -0.0, 88.72, 88.73, -103.97, -103.98, -1e30, 1e30], np.float32))
    assert np.isnan(e[0]) and e[1] == inf and e[2] == 0.0 and e[3] == 1.0 and e[4] == 1.0
    assert np.isfinite(e[5]) and e[6] == inf and e[7] == np.float32(2.0**-149) and e[8] == 0.0 and e[9] == 0.0 and e[10] == inf
    lg = _run(1, np.array([nan, inf, 0.0, -0.0, -1.0, 1.0, 2.0**-149], np.float32))
    assert np.isnan(lg[0]) and lg[1] == inf and lg[2] == -inf and lg[3] == -inf and np.isnan(lg[4]) and lg[5] == 0.0
    assert lg[6] == np.float32(-149 * math.log(2))


@pytest.mark.skipif(ctypes.util.find_library("m") is None, reason="no C libm to compare with")
def test_negative_control_glibc_expf_differs():
    """The old path (libm expf) is not what detinfer computes: the comparison above could fail."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    xs = GRID[np.isfinite(GRID) & (GRID >= -104) & (GRID <= 89)][::10]
    theirs = np.array([libm.expf(float(x)) for x in xs], np.float32)
    assert np.count_nonzero(theirs.view(np.uint32) != _run(0, xs).view(np.uint32)) > 0


def test_sincos64_against_libm():
    for a in [0.0, 1e-300, 0.5, 1.0, math.pi / 4, 3.0, 100.0, 12345.678, 131071.5]:
        s, c = sincos64(a)
        assert abs(s - math.sin(a)) <= 4e-16 * max(1.0, a / 1000) and abs(c - math.cos(a)) <= 4e-16 * max(1.0, a / 1000)


def test_rope_table_within_float32_rounding_of_libm():
    n_ctx, n_rot, base = 4096, 64, 10000.0
    cos, sin = rope_table(n_ctx, n_rot, base)
    p = np.arange(n_ctx, dtype=np.float64)[:, None]
    a = p * np.array([math.pow(base, -2.0 * i / n_rot) for i in range(n_rot // 2)])
    ref_c = np.array([[math.cos(v) for v in row] for row in a])
    ref_s = np.array([[math.sin(v) for v in row] for row in a])
    assert np.max(np.abs(cos - ref_c)) <= 2.0**-25 + 1e-12 and np.max(np.abs(sin - ref_s)) <= 2.0**-25 + 1e-12
