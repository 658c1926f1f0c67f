"""Accuracy of detinfer.numerics against float64 references (figures in docs/determinism.md).

    .venv/bin/python bench/numerics_accuracy.py [--quick]

- exp32 over every float32 x in [-104, 89] (below, exp rounds to 0; above, to +inf; the clamp is tested too),
  log32 over every positive finite float32: max error in float32 ulps of the reference and the count of results
  that are not correctly rounded. The reference is glibc's float64 exp/log, rounded once to float32; each result
  that differs from it is decided again with mpmath at 60 digits (so a double rounding of the reference is not
  counted against detinfer). Also the count that differs from glibc's float32 expf/logf (numerics 1).
- RoPE tables of both registry models (their n_ctx_train positions, every dim, every base): max absolute error of
  the float32 tables against the float64 glibc angle and sin/cos, and how many entries differ from numerics 1.

One thread, about 2 minutes; --quick samples every 97th float32 instead.
"""

from __future__ import annotations

import argparse
import math
import time

import mpmath as mp
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from detinfer.compute.kernels import rope_table
from detinfer.compute.numerics import exp32, log32, pow64, sincos64
from detinfer.model.config import ModelConfig
from detinfer.model.gguf_file import ModelFile
from detinfer.model.registry import resolve_model

MODELS = ("smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m")


@intrinsic
def _view32(typingctx, u):
    """The float32 whose bits are the uint32 ``u``."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@njit(cache=True)
def _ulp32(v):
    """Size of a float32 ulp at the float64 value v > 0 (2^-149 in the subnormal range)."""
    e = math.floor(math.log2(v))
    return 2.0 ** (max(e, -126) - 23)


@njit(cache=True)
def _scan(lo, hi, step, which):
    """Over float32 bit patterns lo..hi (every step-th): (max ulp error, count differing from f32(ref64),
    count differing from glibc float32, the differing inputs' bits up to 10^5)."""
    worst = 0.0
    n_ref = 0
    n_glibc = 0
    flagged = np.empty(100000, np.int64)
    for b in range(lo, hi + 1, step):
        x = _view32(np.uint32(b))
        if which == 0:
            ours = exp32(x)
            ref = math.exp(np.float64(x))
            old = math.exp(x)
        else:
            ours = log32(x)
            ref = math.log(np.float64(x))
            old = math.log(x)
        if ours != np.float32(ref):
            if n_ref < flagged.shape[0]:
                flagged[n_ref] = b
            n_ref += 1
        if ours != old:
            n_glibc += 1
        if ref != 0.0 and abs(ref) < 3.4028234663852886e38:
            err = abs(np.float64(ours) - ref) / _ulp32(abs(ref))
            worst = max(worst, err)
    return worst, n_ref, n_glibc, flagged[: min(n_ref, flagged.shape[0])]


def _not_correctly_rounded(flagged: np.ndarray, fn) -> int:
    """How many flagged inputs are really misrounded, decided at 60 digits."""
    mp.mp.dps = 60
    bad = 0
    for b in flagged:
        x = float(np.uint32(b).view(np.float32))
        exact = fn(mp.mpf(x))
        ours = float((exp32 if fn is mp.exp else log32)(np.float32(x)))
        up = float(np.nextafter(np.float32(ours), np.float32(np.inf)))
        down = float(np.nextafter(np.float32(ours), np.float32(-np.inf)))
        if abs(mp.mpf(up) - exact) < abs(mp.mpf(ours) - exact) or abs(mp.mpf(down) - exact) < abs(mp.mpf(ours) - exact):
            bad += 1
    return bad


def bits32(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


@njit(cache=True)
def _rope_errors(n_ctx, n_rot, base, cos32, sin32):
    """(max |table - float64 glibc|, max |detinfer float64 - glibc float64| before rounding, entries differing
    from numerics 1's tables)."""
    half = n_rot // 2
    worst32 = 0.0
    worst64 = 0.0
    n_old = 0
    for i in range(half):
        inv_ours = pow64(base, -2.0 * i / n_rot)
        inv_ref = math.pow(base, -2.0 * i / n_rot)
        for p in range(n_ctx):
            a = p * inv_ref
            c_ref, s_ref = math.cos(a), math.sin(a)
            s64, c64 = sincos64(p * inv_ours)
            worst32 = max(worst32, abs(np.float64(cos32[p, i]) - c_ref), abs(np.float64(sin32[p, i]) - s_ref))
            worst64 = max(worst64, abs(c64 - c_ref), abs(s64 - s_ref))
            n_old += (cos32[p, i] != np.float32(c_ref)) + (sin32[p, i] != np.float32(s_ref))
    return worst32, worst64, n_old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    step = 97 if ap.parse_args().quick else 1
    rows = []
    for name, fn, ranges in (
        ("exp32", mp.exp, [(bits32(0.0), bits32(89.0)), (bits32(-0.0), bits32(-104.0))]),
        ("log32", mp.log, [(1, bits32(3.4028234663852886e38))]),
    ):
        t0 = time.perf_counter()
        worst, n_ref, n_glibc, n_inputs, bad = 0.0, 0, 0, 0, 0
        for lo, hi in ranges:
            w, r, g, flagged = _scan(lo, hi, step, 0 if name == "exp32" else 1)
            worst, n_ref, n_glibc, n_inputs = max(worst, w), n_ref + r, n_glibc + g, n_inputs + (hi - lo) // step + 1
            bad += _not_correctly_rounded(flagged, fn)
        rows.append(f"| {name} | {n_inputs:,} | {worst:.6f} | {bad:,} | {n_ref:,} | {n_glibc:,} | {time.perf_counter() - t0:.0f} s |")
    print("| function | inputs | max error (ulp) | not correctly rounded | differ from f32(glibc f64) | differ from glibc f32 (numerics 1) | time |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| model | n_ctx_train x dims | base | max abs error of the float32 table | max abs difference from glibc in float64 (before rounding) | entries differing from numerics 1 |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        cfg = ModelConfig.from_model(ModelFile(resolve_model(model)))
        for base in sorted({cfg.rope_freq_base, cfg.rope_freq_base_swa}):
            cos32, sin32 = rope_table(cfg.n_ctx_train, cfg.head_dim, base)
            w32, w64, n_old = _rope_errors(cfg.n_ctx_train, cfg.head_dim, base, cos32, sin32)
            print(f"| {model} | {cfg.n_ctx_train} x {cfg.head_dim // 2} | {base:g} | {w32:.3g} | {w64:.3g} | {n_old:,} of {2 * cos32.size:,} |")


if __name__ == "__main__":
    main()
