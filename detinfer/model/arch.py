"""Architecture descriptions: what in a GGUF file's metadata and tensor set drives which step of the forward pass.

One :class:`Architecture` per supported ``general.architecture``, in :data:`ARCHITECTURES`. The config reads
metadata through it (:mod:`detinfer.model.config`), the weights load the tensors it implies (:func:`detinfer.model.config.tensor_shapes`),
and the engine runs one forward pass whose optional steps it switches on. Adding a decoder-only architecture
built from the same operators is one entry here; a new operator is a kernel plus a flag.

The per-architecture facts follow llama.cpp (``src/llama-model.cpp``: ``llama_model_rope_type``, the
per-arch hyperparameter loading; ``src/models/<arch>.cpp``: the graphs) and gguf-py's tensor names
(``gguf.constants.MODEL_TENSORS``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture maps onto the shared forward pass.

    rope_style: "norm" rotates adjacent pairs (x[2i], x[2i+1]), "neox" rotates halves (x[i], x[i + head_dim/2]),
      as llama.cpp's ``llama_model_rope_type`` gives LLAMA_ROPE_TYPE_NORM / LLAMA_ROPE_TYPE_NEOX for the arch.
    activation: FFN gate activation, "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh approximation).
    qkv_bias: attn_q/k/v have ``.bias`` vectors added after the projection (qwen2).
    qk_norm: per-head RMSNorm of q and k (``attn_q_norm`` / ``attn_k_norm``, [head_dim]) before RoPE.
    post_norms: RMSNorm of the attention and FFN outputs before each residual add (``post_attention_norm``,
      ``post_ffw_norm``; gemma3).
    embd_scale: token embeddings are multiplied by sqrt(n_embd) (float32) before the first layer.
    swa_pattern: 0 if every layer attends to all earlier positions; p > 0 if layer il is a sliding-window
      (local) layer iff il % p < p - 1 (llama.cpp ``llama_hparams::set_swa_pattern``, dense_first false); the
      window is read from ``{arch}.attention.sliding_window``.
    rope_freq_base_swa: RoPE base of the local layers (None: the same as ``{arch}.rope.freq_base``).
    query_pre_attn_scalar: attention scores are scaled by 1/sqrt of this (None: head_dim).
    hybrid: some layers are Gated DeltaNet (recurrent-state) layers instead of attention (qwen35): layer il is
      recurrent iff (il + 1) % ``{arch}.full_attention_interval`` != 0 (default 4); its ``ssm_*`` keys and tensors
      are required, and ``post_attention_norm`` is the pre-FFN norm (llama.cpp src/models/qwen35.cpp).
    attn_output_gate: attn_q also holds a gate per head ([q_h | gate_h] rows, head by head); the attention output
      is multiplied by sigmoid(gate) before attn_output (qwen35).
    partial_rope: RoPE rotates only the first ``{arch}.rope.dimension_count`` dims of each head (qwen35).
    """

    name: str
    rope_style: str
    activation: str = "silu"
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    embd_scale: bool = False
    swa_pattern: int = 0
    rope_freq_base_swa: float | None = None
    query_pre_attn_scalar: float | None = None
    hybrid: bool = False
    attn_output_gate: bool = False
    partial_rope: bool = False


LLAMA = Architecture("llama", rope_style="norm")

# Qwen2 (llama.cpp src/models/qwen2.cpp): llama with biases on the q/k/v projections and NeoX RoPE.
QWEN2 = Architecture("qwen2", rope_style="neox", qkv_bias=True)

# Qwen3 (llama.cpp src/models/qwen3.cpp): no biases; per-head RMSNorm of q and k before NeoX RoPE.
QWEN3 = Architecture("qwen3", rope_style="neox", qk_norm=True)

# Gemma 3 (Gemma Team 2025, "Gemma 3 Technical Report"; llama.cpp src/models/gemma3.cpp, iswa variant).
# The GGUF metadata leaves these values implicit; they come from llama.cpp's gemma3 hparams and agree with
# the published HF config of google/gemma-3-270m (config.json):
#   sliding_window_pattern 6           -> swa_pattern 6 (5 local layers, then 1 global)
#   rope_local_base_freq 10000         -> rope_freq_base_swa (global layers use gemma3.rope.freq_base, 1e6)
#   query_pre_attn_scalar 256          -> scores scaled by 1/16 (llama.cpp: 1/sqrt(head_dim) = 1/sqrt(256))
#   hidden_activation gelu_pytorch_tanh -> "gelu_tanh"
#   final_logit_softcapping null       -> no logit softcap (llama.cpp applies none in the iswa graph)
# The norms are plain RMSNorm with the stored weight: the converter (convert_hf_to_gguf.py, Gemma3Model)
# already added gemma's "+1" to every norm.weight.
GEMMA3 = Architecture(
    "gemma3",
    rope_style="neox",
    activation="gelu_tanh",
    qk_norm=True,
    post_norms=True,
    embd_scale=True,
    swa_pattern=6,
    rope_freq_base_swa=10000.0,
    query_pre_attn_scalar=256.0,
)

# Qwen3.5 dense (llama.cpp src/models/qwen35.cpp, delta-net-base.cpp; HF modeling_qwen3_5.py): Gated DeltaNet layers
# (Yang et al. 2024, "Gated Delta Networks") with three of every four layers, gated full attention in the fourth.
# Attention: per-head q/k RMSNorm, NeoX RoPE on the first rope.dimension_count dims (llama.cpp's IMROPE for text:
# every position row is the token's position), a sigmoid output gate. The converter stored every norm with its +1
# (but ssm_norm) and ssm_a as -exp(A_log).
QWEN35 = Architecture("qwen35", rope_style="neox", qk_norm=True, hybrid=True, attn_output_gate=True, partial_rope=True)

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (LLAMA, QWEN2, QWEN3, GEMMA3, QWEN35)}
