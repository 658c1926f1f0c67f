"""A synthetic GGUF shaped like Llama-3.2-1B, for the 1B-class benchmark of ``make bench`` (written with gguf-py).

Usage: python bench/synth_model.py [--mix q4_k_m,q8_0] [--seed 0] [--dir DIR]. Writes
``DIR/synthetic-llama-1b-<mix>.gguf`` (default DIR: $DETINFER_HOME/bench), one line per file; a file that is
already there with the sha256 and parameters recorded next to it (``<file>.json``) is not written again.

Shape (:data:`LLAMA_1B`): architecture llama, 16 layers, n_embd 2048, n_ff 8192, n_head 32, n_head_kv 8,
head_dim 64, n_vocab 128256, tied output (no ``output.weight``: ``token_embd.weight`` gives the logits),
rope_freq_base 500000, RMS norm eps 1e-5, context 131072. Llama 3's ``rope_freqs.weight`` (long-context RoPE
scaling) is left out: it changes no matrix and no cost at the benchmark's context.

Mixes (the tensor types of each matrix; norms are always F32):

- ``q4_k_m``: what llama.cpp's Q4_K_M picks for this shape (``llama_tensor_get_type_impl`` in
  src/llama-quant.cpp, as vendored by llama-cpp-python 0.3.36): Q4_K by default; Q6_K for ``token_embd.weight``,
  because with tied embeddings the token embedding is the output tensor and gets the output's type (Q6_K);
  Q6_K for ``attn_v.weight`` and ``ffn_down.weight`` in the layers ``use_more_bits`` picks (i < n/8, i >= 7n/8 or
  (i - n/8) % 3 == 2: layers 0, 1, 4, 7, 10, 13, 14, 15 of 16) and Q4_K in the others.
- ``q8_0``: every matrix Q8_0 (Q8_0 keeps Q8_0 for the output/tied embedding in llama.cpp's rule too).

Weights are random quant-block bytes with f16 scales drawn from :data:`SCALES` (bench/kernels.py
``synthetic_rows``), not quantized floats: the file is for speed only and its outputs mean nothing. The scales
give weights of a typical magnitude of a few hundredths, so activations stay finite through the layers.

Tokenizer: byte-level BPE (``gpt2``, pre-tokenizer ``llama-bpe``) of n_vocab tokens: 256 byte tokens (ids
0-255, GPT-2's byte alphabet), then letter pieces with the merges that build them ("a a" -> "aa", ..., "aa a"
-> "aaa", ...), then 256 control tokens at the end as in Llama 3 (``<|begin_of_text|>`` = BOS at n_vocab - 256,
``<|end_of_text|>`` = EOS after it, ``<|eot_id|>`` at n_vocab - 247, the rest reserved).

Deterministic: one numpy PCG64 stream seeded with ``seed``, tensors in a fixed order, so the same seed and
shape write the same bytes.

``--shape qwen35-0.8b`` (:data:`QWEN35_08B`) writes ``synthetic-qwen35-0.8b-<mix>.gguf`` instead: architecture
qwen35 shaped like Qwen3.5-0.8B (24 layers, every fourth gated full attention: n_embd 1024, n_ff 3584, 8 heads, 2 KV
heads of 256, RoPE on 64 dims, base 1e7; 18 Gated DeltaNet layers of 16 key and 16 value heads of 128, conv kernel
4; n_vocab 248320, tied), with the same kind of random block bytes, F32 conv weights and norms, and ssm_a =
-exp(small normal) (a decay, as llama.cpp's converter stores it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import string
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    TokenType,
)
from kernels import synthetic_rows
from tokenizers import pre_tokenizers

from detinfer.errors import DetinferError
from detinfer.fileio import atomic_path, atomic_write_text, sha256_file
from detinfer.paths import detinfer_home

FORMAT = 1  # bump whenever the bytes written for the same parameters change
MIXES = ("q4_k_m", "q8_0")
FILE_TYPES = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q8_0": LlamaFileType.MOSTLY_Q8_0}
N_CONTROL = 256  # control tokens at the end of the vocabulary, as Llama 3's
# f16 block-scale ranges (d and dmin) per type: typical |weight| of a few hundredths, and no f16 subnormal scale
SCALES = {"Q4_K": (1e-4, 2e-4), "Q6_K": (6.2e-5, 1.2e-4), "Q8_0": (1e-4, 4e-4)}


@dataclass(frozen=True)
class Shape:
    """Model hyperparameters, in GGUF's llama.* terms."""

    n_layer: int = 16
    n_embd: int = 2048
    n_ff: int = 8192
    n_head: int = 32
    n_head_kv: int = 8
    head_dim: int = 64
    n_vocab: int = 128256
    n_ctx_train: int = 131072
    rope_freq_base: float = 500000.0
    rms_norm_eps: float = 1e-5
    arch: str = "llama"
    # qwen35 only: every interval-th layer attention, the others Gated DeltaNet; RoPE dims; the recurrence's heads
    interval: int = 0
    n_rot: int = 0
    ssm_conv_kernel: int = 0
    ssm_n_k_head: int = 0
    ssm_n_v_head: int = 0
    ssm_head: int = 0


LLAMA_1B = Shape()
QWEN35_08B = Shape(n_layer=24, n_embd=1024, n_ff=3584, n_head=8, n_head_kv=2, head_dim=256, n_vocab=248320, n_ctx_train=262144,
                   rope_freq_base=1e7, rms_norm_eps=1e-6, arch="qwen35", interval=4, n_rot=64, ssm_conv_kernel=4,
                   ssm_n_k_head=16, ssm_n_v_head=16, ssm_head=128)  # fmt: skip
SHAPES = {"llama-1b": LLAMA_1B, "qwen35-0.8b": QWEN35_08B}
_QWEN35_FIELDS = ("arch", "interval", "n_rot", "ssm_conv_kernel", "ssm_n_k_head", "ssm_n_v_head", "ssm_head")


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits in Q4_K_M (C++ integer division)."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def tensor_plan(mix: str, shape: Shape) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (numpy shape (n_out, n_in) or (n,), GGML type name), in file order."""
    q, kv = shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim

    def mat(name: str, layer: int | None = None) -> str:
        if mix == "q8_0":
            return "Q8_0"
        more = layer is not None and name in ("attn_v", "ffn_down") and use_more_bits(layer, shape.n_layer)
        return "Q6_K" if name == "token_embd" or more else "Q4_K"

    plan = {"token_embd.weight": ((shape.n_vocab, shape.n_embd), mat("token_embd")),
            "output_norm.weight": ((shape.n_embd,), "F32")}
    if shape.arch == "qwen35":
        return plan | _qwen35_plan(shape, mat)
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        for name, dims in (("attn_norm", (shape.n_embd,)), ("attn_q", (q, shape.n_embd)), ("attn_k", (kv, shape.n_embd)),
                           ("attn_v", (kv, shape.n_embd)), ("attn_output", (shape.n_embd, q)), ("ffn_norm", (shape.n_embd,)),
                           ("ffn_gate", (shape.n_ff, shape.n_embd)), ("ffn_up", (shape.n_ff, shape.n_embd)),
                           ("ffn_down", (shape.n_embd, shape.n_ff))):
            plan[p + name + ".weight"] = (dims, "F32" if len(dims) == 1 else mat(name, i))
    return plan


def _qwen35_plan(shape: Shape, mat) -> dict[str, tuple[tuple[int, ...], str]]:
    """The layers of a qwen35 file (llama.cpp src/models/qwen35.cpp): gated attention (attn_q holds [q_h | gate_h]
    per head) every ``interval``-th layer, Gated DeltaNet in the others; post_attention_norm is the pre-FFN norm."""
    d, q, kv = shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    inner, n_v = shape.ssm_n_v_head * shape.ssm_head, shape.ssm_n_v_head
    conv = 2 * shape.ssm_n_k_head * shape.ssm_head + inner
    plan = {}
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        if (i + 1) % shape.interval == 0:
            mixer = (("attn_q", (2 * q, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)), ("attn_output", (d, q)),
                     ("attn_q_norm", (shape.head_dim,)), ("attn_k_norm", (shape.head_dim,)))  # fmt: skip
        else:
            mixer = (("attn_qkv", (conv, d)), ("attn_gate", (inner, d)), ("ssm_beta", (n_v, d)), ("ssm_alpha", (n_v, d)),
                     ("ssm_conv1d", (conv, shape.ssm_conv_kernel)), ("ssm_dt", (n_v,)), ("ssm_a", (n_v,)),
                     ("ssm_norm", (shape.ssm_head,)), ("ssm_out", (d, inner)))  # fmt: skip
        for name, dims in (("attn_norm", (d,)), *mixer, ("post_attention_norm", (d,)), ("ffn_gate", (shape.n_ff, d)),
                           ("ffn_up", (shape.n_ff, d)), ("ffn_down", (d, shape.n_ff))):  # fmt: skip
            suffix = {"ssm_a": "", "ssm_dt": ".bias"}.get(name, ".weight")
            small = len(dims) == 1 or name in ("ssm_conv1d", "ssm_beta", "ssm_alpha")  # F32 (conv: llama.cpp requires it)
            plan[p + name + suffix] = (dims, "F32" if small else mat(name, i))
    return plan


def vocabulary(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the byte-level BPE described in the module docstring."""
    n_pieces = n_vocab - 256 - N_CONTROL
    if n_pieces < 0:
        raise ValueError(f"n_vocab {n_vocab} is below the {256 + N_CONTROL} byte and control tokens")
    letters = string.ascii_letters
    pairs = [a + b for a in letters for b in letters]
    triples = (p + c for p in pairs for c in letters)
    pieces = list(itertools.islice(itertools.chain(pairs, triples, (p + c + e for p in pairs for c in letters for e in letters)), n_pieces))
    if len(pieces) < n_pieces:
        raise ValueError(f"n_vocab {n_vocab} needs more letter pieces than the {len(pieces)} this vocabulary makes")
    merges = [f"{p[:-1]} {p[-1]}" if len(p) >= 3 else f"{p[0]} {p[1]}" for p in pieces]
    control = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(N_CONTROL - 2)]
    control[9] = "<|eot_id|>"
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + pieces + control
    types = [int(TokenType.NORMAL)] * (256 + n_pieces) + [int(TokenType.CONTROL)] * N_CONTROL
    return tokens, types, merges


def _tensor(name: str, dims: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """F32 norm weights near 1 (qwen35's other F32 tensors: small; ssm_a negative), or raw block bytes uint8
    [n_out, row_bytes] of a quantized type."""
    if kind == "F32":
        if name.endswith("norm.weight"):
            return (1.0 + 0.1 * rng.standard_normal(dims)).astype(np.float32)
        w = (0.1 * rng.standard_normal(dims)).astype(np.float32)
        return -np.exp(w) if name.endswith("ssm_a") else w
    return synthetic_rows(kind, dims[0], dims[1], rng, SCALES[kind])


def _write(path: Path, mix: str, shape: Shape, seed: int) -> None:
    tokens, types, merges = vocabulary(shape.n_vocab)
    plan = tensor_plan(mix, shape)
    writer = GGUFWriter(None, shape.arch)
    writer.add_name(f"synthetic {shape.arch} {'1B-class' if shape.arch == 'llama' else '0.8B-shaped'} {mix} (seed {seed}; "
                    "random weights, for speed only)")  # fmt: skip
    writer.add_file_type(int(FILE_TYPES[mix]))
    writer.add_context_length(shape.n_ctx_train)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.n_rot or shape.head_dim)
    if shape.arch == "qwen35":  # llama.cpp's qwen35 keys (M-RoPE sections that reduce to NeoX RoPE for text)
        writer.add_uint32("qwen35.full_attention_interval", shape.interval)
        writer.add_array("qwen35.rope.dimension_sections", [11, 11, 10, 0])
        writer.add_uint32("qwen35.ssm.conv_kernel", shape.ssm_conv_kernel)
        writer.add_uint32("qwen35.ssm.state_size", shape.ssm_head)
        writer.add_uint32("qwen35.ssm.group_count", shape.ssm_n_k_head)
        writer.add_uint32("qwen35.ssm.time_step_rank", shape.ssm_n_v_head)
        writer.add_uint32("qwen35.ssm.inner_size", shape.ssm_n_v_head * shape.ssm_head)
    writer.add_rope_freq_base(shape.rope_freq_base)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(shape.n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    bos = shape.n_vocab - N_CONTROL
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(bos + 1)
    writer.add_eot_token_id(bos + 9)
    writer.add_add_bos_token(True)
    for name, (dims, kind) in plan.items():
        qtype = GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor_info(name, dims, np.dtype(np.float32), 4 * int(np.prod(dims)))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            writer.add_tensor_info(name, (dims[0], dims[1] // block * size), np.dtype(np.uint8),
                                   dims[0] * dims[1] // block * size, raw_dtype=qtype)
    rng = np.random.default_rng(seed)
    with atomic_path(path) as tmp:
        try:
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for name, (dims, kind) in plan.items():  # one tensor in memory at a time
                writer.write_tensor_data(_tensor(name, dims, kind, rng))
        finally:
            writer.close()


def model_path(folder: Path, mix: str, shape: str = "llama-1b") -> Path:
    return folder / f"synthetic-{shape}-{mix}.gguf"


def write_model(path: str | Path, mix: str, *, seed: int = 0, shape: Shape = LLAMA_1B) -> bool:
    """Write the model of ``mix`` (one of MIXES), ``seed`` and ``shape`` to ``path`` atomically, and its sha256 and
    parameters to ``<path>.json``. Returns False, writing nothing, if both are already there and the file's sha256
    matches the record for the same parameters. Raises ValueError for an unknown mix or an impossible vocabulary,
    InputError (detinfer.errors) for a path that cannot be written."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; known: {', '.join(MIXES)}")
    path = Path(path)
    record_path = path.with_name(path.name + ".json")
    # the qwen35 fields only where set: the llama files' records (written before they existed) stay up to date
    fields = {k: v for k, v in asdict(shape).items() if k in asdict(LLAMA_1B) and (k not in _QWEN35_FIELDS or v != asdict(LLAMA_1B)[k])}
    params = {"format": FORMAT, "mix": mix, "seed": seed, "shape": fields}
    try:
        record = json.loads(record_path.read_text())
        if record["params"] == params and sha256_file(path) == record["sha256"]:
            return False
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record, no file or a stale one: write both
    _write(path, mix, shape, seed)
    atomic_write_text(record_path, json.dumps({"params": params, "sha256": sha256_file(path)}, indent=1) + "\n")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", default=",".join(MIXES), help="comma-separated mixes to write")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", choices=list(SHAPES), default="llama-1b")
    ap.add_argument("--dir", type=Path, default=None, help="output folder (default: $DETINFER_HOME/bench)")
    args = ap.parse_args()
    folder = args.dir or detinfer_home() / "bench"
    try:
        for mix in args.mix.split(","):
            path = model_path(folder, mix, args.shape)
            wrote = write_model(path, mix, seed=args.seed, shape=SHAPES[args.shape])
            print(f"{path}: {'written' if wrote else 'up to date'}")
    except (ValueError, DetinferError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
