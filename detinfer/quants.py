"""Block formats of the GGML tensor types the engine supports: F32, F16, BF16, Q8_0, Q4_0, Q4_1.

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
    else:
        raise ValueError("dequantize_row: unsupported GGML type id")


@njit(cache=True)
def _dequantize_rows(ggml_type_id, raw, out):
    """out[r] = dequantize_row(raw[r]) for each row r; raw uint8 (n_rows, row_bytes), out float32 (n_rows, n_cols)."""
    for r in range(raw.shape[0]):
        dequantize_row(ggml_type_id, raw[r], out[r])


_SUPPORTED = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)


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
    if qtype not in _SUPPORTED:
        raise ValueError(f"GGML type {qtype.name} is not supported (supported: {', '.join(t.name for t in _SUPPORTED)})")
    if raw_2d.dtype != np.uint8 or raw_2d.ndim != 2:
        raise ValueError(f"raw_2d must be a 2-d uint8 array, got {raw_2d.dtype} with shape {raw_2d.shape}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    n_rows, row_bytes = raw_2d.shape
    if row_bytes % type_size != 0:
        raise ValueError(f"row length {row_bytes} bytes is not a multiple of the {qtype.name} block size {type_size} bytes")
    out = np.empty((n_rows, row_bytes // type_size * block_size), dtype=np.float32)
    _dequantize_rows(int(qtype), np.ascontiguousarray(raw_2d), out)
    return out
