"""Slow, obviously-correct float64 numpy forward pass of a GGUF llama model: the oracle for the engine.

It shares nothing with the engine but the file reader: weights are dequantized by gguf-py
(``gguf.quants.dequantize``), hyperparameters are read straight from the ``llama.*`` metadata keys, and the
whole sequence is run at once with full causal attention (no KV cache, no chunking, no quantized
activations). Only use it in tests.

The model, as llama.cpp runs a GGUF ``llama`` file (llama.cpp ``src/llama-model.cpp``, ``LLM_ARCH_LLAMA``
graph; ``ggml/src/ggml-cpu/ops.cpp`` for the operators):

    x = token_embd[t]                                                       # [n_embd]
    per layer:
        h = rmsnorm(x) * attn_norm                                          # RMSNorm: Zhang & Sennrich 2019,
                                                                            #   x / sqrt(mean(x^2) + eps)
        q, k, v = attn_q @ h, attn_k @ h, attn_v @ h                        # GGUF matrices are (n_out, n_in)
        q, k = rope(q, pos), rope(k, pos)                                   # RoFormer, Su et al. 2021
        a = softmax(q_h . k_{h // (n_head / n_head_kv)} / sqrt(head_dim), causal) @ v   # grouped-query attention
        x = x + attn_output @ a
        h = rmsnorm(x) * ffn_norm
        x = x + ffn_down @ (silu(ffn_gate @ h) * (ffn_up @ h))              # SwiGLU: Shazeer 2020
    logits = (output or token_embd) @ (rmsnorm(x) * output_norm)

RoPE is llama.cpp's NORMAL mode (the mode for arch llama): each head's ADJACENT pairs (x[2i], x[2i+1]) are
rotated by the angle pos * base^(-2i / head_dim). (HF's llama rotates halves, x[i] with x[i + d/2]; the
GGUF converter permutes the rows of attn_q / attn_k so the adjacent-pair form computes the same thing.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf.quants import dequantize

from detinfer.gguf_file import ModelFile


@dataclass(frozen=True)
class _Hparams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    eps: float


@dataclass
class _Weights:
    hp: _Hparams
    tensors: dict[str, np.ndarray]  # GGUF tensor name -> float64 array in numpy order


# Dequantized float64 weights per model file path: about 1.1 GB for SmolLM2-135M, built once per test session.
_CACHE: dict[str, _Weights] = {}


def _hparams(mf: ModelFile) -> _Hparams:
    arch = mf.require("general.architecture")
    if arch != "llama":
        raise ValueError(f"reference forward only implements llama, got {arch!r}")
    n_embd = int(mf.require("llama.embedding_length"))
    n_head = int(mf.require("llama.attention.head_count"))
    return _Hparams(
        n_vocab=mf.tensor("token_embd.weight").shape[0],
        n_embd=n_embd,
        n_layer=int(mf.require("llama.block_count")),
        n_head=n_head,
        n_head_kv=int(mf.get("llama.attention.head_count_kv", n_head)),
        head_dim=int(mf.get("llama.attention.key_length", n_embd // n_head)),
        rope_base=float(mf.get("llama.rope.freq_base", 10000.0)),
        eps=float(mf.require("llama.attention.layer_norm_rms_epsilon")),
    )


def _load(mf: ModelFile) -> _Weights:
    key = str(mf.path.resolve())
    if key not in _CACHE:
        tensors = {}
        for name, info in mf.tensors.items():
            w = dequantize(mf.tensor_data(name), info.ggml_type).astype(np.float64)
            tensors[name] = w.reshape(info.shape)
        _CACHE[key] = _Weights(_hparams(mf), tensors)
    return _CACHE[key]


def _rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x: [n, d] -> x / sqrt(mean(x^2) + eps) * w, row by row."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    """x: [n_tokens, n_heads, head_dim] at positions 0..n_tokens-1 -> rotated copy (adjacent pairs)."""
    n, _, d = x.shape
    inv_freq = base ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]: base^(-2i/d)
    angle = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n, d/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]  # [n, 1, d/2]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, n_head_kv: int) -> np.ndarray:
    """q: [n, n_head, hd], k, v: [n, n_head_kv, hd] -> [n, n_head * hd]; causal, query head h reads kv head
    h // (n_head / n_head_kv)."""
    n, n_head, hd = q.shape
    group = n_head // n_head_kv
    kh = np.repeat(k, group, axis=1).transpose(1, 0, 2)  # [n_head, n, hd]
    vh = np.repeat(v, group, axis=1).transpose(1, 0, 2)  # [n_head, n, hd]
    qh = q.transpose(1, 0, 2)  # [n_head, n, hd]
    scores = qh @ kh.transpose(0, 2, 1) / np.sqrt(hd)  # [n_head, n_query, n_key]
    scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return (p @ vh).transpose(1, 0, 2).reshape(n, n_head * hd)


def reference_logits(mf: ModelFile, tokens: list[int]) -> np.ndarray:
    """Logits float64 [len(tokens), n_vocab] for ``tokens`` at positions 0..len-1 (one causal pass, no cache)."""
    wt = _load(mf)
    hp, W = wt.hp, wt.tensors
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= hp.n_vocab:
        raise ValueError(f"tokens must be a non-empty list of ids in [0, {hp.n_vocab}), got {tokens!r}")
    n, hd = len(ids), hp.head_dim
    x = W["token_embd.weight"][ids]  # [n, n_embd]
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        h = _rmsnorm(x, W[p + "attn_norm.weight"], hp.eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(n, hp.n_head, hd)
        k = (h @ W[p + "attn_k.weight"].T).reshape(n, hp.n_head_kv, hd)
        v = (h @ W[p + "attn_v.weight"].T).reshape(n, hp.n_head_kv, hd)
        a = _attention(_rope(q, hp.rope_base), _rope(k, hp.rope_base), v, hp.n_head_kv)
        x = x + a @ W[p + "attn_output.weight"].T
        h = _rmsnorm(x, W[p + "ffn_norm.weight"], hp.eps)
        g = h @ W[p + "ffn_gate.weight"].T  # [n, n_ff]
        u = h @ W[p + "ffn_up.weight"].T  # [n, n_ff]
        x = x + (g / (1.0 + np.exp(-g)) * u) @ W[p + "ffn_down.weight"].T
    x = _rmsnorm(x, W["output_norm.weight"], hp.eps)
    out = W.get("output.weight", W["token_embd.weight"])  # tied embeddings when there is no output.weight
    return x @ out.T
