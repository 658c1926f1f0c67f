"""Model config: one frozen object read once from the GGUF ``{arch}.*`` metadata.

Key names follow the GGUF spec (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, "LLM" section).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, GGUFError
from .arch import ARCHITECTURES
from .gguf_file import ModelFile


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a decoder-only transformer.

    n_vocab: vocabulary size (rows of token_embd); n_ctx_train: context length it was trained for;
    n_embd: hidden width; n_layer: number of blocks; n_head / n_head_kv: query / key-value heads
    (grouped-query attention when they differ); head_dim: width of one head; n_ff: FFN inner width;
    rope_freq_base: RoPE theta base; rms_norm_eps: RMSNorm epsilon; tied_embeddings: logits use token_embd
    when the file has no ``output.weight``.
    Attention pattern (see :class:`detinfer.arch.Architecture`): swa_layers[il] is True for a sliding-window
    layer, where the query at position p sees keys p' with p - p' < sliding_window (llama.cpp
    LLAMA_SWA_TYPE_STANDARD) and RoPE uses rope_freq_base_swa; other layers see every earlier position and
    use rope_freq_base. query_pre_attn_scalar: scores are scaled by 1 / sqrt(query_pre_attn_scalar).
    n_rot: dims of each head RoPE rotates (head_dim but for partial RoPE).
    Hybrid (Gated DeltaNet) models: recurrent_layers[il] is True for a recurrent layer (no KV cache; a running
    state per sequence instead); ssm_conv_kernel: the causal conv's width K; ssm_n_k_head / ssm_n_v_head: key and
    value heads of the recurrence (``ssm.group_count`` / ``ssm.time_step_rank``); ssm_head_k / ssm_head_v: their
    widths (``ssm.state_size`` / ``ssm.inner_size`` over the value heads). All 0 / False for other models.
    """

    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rope_freq_base: float
    rms_norm_eps: float
    tied_embeddings: bool
    sliding_window: int
    swa_layers: tuple[bool, ...]
    rope_freq_base_swa: float
    query_pre_attn_scalar: float
    n_rot: int = 0
    recurrent_layers: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_n_k_head: int = 0
    ssm_n_v_head: int = 0
    ssm_head_k: int = 0
    ssm_head_v: int = 0

    @property
    def kv_width(self) -> int:
        """Numbers stored per position per layer for K (and again for V): n_head_kv * head_dim."""
        return self.n_head_kv * self.head_dim

    @property
    def n_attn_layer(self) -> int:
        """Layers with a KV cache: every layer but the recurrent ones."""
        return self.n_layer - sum(self.recurrent_layers)

    @property
    def ssm_conv_width(self) -> int:
        """Channels of a recurrent layer's causal conv: q and k (n_k_head x head_k each), then v (n_v_head x head_v)."""
        return 2 * self.ssm_n_k_head * self.ssm_head_k + self.ssm_n_v_head * self.ssm_head_v

    @property
    def ssm_d_inner(self) -> int:
        """Width of a recurrent layer's output (and of its gate z): n_v_head x head_v."""
        return self.ssm_n_v_head * self.ssm_head_v

    def kv_bytes(self, n_positions: int, bytes_per_number: int) -> int:
        """KV cache size in bytes: n_attn_layer x positions x 2 (K and V) x kv_width x bytes_per_number."""
        return self.n_attn_layer * n_positions * 2 * self.kv_width * bytes_per_number

    @property
    def state_bytes(self) -> int:
        """Recurrent state bytes of one sequence, whatever its length (float32): per recurrent layer the conv's last
        K - 1 inputs (ssm_conv_width each) and the state, n_v_head x head_v x head_k (llama.cpp n_embd_r / n_embd_s)."""
        per_layer = (self.ssm_conv_kernel - 1) * self.ssm_conv_width + self.ssm_n_v_head * self.ssm_head_v * self.ssm_head_k
        return 4 * sum(self.recurrent_layers) * per_layer

    @classmethod
    def from_model(cls, mf: ModelFile) -> "ModelConfig":
        """Read the config from ``mf``'s metadata.

        Raises ConfigError naming the architecture if it is unsupported, or the key if one is missing or invalid.
        """
        arch = mf.architecture
        if arch not in ARCHITECTURES:
            raise ConfigError(
                f"{mf.path.name}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        spec = ARCHITECTURES[arch]
        # Logit soft-capping (Gemma 2; llama.cpp applies it when these keys are present): refused, never ignored.
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f"{arch}.{name}" in mf.metadata:
                raise ConfigError(f"{mf.path.name}: metadata key '{arch}.{name}' (logit soft-capping) is not supported")

        def key(name: str, default=None, kind: type = int):
            """The value of ``{arch}.{name}`` as ``kind``: an int must be stored as an integer, a float as a finite
            number; a list, string, bool or fractional value is rejected, never truncated."""
            full = f"{arch}.{name}"
            if full not in mf.metadata:
                if default is None:
                    raise ConfigError(f"{mf.path.name}: metadata key {full!r} is missing")
                return default
            value = mf.metadata[full]
            if kind is int and isinstance(value, int) and not isinstance(value, bool):
                return value
            if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                return float(value)
            expected = "an integer" if kind is int else "a finite number"
            raise ConfigError(f"{mf.path.name}: metadata key {full!r} is {value!r:.60}, expected {expected}")

        try:
            n_embd = key("embedding_length")
            n_head = key("attention.head_count")
            embd = mf.tensor("token_embd.weight")
        except GGUFError as e:
            raise ConfigError(str(e)) from None
        if n_embd <= 0 or n_head <= 0 or n_embd % n_head:
            raise ConfigError(f"{mf.path.name}: embedding_length {n_embd} is not divisible by head_count {n_head}")
        n_head_kv = key("attention.head_count_kv", n_head)
        if n_head_kv <= 0 or n_head % n_head_kv:
            raise ConfigError(f"{mf.path.name}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        head_dim = key("attention.key_length", n_embd // n_head)
        if head_dim <= 0 or head_dim % 2:
            raise ConfigError(f"{mf.path.name}: head_dim {head_dim} must be even for RoPE")
        n_layer = key("block_count")
        # Bound it by the file before anything is sized by it (the tensor table, per-layer tuples, the KV cache).
        n_blocks = 1 + max((int(b) for b in (t.split(".")[1] for t in mf.tensors if t.startswith("blk.")) if b.isdigit()), default=-1)
        if n_layer > n_blocks:
            raise ConfigError(f"{mf.path.name}: block_count is {n_layer} but the file has tensors for {n_blocks} block(s)")
        rope_freq_base = key("rope.freq_base", 10000.0, float)
        # llama.cpp reads the window only for architectures with a sliding-window pattern; it is required there.
        p = spec.swa_pattern
        window = key("attention.sliding_window") if p else 0
        hybrid = {}
        if spec.hybrid:  # every ssm key is required, as llama.cpp's qwen35 loader requires them
            interval = key("full_attention_interval", 4)
            if interval <= 0:
                raise ConfigError(f"{mf.path.name}: full_attention_interval must be positive, got {interval}")
            n_k_head, n_v_head, inner = key("ssm.group_count"), key("ssm.time_step_rank"), key("ssm.inner_size")
            hybrid = dict(recurrent_layers=tuple((il + 1) % interval != 0 for il in range(max(n_layer, 0))),
                          ssm_conv_kernel=key("ssm.conv_kernel"), ssm_n_k_head=n_k_head, ssm_n_v_head=n_v_head,
                          ssm_head_k=key("ssm.state_size"), ssm_head_v=inner // n_v_head if n_v_head > 0 else 0)  # fmt: skip
            if min(hybrid[k] for k in ("ssm_conv_kernel", "ssm_n_k_head", "ssm_n_v_head", "ssm_head_k")) <= 0 or inner % max(n_v_head, 1) \
                    or n_v_head % n_k_head or hybrid["ssm_head_v"] != hybrid["ssm_head_k"]:  # fmt: skip
                raise ConfigError(f"{mf.path.name}: ssm keys (conv_kernel {hybrid['ssm_conv_kernel']}, group_count {n_k_head}, "
                                  f"time_step_rank {n_v_head}, state_size {hybrid['ssm_head_k']}, inner_size {inner}) must be "
                                  "positive, with time_step_rank a multiple of group_count and inner_size / time_step_rank = state_size")  # fmt: skip
        n_rot = key("rope.dimension_count", head_dim) if spec.partial_rope else head_dim
        if not 0 < n_rot <= head_dim or n_rot % 2:
            raise ConfigError(f"{mf.path.name}: rope.dimension_count {n_rot} must be even and between 2 and head_dim {head_dim}")
        cfg = cls(
            arch=arch,
            n_vocab=key("vocab_size", embd.ne[1] if len(embd.ne) > 1 else 0),
            n_ctx_train=key("context_length"),
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=key("feed_forward_length"),
            rope_freq_base=rope_freq_base,
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", None, float),
            tied_embeddings="output.weight" not in mf.tensors,
            sliding_window=window,
            swa_layers=tuple(p > 0 and il % p < p - 1 for il in range(max(n_layer, 0))),
            rope_freq_base_swa=rope_freq_base if spec.rope_freq_base_swa is None else spec.rope_freq_base_swa,
            query_pre_attn_scalar=float(head_dim) if spec.query_pre_attn_scalar is None else spec.query_pre_attn_scalar,
            n_rot=n_rot,
            **hybrid,
        )
        for name in ("n_vocab", "n_ctx_train", "n_layer", "n_ff"):
            if getattr(cfg, name) <= 0:
                raise ConfigError(f"{mf.path.name}: {name} must be positive, got {getattr(cfg, name)}")
        if spec.swa_pattern and not 0 < cfg.sliding_window < 2**31:  # positions are compared as int64 in the kernels
            raise ConfigError(f"{mf.path.name}: attention.sliding_window must be between 1 and {2**31 - 1}, got {cfg.sliding_window}")
        if cfg.rope_freq_base <= 0 or cfg.rms_norm_eps < 0:
            raise ConfigError(
                f"{mf.path.name}: rope.freq_base {cfg.rope_freq_base} must be > 0 and layer_norm_rms_epsilon "
                f"{cfg.rms_norm_eps} must be >= 0"
            )
        return cfg


def tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Expected GGUF tensors of ``cfg``'s architecture and their numpy shapes (n_out, n_in) / (n,).

    Names from gguf-py ``gguf.constants.MODEL_TENSORS``; the optional ones follow the Architecture's flags.
    """
    arch = ARCHITECTURES[cfg.arch]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (cfg.n_vocab, cfg.n_embd),
        "output_norm.weight": (cfg.n_embd,),
    }
    if not cfg.tied_embeddings:
        shapes["output.weight"] = (cfg.n_vocab, cfg.n_embd)
    q_width = cfg.n_head * cfg.head_dim
    recurrent = cfg.recurrent_layers or (False,) * cfg.n_layer
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        # the pre-FFN norm: ffn_norm, or post_attention_norm in a hybrid model (llama.cpp qwen35.cpp)
        shapes.update({p + "attn_norm.weight": (cfg.n_embd,), p + ("post_attention_norm" if arch.hybrid else "ffn_norm") + ".weight": (cfg.n_embd,),
                       p + "ffn_gate.weight": (cfg.n_ff, cfg.n_embd), p + "ffn_up.weight": (cfg.n_ff, cfg.n_embd),
                       p + "ffn_down.weight": (cfg.n_embd, cfg.n_ff)})  # fmt: skip
        if recurrent[i]:
            n_v = cfg.ssm_n_v_head
            shapes.update({p + "attn_qkv.weight": (cfg.ssm_conv_width, cfg.n_embd), p + "attn_gate.weight": (cfg.ssm_d_inner, cfg.n_embd),
                           p + "ssm_beta.weight": (n_v, cfg.n_embd), p + "ssm_alpha.weight": (n_v, cfg.n_embd),
                           p + "ssm_conv1d.weight": (cfg.ssm_conv_width, cfg.ssm_conv_kernel), p + "ssm_dt.bias": (n_v,),
                           p + "ssm_a": (n_v,), p + "ssm_norm.weight": (cfg.ssm_head_v,), p + "ssm_out.weight": (cfg.n_embd, cfg.ssm_d_inner)})  # fmt: skip
            continue
        shapes.update(
            {
                p + "attn_q.weight": ((2 if arch.attn_output_gate else 1) * q_width, cfg.n_embd),
                p + "attn_k.weight": (cfg.kv_width, cfg.n_embd),
                p + "attn_v.weight": (cfg.kv_width, cfg.n_embd),
                p + "attn_output.weight": (cfg.n_embd, q_width),
            }
        )
        if arch.qkv_bias:
            shapes.update({p + "attn_q.bias": (q_width,), p + "attn_k.bias": (cfg.kv_width,), p + "attn_v.bias": (cfg.kv_width,)})
        if arch.qk_norm:
            shapes.update({p + "attn_q_norm.weight": (cfg.head_dim,), p + "attn_k_norm.weight": (cfg.head_dim,)})
        if arch.post_norms:
            shapes.update({p + "post_attention_norm.weight": (cfg.n_embd,), p + "post_ffw_norm.weight": (cfg.n_embd,)})
    return shapes
