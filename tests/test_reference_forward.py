"""The engine's forward against the float64 numpy reference (tests/reference_forward.py) on a real prompt.

Tolerance: the engine computes in float32 from the same dequantized weights, so its logits should sit within
float32 rounding of the reference. Measured on SmolLM2-135M (12 tokens, logit scale ~31): the engine (f32 KV)
is 9.3e-5 from the reference (1.2e-4 over 108 tokens); bugs that keep every argmax move the logits far more
(RMSNorm eps 1e-6 instead of 1e-5: 1.2e-2; K/V rounded to f16: 2.0e-2; rope base off by 10%: 8.8e-2).
REL_TOL * scale (~3e-3) sits between, ~30x above the float32 noise and ~4x below the smallest such bug.
"""

from __future__ import annotations

import numpy as np
import pytest
from reference_forward import _rope, reference_logits

from detinfer.engine import Engine
from detinfer.gguf_file import ModelFile

REL_TOL = 1e-4  # max |engine - reference| allowed, as a fraction of max |reference logit|
N_TOKENS = 12


@pytest.fixture(scope="module")
def engine(model_path) -> Engine:
    return Engine.load(model_path, n_ctx=512)


@pytest.fixture(scope="module")
def model_file(model_path) -> ModelFile:
    return ModelFile(model_path)


def test_engine_matches_reference(engine, model_file, smollm2_reference):
    prompt = next(p for p in smollm2_reference["prompts"] if p["name"] == "story")
    tokens = prompt["tokens"][:N_TOKENS]
    ref = reference_logits(model_file, tokens)
    got = engine.forward(tokens, engine.new_cache(), all_logits=True)
    assert got.dtype == np.float32 and got.shape == ref.shape, f"engine gave {got.dtype} {got.shape}, want float32 {ref.shape}"

    top2 = np.sort(ref, axis=1)[:, -2:]
    # The argmax check below is only meaningful if no position is a near-tie within the tolerance.
    tol = REL_TOL * np.abs(ref).max()
    assert (top2[:, 1] - top2[:, 0]).min() > 2 * tol, "test prompt has a near-tie; pick another prompt"

    diff = np.abs(got.astype(np.float64) - ref)
    bad = np.flatnonzero(diff.max(axis=1) > tol)
    if len(bad):
        pos = int(bad[0])
        tok = int(diff[pos].argmax())
        pytest.fail(
            f"position {pos} (token {tokens[pos]}): logit of token {tok} is {got[pos, tok]:.6f}, reference "
            f"{ref[pos, tok]:.6f} (|diff| {diff[pos, tok]:.2e} > tol {tol:.2e}); max |diff| overall {diff.max():.2e}"
        )

    ours, theirs = got.argmax(axis=1), ref.argmax(axis=1)
    for pos in range(len(tokens)):
        assert ours[pos] == theirs[pos], f"position {pos}: engine argmax {ours[pos]}, reference argmax {theirs[pos]}"


def test_reference_rope_depends_only_on_relative_position():
    """RoPE's defining property (RoFormer, eq. 16): <rope(q, m), rope(k, n)> depends on m - n only."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 64))
    n = 40
    qs = _rope(np.broadcast_to(q, (n, 1, 64)).copy(), 1e5)[:, 0]  # q at positions 0..n-1
    ks = _rope(np.broadcast_to(k, (n, 1, 64)).copy(), 1e5)[:, 0]
    dots = qs @ ks.T  # dots[m, j] = <rope(q, m), rope(k, j)>
    for offset in (0, 3, 17):
        diag = np.diagonal(dots, offset)
        np.testing.assert_allclose(diag, diag[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(qs, axis=1), np.linalg.norm(q), rtol=1e-12)
