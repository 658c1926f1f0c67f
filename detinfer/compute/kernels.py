"""Numba kernels of the forward pass, each with one fixed summation order.

Rules that make every output bit-identical across thread counts, prefill chunk sizes and runs
(measured facts in docs/determinism.md):

- ``prange`` runs only over independent outputs (row groups, heads x tokens), never over a sum.
- Every reduction is written out in the source in a fixed order (sequential, or a fixed number of partial sums
  combined in a fixed tree); no fastmath (LLVM never contracts or reassociates), no BLAS, no ``np.dot``.
- Fused multiply-adds appear only as explicit ``llvm.fma`` calls (one rounding on every target) and are part of
  the documented order: the quantized matmuls' block step uses its vector form (``llvm.fma.v16f32``).
- The quantized matmuls (:func:`matmul_q`) sum each block's products of integer codes exactly in int32, so the
  instructions that do it (VNNI, AVX2, plain IR: ``jit.int_dot_tier``) cannot move a bit; only the float steps
  after each block are ordered. Their matrices are repacked at load so that a group of ``ROWS`` output rows is
  stored k-major, and the vector instructions work *across rows*.
- A token's arithmetic never depends on how many other tokens share its chunk: prefill of n tokens computes,
  for every token, exactly the operations one-token decode does.
- ``exp`` and the RoPE tables' sin, cos and pow are detinfer's own (:mod:`detinfer.numerics`), made of IEEE basic
  operations only: no libm result reaches an output. Kernels that call ``exp32`` in a loop use numba's
  ``error_model="numpy"`` (no zero-divisor check, which would stop LLVM vectorizing; their divisors are >= 1).

Indexing goes through slices (``row = a[i]``, then ``row[r]`` with ``r`` from ``range``) so LLVM can see the
indices are non-negative and vectorize.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ..model.quants import QK, f32_to_f16_bits
from ..model.weights import ROWS
from . import jit
from .numerics import exp32, from_bits, log32, pow64, sincos64

# Benchmark only (detinfer.bench measures the cost of the contract): DETINFER_BENCH_FASTMATH=1, read once at import,
# compiles every kernel with fastmath, which breaks bit-identity. The bench worker gives it its own NUMBA_CACHE_DIR.
FASTMATH = os.environ.get("DETINFER_BENCH_FASTMATH") == "1"
if FASTMATH:
    if not os.environ.get("NUMBA_CACHE_DIR"):  # numba's cache key ignores flags: never share the default cache
        raise RuntimeError("DETINFER_BENCH_FASTMATH=1 needs its own NUMBA_CACHE_DIR (numba's cache ignores fastmath)")
    # Every flag but nnan/ninf: those let LLVM drop the zero-divisor checks' NaN cases (a NaN norm then raised
    # ZeroDivisionError in the Gemma 3 decode); what the contract forbids is reassociation and contraction.
    njit = functools.partial(njit, fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})

# ROWS output rows per repacked group, QK elements per block (detinfer/model/weights.py: the layout). Loops over rows
# take a runtime trip count: a compile-time one made LLVM unroll them into scalar code instead of vectorizing.
PREFETCH_BLOCKS = 4  # how many blocks ahead the weight stream is prefetched
KV_TILE = 16  # K positions written per transposed row at a time (one 64-byte line of float32)


def _prefetch_fn(builder):
    """llvm.prefetch(ptr, rw, locality, cache type): a hint, never a fault, even past the end of an array."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    return cgutils.get_or_insert_function(builder.module, fn, "llvm.prefetch.p0")


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Software prefetch of ``arr[idx]`` (llvm.prefetch, read, high locality): a hint that changes no result."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        i32 = ir.IntType(32)
        builder.call(_prefetch_fn(builder), [builder.bitcast(ptr, ir.IntType(8).as_pointer()), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(arr, types.intp), codegen


def _prefetch_rows(a, b):
    """Prefetch row ``b`` (if it exists) of a 2-D array, one hint per 64-byte line; ``a`` is one row group's
    quants ([nb, k*ROWS] bytes) or scales (float32 [nb, ROWS]), so row ``b`` is block ``b`` of the group.
    A no-op when ``a`` is None (a format without that array)."""


@overload(_prefetch_rows, inline="always")
def _prefetch_rows_impl(a, b):
    if isinstance(a, types.NoneType):
        return lambda a, b: None

    def impl(a, b):
        if b < a.shape[0]:
            row = a[b]
            step = 64 // row.itemsize
            for c in range(0, row.shape[0], step):
                _prefetch(row, c)

    return impl


def _sub(a, i):
    """``a[i]``, or None when ``a`` is None: the optional arrays of :func:`matmul_q` (chosen at compile time)."""


@overload(_sub, inline="always")
def _sub_impl(a, i):
    if isinstance(a, types.NoneType):
        return lambda a, i: None
    return lambda a, i: a[i]


# --- exact integer block dots (detinfer-numerics/3) -------------------------------------------------------
# The quantized matmuls multiply integer weight codes by integer activation codes (quantize_blocks) and sum
# each block's 16- or 32-term products exactly in int32, so the instructions that do it (and their order) cannot
# change a bit; jit.int_dot_tier picks them per compile target. Only the float steps after each block are ordered.

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat(builder, word, n):
    """An <n x i32> vector of one i32 ``word``."""
    v = builder.insert_element(ir.Constant(_vec(_I32, n), ir.Undefined), word, _I32(0))
    return builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, n), [0] * n))


def _x86(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


PAIR_TIERS = ("avx512bw", "avx2")  # integer-dot tiers of vpmaddubsw (int16 pair sums) + vpmaddwd (to int32)


def _sign_fix(builder, tier, a, b):
    """|a| and b * sign(a), byte-wise: the same products with an unsigned first operand (|a| <= 128). On the
    avx2 tier b * sign(a) is one vpsignb (0 where a is 0, whose products are 0 either way); AVX-512 has none."""
    bv = _vec(_I8, 4 * a.type.count)
    zero = ir.Constant(bv, [0] * bv.count)
    a8, b8 = builder.bitcast(a, bv), builder.bitcast(b, bv)
    neg = builder.icmp_signed("<", a8, zero)
    if tier == "avx2":
        return (builder.bitcast(builder.select(neg, builder.sub(zero, a8), a8), a.type),
                builder.bitcast(_x86(builder, "llvm.x86.avx2.psign.b", bv, [b8, a8]), b.type))  # fmt: skip
    return (builder.bitcast(builder.select(neg, builder.sub(zero, a8), a8), a.type),
            builder.bitcast(builder.select(neg, builder.sub(zero, b8), b8), b.type))  # fmt: skip


def _pairs(builder, tier, a, b):
    """vpmaddubsw: <2n x i16> sums of adjacent byte products a[2j] b[2j] + a[2j+1] b[2j+1], a unsigned, b signed
    bytes (saturating only beyond 2^15 - 1: the callers bound a so that it never does)."""
    n = a.type.count
    bv = _vec(_I8, 4 * n)
    ubs = "llvm.x86.avx512.pmaddubs.w.512" if tier == "avx512bw" else "llvm.x86.avx2.pmadd.ub.sw"
    return _x86(builder, ubs, _vec(_I16, 2 * n), [builder.bitcast(a, bv), builder.bitcast(b, bv)])


def _widen(builder, tier, pairs):
    """vpmaddwd with ones: <n x i32> sums of adjacent int16 lanes, exact."""
    wd = "llvm.x86.avx512.pmaddw.d.512" if tier == "avx512bw" else "llvm.x86.avx2.pmadd.wd"
    ones = ir.Constant(pairs.type, [1] * pairs.type.count)
    return _x86(builder, wd, _vec(_I32, pairs.type.count // 2), [pairs, ones])


def _dot4(builder, tier, acc, a, b, signed):
    """acc + the sum of 4 byte products per i32 lane: acc[l] + sum_i a[4l+i] * b[4l+i], exact (int32), with a
    unsigned bytes (signed=False: codes 0..63) or signed bytes (signed=True: -128..127), b signed bytes in
    -127..127, on the tiers without int16 pair sums ("vnni512" and plain IR; the PAIR_TIERS defer their
    vpmaddwd in :func:`_make_qblock`). acc, a, b: <n x i32>, n = 16."""
    n = acc.type.count
    bv = _vec(_I8, 4 * n)
    if signed:
        a, b = _sign_fix(builder, tier, a, b)
    if tier == "vnni512":
        return _x86(builder, "llvm.x86.avx512.vpdpbusd.512", acc.type, [acc, a, b])
    # plain IR: products in 16 bits (|a b| <= 128 * 127), then pairs and quads of lanes added in 32 bits
    w16 = _vec(_I16, 4 * n)
    p = builder.mul(builder.zext(builder.bitcast(a, bv), w16), builder.sext(builder.bitcast(b, bv), w16))
    half = [builder.sext(builder.shuffle_vector(p, p, ir.Constant(_vec(_I32, 2 * n), [2 * l + i for l in range(2 * n)])),
                         _vec(_I32, 2 * n)) for i in range(2)]  # fmt: skip
    pairs = builder.add(half[0], half[1])
    quad = [builder.shuffle_vector(pairs, pairs, ir.Constant(_vec(_I32, n), [2 * l + i for l in range(n)])) for i in range(2)]
    return builder.add(acc, builder.add(quad[0], quad[1]))


def _f16_to_f32(builder, tier, h):
    """<n x i16> float16 bits -> <n x float>, exact (every f16 value is a float32). The x86 tiers have F16C
    (``vcvtph2ps``); the plain-IR tier converts with integer operations so that no target needs a libcall:
    magnitude bits << 13 read as a float32 times 2^112 (exact for normal and subnormal f16), inf/NaN's exponent
    set to all ones, then the sign (as in F. Giesen's ``half_to_float``). A signalling NaN scale may come out
    quieted or not, which no output shows: the kernel's first multiply quiets it either way."""
    n = h.type.count
    vi, vf = _vec(_I32, n), _vec(ir.FloatType(), n)
    if tier != "generic":
        return builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), n)), vf)

    def const(v):
        return ir.Constant(vi, [v] * n)

    w = builder.zext(h, vi)
    mag = builder.shl(builder.and_(w, const(0x7FFF)), const(13))
    scaled = builder.bitcast(builder.fmul(builder.bitcast(mag, vf), ir.Constant(vf, [2.0**112] * n)), vi)
    special = builder.icmp_unsigned(">=", mag, const(0x7C00 << 13))
    bits = builder.select(special, builder.or_(mag, const(0x7F800000)), scaled)
    return builder.bitcast(builder.or_(bits, builder.shl(builder.and_(w, const(0x8000)), const(16))), vf)


def _make_qblock(nt):
    """An intrinsic qblock(qb, qhb, xb, at, db, hb, mb, z, dxs, sxs, sdb, smb): one block of a row group for ``nt``
    tokens, the whole per-block step of :func:`matmul_q` in vector registers. The weight vectors are loaded and
    unpacked once for all ``nt`` tokens; per token t and row r the exact integer dots lo = sum_{e<16} c[r, e]
    xq[t, e] and hi = sum_{e>=16} c[r, e] xq[t, e] (int32, |lo + hi| < 2^21), then at[t*ROWS + r] = fma(dx, u,
    at[t*ROWS + r]) with u as in :func:`matmul_q`.
    qb: one block of the row group: uint32 [4*ROWS] packed nibbles (byte i of word g*ROWS + r holds codes
    e = 4g + i in its low nibble and 16 + 4g + i in its high nibble, of row r), or int8 [32*ROWS] signed codes
    (byte i of word g*ROWS + r is code e = 4g + i of row r);
    qhb: None for 4-bit and signed codes; for 5- and 6-bit codes (0..63), the higher bits of the nibbles' codes:
    uint32 [ROWS] (bit 4) or [2, ROWS] (bits 4 and 5), plane p, word r: bit g of byte i holds bit 4 + p of code
    4g + i of row r, bit 4 + g that of code 16 + 4g + i (g, i < 4), so one shift and mask per plane and nibble
    word moves them onto the nibbles' bytes;
    xb: int8 [nt, 32] activation codes; at: float32 [nt*ROWS] accumulators; db, hb, mb: [ROWS] the block's d,
    d_hi (or None) and m (or None): float32, float16 bits (uint16, widened exactly by :func:`_f16_to_f32`), or
    integer sub-block scales (uint8, int8) when sdb (for d and d_hi) and smb (for m) give their super-block's
    float32 [ROWS] factor: d = sdb * float(db), exact; z: int zero point; dxs: float32 [nt] activation scales;
    sxs: int32 [nt, 2] the activation codes' half sums (rows of xb, dxs, sxs may be strided)."""

    @intrinsic
    def qblock(typingctx, qb, qhb, xb, at, db, hb, mb, z, dxs, sxs, sdb, smb):
        nibbles = qb.dtype == types.uint32
        signed = qb.dtype == types.int8
        planes = 0 if isinstance(qhb, types.NoneType) else qhb.ndim
        halves = not isinstance(hb, types.NoneType)
        offset = not isinstance(mb, types.NoneType)

        def codegen(context, builder, sig, args):
            tier = jit.int_dot_tier()
            n = 8 if tier == "avx2" else 16
            vi, vf = _vec(_I32, n), _vec(ir.FloatType(), n)
            arr = {i: context.make_array(sig.args[i])(context, builder, args[i])
                   for i in (0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11) if not isinstance(sig.args[i], types.NoneType)}

            def ptr(i, ty):
                return builder.bitcast(arr[i].data, ty.as_pointer())

            def row(i, t, ty):  # element pointer of row t of a strided array
                stride = cgutils.unpack_tuple(builder, arr[i].strides, arr[i].strides.type.count)[0]
                p = builder.gep(builder.bitcast(arr[i].data, _I8.as_pointer()), [builder.mul(stride, stride.type(t))])
                return builder.bitcast(p, ty.as_pointer())

            def vload(p, off, ty):
                return builder.load(builder.bitcast(builder.gep(p, [_I32(off)]), ty.as_pointer()), align=1)

            def scale(i, sup, r0):  # the float32 vector of block scales (d, d_hi or m) of rows r0 ..
                if sig.args[i].dtype == types.float32:
                    return vload(ptr(i, ir.FloatType()), r0, vf)
                if sig.args[i].dtype == types.uint16:
                    return _f16_to_f32(builder, tier, vload(ptr(i, _I16), r0, _vec(_I16, n)))
                ints = vload(ptr(i, _I8), r0, _vec(_I8, n))
                f = builder.sitofp(ints, vf) if sig.args[i].dtype.signed else builder.uitofp(ints, vf)
                return builder.fmul(vload(ptr(sup, ir.FloatType()), r0, vf), f)

            def splat_f(v):
                u = builder.insert_element(ir.Constant(vf, ir.Undefined), v, _I32(0))
                return builder.shuffle_vector(u, u, ir.Constant(vi, [0] * n))

            def const(v):
                return ir.Constant(vi, [v] * n)

            def move(w, src, dst):  # w's bits src of each byte to bits dst (other bits masked off)
                if dst > src:
                    w = builder.shl(w, const(dst - src))
                elif src > dst:
                    w = builder.lshr(w, const(src - dst))
                return builder.and_(w, const(0x01010101 << dst))

            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{n}f32")
            q, at = ptr(0, _I32), ptr(3, ir.FloatType())
            zi = builder.trunc(args[7], _I32) if args[7].type.width > 32 else args[7]
            xs, dx, s = [], [], []
            for t in range(nt):
                xt = row(2, t, _I32)
                xs.append([_splat(builder, builder.load(builder.gep(xt, [_I32(i)]), align=1), n) for i in range(8)])
                dx.append(splat_f(builder.load(row(8, t, ir.FloatType()))))
                st = row(9, t, _I32)
                s.append([builder.load(builder.gep(st, [_I32(h)])) for h in range(2)])
            mask = const(0x0F0F0F0F)
            n_acc = 2 if halves else 1
            # VNNI multiplies unsigned by signed bytes: signed codes c go in as c + 128 (one xor per weight vector,
            # shared by the nt tokens) and each accumulator starts at -128 times the sum of the activation codes
            # it covers, so it ends at the same exact integer as with _dot4's sign fix-up, which costs more.
            biased = signed and tier == "vnni512"

            def start(t, h):
                if not biased:
                    return const(0)
                covered = s[t][h] if halves else builder.add(*s[t])
                return _splat(builder, builder.mul(covered, _I32(-128)), n)

            starts = [[start(t, h) for h in range(n_acc)] for t in range(nt)]
            # vpmaddubsw tiers: the int16 pair sums of this many dots are added before one vpmaddwd widens them,
            # exact while their total stays below 2^15: 2 * 127 * (largest code) per dot, codes up to 15
            # (nibbles), 31 or 63 (one or two planes), 128 (signed codes, after the sign fix-up).
            largest = 128 if signed else (15, 31, 63)[planes]
            deferred = (2**15 - 1) // (2 * 127 * largest) if tier in PAIR_TIERS else 0

            def flush(t, h):
                total = pending[t][h][0]
                for p in pending[t][h][1:]:
                    total = builder.add(total, p)
                acc[t][h] = builder.add(acc[t][h], _widen(builder, tier, total))
                pending[t][h].clear()

            ahead = nt == 1 and PREFETCH_BLOCKS > 0

            def prefetch(i, off):  # byte ``off`` of arg i's block PREFETCH_BLOCKS on (a group's blocks are contiguous)
                size = builder.mul(arr[i].nitems, arr[i].itemsize)
                p = builder.gep(ptr(i, _I8), [builder.mul(size, size.type(PREFETCH_BLOCKS))])
                builder.call(_prefetch_fn(builder), [builder.gep(p, [_I32(off)]), _I32(0), _I32(3), _I32(1)])

            if ahead:  # the higher bits' and scales' lines first, the codes' a line set at a time between the loads
                for i in (1, 4, 5, 6):
                    if i in arr:
                        size = ROWS * max(1, planes if i == 1 else 1) * sig.args[i].dtype.bitwidth // 8
                        for off in range(0, size, 64):
                            prefetch(i, off)
            for r0 in range(0, ROWS, n):
                if ahead and r0 % 16 == 0:
                    for g in range(4 if nibbles else 8):
                        prefetch(0, 4 * (g * ROWS + r0))
                acc = [list(a) for a in starts]
                pending = [[[] for _ in range(n_acc)] for _ in range(nt)]
                high = [vload(ptr(1, _I32), p * ROWS + r0, vi) for p in range(planes)]
                for g in range(4 if nibbles else 8):
                    v = vload(q, g * ROWS + r0, vi)
                    if nibbles:
                        lo, hi = builder.and_(v, mask), builder.and_(builder.lshr(v, const(4)), mask)
                        for p, w in enumerate(high):
                            lo = builder.or_(lo, move(w, g, 4 + p))
                            hi = builder.or_(hi, move(w, 4 + g, 4 + p))
                        parts = ((0, g, lo), (1, 4 + g, hi))
                    else:
                        parts = ((g // 4, g, builder.xor(v, const(0x80808080)) if biased else v),)
                    for half, xg, codes in parts:
                        h = half if halves else 0
                        for t in range(nt):
                            if not deferred:
                                acc[t][h] = _dot4(builder, tier, acc[t][h], codes, xs[t][xg], signed and not biased)
                                continue
                            a, b = _sign_fix(builder, tier, codes, xs[t][xg]) if signed else (codes, xs[t][xg])
                            pend = pending[t][h]
                            pend.append(_pairs(builder, tier, a, b))
                            if len(pend) == deferred:
                                flush(t, h)
                for t in range(nt):
                    for h in range(n_acc):
                        if pending[t][h]:
                            flush(t, h)
                d = scale(4, 10, r0)
                dh = scale(5, 10, r0) if halves else None
                m = scale(6, 11, r0) if offset else None
                for t in range(nt):
                    s0, s1 = s[t]
                    if halves:  # u = fma(d_hi, float(hi - z s1), d * float(lo - z s0))
                        lo = builder.sub(acc[t][0], _splat(builder, builder.mul(zi, s0), n))
                        hi = builder.sub(acc[t][1], _splat(builder, builder.mul(zi, s1), n))
                        u = builder.call(fma, [dh, builder.sitofp(hi, vf), builder.fmul(d, builder.sitofp(lo, vf))])
                    elif offset:  # u = fma(d, float(lo + hi), m * float(s0 + s1))
                        ms = builder.fmul(m, splat_f(builder.sitofp(builder.add(s0, s1), ir.FloatType())))
                        u = builder.call(fma, [d, builder.sitofp(acc[t][0], vf), ms])
                    else:  # u = d * float(lo + hi - z (s0 + s1))
                        zs = _splat(builder, builder.mul(zi, builder.add(s0, s1)), n)
                        u = builder.fmul(d, builder.sitofp(builder.sub(acc[t][0], zs), vf))
                    pa = builder.bitcast(builder.gep(at, [_I32(t * ROWS + r0)]), vf.as_pointer())
                    builder.store(builder.call(fma, [dx[t], u, builder.load(pa, align=1)]), pa, align=1)
            return context.get_dummy_value()

        return types.none(qb, qhb, xb, at, db, hb, mb, z, dxs, sxs, sdb, smb), codegen

    return qblock


TOKENS = 4  # tokens per _qblock4 call in a chunk
_qblock4 = _make_qblock(TOKENS)
_qblock1 = _make_qblock(1)


MAGIC = np.float32(12582912.0)  # 1.5 * 2^23: (v + MAGIC) - MAGIC is float32 v rounded to an integer (ties to even), |v| < 2^22
Q8_MAX = np.float32(127.0)
INF_BITS = np.uint32(0x7F800000)  # the bits of float32 +inf


@intrinsic
def _abs_bits(typingctx, x):
    """The bits of |x| (float32) as uint32: for finite values they order as the values do; inf and NaN are the
    ones >= INF_BITS."""

    def codegen(context, builder, sig, args):
        return builder.and_(builder.bitcast(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 0x7FFFFFFF))

    return types.uint32(types.float32), codegen


@njit(cache=True)
def quantize_blocks(x, xq, dx, sx):
    """Activations to 8-bit block codes, the integer side of :func:`matmul_q` (as llama.cpp's ``quantize_row_q8_0``
    does for its CPU dot products, with ties to even and the scale's reciprocal rounded once).

    x: float32 [T, n] (n a multiple of 32); outputs per token t and block b of 32 elements:
    amax = max |x|; d = amax / 127 and inv = 127 / amax (float32, each rounded once; d = inv = 0 when amax = 0);
    xq[t, 32b + e] = clamp(round_half_even(x * inv), -127, 127) (int8 [T, n], x * inv rounded to float32 first);
    dx[t, b] = d (float32 [T, n // 32]); sx[t, 2b] and sx[t, 2b+1]: sums of the block's codes 0-15 and 16-31
    (int32 [T, n // 16]).
    A block holding inf or NaN gets codes 0 and d = NaN, so the products it feeds are NaN, as in float arithmetic.
    In a block of amax below 127 / FLT_MAX (~3.7e-37) inv is inf, so x * inv is +-inf (codes +-127) and 0 * inv NaN,
    which gets code 0.
    """
    if dx.shape[1] == 0:
        return
    # Unsigned indices (numba adds no negative-index wraparound for them) and QK read at run time (LLVM unrolled
    # constant 16- and 32-trip loops into scalar code): LLVM vectorizes every loop here, 0.5 ns per element.
    qk = np.uint64(x.shape[1] // dx.shape[1])
    for t in range(x.shape[0]):
        xt, qt, dt, st = x[t], xq[t], dx[t], sx[t]
        for b in range(dt.shape[0]):
            lo = np.uint64(b) * qk
            top = np.uint32(0)  # the largest |x| as bits: an integer max, which vectorizes where a float max cannot
            for e in range(lo, lo + qk):
                top = max(top, _abs_bits(xt[e]))
            if top >= INF_BITS:  # inf or NaN: x * 0 is NaN or 0, so every code is 0
                d, inv = np.float32(np.nan), np.float32(0.0)
            elif top == 0:
                d = inv = np.float32(0.0)
            else:
                amax = from_bits(top)
                d, inv = amax / Q8_MAX, Q8_MAX / amax
            dt[b] = d
            for e in range(lo, lo + qk):
                v = (xt[e] * inv + MAGIC) - MAGIC
                qt[e] = np.int8(min(max(v, -Q8_MAX), Q8_MAX)) if v == v else np.int8(0)  # NaN: no int8 (LLVM: poison)
            mid = lo + qk // np.uint64(2)
            s0 = s1 = np.int32(0)
            for e in range(lo, mid):
                s0 += np.int32(qt[e])
            for e in range(mid, lo + qk):
                s1 += np.int32(qt[e])
            st[2 * b], st[2 * b + 1] = s0, s1


def token_slices(n_groups: int, T: int) -> int:
    """Token slices per row group for :func:`matmul_q`: 1, or the thread count when the threads do not divide the
    row groups and the chunk has at least two TOKENS runs per thread. Then every thread gets the same number of
    jobs (SmolLM2's 9 groups of 576 outputs: 5 + 4 per thread caps 2 threads at 1.8x; 9 + 9 half groups do not),
    for one more pass over a group's weights per slice, which a chunk can afford. Bytes do not depend on it."""
    if T < 4 * TOKENS:
        return 1  # decode and short chunks: no call into the threading layer (~2 us)
    n_threads = get_num_threads()
    return n_threads if n_groups % n_threads and T >= 2 * TOKENS * n_threads else 1


@njit(cache=True, parallel=True)
def matmul_q(qs, qh, d, d_hi, m, z, d_super, m_super, xq, dx, sx, slices, out):
    """out[T, n_out] = x @ W.T for block-quantized weights (every GGUF type detinfer reads but F32/F16/BF16), from
    the activation codes of :func:`quantize_blocks` (xq int8 [T, n_in], dx float32 [T, nb], sx int32 [T, 2 nb]).

    Weights, per row and 32-element block: element e = d * (c_e - z) + m (ggml-quants.c ``dequantize_row_*``;
    weights.QMatrix gives each type's c, z, d, m), repacked for the integer dots (see :func:`_make_qblock`) as
    qs [G, nb, ...]: uint32 packed nibbles (the low 4 bits of 4-, 5- and 6-bit codes) or int8 (Q8_0's signed
    codes); qh: the 5- and 6-bit codes' higher bits, uint32 [G, nb, ROWS] or [G, nb, 2, ROWS] (planes of
    :func:`_make_qblock`; None for the other types); d [G, nb, ROWS] (for Q6_K the scale of elements 0-15 and
    d_hi that of 16-31, else d_hi None); m [G, nb, ROWS] or None; z: int zero point (0 with m). The scales keep
    the file's precision, so there are fewer bytes to stream, and are widened to float32 exactly in the kernel:
    the 32-element block types' f16 d and m as float16 bits (uint16); the k-quants' (Q4_K, Q5_K, Q6_K) integer
    sub-block scales as integers (uint8 sc, m; int8 for Q6_K) beside their 256-element super-block's float32
    factor, d_super [G, nb // 8, ROWS] for d and d_hi, m_super for m (else None): the block's
    d = d_super[g, b // 8] * float(d[g, b]), exact (an f16 times an 8-bit integer).
    Order per output (float32, fma = one rounding, ``llvm.fma``): per block b, the exact integers
    lo = sum_{e<16} c_e xq_e and hi = sum_{e>=16} c_e xq_e (in any order: they are exact), s0, s1 = sx[t, 2b],
    sx[t, 2b + 1], then
      u = fma(d, float(lo + hi), m * float(s0 + s1))        with an offset m (Q4_1, Q4_K, Q5_1, Q5_K),
      u = d * float(lo + hi - z (s0 + s1))                  one scale (Q4_0, Q5_0, Q8_0),
      u = fma(d_hi, float(hi - z s1), d * float(lo - z s0))  Q6_K,
    (every float() exact: its integer is below 2^21 in magnitude), and acc = fma(dx, u, acc), blocks left to
    right from acc = +0. Every token runs this same sequence, whatever T is and whichever job computes it.
    Parallel over jobs of (row group, token slice), never over a sum: the T tokens are cut into ``slices`` runs of
    whole TOKENS (:func:`token_slices`), and each job streams its group's weights once for its run.
    """
    G, nb = d.shape[0], d.shape[1]
    n_out, T = out.shape[1], xq.shape[0]
    per_slice = (T + slices - 1) // slices
    per_slice = (per_slice + TOKENS - 1) // TOKENS * TOKENS
    for job in prange(G * slices):
        g, t_lo = job // slices, job % slices * per_slice
        t_hi = min(T, t_lo + per_slice)
        row0 = g * ROWS
        n = min(ROWS, n_out - row0)
        qg, qhg, dg, hg, mg = qs[g], _sub(qh, g), d[g], _sub(d_hi, g), _sub(m, g)
        sdg, smg = _sub(d_super, g), _sub(m_super, g)
        acc = np.zeros(max(0, t_hi - t_lo) * ROWS, np.float32)
        for b in range(nb):
            if t_hi - t_lo >= TOKENS:  # _qblock1 prefetches its own rows, between its loads
                _prefetch_rows(qg, b + PREFETCH_BLOCKS)
                _prefetch_rows(qhg, b + PREFETCH_BLOCKS)
                _prefetch_rows(dg, b + PREFETCH_BLOCKS)
                _prefetch_rows(hg, b + PREFETCH_BLOCKS)
                _prefetch_rows(mg, b + PREFETCH_BLOCKS)
            qb, qhb, db, hb, mb = qg[b], _sub(qhg, b), dg[b], _sub(hg, b), _sub(mg, b)
            sdb, smb = _sub(sdg, b // 8), _sub(smg, b // 8)
            t = t_lo
            while t + TOKENS <= t_hi:
                a = (t - t_lo) * ROWS
                _qblock4(qb, qhb, xq[t : t + TOKENS, b * QK : b * QK + QK], acc[a : a + TOKENS * ROWS], db,
                         hb, mb, z, dx[t : t + TOKENS, b], sx[t : t + TOKENS, 2 * b : 2 * b + 2], sdb, smb)  # fmt: skip
                t += TOKENS
            while t < t_hi:
                a = (t - t_lo) * ROWS
                _qblock1(qb, qhb, xq[t : t + 1, b * QK : b * QK + QK], acc[a : a + ROWS], db, hb, mb, z,
                         dx[t : t + 1, b], sx[t : t + 1, 2 * b : 2 * b + 2], sdb, smb)  # fmt: skip
                t += 1
        for t in range(t_lo, t_hi):
            o = out[t, row0 : row0 + n]
            at = acc[(t - t_lo) * ROWS : (t - t_lo + 1) * ROWS]
            for r in range(n):
                o[r] = at[r]


@njit(cache=True, parallel=True)
def matmul_dense(w, x, out):
    """out[t, r] = sum over k of w[r, k] * x[t, k], k left to right (float32, rounded multiply then add),
    for F32/F16/BF16 weights.

    w: float32 [G, n_in, ROWS] (k-major row groups, exact f32 values of the stored weights);
    x: float32 [T, n_in]; out: float32 [T, n_out]. Parallel over row groups only.
    """
    G, n_in = w.shape[0], w.shape[1]
    n_out, T = out.shape[1], x.shape[0]
    for g in prange(G):
        row0 = g * ROWS
        n = min(ROWS, n_out - row0)
        wg = w[g]
        for t in range(T):
            o = out[t, row0 : row0 + n]
            for r in range(n):
                o[r] = np.float32(0.0)
        for k in range(n_in):
            wk = wg[k]
            for t in range(T):
                xk = x[t, k]
                o = out[t, row0 : row0 + n]
                for r in range(n):
                    o[r] += wk[r] * xk


@njit(cache=True)
def rmsnorm(x, w, eps, out):
    """RMSNorm (Zhang & Sennrich 2019): out[t] = x[t] * (1 / sqrt(mean(x[t]^2) + eps)) * w.

    x, out: float32 [T, n]; w: float32 [n]; eps: float32. Sum of squares left to right in float32; then
    each element is (x * scale) * w.
    """
    n = x.shape[1]
    for t in range(x.shape[0]):
        xt = x[t]
        ss = np.float32(0.0)
        for i in range(n):
            ss += xt[i] * xt[i]
        scale = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(n) + eps))
        ot = out[t]
        for i in range(n):
            ot[i] = (xt[i] * scale) * w[i]


def rope_table(n_ctx, n_rot, base):
    """cos/sin tables for RoPE (Su et al. 2021, RoFormer): angle[p, i] = p * base^(-2i / n_rot).

    Returns (cos, sin), float32 [n_ctx, n_rot // 2], filled by :func:`rope_fill`.
    """
    cos = np.empty((n_ctx, n_rot // 2), np.float32)
    sin = np.empty_like(cos)
    rope_fill(cos, sin, n_rot, base)
    return cos, sin


@njit(cache=True)
def rope_fill(cos, sin, n_rot, base):
    """Fill the RoPE tables cos, sin (float32 [n_ctx, n_rot // 2]) in place: inv_freq = pow64(base, -2i / n_rot),
    a = p * inv_freq, (sin a, cos a) by :func:`~detinfer.numerics.sincos64`, all in float64, each value rounded once
    to float32 (see :func:`rope_table`)."""
    for i in range(cos.shape[1]):
        inv_freq = pow64(base, -2.0 * i / n_rot)
        for p in range(cos.shape[0]):
            s, c = sincos64(p * inv_freq)
            cos[p, i] = c
            sin[p, i] = s


@njit(cache=True)
def rope_norm(x, positions, n_head, head_dim, cos, sin):
    """In-place RoPE, llama.cpp "normal" mode (adjacent pairs), as GGUF llama files expect.

    x: float32 [T, n_head * head_dim]; positions: int64 [T]; cos, sin: [n_ctx, head_dim // 2].
    For each head and pair i: (x0, x1) = (x[2i], x[2i+1]) -> (x0*c - x1*s, x0*s + x1*c).
    """
    for t in range(x.shape[0]):
        c = cos[positions[t]]
        s = sin[positions[t]]
        xt = x[t]
        for h in range(n_head):
            o = h * head_dim
            for i in range(head_dim // 2):
                x0 = xt[o + 2 * i]
                x1 = xt[o + 2 * i + 1]
                xt[o + 2 * i] = x0 * c[i] - x1 * s[i]
                xt[o + 2 * i + 1] = x0 * s[i] + x1 * c[i]


@njit(cache=True, error_model="numpy")
def gate_heads(x, qkv, n_head, head_dim):
    """In-place attention output gate (qwen35; llama.cpp qwen35.cpp build_layer_attn): x[t, h*hd + d] *=
    sigmoid(qkv[t, (2h + 1)*hd + d]), the gate half of head h's [q_h | gate_h] projection rows;
    sigmoid(g) = 1 / (1 + exp32(-g)). x: float32 [T, n_head * head_dim]; qkv: float32 [T, >= 2 n_head head_dim]."""
    for t in range(x.shape[0]):
        xt, gt = x[t], qkv[t]
        for h in range(n_head):
            for d in range(head_dim):
                g = gt[(2 * h + 1) * head_dim + d]
                xt[h * head_dim + d] *= np.float32(1.0) / (np.float32(1.0) + exp32(-g))


@njit(cache=True, parallel=True, error_model="numpy")
def delta_net(inp, conv_w, dt_bias, a, norm_w, conv_state, state, n_k_head, eps, out):
    """One Gated DeltaNet layer (Yang et al. 2024, "Gated Delta Networks"; llama.cpp src/models/qwen35.cpp,
    delta-net-base.cpp and ggml's ssm_conv / gated_delta_net) over the T tokens of one sequence, token by token, in
    place on that sequence's state: prefill runs exactly what decode runs, one token after another.

    inp: float32 [T, C + d_inner + 2 H], per token the projections q | k | v (C conv channels: n_k_head x head_k
    twice, then H x head_v), z (d_inner = H x head_v), b (H), a_in (H); conv_w: [C, K]; dt_bias, a: [H] (a stored
    as -exp(A_log)); norm_w: [head_v]; conv_state: [C, K - 1], the last K - 1 inputs, oldest first; state:
    [H, head_k, head_v], S_j[i, m] (key i, value m: HF's layout); out: float32 [T, d_inner]. Per token:
    y_c = silu(sum over i < K of win_i * conv_w[c, i]), win = (conv_state[c], x_c), i in increasing order, and
    conv_state[c] <- win[1:]; value head j reads q and k of key head j % n_k_head (llama.cpp's order) and
    divides each by max(||.||, eps); beta = sigmoid(b_j); g = softplus(a_in_j + dt_bias_j) * a_j with
    softplus(x) = x above 20, else log32(1 + exp32(x)); S_j *= exp32(g); d_m = (v_m - sum_i S_j[i, m] k_i) * beta;
    S_j[i, m] += d_m * k_i; o_m = (sum_i S_j[i, m] q_i) * (1 / sqrt(head_v)); out_j = rmsnorm(o) * norm_w *
    silu(z_j) (:func:`rmsnorm`'s order, eps). Every sum runs left to right in float32. Parallel over conv channels
    and over value heads (each owns its rows of the state) only: the same bytes at any thread count.
    """
    T, K = inp.shape[0], conv_w.shape[1]
    H, dv, dk = state.shape[0], state.shape[1], state.shape[2]
    C = conv_w.shape[0]
    key = n_k_head * dk
    zc, bc = C, C + H * dv
    scale = np.float32(1.0 / math.sqrt(dv))
    one = np.float32(1.0)
    y = np.empty(C, np.float32)
    for t in range(T):
        x = inp[t]
        for c in prange(C):
            w, st = conv_w[c], conv_state[c]
            acc = np.float32(0.0)
            for i in range(K - 1):
                acc += st[i] * w[i]
            acc += x[c] * w[K - 1]
            for i in range(K - 2):
                st[i] = st[i + 1]
            if K > 1:
                st[K - 2] = x[c]
            y[c] = acc / (one + exp32(-acc))
        for j in prange(H):
            kh = j % n_k_head
            qo, ko, vo = kh * dk, key + kh * dk, 2 * key + j * dv
            qn = np.float32(0.0)
            kn = np.float32(0.0)
            for i in range(dk):
                qn += y[qo + i] * y[qo + i]
                kn += y[ko + i] * y[ko + i]
            qs = one / max(np.float32(math.sqrt(qn)), eps)
            ks = one / max(np.float32(math.sqrt(kn)), eps)
            beta = one / (one + exp32(-x[bc + j]))
            u = x[bc + H + j] + dt_bias[j]
            g = (u if u > np.float32(20.0) else log32(one + exp32(u))) * a[j]
            decay = exp32(g)
            s = state[j]
            # i outer, m inner: every sum over i still runs in increasing i for each m, while the m lanes vectorize
            kv = np.zeros(dv, np.float32)
            for i in range(dk):
                ki, row = y[ko + i] * ks, s[i]
                for m in range(dv):
                    row[m] *= decay
                    kv[m] += row[m] * ki
            d = np.empty(dv, np.float32)
            for m in range(dv):
                d[m] = (y[vo + m] - kv[m]) * beta
            o = np.zeros(dv, np.float32)
            for i in range(dk):
                ki, qi, row = y[ko + i] * ks, y[qo + i] * qs, s[i]
                for m in range(dv):
                    row[m] += d[m] * ki
                    o[m] += row[m] * qi
            for m in range(dv):
                o[m] *= scale
            ss = np.float32(0.0)
            for m in range(dv):
                ss += o[m] * o[m]
            r = one / np.float32(math.sqrt(ss / np.float32(dv) + eps))
            ot = out[t]
            for m in range(dv):
                z = x[zc + j * dv + m]
                ot[j * dv + m] = ((o[m] * r) * norm_w[m]) * (z / (one + exp32(-z)))


@njit(cache=True, error_model="numpy")
def swiglu(gate_up, out):
    """SwiGLU (Shazeer 2020): out = silu(gate) * up with silu(g) = g / (1 + exp32(-g)); out float32 [T, n_ff],
    gate_up float32 [T, 2 n_ff], rows [gate | up] (the fused projection's output). One array, not its two column
    halves: a half's rows are strided, and numba's code for strided rows is scalar (5.7x slower, measured)."""
    n = out.shape[1]
    for t in range(out.shape[0]):
        gt, ut, ot = gate_up[t, :n], gate_up[t, n:], out[t]
        for i in range(n):
            g = gt[i]
            ot[i] = (g / (np.float32(1.0) + exp32(-g))) * ut[i]


@njit(cache=True)
def add_inplace(x, y):
    """x += y elementwise; float32 [T, n]."""
    for t in range(x.shape[0]):
        xt = x[t]
        yt = y[t]
        for i in range(xt.shape[0]):
            xt[i] += yt[i]


# --- KV cache storage: float32, or float16 kept as uint16 bits (numba has no float16 type) ---------------


def kv_load(a, i, lut):
    """Element ``i`` of a KV row as float32: ``a[i]``, or ``lut[a[i]]`` for float16 bits."""


@overload(kv_load, inline="always")
def _kv_load(a, i, lut):
    if a.dtype == types.uint16:
        return lambda a, i, lut: lut[a[i]]
    return lambda a, i, lut: a[i]


def kv_store(a, i, v):
    """Store float32 ``v`` at ``a[i]``, rounding to float16 (nearest even) when ``a`` holds float16 bits."""


@overload(kv_store, inline="always")
def _kv_store(a, i, v):
    if a.dtype == types.uint16:

        def impl(a, i, v):
            a[i] = f32_to_f16_bits(v)

        return impl

    def impl_f32(a, i, v):
        a[i] = v

    return impl_f32


@njit(cache=True)
def kv_write(k_cache, v_cache, qkv, k_col, v_col, pos0):
    """Append K and V of T tokens at positions pos0 .. pos0+T-1.

    k_cache: [n_head_kv, head_dim, n_ctx] (K stored transposed, so attention scores vectorize over positions);
    v_cache: [n_head_kv, n_ctx, head_dim]; both float32 or float16 bits (uint16). qkv: float32 [T, >= v_col +
    n_head_kv*head_dim], K in columns k_col.., V in columns v_col.. (the whole q|k|v buffer, so that a chunk and one
    token pass the same array type and the kernel compiles once).
    K is written KV_TILE positions of one transposed row at a time, not token by token: the rows lie n_ctx numbers
    apart (16 KB at n_ctx 4096, a power of two), so one token's n_head_kv x head_dim values fall in a few cache sets
    and evict each other, a miss per value; a tile fills whole lines. Serial: stores only.
    """
    n_kv, hd, T = k_cache.shape[0], k_cache.shape[1], qkv.shape[0]
    for t0 in range(0, T, KV_TILE):
        for g in range(n_kv):
            for dd in range(hd):
                row = k_cache[g, dd]
                for t in range(t0, min(T, t0 + KV_TILE)):
                    kv_store(row, pos0 + t, qkv[t, k_col + g * hd + dd])
    for t in range(T):
        for g in range(n_kv):
            vrow = v_cache[g, pos0 + t]
            for dd in range(hd):
                kv_store(vrow, dd, qkv[t, v_col + g * hd + dd])


@njit(cache=True, parallel=True, error_model="numpy")
def attention(q, k_cache, v_cache, pos0, n_head, scale, lut, out, window=0, heads_per_job=1):
    """Causal grouped-query attention of T query tokens at positions pos0.. against the KV cache.

    q: float32 [T, >= n_head*head_dim] (after RoPE), the queries in its first n_head*head_dim columns (the
    engine passes its whole q|k|v buffer: one C-contiguous layout for decode and chunks, so one compile);
    k_cache: [n_head_kv, head_dim, n_ctx]; v_cache: [n_head_kv, n_ctx, head_dim] (float32, or uint16 float16
    bits decoded through ``lut``); out: float32 [T, n_head*head_dim]. Query head h reads KV head
    h // (n_head / n_head_kv) (GQA, Ainslie et al. 2023).
    window: 0 for full causal attention; w > 0 for a sliding window, where the query at p sees key positions
    i with p - i < w (llama.cpp LLAMA_SWA_TYPE_STANDARD masks p - i >= n_swa).
    For query t at position p = pos0 + t and every visible key position i <= p, in increasing i:
    score_i = (sum over d of q_d * k_id, d left to right) * scale; m = max_i score_i;
    e_i = exp32(score_i - m); z = sum of e_i, i left to right; out_d = (sum of e_i * v_id, i left to right) / z.
    Parallel over (token, query heads) jobs only, ordered KV head by KV head, then token, then the query heads of
    the KV head's group, ``heads_per_job`` of them (a divisor of the group size) per job: one job reads its keys
    and values once for all its heads, while they are in the L1 cache. Every score and output keeps the order
    above whatever heads_per_job is (speed only: the engine takes whole groups for chunks, one head for decode,
    where a group per job would leave threads idle).
    """
    T = q.shape[0]
    n_kv, hd = k_cache.shape[0], k_cache.shape[1]
    group = n_head // n_kv
    hp = heads_per_job
    per_token = group // hp
    for job in prange(T * n_kv * per_token):
        g, t = job // (T * per_token), job // per_token % T
        h0 = g * group + job % per_token * hp
        p = pos0 + t
        lo = max(0, p - window + 1) if window > 0 else 0  # first visible key position
        n = p + 1 - lo
        qt = q[t]
        s = np.zeros((hp, n), np.float32)
        dd = 0
        while dd + 4 <= hd:  # four dimensions per pass over the scores, each still added in turn
            k0, k1 = k_cache[g, dd, lo:], k_cache[g, dd + 1, lo:]
            k2, k3 = k_cache[g, dd + 2, lo:], k_cache[g, dd + 3, lo:]
            for j in range(hp):
                o = (h0 + j) * hd + dd
                q0, q1, q2, q3 = qt[o], qt[o + 1], qt[o + 2], qt[o + 3]
                sj = s[j]
                for i in range(n):
                    sj[i] = (((sj[i] + q0 * kv_load(k0, i, lut)) + q1 * kv_load(k1, i, lut)) + q2 * kv_load(k2, i, lut)) + q3 * kv_load(k3, i, lut)
            dd += 4
        for d in range(dd, hd):
            krow = k_cache[g, d, lo:]
            for j in range(hp):
                qd = qt[(h0 + j) * hd + d]
                sj = s[j]
                for i in range(n):
                    sj[i] += qd * kv_load(krow, i, lut)
        z = np.empty(hp, np.float32)
        for j in range(hp):
            sj = s[j]
            mx = np.float32(-np.inf)
            for i in range(n):
                sj[i] = sj[i] * scale
                mx = max(mx, sj[i])
            for i in range(n):  # apart from the sum below, so it vectorizes
                sj[i] = exp32(sj[i] - mx)
            zj = np.float32(0.0)
            for i in range(n):
                zj += sj[i]
            z[j] = zj
        acc = np.zeros((hp, hd), np.float32)
        i = 0
        while i + 4 <= n:  # four positions per pass over the head's dimensions, each still added in turn
            v0, v1, v2, v3 = v_cache[g, lo + i], v_cache[g, lo + i + 1], v_cache[g, lo + i + 2], v_cache[g, lo + i + 3]
            for j in range(hp):
                e0, e1, e2, e3 = s[j, i], s[j, i + 1], s[j, i + 2], s[j, i + 3]
                aj = acc[j]
                for d in range(hd):
                    aj[d] = (((aj[d] + e0 * kv_load(v0, d, lut)) + e1 * kv_load(v1, d, lut)) + e2 * kv_load(v2, d, lut)) + e3 * kv_load(v3, d, lut)
            i += 4
        for i in range(i, n):
            vrow = v_cache[g, lo + i]
            for j in range(hp):
                e = s[j, i]
                aj = acc[j]
                for d in range(hd):
                    aj[d] += e * kv_load(vrow, d, lut)
        ot = out[t]
        for j in range(hp):
            o = (h0 + j) * hd
            for d in range(hd):
                ot[o + d] = acc[j, d] / z[j]


# --- Operators of other architectures (see detinfer/arch.py) ---------------------------------------------


@njit(cache=True)
def rope_neox(x, positions, n_head, head_dim, cos, sin):
    """In-place RoPE, llama.cpp "NeoX" mode (halves), as GGUF qwen2 / qwen3 / gemma3 files expect.

    x: float32 [T, n_head * head_dim]; positions: int64 [T]; cos, sin: [n_ctx, n_rot // 2] (:func:`rope_table`),
    n_rot = head_dim but for partial RoPE (qwen35), where dims n_rot.. of each head pass through unchanged.
    For each head and i < n_rot/2: (x0, x1) = (x[i], x[i + n_rot/2]) -> (x0*c - x1*s, x0*s + x1*c).
    """
    half = cos.shape[1]
    for t in range(x.shape[0]):
        c = cos[positions[t]]
        s = sin[positions[t]]
        xt = x[t]
        for h in range(n_head):
            o = h * head_dim
            for i in range(half):
                x0 = xt[o + i]
                x1 = xt[o + half + i]
                xt[o + i] = x0 * c[i] - x1 * s[i]
                xt[o + half + i] = x0 * s[i] + x1 * c[i]


@njit(cache=True)
def rmsnorm_heads(x, w, eps):
    """In-place RMSNorm of every head (query/key norm): x[t, h] = rmsnorm(x[t, h]) * w, in :func:`rmsnorm`'s order.

    x: float32 [T, n_head, head_dim] (a view of q or k); w: float32 [head_dim], shared by all heads.
    """
    for t in range(x.shape[0]):
        rmsnorm(x[t], w, eps, x[t])


@njit(cache=True)
def add_bias(x, b):
    """x[t] += b for every row t; x: float32 [T, n], b: float32 [n]."""
    for t in range(x.shape[0]):
        xt = x[t]
        for i in range(xt.shape[0]):
            xt[i] += b[i]


GELU_COEF_A = np.float32(0.044715)  # ggml-cpu vec.h, as in the tanh approximation (Hendrycks & Gimpel 2016)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)


@njit(cache=True, error_model="numpy")
def geglu(gate_up, out):
    """GeGLU (Shazeer 2020) with tanh-approximated GELU: out = gelu(gate) * up; out float32 [T, n_ff], gate_up
    float32 [T, 2 n_ff], rows [gate | up] (as :func:`swiglu`).

    gelu(g) = 0.5 g (1 + tanh(y)), y = sqrt(2/pi) * g * (1 + 0.044715 g^2) (ggml's ``gelu`` formula, HF
    "gelu_pytorch_tanh"). Computed as g / (1 + exp32(-2y)), which is the same function because
    0.5 (1 + tanh y) = 1 / (1 + e^-2y): it needs only detinfer's own exp (:func:`~detinfer.numerics.exp32`), no
    libm tanhf. Order: y = (C * g) * (1 + (A * g) * g) in float32, then (g / (1 + exp32(-(2 y)))) * up.
    """
    n = out.shape[1]
    for t in range(out.shape[0]):
        gt, ut, ot = gate_up[t, :n], gate_up[t, n:], out[t]
        for i in range(n):
            g = gt[i]
            y = (SQRT_2_OVER_PI * g) * (np.float32(1.0) + (GELU_COEF_A * g) * g)
            ot[i] = (g / (np.float32(1.0) + exp32(-(np.float32(2.0) * y)))) * ut[i]


# --- chunks: the per-token kernels above, run token by token in parallel -----------------------------------
# Tokens of a chunk are independent in these kernels, so each token runs exactly its one-token sequence (same
# bytes) on whichever thread. Decode (T = 1) calls the kernels above directly: a parallel launch per call would
# cost more than the work. One wrapper per kernel: numba's cache never reuses a function taking another as argument.


@njit(cache=True, parallel=True)
def quantize_blocks_tokens(x, xq, dx, sx):
    """:func:`quantize_blocks`, tokens in parallel."""
    for t in prange(x.shape[0]):
        quantize_blocks(x[t : t + 1], xq[t : t + 1], dx[t : t + 1], sx[t : t + 1])


@njit(cache=True, parallel=True)
def rmsnorm_tokens(x, w, eps, out):
    """:func:`rmsnorm`, tokens in parallel."""
    for t in prange(x.shape[0]):
        rmsnorm(x[t : t + 1], w, eps, out[t : t + 1])


@njit(cache=True, parallel=True)
def rmsnorm_heads_tokens(x, w, eps):
    """:func:`rmsnorm_heads`, tokens in parallel."""
    for t in prange(x.shape[0]):
        rmsnorm_heads(x[t : t + 1], w, eps)


@njit(cache=True, parallel=True)
def rope_norm_tokens(x, positions, n_head, head_dim, cos, sin):
    """:func:`rope_norm`, tokens in parallel."""
    for t in prange(x.shape[0]):
        rope_norm(x[t : t + 1], positions[t : t + 1], n_head, head_dim, cos, sin)


@njit(cache=True, parallel=True)
def rope_neox_tokens(x, positions, n_head, head_dim, cos, sin):
    """:func:`rope_neox`, tokens in parallel."""
    for t in prange(x.shape[0]):
        rope_neox(x[t : t + 1], positions[t : t + 1], n_head, head_dim, cos, sin)


@njit(cache=True, parallel=True)
def kv_write_tokens(k_cache, v_cache, qkv, k_col, v_col, pos0):
    """:func:`kv_write`, runs of KV_TILE tokens in parallel: each thread stores the K and V rows that it computed
    (RoPE splits a chunk's tokens among the threads in the same contiguous runs), read from its own cache."""
    for j in prange((qkv.shape[0] + KV_TILE - 1) // KV_TILE):
        t0 = j * KV_TILE
        kv_write(k_cache, v_cache, qkv[t0 : t0 + KV_TILE], k_col, v_col, pos0 + t0)


@njit(cache=True, parallel=True)
def swiglu_tokens(gate_up, out):
    """:func:`swiglu`, tokens in parallel."""
    for t in prange(out.shape[0]):
        swiglu(gate_up[t : t + 1], out[t : t + 1])


@njit(cache=True, parallel=True)
def geglu_tokens(gate_up, out):
    """:func:`geglu`, tokens in parallel."""
    for t in prange(out.shape[0]):
        geglu(gate_up[t : t + 1], out[t : t + 1])
