"""The engine's forward against the float64 numpy reference (tests/reference_forward.py).

On the real models (SmolLM2, llama; Gemma 3 270M, gemma3) and on tiny synthetic files of every architecture
(tests/gguf_factory.py: llama, qwen2 with q/k/v biases, qwen3 with q/k norms, gemma3 with 7 layers and a
5-position sliding window, run past the window; some with a projection split by tensor type).

The engine's quantized matmuls take 8-bit activation codes (detinfer-numerics/3, as llama.cpp's CPU dot
products), whose rounding steps (1/254 of a block's largest value) swamp the bugs below; a float64 reference
rounding the same way does not help, as its decisions flip wherever float32 and float64 inputs straddle a step
(measured: no closer to the engine than the float reference). So the architecture is checked with every matrix
widened to float32 (dense matmuls, the engine's own code otherwise) against the float64 reference, and the real
engine only against the 8-bit rounding budget (Q8_REL_TOL; measured max |diff| / max |logit| 0.03 on SmolLM2,
0.11 on Gemma 3, whose FFN inputs carry large outliers; the kernels' own tests check the integer dots exactly).

Tolerance of the float32 comparison: the engine computes in float32 from the same dequantized weights, so its
logits should sit within float32 rounding of the reference. Measured as max |engine - reference| / max |reference logit|: SmolLM2 (12
tokens) 3e-6; Gemma 3 270M 1.5e-6 (12 tokens), 1.1e-6 to 1.7e-6 (70 to 87 tokens); the tiny files <= 2e-6. Bugs that keep every
argmax move the logits far more (SmolLM2: RMSNorm eps 1e-6 instead of 1e-5: 4e-4; K/V rounded to f16: 6e-4;
rope base off by 10%: 3e-3; tiny gemma3: local layers on the global RoPE base 5e-2, GELU replaced by SiLU 0.16,
window one too wide 0.54, halves-RoPE replaced by adjacent pairs 0.20; tiny qwen2/qwen3 with adjacent-pair
RoPE ~1). REL_TOL sits ~30x above the float32 noise and ~4x below the smallest such bug.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_factory import write_tiny_gguf
from reference_forward import _rope, reference_logits

from detinfer.compute.engine import Engine
from detinfer.model.gguf_file import ModelFile
from detinfer.model.weights import Projection, QMatrix

REL_TOL = 1e-4  # max |engine - reference| allowed, as a fraction of max |reference logit|
Q8_REL_TOL = 0.25  # the same for the real engine (8-bit activation codes) against the float64 reference
N_TOKENS = 12


def widened(engine: Engine) -> Engine:
    """``engine`` with every block-quantized matrix replaced by its float32 values (gguf-py's dequantization),
    run by the dense kernel: the forward pass without 8-bit activation codes."""
    mf = engine.model_file

    def dense(mat: QMatrix) -> QMatrix:
        if mat.kind == "dense":
            return mat
        rows = [dequantize(mf.read_tensor(n), mf.tensor(n).ggml_type) for n in mat.name.split("+")]
        w = np.ascontiguousarray(np.concatenate(rows).astype(np.float32)).reshape(mat.n_out, mat.n_in)
        return QMatrix.from_raw(mat.name, GGMLQuantizationType.F32, w.view(np.uint8), mat.n_in)

    def proj(p: Projection | None) -> Projection | None:
        return None if p is None else Projection(tuple(dense(m) for m in p.mats))

    w = engine.weights
    fields = ("attn_qkv", "attn_output", "ssm_in", "ssm_out", "ffn_gate_up", "ffn_down")
    layers = tuple(replace(l, **{f: proj(getattr(l, f)) for f in fields}) for l in w.layers)
    engine.weights = replace(w, layers=layers, output=dense(w.output))
    return engine


def check_against_reference(
    got: np.ndarray, ref: np.ndarray, tokens: list[int], *, argmax: bool = True, rel_tol: float = REL_TOL
) -> None:
    assert got.dtype == np.float32 and got.shape == ref.shape, f"engine gave {got.dtype} {got.shape}, want float32 {ref.shape}"
    tol = rel_tol * np.abs(ref).max()
    diff = np.abs(got.astype(np.float64) - ref)
    bad = np.flatnonzero(diff.max(axis=1) > tol)
    if len(bad):
        pos = int(bad[0])
        tok = int(diff[pos].argmax())
        pytest.fail(
            f"position {pos} (token {tokens[pos]}): logit of token {tok} is {got[pos, tok]:.6f}, reference "
            f"{ref[pos, tok]:.6f} (|diff| {diff[pos, tok]:.2e} > tol {tol:.2e}); max |diff| overall {diff.max():.2e}"
        )
    if not argmax:
        return
    top2 = np.sort(ref, axis=1)[:, -2:]
    # The argmax check is only meaningful if no position is a near-tie within the tolerance.
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * tol, "test prompt has a near-tie; pick another prompt"
    ours, theirs = got.argmax(axis=1), ref.argmax(axis=1)
    for pos in range(len(tokens)):
        assert ours[pos] == theirs[pos], f"position {pos}: engine argmax {ours[pos]}, reference argmax {theirs[pos]}"


def _story(real_model) -> list[int]:
    prompt = next(p for p in real_model[2]["prompts"] if p["name"] == "story")
    return prompt["tokens"][:N_TOKENS]


def test_engine_matches_reference(real_model):
    """The architecture, tight: the engine with float32 matrices against the float64 reference."""
    engine, tokens = widened(Engine.load(real_model[1], n_ctx=512)), _story(real_model)
    got = engine.forward(tokens, engine.new_cache(), all_logits=True)
    check_against_reference(got, reference_logits(ModelFile(real_model[1]), tokens), tokens)


def test_engine_with_activation_codes_stays_near_reference(real_model):
    """The real engine (8-bit activation codes) within the rounding budget of the float64 reference."""
    engine, tokens = Engine.load(real_model[1], n_ctx=512), _story(real_model)
    got = engine.forward(tokens, engine.new_cache(), all_logits=True)
    check_against_reference(got, reference_logits(ModelFile(real_model[1]), tokens), tokens, argmax=False, rel_tol=Q8_REL_TOL)


# (architecture, matrix type, per-tensor types): qwen3 and gemma3 have attn_v in another type than attn_q/attn_k,
# as the real gemma file does, so their q/k/v projection is split in two matrices.
TINY = [
    ("llama", "F32", {}),
    ("qwen2", "Q8_0", {}),
    ("qwen3", "F32", {"blk.1.attn_v.weight": "Q8_0"}),
    ("gemma3", "Q4_0", {f"blk.{i}.attn_v.weight": "Q8_0" for i in (0, 5)}),
    ("qwen35", "F32", {"blk.0.ssm_out.weight": "Q8_0", "blk.1.attn_v.weight": "Q8_0"}),  # Gated DeltaNet + gated attention
]


@pytest.mark.parametrize("arch, matrix_type, types", TINY, ids=[t[0] for t in TINY])
def test_tiny_architectures_match_reference(tmp_path, arch, matrix_type, types):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", architecture=arch, matrix_type=matrix_type, types=types)
    engine = widened(Engine.load(path, n_ctx=64))
    tokens = [(7 * i + 3) % 299 for i in range(37)]  # 37 positions: far past gemma3's 5-position window
    got = engine.forward(tokens, engine.new_cache(), all_logits=True, chunk_size=16)
    # random tiny weights give near-ties, so only the logits are compared
    check_against_reference(got, reference_logits(ModelFile(path), tokens), tokens, argmax=False)


@pytest.mark.parametrize("neox", [False, True])
def test_reference_rope_depends_only_on_relative_position(neox):
    """RoPE's defining property (RoFormer, eq. 16): <rope(q, m), rope(k, n)> depends on m - n only."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 64))
    n = 40
    qs = _rope(np.broadcast_to(q, (n, 1, 64)).copy(), 1e5, neox)[:, 0]  # q at positions 0..n-1
    ks = _rope(np.broadcast_to(k, (n, 1, 64)).copy(), 1e5, neox)[:, 0]
    dots = qs @ ks.T  # dots[m, j] = <rope(q, m), rope(k, j)>
    for offset in (0, 3, 17):
        diag = np.diagonal(dots, offset)
        np.testing.assert_allclose(diag, diag[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(qs, axis=1), np.linalg.norm(q), rtol=1e-12)
