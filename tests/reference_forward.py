"""Slow, obviously-correct float64 numpy forward pass of GGUF llama / qwen2 / qwen3 / gemma3 / qwen35 models: the oracle for the engine.

It shares nothing with the engine but the file reader: weights are dequantized by gguf-py
(``gguf.quants.dequantize``), hyperparameters are read straight from the ``{arch}.*`` metadata keys, the
per-architecture facts are written out again below (not imported from detinfer.model.arch), and the whole sequence
is run at once with a full attention mask (no KV cache, no chunking, no quantized activations). Only use it
in tests.

The model, as llama.cpp runs a GGUF file (``src/models/{llama,qwen2,qwen3,gemma3}.cpp``;
``ggml/src/ggml-cpu/ops.cpp`` for the operators); [arch] marks a step only some architectures have:

    x = token_embd[t]                                                       # [n_embd]
    x = x * sqrt(n_embd)                                           [gemma3] # llama.cpp gemma3.cpp, inp_scaled
    per layer il:
        h = rmsnorm(x) * attn_norm                                          # RMSNorm: Zhang & Sennrich 2019,
                                                                            #   x / sqrt(mean(x^2) + eps)
        q, k, v = attn_q @ h, attn_k @ h, attn_v @ h                        # GGUF matrices are (n_out, n_in)
        q, k, v += attn_{q,k,v}.bias                                [qwen2]
        q_h, k_h = rmsnorm(q_h) * attn_q_norm, rmsnorm(k_h) * attn_k_norm   [qwen3, gemma3] per head
        q, k = rope(q, pos, base_il), rope(k, pos, base_il)                 # RoFormer, Su et al. 2021
        a = softmax(q_h . k_{h // (n_head / n_head_kv)} * scale + mask) @ v # grouped-query attention
        a = attn_output @ a
        a = rmsnorm(a) * post_attention_norm                       [gemma3]
        x = x + a
        h = rmsnorm(x) * ffn_norm
        f = ffn_down @ (act(ffn_gate @ h) * (ffn_up @ h))                   # act: silu (SwiGLU, Shazeer 2020),
                                                                            #   gemma3: gelu, tanh approximation
        f = rmsnorm(f) * post_ffw_norm                             [gemma3]
        x = x + f
    logits = (output or token_embd) @ (rmsnorm(x) * output_norm)

scale = 1/sqrt(head_dim), gemma3: 1/sqrt(query_pre_attn_scalar = 256). mask: causal; gemma3's local layers
(il % 6 < 5) also mask keys p' with p - p' >= sliding_window, and use RoPE base 10000 instead of rope.freq_base
(HF google/gemma-3-270m config.json: sliding_window_pattern 6, rope_local_base_freq 10000; llama.cpp
LLAMA_SWA_TYPE_STANDARD).

RoPE is llama.cpp's NORM mode for llama: each head's ADJACENT pairs (x[2i], x[2i+1]) are rotated by the angle
pos * base^(-2i / head_dim). (HF's llama rotates halves, x[i] with x[i + d/2]; the GGUF converter permutes the
rows of attn_q / attn_k so the adjacent-pair form computes the same thing.) qwen2, qwen3 and gemma3 are NEOX
mode: x[i] is paired with x[i + d/2] (llama.cpp ``llama_model_rope_type``).

qwen35 (Qwen3.5 dense; HF transformers ``modeling_qwen3_5.py``, ``torch_recurrent_gated_delta_rule``; llama.cpp
``src/models/qwen35.cpp``) is :func:`_qwen35_logits`: layer il is a Gated DeltaNet layer iff (il + 1) %
full_attention_interval != 0, else gated attention; ``post_attention_norm`` is the pre-FFN norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import dequantize

from detinfer.model.gguf_file import ModelFile

NEOX_ARCHS = ("qwen2", "qwen3", "gemma3")  # llama.cpp llama_model_rope_type: LLAMA_ROPE_TYPE_NEOX
ARCHS = ("llama", *NEOX_ARCHS, "qwen35")
# gemma3 values the GGUF metadata leaves implicit (HF google/gemma-3-270m config.json).
GEMMA3_SWA_PATTERN, GEMMA3_LOCAL_BASE, GEMMA3_QUERY_PRE_ATTN_SCALAR = 6, 10000.0, 256.0


@dataclass(frozen=True)
class _Hparams:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    eps: float
    window: int  # sliding window of the local layers (0: none)

@dataclass
class _Weights:
    hp: _Hparams
    tensors: dict[str, np.ndarray]  # GGUF tensor name -> float32 array in numpy order (gguf-py's values, exact)


# Dequantized weights per model file path, built once per test session. They are kept in float32, which holds
# gguf-py's dequantized values exactly, and widened to float64 where used (gemma3's 262144-row embedding
# alone would be 1.3 GB in float64).
_CACHE: dict[str, _Weights] = {}


def _hparams(mf: ModelFile) -> _Hparams:
    arch = mf.require("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"reference forward implements {', '.join(ARCHS)}, got {arch!r}")
    n_embd = int(mf.require(f"{arch}.embedding_length"))
    n_head = int(mf.require(f"{arch}.attention.head_count"))
    return _Hparams(
        arch=arch,
        n_vocab=mf.tensor("token_embd.weight").shape[0],
        n_embd=n_embd,
        n_layer=int(mf.require(f"{arch}.block_count")),
        n_head=n_head,
        n_head_kv=int(mf.get(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=int(mf.get(f"{arch}.attention.key_length", n_embd // n_head)),
        rope_base=float(mf.get(f"{arch}.rope.freq_base", 10000.0)),
        eps=float(mf.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        window=int(mf.require(f"{arch}.attention.sliding_window")) if arch == "gemma3" else 0,
    )


def _load(mf: ModelFile) -> _Weights:
    key = str(mf.path.resolve())
    if key not in _CACHE:
        tensors = {}
        for name, info in mf.tensors.items():
            w = dequantize(mf.tensor_data(name), info.ggml_type).astype(np.float32, copy=False)
            tensors[name] = w.reshape(info.shape)
        _CACHE[key] = _Weights(_hparams(mf), tensors)
    return _CACHE[key]


def _mm(x: np.ndarray, w: np.ndarray, rows: int = 32768) -> np.ndarray:
    """x [n, n_in] float64 @ w [n_out, n_in].T in float64, widening w a block of rows at a time."""
    return np.concatenate([x @ w[r : r + rows].astype(np.float64).T for r in range(0, w.shape[0], rows)], axis=1)


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [..., d] -> x / sqrt(mean(x^2) + eps) * w over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, base: float, neox: bool = False) -> np.ndarray:
    """x: [n_tokens, n_heads, head_dim] at positions 0..n_tokens-1 -> rotated copy.

    Pair i (angle pos * base^(-2i/d)) is (x[2i], x[2i+1]) (adjacent, NORM) or, if ``neox``, (x[i], x[i + d/2]).
    """
    n, _, d = x.shape
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]: base^(-2i/d)
    angle = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n, d/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [n, 1, d/2]
    first, second = (np.s_[..., : d // 2], np.s_[..., d // 2 :]) if neox else (np.s_[..., 0::2], np.s_[..., 1::2])
    x0, x1 = x[first], x[second]
    out = np.empty_like(x)
    out[first] = x0 * cos - x1 * sin
    out[second] = x0 * sin + x1 * cos
    return out


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head_kv: int, scale: float, window: int = 0) -> np.ndarray:
    """q: [n, n_head, hd], k, v: [n, n_head_kv, hd] -> [n, n_head * hd]; causal, query head h reads kv head
    h // (n_head / n_head_kv); with ``window`` > 0, query p sees only keys p' with p - p' < window."""
    n, n_head, hd = q.shape
    group = n_head // n_head_kv
    kh = np.repeat(k, group, axis=1).transpose(1, 0, 2)  # [n_head, n, hd]
    vh = np.repeat(v, group, axis=1).transpose(1, 0, 2)  # [n_head, n, hd]
    qh = q.transpose(1, 0, 2)  # [n_head, n, hd]
    scores = qh @ kh.transpose(0, 2, 1) * scale  # [n_head, n_query, n_key]
    dist = np.arange(n)[:, None] - np.arange(n)[None, :]  # query position - key position
    visible = (dist >= 0) & ((dist < window) if window > 0 else True)
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ vh).transpose(1, 0, 2).reshape(n, n_head * hd)


def _gelu_tanh(g: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016; HF "gelu_pytorch_tanh")."""
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


def reference_logits(mf: ModelFile, tokens: list[int]) -> np.ndarray:
    """Logits float64 [len(tokens), n_vocab] for ``tokens`` at positions 0..len-1 (one causal pass, no cache)."""
    wt = _load(mf)
    hp, W = wt.hp, wt.tensors
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= hp.n_vocab:
        raise ValueError(f"tokens must be a non-empty list of ids in [0, {hp.n_vocab}), got {tokens!r}")
    if hp.arch == "qwen35":
        return _qwen35_logits(mf, W, hp, ids)
    n, hd = len(ids), hp.head_dim
    gemma = hp.arch == "gemma3"
    neox = hp.arch in NEOX_ARCHS
    scale = 1 / np.sqrt(GEMMA3_QUERY_PRE_ATTN_SCALAR if gemma else hd)
    x = W["token_embd.weight"][ids].astype(np.float64)  # [n, n_embd]
    if gemma:
        x = x * np.sqrt(hp.n_embd)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        local = gemma and il % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1
        base = GEMMA3_LOCAL_BASE if local else hp.rope_base
        h = _rmsnorm(x, W[p + "attn_norm.weight"], hp.eps)
        q, k, v = (_mm(h, W[p + f"attn_{name}.weight"]) for name in "qkv")
        if hp.arch == "qwen2":
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.reshape(n, hp.n_head, hd), k.reshape(n, hp.n_head_kv, hd), v.reshape(n, hp.n_head_kv, hd)
        if hp.arch in ("qwen3", "gemma3"):
            q, k = _rmsnorm(q, W[p + "attn_q_norm.weight"], hp.eps), _rmsnorm(k, W[p + "attn_k_norm.weight"], hp.eps)
        a = _attention(_rope(q, base, neox), _rope(k, base, neox), v, hp.n_head_kv, scale, hp.window if local else 0)
        a = _mm(a, W[p + "attn_output.weight"])
        if gemma:
            a = _rmsnorm(a, W[p + "post_attention_norm.weight"], hp.eps)
        x = x + a
        h = _rmsnorm(x, W[p + "ffn_norm.weight"], hp.eps)
        g, u = _mm(h, W[p + "ffn_gate.weight"]), _mm(h, W[p + "ffn_up.weight"])  # [n, n_ff]
        f = _mm((_gelu_tanh(g) if gemma else g / (1.0 + np.exp(-g))) * u, W[p + "ffn_down.weight"])
        if gemma:
            f = _rmsnorm(f, W[p + "post_ffw_norm.weight"], hp.eps)
        x = x + f
    x = _rmsnorm(x, W["output_norm.weight"], hp.eps)
    return _mm(x, W.get("output.weight", W["token_embd.weight"]))  # tied embeddings when there is no output.weight


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _qwen35_logits(mf: ModelFile, W: dict[str, np.ndarray], hp: _Hparams, ids: np.ndarray) -> np.ndarray:
    """qwen35, per layer (HF Qwen3_5GatedDeltaNet / Qwen3_5Attention, written out from the formulas):

    DeltaNet: mixed = attn_qkv @ h; z, b, a_in = attn_gate @ h, ssm_beta @ h, ssm_alpha @ h; y = silu(causal
    depthwise conv over time of mixed, kernel ssm_conv1d [C, K], zeros before position 0); q, k, v = split(y)
    (n_k_head x head_k twice, n_v_head x head_v), value head j reading key head j % n_k_head; q, k /= their L2
    norm (at least eps); beta = sigmoid(b); g = softplus(a_in + ssm_dt.bias) * ssm_a; per token
    S_j = S_j * exp(g_j); S_j += k (x) ((v_j - S_j^T k) * beta_j); o_j = S_j^T q / sqrt(head_v); out =
    ssm_out @ (rmsnorm(o_j) * ssm_norm * silu(z_j)). Attention: attn_q rows are [q_h | gate_h] per head; per-head
    q/k norm; NeoX RoPE on the first rope.dimension_count dims; softmax(q k / sqrt(head_dim)) v * sigmoid(gate).
    """
    a = "qwen35"
    interval, n_rot = int(mf.get(f"{a}.full_attention_interval", 4)), int(mf.require(f"{a}.rope.dimension_count"))
    K, dk = int(mf.require(f"{a}.ssm.conv_kernel")), int(mf.require(f"{a}.ssm.state_size"))
    n_kh, n_vh = int(mf.require(f"{a}.ssm.group_count")), int(mf.require(f"{a}.ssm.time_step_rank"))
    dv = int(mf.require(f"{a}.ssm.inner_size")) // n_vh
    n, hd, eps = len(ids), hp.head_dim, hp.eps
    x = W["token_embd.weight"][ids].astype(np.float64)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = _rmsnorm(x, W[p + "attn_norm.weight"], eps)
        if (il + 1) % interval:
            mixed, z = _mm(h, W[p + "attn_qkv.weight"]), _mm(h, W[p + "attn_gate.weight"]).reshape(n, n_vh, dv)
            beta = 1.0 / (1.0 + np.exp(-_mm(h, W[p + "ssm_beta.weight"])))
            u = _mm(h, W[p + "ssm_alpha.weight"]) + W[p + "ssm_dt.bias"]
            g = np.where(u > 20, u, np.log1p(np.exp(np.minimum(u, 20)))) * W[p + "ssm_a"]
            w = W[p + "ssm_conv1d.weight"].astype(np.float64)  # [C, K]
            padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])
            y = _silu(sum(padded[i : i + n] * w[:, i] for i in range(K)))
            key = n_kh * dk
            q, k, v = y[:, :key].reshape(n, n_kh, dk), y[:, key : 2 * key].reshape(n, n_kh, dk), y[:, 2 * key :].reshape(n, n_vh, dv)
            q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), eps)
            k = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), eps)
            S, o = np.zeros((n_vh, dk, dv)), np.empty((n, n_vh, dv))
            for t in range(n):
                for j in range(n_vh):
                    kt, qt = k[t, j % n_kh], q[t, j % n_kh]
                    S[j] *= np.exp(g[t, j])
                    S[j] += np.outer(kt, (v[t, j] - S[j].T @ kt) * beta[t, j])
                    o[t, j] = S[j].T @ qt / np.sqrt(dv)
            out = _rmsnorm(o, W[p + "ssm_norm.weight"], eps) * _silu(z)
            x = x + _mm(out.reshape(n, n_vh * dv), W[p + "ssm_out.weight"])
        else:
            qg = _mm(h, W[p + "attn_q.weight"]).reshape(n, hp.n_head, 2 * hd)
            q, gate = qg[..., :hd], qg[..., hd:].reshape(n, hp.n_head * hd)
            k = _mm(h, W[p + "attn_k.weight"]).reshape(n, hp.n_head_kv, hd)
            v = _mm(h, W[p + "attn_v.weight"]).reshape(n, hp.n_head_kv, hd)
            q, k = _rmsnorm(q, W[p + "attn_q_norm.weight"], eps), _rmsnorm(k, W[p + "attn_k_norm.weight"], eps)
            q, k = q.copy(), k.copy()
            q[..., :n_rot], k[..., :n_rot] = _rope(q[..., :n_rot], hp.rope_base, True), _rope(k[..., :n_rot], hp.rope_base, True)
            att = _attention(q, k, v, hp.n_head_kv, 1 / np.sqrt(hd)) / (1.0 + np.exp(-gate))
            x = x + _mm(att, W[p + "attn_output.weight"])
        h = _rmsnorm(x, W[p + "post_attention_norm.weight"], eps)
        f = _mm(_silu(_mm(h, W[p + "ffn_gate.weight"])) * _mm(h, W[p + "ffn_up.weight"]), W[p + "ffn_down.weight"])
        x = x + f
    x = _rmsnorm(x, W["output_norm.weight"], eps)
    return _mm(x, W.get("output.weight", W["token_embd.weight"]))
