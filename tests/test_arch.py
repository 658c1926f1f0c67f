"""Architecture descriptions (detinfer/arch.py), the config they drive, and the kernels only some architectures use.

Kernels are checked against float64 numpy (or, where the order is the same, bytes); the whole forward of each
architecture is checked against the reference forward in test_reference_forward.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFValueType
from gguf_factory import write_tiny_gguf

from detinfer.compute import kernels
from detinfer.errors import ConfigError
from detinfer.model.arch import ARCHITECTURES
from detinfer.model.config import ModelConfig
from detinfer.model.gguf_file import ModelFile
from detinfer.model.weights import Weights

U = 2.0**-24  # float32 unit roundoff

# llama.cpp src/llama-model.cpp, llama_model_rope_type: LLM_ARCH_LLAMA is LLAMA_ROPE_TYPE_NORM ("pairs of
# consecutive head values"); QWEN2, QWEN3 and GEMMA3 are LLAMA_ROPE_TYPE_NEOX ("offset by n_rot/2").
# qwen35: LLAMA_ROPE_TYPE_IMROPE, which for text (every position row the token's position) is NeoX on n_rot dims
LLAMACPP_ROPE_TYPE = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox", "qwen35": "neox"}


def test_every_architecture_has_llamacpps_rope_style():
    assert set(ARCHITECTURES) == set(LLAMACPP_ROPE_TYPE), "a new architecture needs its llama.cpp RoPE type here"
    for name, arch in ARCHITECTURES.items():
        assert arch.rope_style == LLAMACPP_ROPE_TYPE[name], f"{name}: rope_style {arch.rope_style!r}"


def _rope_pairs_f64(x: np.ndarray, positions: np.ndarray, n_head: int, hd: int, cos, sin, neox: bool) -> np.ndarray:
    """float64 rotation of [T, n_head*hd]: pair i is (x[i], x[i + hd/2]) if neox, else (x[2i], x[2i+1])."""
    x = x.astype(np.float64).reshape(len(positions), n_head, hd)
    a, b = (np.s_[..., : hd // 2], np.s_[..., hd // 2 :]) if neox else (np.s_[..., 0::2], np.s_[..., 1::2])
    c = cos[positions].astype(np.float64)[:, None, :]
    s = sin[positions].astype(np.float64)[:, None, :]
    out = np.empty_like(x)
    out[a] = x[a] * c - x[b] * s
    out[b] = x[a] * s + x[b] * c
    return out.reshape(len(positions), n_head * hd)


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_kernel_rotates_the_pairs_of_its_style(style):
    n_head, hd = 3, 32
    cos, sin = kernels.rope_table(64, hd, 10000.0)
    rng = np.random.default_rng(11)
    positions = np.array([0, 1, 5, 63], np.int64)
    x = rng.standard_normal((4, n_head * hd)).astype(np.float32)
    got = x.copy()
    (kernels.rope_neox if style == "neox" else kernels.rope_norm)(got, positions, n_head, hd, cos, sin)
    want = _rope_pairs_f64(x, positions, n_head, hd, cos, sin, neox=style == "neox")
    other = _rope_pairs_f64(x, positions, n_head, hd, cos, sin, neox=style != "neox")
    tol = 4 * U * np.abs(x).max()
    assert np.abs(got - want).max() < tol, f"rope_{style} does not rotate {style} pairs"
    assert np.abs(got - other).max() > 1e3 * tol, "the two RoPE styles must differ on this input"
    assert np.array_equal(got[0], x[0]), "rope at position 0 must be the identity"


def test_rmsnorm_heads_is_rmsnorm_of_each_head():
    T, n_head, hd = 3, 4, 32
    rng = np.random.default_rng(12)
    qkv = rng.standard_normal((T, n_head * hd + 16)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
    want = np.empty((T * n_head, hd), np.float32)
    kernels.rmsnorm(qkv[:, : n_head * hd].reshape(T * n_head, hd), w, np.float32(1e-6), want)
    rest = qkv[:, n_head * hd :].copy()
    kernels.rmsnorm_heads(qkv[:, : n_head * hd].reshape(T, n_head, hd), w, np.float32(1e-6))
    assert np.array_equal(qkv[:, : n_head * hd].reshape(T * n_head, hd).view(np.uint32), want.view(np.uint32))
    assert np.array_equal(qkv[:, n_head * hd :], rest), "rmsnorm_heads touched columns outside its view"


def test_add_bias_adds_to_every_row():
    rng = np.random.default_rng(13)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32)
    want = x + b  # one float32 rounding per element, as the kernel
    kernels.add_bias(x, b)
    assert np.array_equal(x.view(np.uint32), want.view(np.uint32))


def test_geglu_matches_float64_tanh_gelu():
    rng = np.random.default_rng(14)
    gate = np.concatenate([rng.standard_normal((2, 500)) * 3, [np.linspace(-30, 30, 500)]]).astype(np.float32)
    up = rng.standard_normal(gate.shape).astype(np.float32)
    out = np.empty_like(gate)
    kernels.geglu(np.concatenate([gate, up], axis=1), out)
    g = gate.astype(np.float64)
    want = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3))) * up
    # a few roundings in y, expf's ulp amplified by |2y| / (1 + e^2y) <= ~0.56, the division and the product
    tol = 16 * U * np.abs(g * up) + 1e-30
    assert np.all(np.abs(out - want) <= tol), f"max excess {np.max(np.abs(out - want) - tol):.3g}"
    # the silu gate would be a different function: guard against a test that cannot tell them apart
    silu = np.empty_like(gate)
    kernels.swiglu(np.concatenate([gate, up], axis=1), silu)
    assert np.abs(silu - out).max() > 0.1


def _windowed_oracle(q, k, v, pos0, n_head, scale, window):
    """float64 attention of q [T, n_head*hd] over k, v [n, n_kv*hd] (positions 0..), causal + window."""
    T, n_kv = q.shape[0], k.shape[1] * n_head // q.shape[1]
    hd = q.shape[1] // n_head
    out = np.empty((T, n_head, hd))
    for t in range(T):
        p = pos0 + t
        lo = max(0, p - window + 1) if window else 0
        for h in range(n_head):
            g = h // (n_head // n_kv)
            kk = k[lo : p + 1, g * hd : (g + 1) * hd].astype(np.float64)
            s = kk @ q[t, h * hd : (h + 1) * hd].astype(np.float64) * np.float64(scale)
            e = np.exp(s - s.max())
            out[t, h] = (e / e.sum()) @ v[lo : p + 1, g * hd : (g + 1) * hd].astype(np.float64)
    return out.reshape(T, n_head * hd)


def _run_attention(q, k, v, pos0, n_head, scale, window, n_ctx=32):
    n_kv_hd = k.shape[1]
    hd = q.shape[1] // n_head
    n_kv = n_kv_hd // hd
    kc, vc = np.zeros((n_kv, hd, n_ctx), np.float32), np.zeros((n_kv, n_ctx, hd), np.float32)
    kernels.kv_write(kc, vc, np.hstack([k, v]), 0, n_kv_hd, 0)
    out = np.empty((q.shape[0], q.shape[1]), np.float32)
    kernels.attention(q, kc, vc, pos0, n_head, scale, np.zeros(1, np.float32), out, window)
    return out


def test_sliding_window_attention():
    n_head, n_kv, hd, n, window = 4, 1, 16, 20, 5
    rng = np.random.default_rng(15)
    k = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
    q = (rng.standard_normal((6, n_head * hd)) * 2).astype(np.float32)
    pos0, scale = n - 6, np.float32(0.25)
    got = _run_attention(q, k, v, pos0, n_head, scale, window)
    want = _windowed_oracle(q, k, v, pos0, n_head, scale, window)
    assert np.abs(got - want).max() < 1e-5, "windowed attention differs from the float64 oracle"
    full = _windowed_oracle(q, k, v, pos0, n_head, scale, 0)
    assert np.abs(full - want).max() > 1e-2, "the window must matter on this input"
    # a window covering every earlier position is full causal attention, to the bit
    wide = _run_attention(q, k, v, pos0, n_head, scale, n)
    assert np.array_equal(wide.view(np.uint32), _run_attention(q, k, v, pos0, n_head, scale, 0).view(np.uint32))
    # a chunk gives the bytes of one-token calls
    singles = np.concatenate([_run_attention(q[t : t + 1].copy(), k, v, pos0 + t, n_head, scale, window) for t in range(6)])
    assert np.array_equal(got.view(np.uint32), singles.view(np.uint32))


# ---- config ------------------------------------------------------------------------------------------


def test_gemma3_config_from_metadata_and_published_defaults(tmp_path):
    path = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3")
    cfg = ModelConfig.from_model(ModelFile(path))
    assert cfg.head_dim == 32 and cfg.n_head * cfg.head_dim != cfg.n_embd, "head_dim comes from attention.key_length"
    assert cfg.swa_layers == (True, True, True, True, True, False, True), "pattern 6: layers il % 6 < 5 are local"
    assert (cfg.sliding_window, cfg.rope_freq_base, cfg.rope_freq_base_swa) == (5, 1e6, 10000.0)
    assert cfg.query_pre_attn_scalar == 256.0


def test_llama_config_has_no_sliding_window(tmp_path):
    cfg = ModelConfig.from_model(ModelFile(write_tiny_gguf(tmp_path / "l.gguf")))
    assert not any(cfg.swa_layers) and cfg.sliding_window == 0
    assert cfg.rope_freq_base_swa == cfg.rope_freq_base and cfg.query_pre_attn_scalar == cfg.head_dim


def test_gemma3_without_sliding_window_key_is_an_error_naming_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3", drop_metadata=("gemma3.attention.sliding_window",))
    with pytest.raises(ConfigError, match=r"gemma3\.attention\.sliding_window"):
        ModelConfig.from_model(ModelFile(path))


def test_unknown_architecture_is_an_error_naming_it(tmp_path):
    path = write_tiny_gguf(tmp_path / "x.gguf", architecture="phi3")
    with pytest.raises(ConfigError, match=r"'phi3' is not supported"):
        ModelConfig.from_model(ModelFile(path))


@pytest.mark.parametrize("window, vtype", [(0, GGUFValueType.UINT32), (2**63, GGUFValueType.UINT64)])
def test_sliding_window_must_be_positive_and_fit_the_kernels(tmp_path, window, vtype):
    path = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3", extra_metadata={"gemma3.attention.sliding_window": (window, vtype)})
    with pytest.raises(ConfigError, match=f"sliding_window must be between 1 and 2147483647, got {window}"):
        ModelConfig.from_model(ModelFile(path))


# ---- weights -----------------------------------------------------------------------------------------


def test_projections_fuse_only_tensors_of_one_type(tmp_path):
    """gemma3's real file has Q5_0 attn_q/attn_k but Q8_0 attn_v on some layers: those must not be fused."""
    path = write_tiny_gguf(tmp_path / "g.gguf", architecture="gemma3", matrix_type="Q8_0", types={"blk.0.attn_v.weight": "F32"})
    mf = ModelFile(path)
    w = Weights.load(mf, ModelConfig.from_model(mf))
    assert [m.n_out for m in w.layers[0].attn_qkv.mats] == [128 + 32, 32]
    assert [m.n_out for m in w.layers[1].attn_qkv.mats] == [128 + 32 + 32]
    assert w.layers[0].attn_qkv.n_out == w.layers[1].attn_qkv.n_out


def test_logit_softcapping_is_refused_not_ignored(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "g.gguf", architecture="gemma3", extra_metadata={"gemma3.final_logit_softcapping": (30.0, GGUFValueType.FLOAT32)}
    )
    with pytest.raises(ConfigError, match=r"gemma3\.final_logit_softcapping"):
        ModelConfig.from_model(ModelFile(path))


def test_block_count_beyond_the_files_blocks_is_refused_before_sizing_anything(tmp_path):
    """A corrupt block_count must not size the tensor table, per-layer tuples or the KV cache: it is checked against
    the blocks the file has tensors for, first."""
    path = write_tiny_gguf(tmp_path / "m.gguf", extra_metadata={"llama.block_count": (2_000_000, GGUFValueType.UINT32)})
    with pytest.raises(ConfigError, match="block_count is 2000000 but the file has tensors for 2 block"):
        ModelConfig.from_model(ModelFile(path))
