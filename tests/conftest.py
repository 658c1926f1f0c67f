"""Shared fixtures: the real default model (pulled once, hash-verified) and the llama.cpp references."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from detinfer.registry import DEFAULT_MODEL, ensure_model

# CI and every developer have shared/ beside the repo; DETINFER_SHARED points elsewhere (e.g. a clone in /tmp).
SHARED = Path(os.environ.get("DETINFER_SHARED") or Path(__file__).resolve().parents[2] / "shared")
REFERENCE_DIR = SHARED / "reference"


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Path of the default model's .gguf, pulled into $DETINFER_HOME if absent."""
    return ensure_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    """llama.cpp's token ids, greedy continuations and top logits for SmolLM2 (see shared/reference)."""
    path = REFERENCE_DIR / "smollm2-135m-instruct-q4_1.llamacpp.json"
    if not path.exists():
        pytest.fail(f"reference file {path} is missing: the repo expects ../shared/reference beside it")
    return json.loads(path.read_text())
