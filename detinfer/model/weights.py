"""Weights: GGUF tensors mapped to the forward pass, matrices repacked once at load for the kernels.

Quantized blocks stay quantized: a repacked Q4_1 matrix holds the same 4-bit codes and each block's f16
scale and minimum (which the kernel widens to f32, exactly), regrouped so that ``ROWS`` output rows are
stored k-major (the layout detinfer/compute/kernels.py reads; compute/linear.py calls them). Which tensors exist is the architecture's business (:mod:`detinfer.model.arch`); this
module loads whatever of them the architecture lists, into one :class:`Layer` shape for every architecture.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import GGUFError
from . import quants, weights_cache
from .arch import ARCHITECTURES
from .config import ModelConfig, tensor_shapes
from .gguf_file import ModelFile
from .quants import QK, QK_K, dequantize, unpack_k_rows, unpack_q5_codes

Q = GGMLQuantizationType
ROWS = 64  # output rows per repacked group (a multiple of 16, the rows of one 512-bit integer-dot vector)
R = ROWS
SLICE_ROWS = 256 * R  # rows repacked at a time (a multiple of ROWS, so slices fill whole row groups)


def _groups(a: np.ndarray) -> np.ndarray:
    """Pad axis 0 (rows) with zeros to a multiple of ROWS and split it: [n, ...] -> [G, ROWS, ...]."""
    n = a.shape[0]
    g = -(-n // R)
    if g * R != n:
        a = np.concatenate([a, np.zeros((g * R - n,) + a.shape[1:], a.dtype)])
    return a.reshape((g, R) + a.shape[1:])


def _k_major(a: np.ndarray) -> np.ndarray:
    """[n_rows, ...] -> [G, ..., ROWS] contiguous: row groups with the row index innermost."""
    a = _groups(a)
    return np.ascontiguousarray(np.moveaxis(a, 1, -1))


def _words(codes: np.ndarray) -> np.ndarray:
    """Code bytes [n_rows, nb, k] (k a multiple of 4) -> [G, nb, k*ROWS] of kernels._make_qblock: per row group and
    block, byte i of word g of row r (bytes 4g .. 4g+3 of the row's block) at (g*ROWS + r)*4 + i."""
    a = _groups(codes)  # [G, ROWS, nb, k]
    G, _, nb, k = a.shape
    # moved as 4-byte words rather than bytes with an inner axis of 4, which numpy copies ~4x slower
    words = np.ascontiguousarray(np.moveaxis(a.view(np.uint32), 1, -1))  # [G, nb, k // 4, ROWS]
    return words.view(codes.dtype).reshape(G, nb, k * R)


def _f16_bits(raw: np.ndarray) -> np.ndarray:
    """Little-endian f16 bytes [..., 2] -> their bits, uint16 [...] (the kernels widen them exactly)."""
    return np.ascontiguousarray(raw).view("<u2")[..., 0].astype(np.uint16, copy=False)


def _nibble_words(codes: np.ndarray) -> np.ndarray:
    """4-bit codes uint8 [n, nb, 32] -> uint32 [G, nb, 4*ROWS]: byte i of word g holds codes 4g+i (low nibble)
    and 16+4g+i (high nibble), the GGUF Q4_0/Q4_1 byte order (ggml-quants.c ``block_q4_1``) in groups of 4."""
    c = codes & np.uint8(15)
    return _words(c[..., :16] | (c[..., 16:] << np.uint8(4))).view(np.uint32)


def _high_planes(codes: np.ndarray, n_planes: int) -> np.ndarray:
    """Bit 4 (and 5) of 5-bit (6-bit) codes uint8 [n, nb, 32] -> uint32 [G, nb, ROWS] (one plane) or
    [G, nb, 2, ROWS]: bit g of byte i of plane p holds bit 4 + p of code 4g + i, bit 4 + g that of code
    16 + 4g + i (g, i < 4), beside the nibbles of :func:`_nibble_words` (layout in kernels._make_qblock)."""
    words = np.ascontiguousarray(codes).view("<u4")  # [n, nb, 8]: byte i of word w = 4 half + g is code 4w + i
    planes = []
    for p in range(n_planes):
        bits = (words >> np.uint32(4 + p)) & np.uint32(0x01010101)  # bit 4 + p of code 4w + i at bit 8i
        plane = bits[..., 0].copy()
        for w in range(1, 8):
            plane |= bits[..., w] << np.uint32(w)
        planes.append(_k_major(plane))
    return planes[0] if n_planes == 1 else np.ascontiguousarray(np.stack(planes, axis=2))


@dataclass(frozen=True)
class QMatrix:
    """A weight matrix of shape (n_out, n_in) ready for the matmul kernels.

    kind "q" (every block type): arrays (qs, qh, d, d_hi, m, z, d_super, m_super) of kernels.matmul_q, element e
    of a 32-element block = d * (c_e - z) + m, every scale and offset exact in float32 (ggml-quants.c
    ``dequantize_row_*``), the 32-element block types' f16 d and m kept as their bits (uint16):
      - 4-bit codes c in 0..15, packed nibbles: Q4_0 (z = 8), Q4_1 (m), Q4_K;
      - 5- and 6-bit codes, packed nibbles plus one or two planes of their higher bits (qh), as dense as the
        file: Q5_0 (z = 16), Q5_1 (m), Q5_K, Q6_K (z = 32 and a scale per 16 elements: d for elements 0-15,
        d_hi for 16-31);
      - Q8_0: signed codes, one byte each.
    The k-quants keep their integer sub-block scales (Q4_K, Q5_K: uint8 sc as d and m_sc as m; Q6_K: int8) and
    their super-blocks' f16 factors widened to float32 (d_super = d; m_super = -dmin): the kernel's products
    d_super * sc and m_super * m_sc are exact.
    kind "dense" (F32/F16/BF16): (w float32 [G, n_in, ROWS]) of kernels.matmul_dense.
    """

    name: str
    ggml_type: GGMLQuantizationType
    n_out: int
    n_in: int
    kind: str
    arrays: tuple

    @classmethod
    def from_raw(cls, name: str, ggml_type: GGMLQuantizationType, raw: np.ndarray, n_in: int) -> "QMatrix":
        """Repack raw GGUF rows (uint8 [n_out, row_bytes]) of ``ggml_type`` into the kernels' layout."""
        raw = np.ascontiguousarray(raw)
        n_out = raw.shape[0]
        nb = n_in // QK
        qh = d_hi = m = d_super = m_super = None
        z = 0
        if ggml_type in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q5_1):  # 32-element blocks: f16 d (and m), then the codes
            blocks = raw.reshape(n_out, nb, GGML_QUANT_SIZES[ggml_type][1])
            d = _f16_bits(blocks[:, :, 0:2])
            if ggml_type in (Q.Q4_1, Q.Q5_1):
                m = _f16_bits(blocks[:, :, 2:4])
            z = {Q.Q4_0: 8, Q.Q5_0: 16}.get(ggml_type, 0)
            if ggml_type == Q.Q8_0:
                qs = _words(blocks[:, :, 2:].view(np.int8))
            elif ggml_type in (Q.Q4_0, Q.Q4_1):  # the file's packed bytes are already _nibble_words' byte order
                qs = _words(blocks[:, :, 4:] if ggml_type == Q.Q4_1 else blocks[:, :, 2:]).view(np.uint32)
            else:
                codes = np.empty((n_out, nb, QK), np.uint8)
                unpack_q5_codes(int(ggml_type), raw, codes.reshape(n_out, n_in))
                qs, qh = _nibble_words(codes), _high_planes(codes, 1)
        elif ggml_type in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            codes = np.empty((n_out, nb, QK), np.uint8)
            d_super, m_super = np.empty((2, n_out, n_in // QK_K), np.float32)
            six = ggml_type == Q.Q6_K  # int8 scales per 16 elements, offset -32 d
            sc = np.empty((n_out, 2 * nb if six else nb), np.int8 if six else np.uint8)
            m = np.empty((n_out, 0 if six else nb), np.uint8)
            unpack_k_rows(int(ggml_type), raw, codes.reshape(n_out, n_in), sc, m, d_super, m_super)
            if six:
                z, d, d_hi, m, m_super = 32, sc[:, 0::2], sc[:, 1::2], None, None
            else:
                d, m_super = sc, -m_super  # m = -dmin * m_sc, exact
            qs = _nibble_words(codes)
            if ggml_type != Q.Q4_K:
                qh = _high_planes(codes, 2 if six else 1)
        else:
            w = dequantize(raw, ggml_type)  # F32 / F16 / BF16: widening to f32 is exact
            return cls(name, ggml_type, n_out, n_in, "dense", (_k_major(w),))
        arrays = (qs, qh) + tuple(None if a is None else _k_major(a) for a in (d, d_hi, m)) + (z,) + tuple(
            None if a is None else _k_major(a) for a in (d_super, m_super))
        return cls(name, ggml_type, n_out, n_in, "q", arrays)

    @staticmethod
    def specs(ggml_type: GGMLQuantizationType, n_out: int, n_in: int) -> tuple[str, tuple]:
        """(kind, arrays) of what :meth:`from_raw` makes of an (n_out, n_in) matrix of ``ggml_type``, each array
        as (dtype name, shape) and each other entry as it is (z, None): the layout above, without repacking
        anything (a store's descriptor is checked against it before its arrays are mapped)."""
        G, nb = -(-n_out // R), n_in // QK
        if ggml_type in (Q.F32, Q.F16, Q.BF16):
            return "dense", (("float32", (G, n_in, R)),)
        per_block = ("uint16", (G, nb, R))  # f16 bits of d, or of m
        if ggml_type == Q.Q8_0:
            return "q", (("int8", (G, nb, QK * R)), None, per_block, None, None, 0, None, None)
        qs = ("uint32", (G, nb, 4 * R))
        if ggml_type in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
            qh = ("uint32", (G, nb, R)) if ggml_type in (Q.Q5_0, Q.Q5_1) else None
            m = per_block if ggml_type in (Q.Q4_1, Q.Q5_1) else None
            return "q", (qs, qh, per_block, None, m, {Q.Q4_0: 8, Q.Q5_0: 16}.get(ggml_type, 0), None, None)
        supers = ("float32", (G, n_in // QK_K, R))
        if ggml_type == Q.Q6_K:
            sc = ("int8", (G, nb, R))
            return "q", (qs, ("uint32", (G, nb, 2, R)), sc, sc, None, 32, supers, None)
        qh = ("uint32", (G, nb, R)) if ggml_type == Q.Q5_K else None
        sc = ("uint8", (G, nb, R))
        return "q", (qs, qh, sc, None, sc, 0, supers, supers)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays if isinstance(a, np.ndarray))


def validate_tensors(mf: ModelFile, shapes: dict[str, tuple[int, ...]]) -> None:
    """Check that every expected tensor exists with its shape and a supported type, before any kernel runs.

    Raises GGUFError naming the first tensor that is missing, misshapen or of an unsupported type.
    """
    for name, shape in shapes.items():
        info = mf.supported_tensor(name)
        if info.shape != shape:
            raise GGUFError(f"{mf.path.name}: tensor {name!r} has shape {info.shape}, expected {shape}")
        if len(shape) == 1 and info.ggml_type != Q.F32:
            raise GGUFError(f"{mf.path.name}: vector tensor {name!r} has type {info.type_name}, expected F32")


def _matrix(mf: ModelFile, *names: str, mapped: dict[str, QMatrix] | None = None) -> QMatrix:
    """One QMatrix of the rows of ``names`` (tensors of one type) stacked in order: ``mapped``'s, if it has it
    (a store of :mod:`detinfer.weights_cache`), else repacked from the file.

    Fusing changes no result: every output row keeps its own summation order.
    """
    if mapped is not None and "+".join(names) in mapped:
        return mapped["+".join(names)]
    infos = [mf.tensor(n) for n in names]
    if len({i.ggml_type for i in infos}) > 1:
        raise GGUFError(f"{mf.path.name}: tensors {', '.join(names)} must share one type to be fused")
    ggml_type, n_in = infos[0].ggml_type, infos[0].shape[1]
    if len(names) > 1:
        return QMatrix.from_raw("+".join(names), ggml_type, np.concatenate([mf.read_tensor(n) for n in names]), n_in)
    # One tensor is repacked SLICE_ROWS rows at a time into arrays allocated once, so loading a large matrix
    # (Gemma 3's tied 262144-row output) holds the repacked copy plus one slice, never a second whole copy.
    n_out, arrays, kind = infos[0].shape[0], None, ""
    for start in range(0, n_out, SLICE_ROWS):
        part = QMatrix.from_raw(names[0], ggml_type, mf.read_tensor(names[0], start, start + SLICE_ROWS), n_in)
        if arrays is None:
            G, kind = -(-n_out // R), part.kind
            arrays = tuple(np.empty((G,) + a.shape[1:], a.dtype) if isinstance(a, np.ndarray) else a for a in part.arrays)
        for whole, a in zip(arrays, part.arrays):
            if isinstance(a, np.ndarray):
                whole[start // R : start // R + a.shape[0]] = a
    return QMatrix(names[0], ggml_type, n_out, n_in, kind, arrays)


def _runs(mf: ModelFile, names: tuple[str, ...]) -> list[list[str]]:
    """``names`` cut where the tensor type changes: the tensors each QMatrix of a Projection stacks."""
    runs: list[list[str]] = []
    for n in names:
        if runs and mf.tensor(runs[-1][-1]).ggml_type == mf.tensor(n).ggml_type:
            runs[-1].append(n)
        else:
            runs.append([n])
    return runs


# A layer's projections: the Layer field and the tensors (after "blk.<i>.", before ".weight") whose rows it stacks,
# for an attention layer and for a recurrent (Gated DeltaNet) one; then the FFN's, in every layer.
ATTENTION_PROJECTIONS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "attn_output": ("attn_output",)}
RECURRENT_PROJECTIONS = {"ssm_in": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"), "ssm_out": ("ssm_out",)}
FFN_PROJECTIONS = {"ffn_gate_up": ("ffn_gate", "ffn_up"), "ffn_down": ("ffn_down",)}


def _projections(cfg: ModelConfig, i: int) -> dict[str, tuple[str, ...]]:
    """Layer i's projections: its mixer's (attention or recurrent), then its FFN's."""
    recurrent = bool(cfg.recurrent_layers) and cfg.recurrent_layers[i]
    return (RECURRENT_PROJECTIONS if recurrent else ATTENTION_PROJECTIONS) | FFN_PROJECTIONS


def _matrix_names(mf: ModelFile, cfg: ModelConfig) -> list[list[str]]:
    """The tensors of every QMatrix :meth:`Weights.load` makes, in :attr:`Weights.matrices` order."""
    names = [run for i in range(cfg.n_layer) for parts in _projections(cfg, i).values()
             for run in _runs(mf, tuple(f"blk.{i}.{part}.weight" for part in parts))]  # fmt: skip
    return names + [["token_embd.weight" if cfg.tied_embeddings else "output.weight"]]


_saves: list[threading.Thread] = []  # store writes this process started (Weights.load)


def wait_for_store_saves() -> None:
    """Return once every store of repacked weights this process began writing is written (or given up)."""
    while _saves:
        _saves.pop().join()


def open_store(mf: ModelFile, cfg: ModelConfig) -> weights_cache.Mapped | None:
    """The store of ``mf``'s repacked weights (:func:`detinfer.weights_cache.open_store`), checked against what a
    repack of its tensor table gives, or None: no store, a file that is not indexed, or tensors that
    :meth:`Weights.load` will refuse (it reports them)."""
    if not mf.indexed:
        return None
    try:
        validate_tensors(mf, tensor_shapes(cfg))
    except GGUFError:
        return None
    expected: weights_cache.Expected = {}
    for run in _matrix_names(mf, cfg):
        first = mf.tensor(run[0])
        n_out, n_in = sum(mf.tensor(n).shape[0] for n in run), first.shape[1]
        kind, arrays = QMatrix.specs(first.ggml_type, n_out, n_in)
        expected["+".join(run)] = ({"ggml_type": int(first.ggml_type), "n_out": n_out, "n_in": n_in, "kind": kind}, arrays)
    return weights_cache.open_store(mf.header_key, layout_key(), expected, mf.path.name)


@dataclass(frozen=True)
class Projection:
    """Projections of one input whose outputs are concatenated: out[T, n_out] = x[T, n_in] @ [W_0; W_1; ...].T.

    Consecutive tensors of one type are fused into one QMatrix (one kernel call); a change of type starts a
    new matrix, whose output goes through its own buffer and is copied into its columns of ``out``. Either
    way every output row keeps its own summation order, so fusing never changes a bit.
    """

    mats: tuple[QMatrix, ...]
    buffers: dict = field(default_factory=dict, compare=False, repr=False)  # (T, i) -> float32 [T, n_out_i]: compute/linear.py

    @classmethod
    def load(cls, mf: ModelFile, *names: str, mapped: dict[str, QMatrix] | None = None) -> "Projection":
        return cls(tuple(_matrix(mf, *run, mapped=mapped) for run in _runs(mf, names)))

    @property
    def n_in(self) -> int:
        return self.mats[0].n_in

    @property
    def n_out(self) -> int:
        return sum(m.n_out for m in self.mats)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mats)


@dataclass(frozen=True)
class Layer:
    """One block's weights; a field is None when the architecture has no such tensor (see detinfer.arch).

    Norm and bias vectors are float32; matrices are Projections.
    """

    attn_norm: np.ndarray  # [n_embd]
    ffn_norm: np.ndarray  # [n_embd] (a hybrid model's post_attention_norm: its pre-FFN norm)
    ffn_gate_up: Projection  # rows: gate (n_ff), up (n_ff)
    ffn_down: Projection
    # an attention layer (None in a recurrent one)
    attn_qkv: Projection | None = None  # rows: q (n_head*head_dim; with an output gate [q_h | gate_h] per head), k, v
    attn_output: Projection | None = None
    attn_qkv_bias: np.ndarray | None = None  # [n_head*head_dim + 2 kv_width]: q, k, v biases concatenated (qwen2)
    attn_q_norm: np.ndarray | None = None  # [head_dim], shared by all query heads (qwen3, gemma3, qwen35)
    attn_k_norm: np.ndarray | None = None  # [head_dim]
    post_attention_norm: np.ndarray | None = None  # [n_embd] (gemma3)
    post_ffw_norm: np.ndarray | None = None  # [n_embd] (gemma3)
    # a recurrent (Gated DeltaNet) layer (None in an attention one; compute/kernels.py delta_net)
    ssm_in: Projection | None = None  # rows: q, k, v (ssm_conv_width), z (ssm_d_inner), beta (n_v_head), alpha (n_v_head)
    ssm_out: Projection | None = None
    ssm_conv1d: np.ndarray | None = None  # float32 [ssm_conv_width, ssm_conv_kernel]
    ssm_dt_bias: np.ndarray | None = None  # [n_v_head]
    ssm_a: np.ndarray | None = None  # [n_v_head], -exp(A_log) as the converter stored it
    ssm_norm: np.ndarray | None = None  # [head_v], shared by all value heads

    @property
    def recurrent(self) -> bool:
        return self.ssm_in is not None


@dataclass(frozen=True)
class Weights:
    """All weights of a model, for every architecture in detinfer.arch."""

    token_embd: np.ndarray  # raw rows uint8 [n_vocab, row_bytes], memory-mapped: one row is dequantized per token
    token_embd_type: GGMLQuantizationType
    layers: tuple[Layer, ...]
    output_norm: np.ndarray
    output: QMatrix

    @classmethod
    def load(cls, mf: ModelFile, cfg: ModelConfig, store: weights_cache.Mapped | None = None) -> "Weights":
        """Validate the tensors ``cfg``'s architecture expects, then take the matrices from ``store`` (an
        :func:`open_store` of this file, used only once its checks pass) or repack them. A repack of an indexed file (:attr:`ModelFile.indexed`) is saved as its store for the next
        load, by a thread that the process waits for at exit.

        Raises GGUFError naming the first tensor that is missing, misshapen or of an unsupported type.
        """
        validate_tensors(mf, tensor_shapes(cfg))
        arch = ARCHITECTURES[cfg.arch]
        records = store.records(mf.sha256) if store is not None else None
        mapped = None if records is None else {k: _from_record(k, r) for k, r in records.items()}

        def vec(name: str) -> np.ndarray:
            return np.ascontiguousarray(mf.read_tensor(name).view(np.float32).reshape(-1))

        def proj(*names: str) -> Projection:
            return Projection.load(mf, *names, mapped=mapped)

        def layer(i: int) -> Layer:
            p = f"blk.{i}."
            projections = {f: proj(*(f"{p}{part}.weight" for part in parts)) for f, parts in _projections(cfg, i).items()}
            common = dict(attn_norm=vec(p + "attn_norm.weight"), ffn_norm=vec(p + ("post_attention_norm" if arch.hybrid else "ffn_norm") + ".weight"))
            if "ssm_in" in projections:
                if mf.tensor(p + "ssm_conv1d.weight").ggml_type != Q.F32:  # as llama.cpp's ggml_ssm_conv requires
                    raise GGUFError(f"{mf.path.name}: tensor {p}ssm_conv1d.weight must be F32")
                conv = mf.read_tensor(p + "ssm_conv1d.weight").view(np.float32).reshape(cfg.ssm_conv_width, cfg.ssm_conv_kernel)
                return Layer(**common, **projections, ssm_conv1d=np.ascontiguousarray(conv), ssm_dt_bias=vec(p + "ssm_dt.bias"),
                             ssm_a=vec(p + "ssm_a"), ssm_norm=vec(p + "ssm_norm.weight"))  # fmt: skip
            return Layer(
                **common,
                **projections,
                attn_qkv_bias=np.concatenate([vec(p + f"attn_{n}.bias") for n in "qkv"]) if arch.qkv_bias else None,
                attn_q_norm=vec(p + "attn_q_norm.weight") if arch.qk_norm else None,
                attn_k_norm=vec(p + "attn_k_norm.weight") if arch.qk_norm else None,
                post_attention_norm=vec(p + "post_attention_norm.weight") if arch.post_norms else None,
                post_ffw_norm=vec(p + "post_ffw_norm.weight") if arch.post_norms else None,
            )

        weights = cls(
            token_embd=mf.tensor_data("token_embd.weight"),
            token_embd_type=mf.tensor("token_embd.weight").ggml_type,
            layers=tuple(layer(i) for i in range(cfg.n_layer)),
            output_norm=vec("output_norm.weight"),
            output=_matrix(mf, "token_embd.weight" if cfg.tied_embeddings else "output.weight", mapped=mapped),
        )
        if mf.indexed and (mapped is None or any(m.name not in mapped for m in weights.matrices)):
            records = {m.name: _record(m) for m in weights.matrices}
            # in the background (the arrays are only read); not a daemon, so the process waits for it at exit
            args = (mf.header_key, mf.sha256, layout_key(), records)
            save = threading.Thread(target=weights_cache.save_store, args=args, name="weights-cache-save")
            _saves.append(save)
            save.start()
        return weights

    @property
    def matrices(self) -> list[QMatrix]:
        """Every repacked matrix, layer by layer, then the output."""
        projs = [p for layer in self.layers for p in ((layer.ssm_in, layer.ssm_out) if layer.recurrent else (layer.attn_qkv, layer.attn_output))
                 + (layer.ffn_gate_up, layer.ffn_down)]
        return [m for p in projs for m in p.mats] + [self.output]

    @property
    def nbytes(self) -> int:
        """Bytes held by repacked matrices (the memory-mapped embedding rows are not counted)."""
        return sum(m.nbytes for m in self.matrices)


def _record(m: QMatrix) -> weights_cache.Record:
    return {"ggml_type": int(m.ggml_type), "n_out": m.n_out, "n_in": m.n_in, "kind": m.kind}, m.arrays


def _from_record(name: str, r: weights_cache.Record) -> QMatrix:
    f, arrays = r
    return QMatrix(name, GGMLQuantizationType(f["ggml_type"]), f["n_out"], f["n_in"], f["kind"], arrays)


@cache
def layout_key() -> str:
    """16 hex digits of the sha256 of the code that defines the repacked layout (this module, quants.py and
    weights_cache.py) and of ROWS and QK: a store of :mod:`detinfer.weights_cache` written by code that
    repacks differently has another key, so it is never loaded."""
    h = hashlib.sha256(f"ROWS={R} QK={QK}".encode())
    for module in (__file__, quants.__file__, weights_cache.__file__):
        h.update(Path(module).read_bytes())
    return h.hexdigest()[:16]
