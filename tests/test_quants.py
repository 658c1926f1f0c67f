"""Block formats against gguf-py, bit for bit; the f16 conversion against numpy, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from detinfer.model.gguf_file import ModelFile
from detinfer.model.quants import (
    F16_TO_F32,
    SUPPORTED_TYPES,
    dequantize,
    dequantize_row,
    f32_to_f16_array,
    f32_to_f16_bits,
    unpack_k_rows,
    unpack_q5_codes,
)

K_QUANTS = [T.Q4_K, T.Q5_K, T.Q6_K]
UNPACKED_TYPES = [T.Q5_0, T.Q5_1] + K_QUANTS  # the types unpack_q5_codes (Q5_0, Q5_1) and unpack_k_rows serve
ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1] + UNPACKED_TYPES
QUANT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # the ones gguf-py can also quantize

# Block layouts of ggml-common.h (block_q8_0, block_q4_0, ..., block_q6_K), packed as in the file. In the
# k-quants, "d"/"dmin" are the super-block scales, "scales" the packed sub-block scales (6-bit sc and m for
# Q4_K/Q5_K, int8 for Q6_K).
BLOCK_DTYPES = {
    T.Q8_0: np.dtype([("d", "<f2"), ("qs", "i1", (32,))]),
    T.Q4_0: np.dtype([("d", "<f2"), ("qs", "u1", (16,))]),
    T.Q4_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))]),
    T.Q5_0: np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    T.Q5_1: np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (16,))]),
    T.Q4_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qs", "u1", (128,))]),
    T.Q5_K: np.dtype([("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", (12,)), ("qh", "u1", (32,)), ("qs", "u1", (128,))]),
    T.Q6_K: np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("scales", "i1", (16,)), ("d", "<f2")]),
}


def assert_bits_equal(got: np.ndarray, want: np.ndarray, block_size: int = 32) -> None:
    """Bitwise equality of two float32 arrays (n_rows, n_cols); on failure name the first differing element."""
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    g = np.ascontiguousarray(got).view(np.uint32)
    w = np.ascontiguousarray(want).view(np.uint32)
    bad = np.argwhere(g != w)
    if len(bad):
        r, c = (int(v) for v in bad[0])
        pytest.fail(
            f"{len(bad)} elements differ; first at row {r}, block {c // block_size}, element {c % block_size}: "
            f"got {got[r, c]!r} (0x{g[r, c]:08x}), want {want[r, c]!r} (0x{w[r, c]:08x})"
        )


def assert_f16_equal(src: np.ndarray, got: np.ndarray) -> None:
    """got (uint16) must equal numpy's float32 -> float16 cast of src bit for bit."""
    with np.errstate(all="ignore"):  # numpy warns on overflow to inf
        want = src.astype(np.float16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    if len(bad):
        i = bad[0]
        pytest.fail(
            f"{len(bad)} of {len(src)} differ; first: f32 0x{src.view(np.uint32)[i]:08x} ({src[i]!r}) -> "
            f"got 0x{got[i]:04x}, numpy 0x{want[i]:04x}"
        )


def convert(src: np.ndarray) -> np.ndarray:
    src = np.ascontiguousarray(src, dtype=np.float32)
    dst = np.empty(src.shape, dtype=np.uint16)
    f32_to_f16_array(src, dst)
    return dst


# ---- f16 -> f32 table ------------------------------------------------------------------------------


def test_f16_table_matches_numpy_for_all_65536_patterns():
    h = np.arange(65536, dtype=np.uint16)
    want = h.view(np.float16).astype(np.float32)
    assert F16_TO_F32.dtype == np.float32 and F16_TO_F32.shape == (65536,)
    bad = np.flatnonzero(F16_TO_F32.view(np.uint32) != want.view(np.uint32))
    assert not len(bad), f"{len(bad)} differ; first f16 0x{bad[0]:04x}: table {F16_TO_F32[bad[0]]!r}, numpy {want[bad[0]]!r}"
    assert not F16_TO_F32.flags.writeable


# ---- f32 -> f16 --------------------------------------------------------------------------------------


def test_f32_to_f16_all_half_values_midpoints_and_neighbours():
    h = np.arange(65536, dtype=np.uint16)
    exact = h.view(np.float16).astype(np.float32)  # every half, NaNs and infs included
    # Midpoints of consecutive non-negative finite halves (0x0000..0x7bff, and 65504..65536 past the top):
    # exact in float32, since a half has 11 significant bits. These are the ties.
    pos = np.append(exact[:0x7C00].astype(np.float64), 65536.0)
    mid = ((pos[:-1] + pos[1:]) / 2).astype(np.float32)
    mid = np.concatenate([mid, -mid])
    below = np.nextafter(mid, np.float32(0))
    above = np.nextafter(mid, np.float32(np.inf) * np.sign(mid))
    with np.errstate(invalid="ignore"):  # nextafter of a NaN
        toward_zero = np.nextafter(exact, np.float32(0))
    src = np.concatenate([exact, mid, below, above, toward_zero])
    assert_f16_equal(src, convert(src))


def test_f32_to_f16_rounding_bit_patterns():
    # every sign / exponent / top-7-mantissa combination with the low 16 bits at rounding boundaries
    hi = np.arange(65536, dtype=np.uint32) << 16
    lo = np.array(
        [0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x2FFF, 0x3000, 0x3001, 0x3FFF,
         0x4000, 0x5000, 0x6000, 0x7000, 0x7FFF, 0x8000, 0x8001, 0x9000, 0xB000, 0xD000, 0xF000, 0xFFFF],
        dtype=np.uint32,
    )
    src = (hi[:, None] | lo[None, :]).ravel().view(np.float32)
    assert_f16_equal(src, convert(src))


def test_f32_to_f16_random_bit_patterns():
    src = np.random.default_rng(20240501).integers(0, 2**32, size=1 << 20, dtype=np.uint32).view(np.float32)
    assert_f16_equal(src, convert(src))


def test_f32_to_f16_huge_tiny_and_special_values():
    powers = np.ldexp(np.float32(1.0), np.arange(-149, 128)).astype(np.float32)  # f32 subnormals to 2^127
    special = np.array(
        [0.0, 65504.0, 65519.996, 65520.0, 65535.0, 65536.0, 1e10, 3.4028235e38, np.inf, 2.0**-24, 2.0**-25,
         1.5 * 2.0**-25, 2.0**-14, 2.0**-14 - 2.0**-25, 6.1e-5, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11],
        dtype=np.float32,
    )
    nans = np.array([0x7F800001, 0x7F801FFF, 0x7F802000, 0x7FA00000, 0x7FC00000, 0x7FFFFFFF, 0x7FC00001], dtype=np.uint32)
    src = np.concatenate([powers, powers * np.float32(1.75), special, nans.view(np.float32)])
    src = np.concatenate([src, -src])
    got = convert(src)
    assert_f16_equal(src, got)
    # The scalar entry point gives the same bits as the array one. Called from Python, numba unboxes a
    # float32 through a C double, which quiets signalling NaNs before the function sees them: skip those.
    bits = src.view(np.uint32)
    signalling = ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x7FFFFF) != 0) & ((bits & 0x400000) == 0)
    scalar = np.array([f32_to_f16_bits(x) for x in src[~signalling]], dtype=np.uint16)
    assert np.array_equal(scalar, got[~signalling])


def test_f32_to_f16_array_rejects_length_mismatch():
    with pytest.raises(ValueError):
        f32_to_f16_array(np.zeros(4, np.float32), np.zeros(3, np.uint16))


# ---- dequantization against gguf-py ---------------------------------------------------------------


def random_rows(qtype: T, n_rows: int, n_cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid rows of ``qtype``: (n_rows, row_bytes) uint8.

    Float types get random bit patterns (NaNs and infs included: widening must keep them bit for bit).
    Quantized types get finite non-zero f16 scales of realistic magnitude and random bytes everywhere else
    (quants, high bits, packed sub-block scales).
    """
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = n_cols // block_size * type_size
    if qtype not in BLOCK_DTYPES:
        return rng.integers(0, 256, size=(n_rows, row_bytes), dtype=np.uint8)
    n_blocks = n_rows * n_cols // block_size
    blocks = rng.integers(0, 256, size=n_blocks * type_size, dtype=np.uint8).view(BLOCK_DTYPES[qtype])
    magnitude = rng.uniform(1e-4, 0.08, n_blocks)
    if qtype in (T.Q4_1, T.Q5_1):
        blocks["d"] = magnitude  # (max - min) / 15 >= 0
        blocks["m"] = rng.uniform(-0.6, 0.1, n_blocks) + 1e-3  # the block minimum
    elif qtype in (T.Q4_K, T.Q5_K):
        blocks["d"] = magnitude / 63  # sub-block scale d * sc with the 6-bit sc
        blocks["dmin"] = rng.uniform(1e-4, 0.01, n_blocks)
    else:
        blocks["d"] = magnitude * rng.choice([-1.0, 1.0], n_blocks) / (127 if qtype == T.Q6_K else 1)
    assert np.all(blocks["d"] != 0) and np.all(np.isfinite(blocks["d"]))
    return blocks.view(np.uint8).reshape(n_rows, row_bytes)


def test_every_supported_type_has_dequantization_tests():
    """The types a model file may hold (quants.SUPPORTED_TYPES) are exactly those tested here."""
    assert set(ALL_TYPES) == SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_random_rows(qtype):
    rng = np.random.default_rng(int(qtype) + 1)
    raw = random_rows(qtype, 3, 512, rng)  # k-quants: two super-blocks per row
    with np.errstate(all="ignore"):
        want = gguf_dequantize(raw, qtype)
    got = dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == (3, 512)
    assert np.count_nonzero(got) > 0.8 * got.size
    assert_bits_equal(got, want, GGML_QUANT_SIZES[qtype][0])


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_gguf_quantized_rows(qtype):
    x = (np.random.default_rng(7).standard_normal((2, 1024)) * 0.05).astype(np.float32)
    raw = gguf_quantize(x, qtype)
    assert_bits_equal(dequantize(raw, qtype), gguf_dequantize(raw, qtype))


F16_FIELDS = [(T.Q8_0, "d"), (T.Q4_0, "d"), (T.Q4_1, "d"), (T.Q4_1, "m"), (T.Q5_0, "d"), (T.Q5_1, "d"),
              (T.Q5_1, "m"), (T.Q4_K, "d"), (T.Q4_K, "dmin"), (T.Q5_K, "d"), (T.Q5_K, "dmin"), (T.Q6_K, "d")]


@pytest.mark.parametrize("qtype, field", F16_FIELDS, ids=lambda v: getattr(v, "name", v))
def test_dequantize_matches_gguf_for_every_f16_scale(qtype, field):
    """Every half bit pattern as the scale d (or as the minimum m, dmin): subnormals, zeros, infs, NaNs.

    The block's other f16 field stays finite: when d * q and m are both NaN, which payload the sum keeps is
    up to the instruction's operand order (LLVM treats fadd as commutative; numpy keeps the first operand's).
    """
    rng = np.random.default_rng(11)
    n_blocks = 65536
    dtype = BLOCK_DTYPES[qtype]
    blocks = rng.integers(0, 256, size=n_blocks * dtype.itemsize, dtype=np.uint8).view(dtype)
    for other in {"d", "m", "dmin"} & set(dtype.names) - {field}:
        blocks[other] = rng.uniform(-0.5, 0.5, n_blocks)
    blocks[field] = np.arange(n_blocks, dtype=np.uint16).view(np.float16)
    raw = blocks.view(np.uint8).reshape(64, -1)
    with np.errstate(all="ignore"):
        want = gguf_dequantize(raw, qtype)
    assert_bits_equal(dequantize(raw, qtype), want)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_row_is_alignment_independent(qtype):
    raw = random_rows(qtype, 1, 256, np.random.default_rng(3))[0]
    buf = np.zeros(raw.size + 1, dtype=np.uint8)
    buf[1:] = raw  # starts at an odd address
    out_aligned = np.empty(256, np.float32)
    out_odd = np.empty(256, np.float32)
    dequantize_row(int(qtype), raw, out_aligned)
    dequantize_row(int(qtype), buf[1:], out_odd)
    assert_bits_equal(out_odd[None], out_aligned[None])
    with np.errstate(all="ignore"):
        assert_bits_equal(out_aligned[None], gguf_dequantize(raw[None], qtype))


def test_dequantize_rejects_bad_input():
    raw = np.zeros((2, 40), dtype=np.uint8)
    with pytest.raises(ValueError, match="IQ2_XS"):
        dequantize(raw, T.IQ2_XS)
    with pytest.raises(ValueError, match="multiple"):
        dequantize(np.zeros((2, 41), dtype=np.uint8), T.Q4_1)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(raw.astype(np.int8), T.Q4_1)
    with pytest.raises(ValueError):  # raw holds 2 Q4_1 blocks = 64 values, out has room for 96
        dequantize_row(int(T.Q4_1), raw[0], np.empty(96, np.float32))
    with pytest.raises(ValueError):
        dequantize_row(int(T.IQ2_XS), raw[0], np.empty(64, np.float32))
    with pytest.raises(ValueError):  # 144 bytes are one Q4_K super-block: 256 values, not 512
        dequantize_row(int(T.Q4_K), np.zeros(144, np.uint8), np.empty(512, np.float32))


def unpacked(qtype, raw: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(codes, scale, offset, sub) from unpack_q5_codes with the file's d and m, or from unpack_k_rows with its
    integer sub-block scales times their super-block's float (exact in float64): element e of row r is
    scale[r, e // sub] * codes[r, e] + offset[r, e // sub]. Every array starts filled (NaN, 127 or 255), so one
    the function leaves unwritten shows."""
    rows = raw.shape[0]
    codes = np.full((rows, n), 255, np.uint8)
    if qtype in (T.Q5_0, T.Q5_1):
        unpack_q5_codes(int(qtype), raw, codes)
        blocks = raw.reshape(-1).view(BLOCK_DTYPES[qtype]).reshape(rows, n // 32)
        scale = blocks["d"].astype(np.float64)
        return codes, scale, -16 * scale if qtype == T.Q5_0 else blocks["m"].astype(np.float64), 32
    sub = 16 if qtype == T.Q6_K else 32
    sc = np.full((rows, n // sub), 127, np.int8) if qtype == T.Q6_K else np.full((rows, n // 32), 255, np.uint8)
    m = np.full((rows, 0 if qtype == T.Q6_K else n // 32), 255, np.uint8)
    d, dmin = np.full((2, rows, n // 256), np.nan, np.float32)
    unpack_k_rows(int(qtype), raw, codes, sc, m, d, dmin)
    scale = np.repeat(d.astype(np.float64), 256 // sub, axis=1) * sc
    if qtype == T.Q6_K:
        return codes, scale, -32 * scale, sub
    assert sc.max() < 64 and m.max() < 64
    return codes, scale, -np.repeat(dmin.astype(np.float64), 8, axis=1) * m, sub


@pytest.mark.parametrize("qtype", UNPACKED_TYPES, ids=lambda t: t.name)
def test_unpack_rows_reconstructs_gguf_values(qtype):
    """scale * code + offset (exact in float64) is gguf-py's value up to gguf's own float32 roundings.

    gguf-py rounds d * (q - 16) and D * (q - 32) once (Q5_0, Q6_K: then the float32 of the exact value equals
    its result, up to the sign of zero) and d * q + m, D * q - DM twice (one float32 ulp of each term).
    """
    rng = np.random.default_rng(int(qtype) + 40)
    n = 512
    raw = random_rows(qtype, 4, n, rng)
    codes, scale, offset, sub = unpacked(qtype, raw, n)
    assert codes.max() < {T.Q4_K: 16, T.Q6_K: 64}.get(qtype, 32)
    term = np.repeat(scale, sub, axis=1) * codes
    off = np.repeat(offset, sub, axis=1)
    want = gguf_dequantize(raw, qtype).astype(np.float64)
    if qtype in (T.Q5_0, T.Q6_K):
        bad = np.argwhere((term + off).astype(np.float32) != want.astype(np.float32))
        assert not len(bad), f"{len(bad)} values differ; first at (row, column) {tuple(bad[0])}"
    else:
        err = np.abs(term + off - want)
        assert np.all(err <= 2.0**-24 * (np.abs(term) + np.abs(term + off)) * 1.0001), f"max error {err.max()}"


def test_unpack_rows_refuse_other_types_and_shapes():
    n = 512
    raw5, rawk = (random_rows(t, 4, n, np.random.default_rng(3)) for t in (T.Q5_1, T.Q4_K))
    codes = np.empty((4, n), np.uint8)
    with pytest.raises(ValueError, match="not a Q5_0 or Q5_1"):
        unpack_q5_codes(int(T.Q4_1), raw5, codes)
    with pytest.raises(ValueError, match="n elements"):  # Q5_1 rows read as Q5_0
        unpack_q5_codes(int(T.Q5_0), raw5, codes)
    unpack_q5_codes(int(T.Q5_1), raw5, codes)  # the control
    sc, d = np.empty((4, n // 32), np.uint8), np.empty((4, n // 256), np.float32)
    with pytest.raises(ValueError, match="not a Q4_K, Q5_K or Q6_K"):
        unpack_k_rows(int(T.Q5_1), rawk, codes, sc, sc, d, d)
    with pytest.raises(ValueError, match="row length"):  # Q4_K rows read as Q5_K
        unpack_k_rows(int(T.Q5_K), rawk, codes, sc, sc, d, d)
    with pytest.raises(ValueError, match="n // sub"):  # scales for Q6_K's 16-element sub-blocks
        unpack_k_rows(int(T.Q4_K), rawk, codes, np.empty((4, n // 16), np.uint8), sc, d, d)
    with pytest.raises(ValueError, match="shapes of sc and d"):
        unpack_k_rows(int(T.Q4_K), rawk, codes, sc, sc[:, :1], d, d)
    unpack_k_rows(int(T.Q4_K), rawk, codes, sc, sc.copy(), d, d.copy())  # the control: right shapes pass


# ---- the real model ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected_type",
    [
        ("token_embd.weight", T.Q8_0),
        ("blk.0.ffn_down.weight", T.Q4_1),
        ("blk.29.attn_k.weight", T.Q4_1),
        ("blk.0.attn_norm.weight", T.F32),
        ("output_norm.weight", T.F32),
    ],
)
def test_dequantize_real_model_rows_match_gguf(model_path, name, expected_type):
    model = ModelFile(model_path)
    info = model.tensor(name)
    assert info.ggml_type == expected_type
    raw = model.tensor_data(name)
    n_rows = raw.shape[0]
    # whole tensors, except the 28 MB embedding table: a few rows of it, first and last included
    rows = np.arange(n_rows) if raw.nbytes <= 2**21 else np.array([0, 1, 2, n_rows // 2, n_rows - 2, n_rows - 1])
    sample = raw[rows]
    got = dequantize(sample, info.ggml_type)
    assert got.shape == (len(rows), info.ne[0])
    assert np.all(np.isfinite(got))
    assert_bits_equal(got, gguf_dequantize(sample, info.ggml_type), GGML_QUANT_SIZES[info.ggml_type][0])
