"""detinfer's own transcendentals: exp, log, sin, cos and pow made of IEEE-754 basic operations only.

Every function here is a fixed sequence of float64 +, -, x, / and explicit :func:`fma64` (``llvm.fma.f64``, one
rounding), integer operations and bit casts, in round-to-nearest. IEEE 754 defines each of those results exactly,
so the outputs are the same bits on every IEEE-754 machine, compiler target and library version; no libm
(glibc, macOS, musl, MSVC) is called, so none of their differences can reach logits, the KV cache, sampling or
logprobs. Compiled without fastmath always (the rounding trick and the range reductions rely on exact
evaluation order), also in the benchmark's fastmath build.

``NUMERICS`` names this arithmetic. It is recorded in manifests, golden records, session records and the
server's ``system_fingerprint``, and bumped whenever any output byte can move. Files without it were recorded
by ``detinfer-numerics/1`` (glibc ``expf``/``logf``/``pow``/``sin``/``cos``).

Accuracy (bench/numerics_accuracy.py, figures in docs/determinism.md): exp32 and log32 are within 0.5 ulp plus a
float64 evaluation error of about 2^-50 relative, so they are correctly rounded for all but a handful of inputs.
Coefficients: bench/numerics_coefficients.py.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

NUMERICS = "detinfer-numerics/3"
NUMERICS_1 = "detinfer-numerics/1"  # what a file without a numerics field was recorded with


def _llvm_fma(nbtype, irtype, name: str):
    """(signature, codegen) of an intrinsic a * b + c with one rounding: the LLVM intrinsic ``name``."""

    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(irtype, [irtype] * 3), name)
        return builder.call(fn, args)

    return nbtype(nbtype, nbtype, nbtype), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """float32 fused multiply-add a * b + c with one rounding (``llvm.fma.f32``).

    Exactly rounded by IEEE 754 on every target: one FMA instruction where the CPU has it, a correctly
    rounded libm ``fmaf`` otherwise; LLVM vectorizes it to vfmadd...ps. Never implicit: only written calls fuse.
    """
    return _llvm_fma(types.float32, ir.FloatType(), "llvm.fma.f32")


@intrinsic
def fma64(typingctx, a, b, c):
    """float64 fused multiply-add a * b + c with one rounding (``llvm.fma.f64``): an FMA instruction where the
    CPU has one, the correctly rounded software ``fma`` otherwise. Exact by IEEE 754 on every target."""
    return _llvm_fma(types.float64, ir.DoubleType(), "llvm.fma.f64")


@intrinsic
def from_bits(typingctx, i):
    """The float whose IEEE-754 bits are the integer ``i``: a float64 for a 64-bit integer, a float32 for a 32-bit
    one (a bitcast)."""
    if not isinstance(i, types.Integer) or i.bitwidth not in (32, 64):
        return None
    ftype, irtype = (types.float64, ir.DoubleType()) if i.bitwidth == 64 else (types.float32, ir.FloatType())

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], irtype)

    return ftype(i), codegen


@intrinsic
def _bits(typingctx, x):
    """The IEEE-754 bits of the float64 ``x`` as int64."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return types.int64(types.float64), codegen


ROUND = 6755399441055744.0  # 1.5 * 2^52: (x + ROUND) - ROUND is x rounded to the nearest integer (ties to even), |x| < 2^51
INV_LN2 = 1.4426950408889634  # 1 / ln 2, rounded to float64
LN2_HI = 0.6931471803691238  # ln 2 to 32 bits (fdlibm ln2_hi, 0x3FE62E42FEE00000): k * LN2_HI exact for |k| < 2^21
LN2_LO = 1.9082149292705877e-10  # ln 2 - LN2_HI, rounded (fdlibm ln2_lo)
LN2 = 0.6931471805599453  # ln 2, rounded to float64
SQRT2 = 1.4142135623730951

# exp(r) = 1 + r + r^2 Q(r), |r| <= ln2/2; Q highest degree first (bench/numerics_coefficients.py)
EXP32_Q = (2.761379555451986e-07, 2.7625102005388108e-06, 2.4801536409064087e-05, 0.0001984120875699232,
           0.0013888888905871347, 0.008333333353717156, 0.041666666666651364, 0.16666666666648303, 0.5)  # rel. 1.2e-15
EXP64_Q = (2.0914679376583935e-09, 2.510520637395701e-08, 2.7557273661348637e-07, 2.7557255425746435e-06,
           2.4801587325533363e-05, 0.00019841269874800493, 0.0013888888888883752, 0.008333333333326141,
           0.04166666666666667, 0.1666666666666667, 0.5)  # rel. 3.4e-19
# atanh series: log(m) = 2s + 2s z (1/3 + z/5 + ... + z^10/23), s = (m-1)/(m+1), z = s^2 <= 0.0295; 1/(2k+1) rounded
LOG_Q = tuple(1.0 / (2 * k + 1) for k in range(11, 0, -1))
# 1/n! rounded (n! < 2^53 is exact as a float): sin(r) = r + r z S(z), cos(r) = 1 + z C(z), z = r^2, |r| <= pi/4
SIN_S = tuple((-1.0) ** k / float(math.factorial(2 * k + 1)) for k in range(8, 0, -1))
COS_C = tuple((-1.0) ** k / float(math.factorial(2 * k)) for k in range(9, 0, -1))
TWO_OVER_PI = 0.6366197723675814
# pi/2 in three 33-bit parts and a tail (fdlibm e_rem_pio2.c): k * PIO2_n is exact for |k| < 2^20
PIO2_1 = 1.5707963267341256  # 0x3FF921FB54400000
PIO2_2 = 6.077100506303966e-11  # 0x3DD0B4611A600000
PIO2_3 = 2.0222662487111665e-21  # 0x3BA3198A2E000000
PIO2_3T = 8.478427660348229e-32  # pi/2 - PIO2_1 - PIO2_2 - PIO2_3, rounded


@njit(cache=True, error_model="numpy")
def _exp_reduced(xd, q):
    """exp(xd) for float64 |xd| <= 1000 as (1 + r + r^2 Q(r)) * 2^k: k = rint(xd / ln2), r = (xd - k LN2_HI) - k LN2_LO
    (Cody & Waite 1980), Q by Horner with fma64 from the highest coefficient, one final product by 2^k (exact when
    the result is a normal float64, which all callers guarantee). 2^k's bits are (bits(t) + 1023) << 52 with
    t = xd / ln2 + 1.5 * 2^52, whose low mantissa bits are k in two's complement."""
    t = xd * INV_LN2 + ROUND
    kd = t - ROUND
    r = (xd - kd * LN2_HI) - kd * LN2_LO
    p = q[0]
    for j in range(1, len(q)):
        p = fma64(p, r, q[j])
    e = fma64(r * r, p, r) + 1.0
    return e * from_bits((_bits(t) + 1023) << 52)  # t's low bits hold k: 2^k from integer ops, which vectorize


@njit(cache=True, error_model="numpy")
def exp32(x):
    """e^x of a float32, as float32, in float64 then rounded once: NaN -> NaN, x > 88.73 -> +inf, x < -103.98 -> 0.

    The argument is clamped to [-104, 89] first (exp(-104) rounds to 0 and exp(89) to +inf in float32, so the
    clamp changes no result); see :func:`_exp_reduced` for the order of operations.
    """
    if x != x:
        return x
    xd = np.float64(x)
    xd = 89.0 if xd > 89.0 else xd
    xd = -104.0 if xd < -104.0 else xd
    return np.float32(_exp_reduced(xd, EXP32_Q))


@njit(cache=True, error_model="numpy")
def log64(x):
    """Natural log of a positive normal finite float64: x = m 2^e with m in [sqrt(2)/2, sqrt(2)) from the bits,
    f = m - 1 (exact), s = f / (2 + f), z = s^2, log m = 2s + (2s z) LOG_Q(z) (atanh series, Horner with fma64),
    result e LN2_HI + (e LN2_LO + log m). About 1 ulp."""
    b = _bits(x)
    e = ((b >> 52) & 0x7FF) - 1023
    m = from_bits((b & 0xFFFFFFFFFFFFF) | (np.int64(1023) << 52))
    if m > SQRT2:
        m = m * 0.5
        e += 1
    f = m - 1.0
    s = f / (2.0 + f)
    z = s * s
    p = LOG_Q[0]
    for j in range(1, len(LOG_Q)):
        p = fma64(p, z, LOG_Q[j])
    s2 = s + s
    ed = np.float64(e)
    return ed * LN2_HI + (fma64(ed, LN2_LO, fma64(s2 * z, p, s2)))


@njit(cache=True, error_model="numpy")
def log32(x):
    """Natural log of a float32, as float32: :func:`log64` of the exact float64 value, rounded once.
    0 -> -inf, x < 0 or NaN -> NaN, +inf -> +inf."""
    if x != x or x < np.float32(0.0):
        return np.float32(np.nan)
    if x == np.float32(0.0):
        return np.float32(-np.inf)
    if x == np.float32(np.inf):
        return x
    return np.float32(log64(np.float64(x)))


@njit(cache=True, error_model="numpy")
def exp64(x):
    """e^x of a float64 with -700 <= x <= 700 (the result is a normal float64); about 1 ulp."""
    return _exp_reduced(x, EXP64_Q)


@njit(cache=True, error_model="numpy")
def pow64(b, y):
    """b^y = exp64(y * log64(b)) for positive normal b and |y log b| <= 700; float64, a few ulp."""
    return exp64(y * log64(b))


@njit(cache=True, error_model="numpy")
def sincos64(a):
    """(sin a, cos a) of a float64 with |a| < 2^19 pi: k = rint(a 2/pi), r = ((a - k PIO2_1) - k PIO2_2) - k PIO2_3
    - k PIO2_3T (fdlibm's medium reduction, each k PIO2_n exact), then Taylor polynomials of degree 17 (sin) and
    18 (cos) in z = r^2 by Horner with fma64, and the quadrant k mod 4."""
    kd = (a * TWO_OVER_PI + ROUND) - ROUND
    r = a - kd * PIO2_1
    r = r - kd * PIO2_2
    r = r - kd * PIO2_3
    r = r - kd * PIO2_3T
    z = r * r
    ps = SIN_S[0]
    for j in range(1, len(SIN_S)):
        ps = fma64(ps, z, SIN_S[j])
    pc = COS_C[0]
    for j in range(1, len(COS_C)):
        pc = fma64(pc, z, COS_C[j])
    s = fma64(r * z, ps, r)
    c = fma64(z, pc, 1.0)
    quadrant = np.int64(kd) & 3
    if quadrant == 0:
        return s, c
    if quadrant == 1:
        return c, -s
    if quadrant == 2:
        return -s, -c
    return -c, s
