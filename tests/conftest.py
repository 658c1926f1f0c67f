"""Shared fixtures: the real default model (pulled once, hash-verified) and the llama.cpp references."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from gguf_factory import CHATML, write_tiny_gguf

from detinfer.model.registry import DEFAULT_MODEL, ensure_model
from detinfer.paths import detinfer_home

# Tests that give the CLI an empty $DETINFER_HOME share one store of repacked weights (content-addressed, so
# sharing it is safe) instead of writing 100-250 MB into every temporary home.
os.environ.setdefault("DETINFER_WEIGHTS_CACHE", str(detinfer_home() / "weights"))

# scripts/golden.py (the committed cases) is repo tooling, not part of the package: the tests import it from there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

# llama.cpp's reference data lives in the repo (tests/data/llamacpp/README.md says how it was produced).
REFERENCE_DIR = Path(__file__).resolve().parent / "data" / "llamacpp"


GEMMA_MODEL = "gemma3-270m-q4_k_m"  # registry name of the gemma3 model the architecture tests run


def _reference(filename: str) -> dict:
    return json.loads((REFERENCE_DIR / filename).read_text())


@pytest.fixture(scope="session")
def model_path() -> Path:
    """Path of the default model's .gguf, pulled into $DETINFER_HOME if absent."""
    return ensure_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Path of Gemma 3 270M (Q4_K_M), pulled into $DETINFER_HOME if absent."""
    return ensure_model(GEMMA_MODEL)


@pytest.fixture(scope="session")
def smollm2_reference() -> dict:
    """llama.cpp's token ids, greedy continuations and top logits for SmolLM2 (tests/data/llamacpp)."""
    return _reference("smollm2-135m-instruct-q4_1.llamacpp.json")


@pytest.fixture(scope="session")
def gemma3_reference() -> dict:
    """llama.cpp's token ids, greedy continuations and top logits for Gemma 3 270M (tests/data/llamacpp)."""
    return _reference("gemma3-270m-q4_k_m.llamacpp.json")


# The real models the engine is checked on: name -> (path fixture, llama.cpp reference fixture).
REAL_MODELS = {"smollm2": ("model_path", "smollm2_reference"), "gemma3": ("gemma_path", "gemma3_reference")}


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def real_model(request) -> tuple[str, Path, dict]:
    """(name, .gguf path, llama.cpp reference) of each real model in turn: a test using it runs once per model."""
    path_fixture, reference_fixture = REAL_MODELS[request.param]
    return request.param, request.getfixturevalue(path_fixture), request.getfixturevalue(reference_fixture)


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny synthetic chat model (tests/gguf_factory.py, a ChatML template): for bad-input and bounds tests
    that need a model, not its text."""
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-chat") / "tiny-chat.gguf", chat_template=CHATML)
