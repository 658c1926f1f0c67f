"""The engine's forward against the float64 numpy reference (tests/reference_forward.py).

On the real models (SmolLM2, llama; Gemma 3 270M, gemma3) and on tiny synthetic files of every architecture
(tests/gguf_factory.py: llama, qwen2 with q/k/v biases, qwen3 with q/k norms, gemma3 with 7 layers and a
5-position sliding window, run past the window; some with a projection split by tensor type).

Tolerance: the engine computes in float32 from the same dequantized weights, so its logits should sit within
float32 rounding of the reference. Measured as max |engine - reference| / max |reference logit|: SmolLM2 (12
tokens) 3e-6; Gemma 3 270M 1.5e-6 (12 tokens), 1.1e-6 to 1.7e-6 (70 to 87 tokens); the tiny files <= 2e-6. Bugs that keep every
argmax move the logits far more (SmolLM2: RMSNorm eps 1e-6 instead of 1e-5: 4e-4; K/V rounded to f16: 6e-4;
rope base off by 10%: 3e-3; tiny gemma3: local layers on the global RoPE base 5e-2, GELU replaced by SiLU 0.16,
window one too wide 0.54, halves-RoPE replaced by adjacent pairs 0.20; tiny qwen2/qwen3 with adjacent-pair
RoPE ~1). REL_TOL sits ~30x above the float32 noise and ~4x below the smallest such bug.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf_factory import write_tiny_gguf
from reference_forward import _rope, reference_logits

from detinfer.engine import Engine
from detinfer.gguf_file import ModelFile

REL_TOL = 1e-4  # max |engine - reference| allowed, as a fraction of max |reference logit|
N_TOKENS = 12


def check_against_reference(got: np.ndarray, ref: np.ndarray, tokens: list[int], *, argmax: bool = True) -> None:
    assert got.dtype == np.float32 and got.shape == ref.shape, f"engine gave {got.dtype} {got.shape}, want float32 {ref.shape}"
    tol = REL_TOL * np.abs(ref).max()
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


@pytest.fixture(scope="module")
def engine(real_model) -> Engine:
    return Engine.load(real_model[1], n_ctx=512)


def test_engine_matches_reference(engine, real_model):
    _, path, reference = real_model
    prompt = next(p for p in reference["prompts"] if p["name"] == "story")
    tokens = prompt["tokens"][:N_TOKENS]
    got = engine.forward(tokens, engine.new_cache(), all_logits=True)
    check_against_reference(got, reference_logits(ModelFile(path), tokens), tokens)


# (architecture, matrix type, per-tensor types): qwen3 and gemma3 have attn_v in another type than attn_q/attn_k,
# as the real gemma file does, so their q/k/v projection is split in two matrices.
TINY = [
    ("llama", "F32", {}),
    ("qwen2", "Q8_0", {}),
    ("qwen3", "F32", {"blk.1.attn_v.weight": "Q8_0"}),
    ("gemma3", "Q4_0", {f"blk.{i}.attn_v.weight": "Q8_0" for i in (0, 5)}),
]


@pytest.mark.parametrize("arch, matrix_type, types", TINY, ids=[t[0] for t in TINY])
def test_tiny_architectures_match_reference(tmp_path, arch, matrix_type, types):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", architecture=arch, matrix_type=matrix_type, types=types)
    engine = Engine.load(path, n_ctx=64)
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
