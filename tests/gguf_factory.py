"""Tiny synthetic GGUF files written with gguf-py's ``GGUFWriter``, for tests that need other shapes or broken files.

The default is a llama model the engine can load and run: n_embd 64, 2 layers, 4 query heads over 2 KV heads
(head_dim 16), n_ff 128, and a 299-token byte-level BPE vocabulary (3 control tokens, 256 byte tokens, 40
merges learned from a fixed sentence). Weights are seeded random normals, so every call writes the same bytes.
``architecture`` "qwen2", "qwen3" or "gemma3" adds that architecture's tensors (EXTRA_TENSORS) and metadata
(see :data:`TINY_CONFIGS` for configs that exercise them).
Keyword overrides break one thing at a time: architecture, tensor types, a dropped tensor, a wrong shape,
dropped or extra metadata.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    TokenType,
)
from gguf.quants import quantize

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 as in SmolLM2
CORPUS = "hi there, the cat is on the mat; this is the end of it. hello world, the sun is high in the sky"
N_MERGES = 40

# ChatML, as SmolLM2's template renders it (without the default system message).
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Quantized types gguf-py can produce from floats; any other type is written as zero bytes of the right size
# (enough for a file that must be rejected before its data is read).
_QUANTIZABLE = {GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def bpe_vocab(n_merges: int = N_MERGES) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token_types) of a small byte-level BPE learned greedily from CORPUS.

    Ties between equally frequent pairs go to the lexicographically smallest pair, so the result is fixed.
    """
    chars = _byte_chars()
    words = [[chars[b] for b in w.encode()] for w in re.findall(r" ?[a-z]+| ?[^\sa-z]+", CORPUS)]
    merges: list[str] = []
    merged: list[str] = []
    for _ in range(n_merges):
        pairs = Counter((a, b) for w in words for a, b in zip(w, w[1:]))
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        merged.append(best[0] + best[1])
        for w in words:
            i = 0
            while i < len(w) - 1:
                if (w[i], w[i + 1]) == best:
                    w[i : i + 2] = [best[0] + best[1]]
                else:
                    i += 1
    tokens = [*SPECIALS, *chars, *merged]
    types = [int(TokenType.CONTROL)] * len(SPECIALS) + [int(TokenType.NORMAL)] * (len(chars) + len(merged))
    return tokens, merges, types


@dataclass(frozen=True)
class TinyConfig:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 8192
    rope_freq_base: float = 10000.0
    rms_norm_eps: float = 1e-5
    head_dim: int | None = None  # written as attention.key_length / value_length; None: n_embd // n_head, unwritten
    sliding_window: int = 0  # written as attention.sliding_window when > 0
    # qwen35 (hybrid) only: layer il is Gated DeltaNet iff (il + 1) % interval != 0; the recurrence's heads and widths
    interval: int = 0
    n_rot: int = 0  # rope.dimension_count (0: head_dim)
    ssm_conv_kernel: int = 4
    ssm_n_k_head: int = 2
    ssm_n_v_head: int = 2
    ssm_head: int = 16

    @property
    def q_width(self) -> int:
        return self.n_head * (self.head_dim or self.n_embd // self.n_head)


# Tensors beyond llama's, per architecture (gguf-py MODEL_TENSORS; llama.cpp src/models/<arch>.cpp):
# per layer name -> "q" (q width), "kv" (kv width), "head" (head_dim) or "embd" (n_embd), all 1-D F32.
EXTRA_TENSORS: dict[str, dict[str, str]] = {
    "llama": {},
    "qwen2": {"attn_q.bias": "q", "attn_k.bias": "kv", "attn_v.bias": "kv"},
    "qwen3": {"attn_q_norm.weight": "head", "attn_k_norm.weight": "head"},
    "gemma3": {
        "attn_q_norm.weight": "head",
        "attn_k_norm.weight": "head",
        "post_attention_norm.weight": "embd",
        "post_ffw_norm.weight": "embd",
    },
}

# Tiny configs per architecture: gemma3 gets 7 layers (local 0-4, global 5, local 6 at pattern 6), head_dim 32
# so that n_head * head_dim (128) differs from n_embd, one KV head, and a window of 5 positions.
TINY_CONFIGS: dict[str, TinyConfig] = {
    "llama": TinyConfig(),
    "qwen2": TinyConfig(rope_freq_base=1e6, rms_norm_eps=1e-6),
    "qwen3": TinyConfig(head_dim=32, rope_freq_base=1e6, rms_norm_eps=1e-6),
    "gemma3": TinyConfig(n_layer=7, n_head_kv=1, head_dim=32, rope_freq_base=1e6, rms_norm_eps=1e-6, sliding_window=5),
    # layers 0 and 2 Gated DeltaNet, 1 and 3 gated attention; RoPE on 16 of 32 dims per head
    "qwen35": TinyConfig(n_layer=4, head_dim=32, rope_freq_base=1e7, rms_norm_eps=1e-6, interval=2, n_rot=16),
}


def _qwen35_layer(cfg: TinyConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's mixer tensors in a qwen35 file (llama.cpp src/models/qwen35.cpp; gguf-py MODEL_TENSORS[QWEN35])."""
    p, head_dim = f"blk.{i}.", cfg.head_dim or cfg.n_embd // cfg.n_head
    if (i + 1) % cfg.interval == 0:  # gated full attention: attn_q holds [q_h | gate_h] per head
        kv = cfg.n_head_kv * head_dim
        return {p + "attn_q.weight": (2 * cfg.q_width, cfg.n_embd), p + "attn_k.weight": (kv, cfg.n_embd),
                p + "attn_v.weight": (kv, cfg.n_embd), p + "attn_output.weight": (cfg.n_embd, cfg.q_width),
                p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)}  # fmt: skip
    inner, n_v = cfg.ssm_n_v_head * cfg.ssm_head, cfg.ssm_n_v_head
    conv = 2 * cfg.ssm_n_k_head * cfg.ssm_head + inner
    return {p + "attn_qkv.weight": (conv, cfg.n_embd), p + "attn_gate.weight": (inner, cfg.n_embd),
            p + "ssm_beta.weight": (n_v, cfg.n_embd), p + "ssm_alpha.weight": (n_v, cfg.n_embd),
            p + "ssm_conv1d.weight": (conv, cfg.ssm_conv_kernel), p + "ssm_dt.bias": (n_v,), p + "ssm_a": (n_v,),
            p + "ssm_norm.weight": (cfg.ssm_head,), p + "ssm_out.weight": (cfg.n_embd, inner)}  # fmt: skip


def tensor_shapes(cfg: TinyConfig, n_vocab: int, *, tied: bool = True, architecture: str = "llama") -> dict[str, tuple[int, ...]]:
    """Tensor names and numpy shapes (n_out, n_in) / (n,) of ``architecture`` for ``cfg`` (llama's for an
    architecture not in EXTRA_TENSORS)."""
    head_dim = cfg.head_dim or cfg.n_embd // cfg.n_head
    kv = cfg.n_head_kv * head_dim
    widths = {"q": cfg.q_width, "kv": kv, "head": head_dim, "embd": cfg.n_embd}
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (n_vocab, cfg.n_embd), "output_norm.weight": (cfg.n_embd,)}
    if not tied:
        shapes["output.weight"] = (n_vocab, cfg.n_embd)
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        if architecture == "qwen35":  # post_attention_norm is its pre-FFN norm
            shapes.update({p + "attn_norm.weight": (cfg.n_embd,), **_qwen35_layer(cfg, i), p + "post_attention_norm.weight": (cfg.n_embd,),
                           p + "ffn_gate.weight": (cfg.n_ff, cfg.n_embd), p + "ffn_up.weight": (cfg.n_ff, cfg.n_embd),
                           p + "ffn_down.weight": (cfg.n_embd, cfg.n_ff)})  # fmt: skip
            continue
        shapes.update(
            {
                p + "attn_norm.weight": (cfg.n_embd,),
                p + "attn_q.weight": (cfg.q_width, cfg.n_embd),
                p + "attn_k.weight": (kv, cfg.n_embd),
                p + "attn_v.weight": (kv, cfg.n_embd),
                p + "attn_output.weight": (cfg.n_embd, cfg.q_width),
                p + "ffn_norm.weight": (cfg.n_embd,),
                p + "ffn_gate.weight": (cfg.n_ff, cfg.n_embd),
                p + "ffn_up.weight": (cfg.n_ff, cfg.n_embd),
                p + "ffn_down.weight": (cfg.n_embd, cfg.n_ff),
            }
        )
        shapes.update({p + name: (widths[w],) for name, w in EXTRA_TENSORS.get(architecture, {}).items()})
    return shapes


def _tensor_data(shape: tuple[int, ...], qtype: GGMLQuantizationType, rng: np.random.Generator, norm: bool) -> np.ndarray:
    """Seeded weights of ``shape`` stored as ``qtype``: float arrays for F32/F16, uint8 block bytes otherwise.

    ``norm``: values near 1 (norm weights); otherwise normals of std 0.2 (matrices and biases)."""
    w = (1.0 + 0.1 * rng.standard_normal(shape) if norm else 0.2 * rng.standard_normal(shape)).astype(np.float32)
    if qtype == GGMLQuantizationType.F32:
        return w
    if qtype == GGMLQuantizationType.F16:
        return w.astype(np.float16)
    if qtype in _QUANTIZABLE:
        return quantize(w, qtype)
    block, type_size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size {block}")
    return np.zeros((*shape[:-1], shape[-1] // block * type_size), np.uint8)


def write_tiny_gguf(
    path: str | Path,
    *,
    architecture: str = "llama",
    config: TinyConfig | None = None,
    matrix_type: str = "F32",
    types: dict[str, str] | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    drop_tensors: tuple[str, ...] = (),
    tied: bool = True,
    chat_template: str | None = None,
    pre: str = "smollm",
    drop_metadata: tuple[str, ...] = (),
    extra_metadata: dict[str, tuple[Any, GGUFValueType]] | None = None,
    seed: int = 0,
) -> Path:
    """Write a tiny model to ``path`` and return it.

    config: None for ``TINY_CONFIGS[architecture]`` (the llama default for other architectures).
    matrix_type: GGML type name of every 2-D tensor (norms stay F32); ``types`` overrides single tensors by name.
    shapes: numpy-order shapes replacing the correct ones for the named tensors.
    drop_tensors / drop_metadata: names left out of the file. extra_metadata: key -> (value, GGUFValueType).
    chat_template: None writes no ``tokenizer.chat_template`` (see CHATML for one that works).
    """
    path = Path(path)
    tokens, merges, token_types = bpe_vocab()
    rng = np.random.default_rng(seed)
    arch = architecture
    config = config or TINY_CONFIGS.get(arch, TinyConfig())
    head_dim = config.head_dim or config.n_embd // config.n_head
    metadata: dict[str, tuple[Any, GGUFValueType]] = {
        f"{arch}.context_length": (config.n_ctx_train, GGUFValueType.UINT32),
        f"{arch}.embedding_length": (config.n_embd, GGUFValueType.UINT32),
        f"{arch}.block_count": (config.n_layer, GGUFValueType.UINT32),
        f"{arch}.feed_forward_length": (config.n_ff, GGUFValueType.UINT32),
        f"{arch}.attention.head_count": (config.n_head, GGUFValueType.UINT32),
        f"{arch}.attention.head_count_kv": (config.n_head_kv, GGUFValueType.UINT32),
        f"{arch}.attention.layer_norm_rms_epsilon": (config.rms_norm_eps, GGUFValueType.FLOAT32),
        f"{arch}.rope.freq_base": (config.rope_freq_base, GGUFValueType.FLOAT32),
        f"{arch}.rope.dimension_count": (head_dim, GGUFValueType.UINT32),
        "general.name": ("tiny-test", GGUFValueType.STRING),
        "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING),
        "tokenizer.ggml.pre": (pre, GGUFValueType.STRING),
        "tokenizer.ggml.tokens": (tokens, GGUFValueType.ARRAY),
        "tokenizer.ggml.token_type": (token_types, GGUFValueType.ARRAY),
        "tokenizer.ggml.merges": (merges, GGUFValueType.ARRAY),
        "tokenizer.ggml.bos_token_id": (1, GGUFValueType.UINT32),
        "tokenizer.ggml.eos_token_id": (2, GGUFValueType.UINT32),
        "tokenizer.ggml.add_bos_token": (False, GGUFValueType.BOOL),
    }
    if config.head_dim:
        metadata[f"{arch}.attention.key_length"] = (config.head_dim, GGUFValueType.UINT32)
        metadata[f"{arch}.attention.value_length"] = (config.head_dim, GGUFValueType.UINT32)
    if config.sliding_window:
        metadata[f"{arch}.attention.sliding_window"] = (config.sliding_window, GGUFValueType.UINT32)
    if config.n_rot:
        metadata[f"{arch}.rope.dimension_count"] = (config.n_rot, GGUFValueType.UINT32)
    if config.interval:  # llama.cpp's qwen35 keys; M-RoPE sections whose every rotated pair takes the position row
        metadata.update({f"{arch}.full_attention_interval": (config.interval, GGUFValueType.UINT32),
                         f"{arch}.rope.dimension_sections": ([3, 3, 2, 0], GGUFValueType.ARRAY),
                         f"{arch}.ssm.conv_kernel": (config.ssm_conv_kernel, GGUFValueType.UINT32),
                         f"{arch}.ssm.state_size": (config.ssm_head, GGUFValueType.UINT32),
                         f"{arch}.ssm.group_count": (config.ssm_n_k_head, GGUFValueType.UINT32),
                         f"{arch}.ssm.time_step_rank": (config.ssm_n_v_head, GGUFValueType.UINT32),
                         f"{arch}.ssm.inner_size": (config.ssm_n_v_head * config.ssm_head, GGUFValueType.UINT32)})  # fmt: skip
    if chat_template is not None:
        metadata["tokenizer.chat_template"] = (chat_template, GGUFValueType.STRING)
    metadata.update(extra_metadata or {})

    writer = GGUFWriter(path, arch)  # writes general.architecture itself
    for key, (value, vtype) in metadata.items():
        if key in drop_metadata:
            continue
        if vtype == GGUFValueType.ARRAY:
            sub = GGUFValueType.STRING if isinstance(value[0], str) else GGUFValueType.INT32
            writer.add_key_value(key, value, vtype, sub_type=sub)
        else:
            writer.add_key_value(key, value, vtype)
    for name, shape in tensor_shapes(config, len(tokens), tied=tied, architecture=arch).items():
        vector = len(shape) == 1  # norms and biases stay F32, as converters write them
        shape = (shapes or {}).get(name, shape)
        if name in drop_tensors:
            continue
        norm = name.endswith("norm.weight")
        type_name = (types or {}).get(name, "F32" if vector or name.endswith("ssm_conv1d.weight") else matrix_type)
        qtype = GGMLQuantizationType[type_name]
        data = _tensor_data(shape, qtype, rng, norm)
        if name.endswith(".ssm_a"):  # stored as -exp(A_log) by llama.cpp's converter: a decay, always negative
            data = -np.exp(data)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@dataclass(frozen=True)
class Layout:
    """Byte ranges of a GGUF file's parts: header [0, 24), metadata [24, tensor_infos), tensor infos
    [tensor_infos, data), tensor data [data, size)."""

    tensor_infos: int
    data: int
    size: int


def layout(path: str | Path) -> Layout:
    """Where the metadata, tensor infos and tensor data of a (valid) GGUF file begin."""
    reader = GGUFReader(path)
    return Layout(
        tensor_infos=min(t.field.offset for t in reader.tensors),
        data=min(t.data_offset for t in reader.tensors),
        size=Path(path).stat().st_size,
    )
