"""Block formats of the GGML tensor types the engine supports: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
and the k-quants Q4_K, Q5_K, Q6_K (256-element super-blocks).

Each format is one pure numba function that turns one row's bytes into float32, following the block
layouts of ggml's ``ggml-common.h`` / ``ggml-quants.c`` (``dequantize_row_q4_0`` etc.) as restated in the
GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md). Results are bit-exact against
gguf-py's ``gguf.quants.dequantize``, which is the oracle in tests/test_quants.py. All multi-byte fields
are little-endian and read byte by byte, so rows need no alignment. Block and byte sizes are gguf's
``GGML_QUANT_SIZES``; they are not repeated here.

Float16 also has the reverse direction, ``f32_to_f16_bits``, for an f16 KV cache: round to nearest even,
bit-identical to numpy's float32 -> float16 cast for every input, NaNs included.

Compiled without fastmath: ``d * q + m`` stays a rounded multiply then a rounded add (never an FMA), as
in gguf-py. (ggml's C code may be contracted into FMA by its compiler; gguf-py is the reference here.)

The weight loader repacks the codes of the 5-bit formats (:func:`unpack_q5_codes`) and the k-quants' codes with
their integer sub-block scales (:func:`unpack_k_rows`) for the matmul kernels; dequantization and unpacking read
codes and scales through the same per-element helpers.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import njit

_F32 = int(GGMLQuantizationType.F32)
_F16 = int(GGMLQuantizationType.F16)
_BF16 = int(GGMLQuantizationType.BF16)
_Q8_0 = int(GGMLQuantizationType.Q8_0)
_Q4_0 = int(GGMLQuantizationType.Q4_0)
_Q4_1 = int(GGMLQuantizationType.Q4_1)
_Q5_0 = int(GGMLQuantizationType.Q5_0)
_Q5_1 = int(GGMLQuantizationType.Q5_1)
_Q4_K = int(GGMLQuantizationType.Q4_K)
_Q5_K = int(GGMLQuantizationType.Q5_K)
_Q6_K = int(GGMLQuantizationType.Q6_K)
QK = 32  # elements per block in Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (GGUF spec), and of the activation codes
QK_K = 256  # elements per k-quant super-block (ggml-common.h QK_K)


def _f16_table() -> np.ndarray:
    """float32 value of every float16 bit pattern, built with integer operations only.

    Exact IEEE widening: normals and subnormals exactly, +-0, +-inf, and NaNs with their sign and
    payload kept as is (not quieted), which is what numpy's own cast does; tests check the two agree
    on all 65536 patterns. Integer construction keeps the table independent of numpy's CPU dispatch.
    """
    h = np.arange(65536, dtype=np.uint32)
    sign = (h & 0x8000) << 16
    exp = (h >> 10) & 0x1F
    mant = h & 0x3FF
    bits = sign | ((exp + (127 - 15)) << 23) | (mant << 13)  # normal numbers: rebias the exponent
    bits = np.where(exp == 0x1F, sign | 0x7F800000 | (mant << 13), bits)  # inf and NaN
    table = bits.view(np.float32).copy()
    # zero and subnormals: mant * 2^-24, exact in float32 (an 11-bit integer times a power of two)
    sub = exp == 0
    table[sub] = mant[sub].astype(np.float32) * np.float32(2.0**-24)
    table[sub & (sign != 0)] *= np.float32(-1.0)  # keeps -0.0 negative
    table.setflags(write=False)
    return table


# F16_TO_F32[h] = float32 value of the float16 with bit pattern h; shape (65536,), float32, read-only.
F16_TO_F32: np.ndarray = _f16_table()


@njit(cache=True)
def f32_to_f16_bits(x):
    """IEEE binary16 bit pattern (uint16) of float32 ``x``, rounded to nearest, ties to even.

    Equals numpy's ``np.float32(x).astype(np.float16)`` bit for bit: values at or above 65520 in
    magnitude overflow to +-inf; results below 2^-14 become subnormals (exact ties go to even, so 2^-25
    becomes +-0); NaNs keep the sign and the top 10 payload bits, and a payload that would become zero is
    set to 1 so the result stays a NaN (numpy's rule; hardware F16C would quiet instead).
    Called from Python (not from njit code), numba unboxes x through a C double, which quiets a
    signalling NaN before this function sees it; f32_to_f16_array has no such step.
    """
    u = np.int64(np.float32(x).view(np.uint32))
    sign = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN
        payload = (a >> 13) & 0x3FF
        if payload == 0:
            payload = 1
        return np.uint16(sign | 0x7C00 | payload)
    if a >= 0x477FF000:  # >= 65520 = midway between 65504 (largest half) and 2^16: rounds to inf
        return np.uint16(sign | 0x7C00)
    if a >= 0x38800000:  # >= 2^-14: normal half; rebias the exponent, keep the top 10 mantissa bits
        h = (a >> 13) - ((127 - 15) << 10)
        rest = a & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and (h & 1) == 1):
            h += 1  # a carry out of the mantissa increments the exponent, which is correct
        return np.uint16(sign | h)
    e = a >> 23
    if e < 102:  # below 2^-25: rounds to zero
        return np.uint16(sign)
    # subnormal half: k * 2^-24 with k = significand * 2^(e - 126), shift in [14, 24]
    sig = (a & 0x7FFFFF) | 0x800000
    shift = 126 - e
    k = sig >> shift
    rest = sig & ((np.int64(1) << shift) - 1)
    half = np.int64(1) << (shift - 1)
    if rest > half or (rest == half and (k & 1) == 1):
        k += 1  # k may reach 0x400, the smallest normal half, which is correct
    return np.uint16(sign | k)


@njit(cache=True)
def f32_to_f16_array(src, dst):
    """dst[i] = f32_to_f16_bits(src[i]); src float32 (n,), dst uint16 (n,)."""
    if src.shape[0] != dst.shape[0]:
        raise ValueError("f32_to_f16_array: src and dst lengths differ")
    for i in range(src.shape[0]):
        dst[i] = f32_to_f16_bits(src[i])


@njit(cache=True)
def _u16(raw, o):
    """Little-endian uint16 at byte offset o of uint8 array raw, as int64."""
    return np.int64(raw[o]) | (np.int64(raw[o + 1]) << 8)


@njit(cache=True)
def dequant_row_f32(raw, out):
    """F32: out[i] = the little-endian float32 in raw[4i : 4i+4], bits copied unchanged.

    raw uint8 (4n,), out float32 (n,).
    """
    n = out.shape[0]
    if raw.shape[0] != 4 * n:
        raise ValueError("dequant_row_f32: raw must hold 4 bytes per output")
    for i in range(n):
        bits = _u16(raw, 4 * i) | (_u16(raw, 4 * i + 2) << 16)
        out[i] = np.uint32(bits).view(np.float32)


@njit(cache=True)
def dequant_row_f16(raw, out):
    """F16: out[i] = F16_TO_F32[little-endian uint16 at raw[2i]] (exact widening).

    raw uint8 (2n,), out float32 (n,).
    """
    n = out.shape[0]
    if raw.shape[0] != 2 * n:
        raise ValueError("dequant_row_f16: raw must hold 2 bytes per output")
    for i in range(n):
        out[i] = F16_TO_F32[_u16(raw, 2 * i)]


@njit(cache=True)
def dequant_row_bf16(raw, out):
    """BF16: out[i] = float32 with bits (little-endian uint16 at raw[2i]) << 16 (exact, NaNs kept).

    raw uint8 (2n,), out float32 (n,). Source: ggml_compute_bf16_to_fp32 in ggml-impl.h.
    """
    n = out.shape[0]
    if raw.shape[0] != 2 * n:
        raise ValueError("dequant_row_bf16: raw must hold 2 bytes per output")
    for i in range(n):
        out[i] = np.uint32(_u16(raw, 2 * i) << 16).view(np.float32)


@njit(cache=True)
def dequant_row_q8_0(raw, out):
    """Q8_0: 32-element blocks of 34 bytes: d (f16), then qs[32] (int8).

    out[32b + j] = q_j * d in float32, with d = F16_TO_F32[d]. raw uint8 (34 * n/32,), out float32 (n,),
    n a multiple of 32. Source: block_q8_0 / dequantize_row_q8_0 in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % 32 != 0 or raw.shape[0] != (n // 32) * 34:
        raise ValueError("dequant_row_q8_0: out length must be 32*k and raw length 34*k")
    for b in range(n // 32):
        o = 34 * b
        d = F16_TO_F32[_u16(raw, o)]
        for j in range(32):
            q = np.int64(raw[o + 2 + j])
            if q >= 128:
                q -= 256  # two's complement int8
            out[32 * b + j] = np.float32(q) * d


@njit(cache=True)
def dequant_row_q4_0(raw, out):
    """Q4_0: 32-element blocks of 18 bytes: d (f16), then qs[16], two 4-bit quants per byte.

    out[32b + j] = (q_j - 8) * d in float32, where q_j is the low nibble of qs[j] for j in 0..15 and the
    high nibble of qs[j - 16] for j in 16..31. raw uint8 (18 * n/32,), out float32 (n,), n a multiple of 32.
    Source: block_q4_0 / dequantize_row_q4_0 in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % 32 != 0 or raw.shape[0] != (n // 32) * 18:
        raise ValueError("dequant_row_q4_0: out length must be 32*k and raw length 18*k")
    for b in range(n // 32):
        o = 18 * b
        d = F16_TO_F32[_u16(raw, o)]
        for j in range(16):
            q = np.int64(raw[o + 2 + j])
            out[32 * b + j] = np.float32((q & 0x0F) - 8) * d
            out[32 * b + j + 16] = np.float32((q >> 4) - 8) * d


@njit(cache=True)
def dequant_row_q4_1(raw, out):
    """Q4_1: 32-element blocks of 20 bytes: d (f16), m (f16), then qs[16], two 4-bit quants per byte.

    out[32b + j] = (d * q_j) + m in float32 (a rounded product, then a rounded sum; no FMA), where q_j is
    the low nibble of qs[j] for j in 0..15 and the high nibble of qs[j - 16] for j in 16..31.
    raw uint8 (20 * n/32,), out float32 (n,), n a multiple of 32.
    Source: block_q4_1 / dequantize_row_q4_1 in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % 32 != 0 or raw.shape[0] != (n // 32) * 20:
        raise ValueError("dequant_row_q4_1: out length must be 32*k and raw length 20*k")
    for b in range(n // 32):
        o = 20 * b
        d = F16_TO_F32[_u16(raw, o)]
        m = F16_TO_F32[_u16(raw, o + 2)]
        for j in range(16):
            q = np.int64(raw[o + 4 + j])
            out[32 * b + j] = d * np.float32(q & 0x0F) + m
            out[32 * b + j + 16] = d * np.float32(q >> 4) + m


@njit(cache=True)
def _q5_code(raw, o, j):
    """5-bit code (0..31) of element j of the Q5_0/Q5_1 block whose qh starts at byte o: the low nibble of
    qs[j] (j < 16) or the high nibble of qs[j - 16], plus bit j of the little-endian uint32 qh as bit 4."""
    nib = (np.int64(raw[o + 4 + (j & 15)]) >> (4 * (j >> 4))) & 15
    return nib | (((np.int64(raw[o + (j >> 3)]) >> (j & 7)) & 1) << 4)


@njit(cache=True)
def dequant_row_q5_0(raw, out):
    """Q5_0: 32-element blocks of 22 bytes: d (f16), qh (uint32 LE, bit j = bit 4 of q_j), qs[16] as in Q4_0.

    out[32b + j] = (q_j - 16) * d in float32, q_j = (low or high nibble, as Q4_0) | (bit j of qh) << 4.
    raw uint8 (22 * n/32,), out float32 (n,), n a multiple of 32.
    Source: block_q5_0 / dequantize_row_q5_0 in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % 32 != 0 or raw.shape[0] != (n // 32) * 22:
        raise ValueError("dequant_row_q5_0: out length must be 32*k and raw length 22*k")
    for b in range(n // 32):
        o = 22 * b
        d = F16_TO_F32[_u16(raw, o)]
        for j in range(32):
            out[32 * b + j] = np.float32(_q5_code(raw, o + 2, j) - 16) * d


@njit(cache=True)
def dequant_row_q5_1(raw, out):
    """Q5_1: 32-element blocks of 24 bytes: d (f16), m (f16), qh (uint32 LE), qs[16]; codes as in Q5_0.

    out[32b + j] = (d * q_j) + m in float32 (rounded product, then rounded sum; no FMA).
    raw uint8 (24 * n/32,), out float32 (n,), n a multiple of 32.
    Source: block_q5_1 / dequantize_row_q5_1 in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % 32 != 0 or raw.shape[0] != (n // 32) * 24:
        raise ValueError("dequant_row_q5_1: out length must be 32*k and raw length 24*k")
    for b in range(n // 32):
        o = 24 * b
        d = F16_TO_F32[_u16(raw, o)]
        m = F16_TO_F32[_u16(raw, o + 2)]
        for j in range(32):
            out[32 * b + j] = d * np.float32(_q5_code(raw, o + 4, j)) + m


@njit(cache=True)
def _k_sc_m(raw, o, i):
    """The 6-bit integers (sc_i, m_i) of sub-block i (0..7) of the Q4_K/Q5_K super-block at byte o, packed in the
    12 bytes at o+4 (ggml-quants.c ``get_scale_min_k4``)."""
    s = o + 4
    if i < 4:
        return raw[s + i] & 63, raw[s + i + 4] & 63
    return (raw[s + i + 4] & 15) | ((raw[s + i - 4] >> 6) << 4), (raw[s + i + 4] >> 4) | ((raw[s + i] >> 6) << 4)


@njit(cache=True)
def _k_scale_min(raw, o, i):
    """(D, DM) float32 of sub-block i (0..7) of the Q4_K/Q5_K super-block at byte o: D = d * sc_i and
    DM = dmin * m_i, with d, dmin the f16 at o, o+2 and sc_i, m_i from :func:`_k_sc_m`. Both products are exact:
    11-bit times 6-bit significands."""
    sc, m = _k_sc_m(raw, o, i)
    return F16_TO_F32[_u16(raw, o)] * np.float32(sc), F16_TO_F32[_u16(raw, o + 2)] * np.float32(m)


@njit(cache=True)
def _q4_k_code(raw, o, e):
    """4-bit code of element e (0..255) of the Q4_K super-block at byte o: 64-element chunk c = e // 64 uses
    qs bytes 32c .. 32c+31 (qs at o+16), low nibbles for its first 32 elements, high nibbles for the rest."""
    return (np.int64(raw[o + 16 + 32 * (e >> 6) + (e & 31)]) >> (4 * ((e >> 5) & 1))) & 15


@njit(cache=True)
def _q5_k_code(raw, o, e):
    """5-bit code of element e (0..255) of the Q5_K super-block at byte o: nibble as Q4_K with qs at o+48,
    bit 4 = bit (e // 32) of qh[e % 32] (qh at o+16)."""
    nib = (np.int64(raw[o + 48 + 32 * (e >> 6) + (e & 31)]) >> (4 * ((e >> 5) & 1))) & 15
    return nib | (((np.int64(raw[o + 16 + (e & 31)]) >> (e >> 5)) & 1) << 4)


@njit(cache=True)
def _q6_k_code(raw, o, e):
    """6-bit code (0..63) of element e (0..255) of the Q6_K super-block at byte o. Half h = e // 128 uses
    ql[64h .. 64h+63] (ql at o) and qh[32h .. 32h+31] (qh at o+128); with k = (e % 128) // 32 and l = e % 32,
    the low 4 bits are nibble k // 2 of ql[64h + 32 (k % 2) + l], the high 2 bits are bits 2k, 2k+1 of qh[32h + l]."""
    h = e >> 7
    k = (e >> 5) & 3
    l = e & 31
    nib = (np.int64(raw[o + 64 * h + 32 * (k & 1) + l]) >> (4 * (k >> 1))) & 15
    return nib | (((np.int64(raw[o + 128 + 32 * h + l]) >> (2 * k)) & 3) << 4)


@njit(cache=True)
def _q6_k_sc(raw, o, i):
    """The int8 scale sc_i (at o+192+i) of 16-element sub-block i of the Q6_K super-block at byte o."""
    sc = np.int64(raw[o + 192 + i])
    return sc - 256 if sc >= 128 else sc


@njit(cache=True)
def _q6_k_scale(raw, o, i):
    """D = d * sc_i (float32, exact: 11-bit times 8-bit) for 16-element sub-block i of the Q6_K super-block
    at byte o: sc_i from :func:`_q6_k_sc`, d the f16 at o+208."""
    return F16_TO_F32[_u16(raw, o + 208)] * np.float32(_q6_k_sc(raw, o, i))


@njit(cache=True)
def dequant_row_q4_k(raw, out):
    """Q4_K: super-blocks of 256 elements in 144 bytes: d, dmin (f16), scales[12] (eight 6-bit sc, m), qs[128].

    out[256s + 32i + l] = (D_i * q) - DM_i in float32, D_i = d * sc_i, DM_i = dmin * m_i (both exact), q the
    4-bit code (:func:`_q4_k_code`). raw uint8 (144 * n/256,), out float32 (n,), n a multiple of 256.
    Source: block_q4_K / dequantize_row_q4_K in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % QK_K != 0 or raw.shape[0] != (n // QK_K) * 144:
        raise ValueError("dequant_row_q4_k: out length must be 256*k and raw length 144*k")
    for s in range(n // QK_K):
        o = 144 * s
        for i in range(8):
            D, DM = _k_scale_min(raw, o, i)
            for l in range(32):
                out[QK_K * s + 32 * i + l] = D * np.float32(_q4_k_code(raw, o, 32 * i + l)) - DM


@njit(cache=True)
def dequant_row_q5_k(raw, out):
    """Q5_K: super-blocks of 256 elements in 176 bytes: d, dmin (f16), scales[12], qh[32], qs[128].

    out[256s + 32i + l] = (D_i * q) - DM_i in float32 as in Q4_K, q the 5-bit code (:func:`_q5_k_code`).
    raw uint8 (176 * n/256,), out float32 (n,), n a multiple of 256.
    Source: block_q5_K / dequantize_row_q5_K in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % QK_K != 0 or raw.shape[0] != (n // QK_K) * 176:
        raise ValueError("dequant_row_q5_k: out length must be 256*k and raw length 176*k")
    for s in range(n // QK_K):
        o = 176 * s
        for i in range(8):
            D, DM = _k_scale_min(raw, o, i)
            for l in range(32):
                out[QK_K * s + 32 * i + l] = D * np.float32(_q5_k_code(raw, o, 32 * i + l)) - DM


@njit(cache=True)
def dequant_row_q6_k(raw, out):
    """Q6_K: super-blocks of 256 elements in 210 bytes: ql[128], qh[64], scales[16] (int8), d (f16).

    out[256s + 16i + l] = D_i * (q - 32) in float32, D_i = d * sc_i (exact), q the 6-bit code
    (:func:`_q6_k_code`). raw uint8 (210 * n/256,), out float32 (n,), n a multiple of 256.
    Source: block_q6_K / dequantize_row_q6_K in ggml-common.h / ggml-quants.c.
    """
    n = out.shape[0]
    if n % QK_K != 0 or raw.shape[0] != (n // QK_K) * 210:
        raise ValueError("dequant_row_q6_k: out length must be 256*k and raw length 210*k")
    for s in range(n // QK_K):
        o = 210 * s
        for i in range(16):
            D = _q6_k_scale(raw, o, i)
            for l in range(16):
                out[QK_K * s + 16 * i + l] = D * np.float32(_q6_k_code(raw, o, 16 * i + l) - 32)


@njit(cache=True)
def dequantize_row(ggml_type_id, raw, out):
    """Dequantize one row: raw uint8 (row_bytes,) of GGML type ``ggml_type_id`` -> out float32 (n_cols,).

    Dispatches to dequant_row_<type>; raises ValueError for an unsupported type or mismatched lengths.
    """
    if ggml_type_id == _Q4_1:
        dequant_row_q4_1(raw, out)
    elif ggml_type_id == _Q8_0:
        dequant_row_q8_0(raw, out)
    elif ggml_type_id == _Q4_0:
        dequant_row_q4_0(raw, out)
    elif ggml_type_id == _F32:
        dequant_row_f32(raw, out)
    elif ggml_type_id == _F16:
        dequant_row_f16(raw, out)
    elif ggml_type_id == _BF16:
        dequant_row_bf16(raw, out)
    elif ggml_type_id == _Q5_0:
        dequant_row_q5_0(raw, out)
    elif ggml_type_id == _Q5_1:
        dequant_row_q5_1(raw, out)
    elif ggml_type_id == _Q4_K:
        dequant_row_q4_k(raw, out)
    elif ggml_type_id == _Q5_K:
        dequant_row_q5_k(raw, out)
    elif ggml_type_id == _Q6_K:
        dequant_row_q6_k(raw, out)
    else:
        raise ValueError("dequantize_row: unsupported GGML type id")


# The row function of each type, for a caller whose rows are all of one type (the engine's token embedding):
# only that type's function compiles, where dequantize_row compiles them all (~2.5 s of a cold start).
# Keyed by type id; a GGMLQuantizationType (an IntEnum) finds the same entry.
DEQUANT_ROW = {
    _Q4_1: dequant_row_q4_1, _Q8_0: dequant_row_q8_0, _Q4_0: dequant_row_q4_0, _F32: dequant_row_f32,
    _F16: dequant_row_f16, _BF16: dequant_row_bf16, _Q5_0: dequant_row_q5_0, _Q5_1: dequant_row_q5_1,
    _Q4_K: dequant_row_q4_k, _Q5_K: dequant_row_q5_k, _Q6_K: dequant_row_q6_k,
}


@njit(cache=True)
def _dequantize_rows(ggml_type_id, raw, out):
    """out[r] = dequantize_row(raw[r]) for each row r; raw uint8 (n_rows, row_bytes), out float32 (n_rows, n_cols)."""
    for r in range(raw.shape[0]):
        dequantize_row(ggml_type_id, raw[r], out[r])


@njit(cache=True)
def unpack_q5_codes(ggml_type_id, raw, codes):
    """The unsigned 5-bit codes of Q5_0 or Q5_1 rows, for the weight loader (which reads each block's f16 d, and
    Q5_1's m, from the bytes itself): element e of row r is d * (codes[r, e] - 16) (Q5_0) or d * codes[r, e] + m
    (Q5_1), with d, m those of block e // 32.

    raw uint8 (n_rows, row_bytes); codes uint8 (n_rows, n) in element order. Raises ValueError for another type
    or mismatched lengths.
    """
    n = codes.shape[1]
    if ggml_type_id != _Q5_0 and ggml_type_id != _Q5_1:
        raise ValueError("unpack_q5_codes: not a Q5_0 or Q5_1 type id")
    bb = 22 if ggml_type_id == _Q5_0 else 24
    if codes.shape[0] != raw.shape[0] or n % 32 != 0 or raw.shape[1] != (n // 32) * bb:
        raise ValueError("unpack_q5_codes: codes must have n_rows rows and the rows' n elements")
    for r in range(raw.shape[0]):
        row, c = raw[r], codes[r]
        for b in range(n // 32):
            for j in range(32):  # qh[4] and qs[16] end the block
                c[32 * b + j] = _q5_code(row, bb * b + bb - 20, j)


@njit(cache=True)
def unpack_k_rows(ggml_type_id, raw, codes, sc, m, d, dmin):
    """Unsigned codes and the integer sub-block scales of Q4_K, Q5_K or Q6_K rows, with their super-blocks'
    float scales, for the weight loader (which keeps them apart: one byte per sub-block instead of a float).

    raw uint8 (n_rows, row_bytes); codes uint8 (n_rows, n) in element order; d, dmin float32 (n_rows, n // 256):
    the super-blocks' f16 d and dmin, widened exactly. Q4_K, Q5_K: sc, m uint8 (n_rows, n // 32), the 6-bit
    sub-block scales and minimums; element e of row r is (in real numbers) d[r, e // 256] * sc[r, e // 32] *
    codes[r, e] - dmin[r, e // 256] * m[r, e // 32]. Q6_K: sc int8 (n_rows, n // 16); element e is
    d[r, e // 256] * sc[r, e // 16] * (codes[r, e] - 32); m and dmin are not written (pass empty arrays).
    Raises ValueError for another type or mismatched lengths.
    """
    n = codes.shape[1]
    n_rows = raw.shape[0]
    sub = 16 if ggml_type_id == _Q6_K else 32
    bb = 144 if ggml_type_id == _Q4_K else 176 if ggml_type_id == _Q5_K else 210
    if ggml_type_id != _Q4_K and ggml_type_id != _Q5_K and ggml_type_id != _Q6_K:
        raise ValueError("unpack_k_rows: not a Q4_K, Q5_K or Q6_K type id")
    if n % QK_K != 0 or raw.shape[1] != (n // QK_K) * bb:
        raise ValueError("unpack_k_rows: row length mismatch")
    if codes.shape[0] != n_rows or sc.shape != (n_rows, n // sub) or d.shape != (n_rows, n // QK_K):
        raise ValueError("unpack_k_rows: codes, sc and d must have n_rows rows and n, n // sub, n // 256 columns")
    if sub == 32 and (m.shape != sc.shape or dmin.shape != d.shape):
        raise ValueError("unpack_k_rows: m and dmin must have the shapes of sc and d")
    for r in range(n_rows):
        row, c = raw[r], codes[r]
        for s in range(n // QK_K):
            o = bb * s
            if sub == 16:
                d[r, s] = F16_TO_F32[_u16(row, o + 208)]
                for i in range(16):
                    sc[r, 16 * s + i] = _q6_k_sc(row, o, i)
                for e in range(QK_K):
                    c[QK_K * s + e] = _q6_k_code(row, o, e)
                continue
            d[r, s] = F16_TO_F32[_u16(row, o)]
            dmin[r, s] = F16_TO_F32[_u16(row, o + 2)]
            for i in range(8):
                sc[r, 8 * s + i], m[r, 8 * s + i] = _k_sc_m(row, o, i)
            for e in range(QK_K):
                c[QK_K * s + e] = _q4_k_code(row, o, e) if bb == 144 else _q5_k_code(row, o, e)


# The tensor types detinfer runs: exactly those with a row dequantizer.
SUPPORTED_TYPES = frozenset(GGMLQuantizationType(t) for t in DEQUANT_ROW)


def supported_type_names() -> str:
    """The supported GGML type names, comma-separated in type-id order, for error messages."""
    return ", ".join(t.name for t in sorted(SUPPORTED_TYPES))


def dequantize(raw_2d: np.ndarray, ggml_type: GGMLQuantizationType | int) -> np.ndarray:
    """Dequantize a whole tensor: raw_2d uint8 (n_rows, row_bytes) -> float32 (n_rows, n_cols).

    n_cols = row_bytes / type_size * block_size (gguf's GGML_QUANT_SIZES). For tests and tools; the
    engine calls dequantize_row or its own kernels. Raises ValueError for an unsupported type, a
    non-uint8 or non-2-d array, or a row length that is not a whole number of blocks.
    """
    try:
        qtype = GGMLQuantizationType(int(ggml_type))
    except ValueError:
        raise ValueError(f"unknown GGML type id {int(ggml_type)}") from None
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"GGML type {qtype.name} is not supported (supported: {supported_type_names()})")
    if raw_2d.dtype != np.uint8 or raw_2d.ndim != 2:
        raise ValueError(f"raw_2d must be a 2-d uint8 array, got {raw_2d.dtype} with shape {raw_2d.shape}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_rows, row_bytes = raw_2d.shape
    if row_bytes % type_size != 0:
        raise ValueError(f"row length {row_bytes} bytes is not a multiple of the {qtype.name} block size {type_size} bytes")
    out = np.empty((n_rows, row_bytes // type_size * block_size), dtype=np.float32)
    _dequantize_rows(int(qtype), np.ascontiguousarray(raw_2d), out)
    return out
