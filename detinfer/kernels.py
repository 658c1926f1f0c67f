"""Numba kernels of the forward pass, each with one fixed summation order.

Rules that make every output bit-identical across thread counts, prefill chunk sizes and runs
(measured facts in docs/determinism.md):

- ``prange`` runs only over independent outputs (row groups, heads x tokens), never over a sum.
- Every reduction is written out in the source in a fixed order (sequential, or a fixed number of partial sums
  combined in a fixed tree); no fastmath (LLVM never contracts or reassociates), no BLAS, no ``np.dot``.
- Fused multiply-adds appear only as explicit :func:`fma32` calls (``llvm.fma.f32``, one rounding on every
  target) and are part of the documented order; the quantized matmuls use them.
- Quantized matrices are repacked at load so that a group of ``ROWS`` output rows is stored k-major: each
  output keeps its own documented order over k, and LLVM vectorizes *across rows*, which changes no bit.
- A token's arithmetic never depends on how many other tokens share its chunk: prefill of n tokens computes,
  for every token, exactly the operations one-token decode does.
- ``exp`` and the RoPE tables' sin, cos and pow are detinfer's own (:mod:`detinfer.numerics`), made of IEEE basic
  operations only: no libm result reaches an output. Kernels that call ``exp32`` in a loop use numba's
  ``error_model="numpy"`` (no zero-divisor check, which would stop LLVM vectorizing; their divisors are >= 1).

Indexing goes through slices (``row = a[i]``, then ``row[r]`` with ``r`` from ``range``) so LLVM can see the
indices are non-negative and vectorize. The one computed index, ``block[j * ROWS + r]`` in the quantized matmuls
(``j`` a constant of an unrolled loop, ``r`` from ``range``), is provably non-negative to LLVM, and its constant
offsets keep one base pointer where a 2-D ``block[j, r]`` kept 16-32 row pointers spilled on the stack.
"""

from __future__ import annotations

import functools
import math
import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .numerics import exp32, fma32, pow64, sincos64
from .quants import f32_to_f16_bits

# Benchmark only (detinfer.bench measures the cost of the contract): DETINFER_BENCH_FASTMATH=1, read once at import,
# compiles every kernel with fastmath, which breaks bit-identity. The bench worker gives it its own NUMBA_CACHE_DIR.
FASTMATH = os.environ.get("DETINFER_BENCH_FASTMATH") == "1"
if FASTMATH:
    if not os.environ.get("NUMBA_CACHE_DIR"):  # numba's cache key ignores flags: never share the default cache
        raise RuntimeError("DETINFER_BENCH_FASTMATH=1 needs its own NUMBA_CACHE_DIR (numba's cache ignores fastmath)")
    # Every flag but nnan/ninf: those let LLVM drop the zero-divisor checks' NaN cases (a NaN norm then raised
    # ZeroDivisionError in the Gemma 3 decode); what the contract forbids is reassociation and contraction.
    njit = functools.partial(njit, fastmath={"reassoc", "contract", "arcp", "nsz", "afn"})

ROWS = 64  # output rows per repacked group. The kernels index quants as block[j * ROWS + r] with this
# compile-time constant (one base pointer, constant offsets) but loop over rows with a runtime trip count: a
# compile-time trip count would make LLVM unroll the row loop into scalar code instead of vectorizing it.
QK = 32  # elements per block in Q4_0, Q4_1, Q8_0 (GGUF spec)
PREFETCH_BLOCKS = 2  # how many blocks ahead the weight stream is prefetched


@intrinsic
def _prefetch(typingctx, arr, idx):
    """Software prefetch of ``arr[idx]`` (llvm.prefetch, read, high locality): a hint that changes no result."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = builder.gep(ary.data, [args[1]])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(arr, types.intp), codegen


@intrinsic
def _lo4(typingctx, q):
    """float32(q & 15) for a uint8 ``q``, in 32-bit integers (numba would widen ``q & 15`` to 64 bits)."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.sitofp(builder.and_(builder.zext(args[0], i32), i32(15)), ir.FloatType())

    return types.float32(types.uint8), codegen


@intrinsic
def _hi4(typingctx, q):
    """float32(q >> 4) for a uint8 ``q``, in 32-bit integers."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        return builder.sitofp(builder.lshr(builder.zext(args[0], i32), i32(4)), ir.FloatType())

    return types.float32(types.uint8), codegen


@intrinsic
def _code5(typingctx, q, shift, h, bit):
    """float32(((q >> shift) & 15) | (((h >> bit) & 1) << 4)) for uint8 q, uint32 h, in 32-bit integers."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        nib = builder.and_(builder.lshr(builder.zext(args[0], i32), builder.trunc(args[1], i32)), i32(15))
        hi = builder.and_(builder.lshr(args[2], builder.trunc(args[3], i32)), i32(1))
        return builder.sitofp(builder.or_(nib, builder.shl(hi, i32(4))), ir.FloatType())

    return types.float32(types.uint8, types.intp, types.uint32, types.intp), codegen


@intrinsic
def _code6(typingctx, q, shift, h, bit):
    """float32((((q >> shift) & 15) | (((h >> bit) & 3) << 4)) - 32) for uint8 q and h, in 32-bit integers."""

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        nib = builder.and_(builder.lshr(builder.zext(args[0], i32), builder.trunc(args[1], i32)), i32(15))
        hi = builder.and_(builder.lshr(builder.zext(args[2], i32), builder.trunc(args[3], i32)), i32(3))
        return builder.sitofp(builder.sub(builder.or_(nib, builder.shl(hi, i32(4))), i32(32)), ir.FloatType())

    return types.float32(types.uint8, types.intp, types.uint8, types.intp), codegen


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
    """``a[i]``, or None when ``a`` is None: the optional arrays of :func:`matmul_nibbles` (chosen at compile time)."""


@overload(_sub, inline="always")
def _sub_impl(a, i):
    if isinstance(a, types.NoneType):
        return lambda a, i: None
    return lambda a, i: a[i]


def _codes(qb, hb, mb, r, j):
    """float32 codes of elements j, 8+j, 16+j, 24+j of row r in one block of :func:`matmul_nibbles`
    (qb: the block's bytes, hb: its high bits or None, mb: its offsets or None). The format follows from the
    types: hb and mb for 5-bit codes, mb alone for 4-bit codes, neither for Q6_K."""


@overload(_codes, inline="always")
def _codes_impl(qb, hb, mb, r, j):
    if not isinstance(hb, types.NoneType):  # 5-bit codes: bit e of hb[r] is bit 4 of element e

        def impl5(qb, hb, mb, r, j):
            q0 = qb[j * ROWS + r]
            q1 = qb[(8 + j) * ROWS + r]
            h = hb[r]
            return _code5(q0, 0, h, j), _code5(q1, 0, h, 8 + j), _code5(q0, 4, h, 16 + j), _code5(q1, 4, h, 24 + j)

        return impl5
    if isinstance(mb, types.NoneType):  # Q6_K: byte 16 + j holds bits 4-5 of elements j, 8+j, 16+j, 24+j

        def impl6(qb, hb, mb, r, j):
            q0 = qb[j * ROWS + r]
            q1 = qb[(8 + j) * ROWS + r]
            h = qb[(16 + j) * ROWS + r]
            return _code6(q0, 0, h, 0), _code6(q1, 0, h, 2), _code6(q0, 4, h, 4), _code6(q1, 4, h, 6)

        return impl6

    def impl4(qb, hb, mb, r, j):  # 4-bit codes
        q0 = qb[j * ROWS + r]  # elements j (low nibble) and j + 16 (high nibble)
        q1 = qb[(8 + j) * ROWS + r]  # elements 8 + j and 24 + j
        return _lo4(q0), _lo4(q1), _hi4(q0), _hi4(q1)

    return impl4


def _block_step(acc, db, mb, r, c0, c1, c2, c3, xs):
    """acc plus one block of row r from its four partial sums, in the order of :func:`matmul_nibbles`."""


@overload(_block_step, inline="always")
def _block_step_impl(acc, db, mb, r, c0, c1, c2, c3, xs):
    if isinstance(mb, types.NoneType):  # Q6_K: a scale per 16 elements, signed codes, no offset

        def impl_k6(acc, db, mb, r, c0, c1, c2, c3, xs):
            return fma32(db[ROWS + r], c2 + c3, fma32(db[r], c0 + c1, acc))

        return impl_k6

    def impl(acc, db, mb, r, c0, c1, c2, c3, xs):
        return acc + fma32(db[r], (c0 + c1) + (c2 + c3), mb[r] * xs)

    return impl


@njit(cache=True)
def block_sums(x, xsum):
    """Per-block sums of activations: xsum[t, b] = x[t, 32b] + x[t, 32b+1] + ... + x[t, 32b+31], left to right.

    x: float32 [T, n_in]; xsum: float32 [T, n_in // 32] (output). Used by Q4_0/Q4_1 products for the ``m`` term.
    """
    for t in range(x.shape[0]):
        xt = x[t]
        st = xsum[t]
        for b in range(st.shape[0]):
            acc = np.float32(0.0)
            for j in range(QK):
                acc += xt[b * QK + j]
            st[b] = acc


@njit(cache=True, parallel=True)
def matmul_nibbles(qs, qh, d, m, x, xsum, out):
    """out[T, n_out] = x @ W.T for weights stored as nibbles (plus high bits): Q4_0, Q4_1, Q4_K, Q5_1, Q5_K,
    Q6_K, in 32-element blocks (Q5_0 is widened to the Q8_0 kernel, see weights.QMatrix).

    qs: uint8 [G, nb, k*ROWS]: byte qs[g, b, j*ROWS + r] is byte j of block b of row g*ROWS + r; for j < 16 its
    low nibble is the low 4 bits of element j, its high nibble those of element j+16 (the GGUF Q4_0/Q4_1/Q5_0/
    Q5_1 layout, ggml-quants.c ``block_q4_1``; k-quants are re-laid into it at load). The high bits:
      - 4-bit codes (Q4_0, Q4_1, Q4_K): k = 16, qh None, code = nibble;
      - 5-bit codes (Q5_1, Q5_K): k = 16, qh uint32 [G, nb, ROWS], bit e of qh[g, b, r] is bit 4 of
        element e (the GGUF Q5_0 ``qh`` word);
      - 6-bit codes (Q6_K): k = 24, qh None, m None; byte 16 + j holds bits 4-5 of elements j, 8+j, 16+j, 24+j
        at bits 0-1, 2-3, 4-5, 6-7, and the code is q - 32 (signed). In qs rather than a separate array: a
        fourth array in the chunk loop stopped LLVM from vectorizing it (4-6x slower, measured).
    d: float32 [G, nb, ROWS] block scale (Q6_K: [G, nb, 2*ROWS], the scales of elements 0-15, then 16-31);
    m: float32 [G, nb, ROWS] block offset, or None for Q6_K. Element value = d * code + m, exactly: Q4_0 (d, -8 d),
    Q4_1 and Q5_1 (d, m), Q4_K and Q5_K sub-blocks (d * sc, -(dmin * m)), Q6_K (d * sc, code q - 32), as in
    ggml-quants.c ``dequantize_row_*`` (see quants.unpack_rows); x: float32 [T, nb*32]; xsum: float32 [T, nb] from
    :func:`block_sums`; out: float32 [T, n_out] with n_out <= G*ROWS (padding rows are not written).
    Order per output (float32, fma = one rounding, :func:`fma32`): per block, four partial sums over the
    elements e = 8k .. 8k+7 in increasing e, c_k = fma(q_e, x_e, c_k) from c_k = +0; then blocks left to right
    from acc = +0: acc = acc + fma(d, (c0 + c1) + (c2 + c3), m * xsum) when m is given, and for Q6_K
    acc = fma(d_hi, c2 + c3, fma(d_lo, c0 + c1, acc)). Parallel over row groups only.
    Chunks (T > 1) go two tokens at a time, sharing each code's conversion to float; every token still runs
    exactly the sequence above, so a chunk gives the bytes of one-token calls.
    """
    G, nb = d.shape[0], d.shape[1]
    n_out, T = out.shape[1], x.shape[0]
    for g in prange(G):
        row0 = g * ROWS
        n = min(ROWS, n_out - row0)
        qg, hg, dg, mg = qs[g], _sub(qh, g), d[g], _sub(m, g)
        if T == 1:  # decode: accumulate straight into out
            o = out[0, row0 : row0 + n]
            for r in range(n):
                o[r] = np.float32(0.0)
            for b in range(nb):
                _prefetch_rows(qg, b + PREFETCH_BLOCKS)
                _prefetch_rows(hg, b + PREFETCH_BLOCKS)
                _prefetch_rows(dg, b + PREFETCH_BLOCKS)
                _prefetch_rows(mg, b + PREFETCH_BLOCKS)
                qb, hb, db, mb = qg[b], _sub(hg, b), dg[b], _sub(mg, b)
                xb = x[0, b * QK : b * QK + QK]
                xs = xsum[0, b]
                for r in range(n):  # vectorized across rows; the j loop is unrolled (constant trip count)
                    c0 = np.float32(0.0)
                    c1 = np.float32(0.0)
                    c2 = np.float32(0.0)
                    c3 = np.float32(0.0)
                    for j in range(8):
                        f0, f1, f2, f3 = _codes(qb, hb, mb, r, j)  # elements j, 8 + j, 16 + j, 24 + j
                        c0 = fma32(f0, xb[j], c0)
                        c1 = fma32(f1, xb[8 + j], c1)
                        c2 = fma32(f2, xb[16 + j], c2)
                        c3 = fma32(f3, xb[24 + j], c3)
                    o[r] = _block_step(o[r], db, mb, r, c0, c1, c2, c3, xs)
            continue
        # Chunk: accumulators acc[t*ROWS + r] and the pair's activations xt[u*32 + e] live in local buffers, so
        # the vectorized row loop touches few distinct arrays (LLVM gives up above a few runtime alias checks).
        acc = np.zeros(T * ROWS, np.float32)
        xt = np.empty(2 * QK, np.float32)
        for b in range(nb):
            _prefetch_rows(qg, b + PREFETCH_BLOCKS)
            _prefetch_rows(hg, b + PREFETCH_BLOCKS)
            _prefetch_rows(dg, b + PREFETCH_BLOCKS)
            _prefetch_rows(mg, b + PREFETCH_BLOCKS)
            qb, hb, db, mb = qg[b], _sub(hg, b), dg[b], _sub(mg, b)
            t = 0
            while t + 2 <= T:
                xa = x[t, b * QK : b * QK + QK]
                xn = x[t + 1, b * QK : b * QK + QK]
                for e in range(QK):
                    xt[e] = xa[e]
                    xt[QK + e] = xn[e]
                sa = xsum[t, b]
                sn = xsum[t + 1, b]
                at = acc[t * ROWS : t * ROWS + 2 * ROWS]
                for r in range(n):
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    a3 = np.float32(0.0)
                    n0 = np.float32(0.0)
                    n1 = np.float32(0.0)
                    n2 = np.float32(0.0)
                    n3 = np.float32(0.0)
                    for j in range(8):
                        f0, f1, f2, f3 = _codes(qb, hb, mb, r, j)
                        a0 = fma32(f0, xt[j], a0)
                        a1 = fma32(f1, xt[8 + j], a1)
                        a2 = fma32(f2, xt[16 + j], a2)
                        a3 = fma32(f3, xt[24 + j], a3)
                        n0 = fma32(f0, xt[QK + j], n0)
                        n1 = fma32(f1, xt[QK + 8 + j], n1)
                        n2 = fma32(f2, xt[QK + 16 + j], n2)
                        n3 = fma32(f3, xt[QK + 24 + j], n3)
                    at[r] = _block_step(at[r], db, mb, r, a0, a1, a2, a3, sa)
                    at[ROWS + r] = _block_step(at[ROWS + r], db, mb, r, n0, n1, n2, n3, sn)
                t += 2
            if t < T:  # odd chunk: the last token alone
                xa = x[t, b * QK : b * QK + QK]
                sa = xsum[t, b]
                at = acc[t * ROWS : t * ROWS + ROWS]
                for r in range(n):
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    a3 = np.float32(0.0)
                    for j in range(8):
                        f0, f1, f2, f3 = _codes(qb, hb, mb, r, j)
                        a0 = fma32(f0, xa[j], a0)
                        a1 = fma32(f1, xa[8 + j], a1)
                        a2 = fma32(f2, xa[16 + j], a2)
                        a3 = fma32(f3, xa[24 + j], a3)
                    at[r] = _block_step(at[r], db, mb, r, a0, a1, a2, a3, sa)
        for t in range(T):
            o = out[t, row0 : row0 + n]
            at = acc[t * ROWS : t * ROWS + ROWS]
            for r in range(n):
                o[r] = at[r]


@njit(cache=True, parallel=True)
def matmul_q8_0(qs, d, x, out):
    """out[t, r] = sum over blocks b of d[r,b] * s[r,b,t] for Q8_0 weights (ggml-quants.c ``block_q8_0``), and
    Q5_0 weights widened to codes q - 16 (x = d * (q - 16), ggml-quants.c ``dequantize_row_q5_0``).

    qs: int8 [G, nb, 32*ROWS], qs[g, b, e*ROWS + r] = element e of block b of row g*ROWS + r; d: float32
    [G, nb, ROWS]; x: float32 [T, nb*32]; out: float32 [T, n_out].
    Order per output (float32, fma = one rounding): per block, four partial sums over e = 8k .. 8k+7 in
    increasing e, c_k = fma(q_e, x_e, c_k) from c_k = +0; s = (c0 + c1) + (c2 + c3); then blocks left to right
    from acc = +0: acc = fma(d, s, acc). Parallel over row groups only; every token runs this same sequence.
    """
    G, nb = d.shape[0], d.shape[1]
    n_out, T = out.shape[1], x.shape[0]
    for g in prange(G):
        row0 = g * ROWS
        n = min(ROWS, n_out - row0)
        qg, dg = qs[g], d[g]
        for t in range(T):
            o = out[t, row0 : row0 + n]
            for r in range(n):
                o[r] = np.float32(0.0)
        for b in range(nb):
            _prefetch_rows(qg, b + PREFETCH_BLOCKS)
            _prefetch_rows(dg, b + PREFETCH_BLOCKS)
            qb, db = qg[b], dg[b]
            for t in range(T):
                xb = x[t, b * QK : b * QK + QK]
                o = out[t, row0 : row0 + n]
                for r in range(n):
                    c0 = np.float32(0.0)
                    c1 = np.float32(0.0)
                    c2 = np.float32(0.0)
                    c3 = np.float32(0.0)
                    for j in range(8):
                        c0 = fma32(np.float32(qb[j * ROWS + r]), xb[j], c0)
                        c1 = fma32(np.float32(qb[(8 + j) * ROWS + r]), xb[8 + j], c1)
                        c2 = fma32(np.float32(qb[(16 + j) * ROWS + r]), xb[16 + j], c2)
                        c3 = fma32(np.float32(qb[(24 + j) * ROWS + r]), xb[24 + j], c3)
                    o[r] = fma32(db[r], (c0 + c1) + (c2 + c3), o[r])


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


@njit(cache=True)
def rope_table(n_ctx, n_rot, base):
    """cos/sin tables for RoPE (Su et al. 2021, RoFormer): angle[p, i] = p * base^(-2i / n_rot).

    Returns (cos, sin), float32 [n_ctx, n_rot // 2]: inv_freq = pow64(base, -2i / n_rot), a = p * inv_freq,
    (sin a, cos a) by :func:`~detinfer.numerics.sincos64`, all in float64, each value rounded once to float32.
    """
    half = n_rot // 2
    cos = np.empty((n_ctx, half), np.float32)
    sin = np.empty((n_ctx, half), np.float32)
    for i in range(half):
        inv_freq = pow64(base, -2.0 * i / n_rot)
        for p in range(n_ctx):
            s, c = sincos64(p * inv_freq)
            cos[p, i] = c
            sin[p, i] = s
    return cos, sin


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
def swiglu(gate, up, out):
    """SwiGLU (Shazeer 2020): out = silu(gate) * up with silu(g) = g / (1 + exp32(-g)); float32 [T, n_ff]."""
    for t in range(gate.shape[0]):
        gt = gate[t]
        ut = up[t]
        ot = out[t]
        for i in range(gt.shape[0]):
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
def kv_write(k_cache, v_cache, k, v, pos0):
    """Append K and V of T tokens at positions pos0 .. pos0+T-1.

    k_cache: [n_head_kv, head_dim, n_ctx] (K stored transposed, so attention scores vectorize over positions);
    v_cache: [n_head_kv, n_ctx, head_dim]; both float32 or float16 bits (uint16). k, v: float32 [T, n_head_kv*head_dim].
    """
    n_kv, hd = k_cache.shape[0], k_cache.shape[1]
    for t in range(k.shape[0]):
        p = pos0 + t
        for g in range(n_kv):
            for dd in range(hd):
                kv_store(k_cache[g, dd], p, k[t, g * hd + dd])
                kv_store(v_cache[g, p], dd, v[t, g * hd + dd])


@njit(cache=True, parallel=True, error_model="numpy")
def attention(q, k_cache, v_cache, pos0, n_head, scale, lut, out, window=0):
    """Causal grouped-query attention of T query tokens at positions pos0.. against the KV cache.

    q: float32 [T, n_head*head_dim] (after RoPE); k_cache: [n_head_kv, head_dim, n_ctx]; v_cache:
    [n_head_kv, n_ctx, head_dim] (float32, or uint16 float16 bits decoded through ``lut``); out: float32
    [T, n_head*head_dim]. Query head h reads KV head h // (n_head / n_head_kv) (GQA, Ainslie et al. 2023).
    window: 0 for full causal attention; w > 0 for a sliding window, where the query at p sees key positions
    i with p - i < w (llama.cpp LLAMA_SWA_TYPE_STANDARD masks p - i >= n_swa).
    For query t at position p = pos0 + t and every visible key position i <= p, in increasing i:
    score_i = (sum over d of q_d * k_id, d left to right) * scale; m = max_i score_i;
    e_i = exp32(score_i - m); z = sum of e_i, i left to right; out_d = (sum of e_i * v_id, i left to right) / z.
    Parallel over (token, head) pairs only.
    """
    T = q.shape[0]
    n_kv, hd = k_cache.shape[0], k_cache.shape[1]
    group = n_head // n_kv
    for job in prange(T * n_head):
        t = job // n_head
        h = job % n_head
        g = h // group
        p = pos0 + t
        lo = max(0, p - window + 1) if window > 0 else 0  # first visible key position
        n = p + 1 - lo
        qt = q[t]
        s = np.zeros(n, np.float32)
        dd = 0
        while dd + 4 <= hd:  # four dimensions per pass over the scores, each still added in turn
            q0, q1, q2, q3 = qt[h * hd + dd], qt[h * hd + dd + 1], qt[h * hd + dd + 2], qt[h * hd + dd + 3]
            k0, k1 = k_cache[g, dd, lo:], k_cache[g, dd + 1, lo:]
            k2, k3 = k_cache[g, dd + 2, lo:], k_cache[g, dd + 3, lo:]
            for i in range(n):
                s[i] = (((s[i] + q0 * kv_load(k0, i, lut)) + q1 * kv_load(k1, i, lut)) + q2 * kv_load(k2, i, lut)) + q3 * kv_load(k3, i, lut)
            dd += 4
        for d in range(dd, hd):
            qd = qt[h * hd + d]
            krow = k_cache[g, d, lo:]
            for i in range(n):
                s[i] += qd * kv_load(krow, i, lut)
        mx = np.float32(-np.inf)
        for i in range(n):
            s[i] = s[i] * scale
            mx = max(mx, s[i])
        for i in range(n):  # apart from the sum below, so it vectorizes
            s[i] = exp32(s[i] - mx)
        z = np.float32(0.0)
        for i in range(n):
            z += s[i]
        acc = np.zeros(hd, np.float32)
        i = 0
        while i + 4 <= n:  # four positions per pass over the head's dimensions, each still added in turn
            e0, e1, e2, e3 = s[i], s[i + 1], s[i + 2], s[i + 3]
            v0, v1, v2, v3 = v_cache[g, lo + i], v_cache[g, lo + i + 1], v_cache[g, lo + i + 2], v_cache[g, lo + i + 3]
            for d in range(hd):
                acc[d] = (((acc[d] + e0 * kv_load(v0, d, lut)) + e1 * kv_load(v1, d, lut)) + e2 * kv_load(v2, d, lut)) + e3 * kv_load(v3, d, lut)
            i += 4
        for j in range(i, n):
            e = s[j]
            vrow = v_cache[g, lo + j]
            for d in range(hd):
                acc[d] += e * kv_load(vrow, d, lut)
        ot = out[t]
        for dd in range(hd):
            ot[h * hd + dd] = acc[dd] / z


# --- Operators of other architectures (see detinfer/arch.py) ---------------------------------------------


@njit(cache=True)
def rope_neox(x, positions, n_head, head_dim, cos, sin):
    """In-place RoPE, llama.cpp "NeoX" mode (halves), as GGUF qwen2 / qwen3 / gemma3 files expect.

    x: float32 [T, n_head * head_dim]; positions: int64 [T]; cos, sin: [n_ctx, head_dim // 2] (:func:`rope_table`).
    For each head and i < head_dim/2: (x0, x1) = (x[i], x[i + head_dim/2]) -> (x0*c - x1*s, x0*s + x1*c).
    """
    half = head_dim // 2
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
def geglu(gate, up, out):
    """GeGLU (Shazeer 2020) with tanh-approximated GELU: out = gelu(gate) * up; float32 [T, n_ff].

    gelu(g) = 0.5 g (1 + tanh(y)), y = sqrt(2/pi) * g * (1 + 0.044715 g^2) (ggml's ``gelu`` formula, HF
    "gelu_pytorch_tanh"). Computed as g / (1 + exp32(-2y)), which is the same function because
    0.5 (1 + tanh y) = 1 / (1 + e^-2y): it needs only detinfer's own exp (:func:`~detinfer.numerics.exp32`), no
    libm tanhf. Order: y = (C * g) * (1 + (A * g) * g) in float32, then (g / (1 + exp32(-(2 y)))) * up.
    """
    for t in range(gate.shape[0]):
        gt = gate[t]
        ut = up[t]
        ot = out[t]
        for i in range(gt.shape[0]):
            g = gt[i]
            y = (SQRT_2_OVER_PI * g) * (np.float32(1.0) + (GELU_COEF_A * g) * g)
            ot[i] = (g / (np.float32(1.0) + exp32(-(np.float32(2.0) * y)))) * ut[i]
