"""detinfer's pytest plugin, active wherever detinfer is installed (entry point ``pytest11``; opt out with
``-p no:detinfer``).

Fixtures:
    detinfer_llm (session scope): the model of ``--detinfer-model`` / ini ``detinfer_model`` (a registry name or
        a .gguf path; default: the registry's default model), loaded once, threads from ``--detinfer-threads``.
    detinfer_snapshot: syrupy's ``snapshot`` with detinfer's token-stream extension (detinfer/snapshot.py):
        ``assert detinfer_llm.chat(messages) == detinfer_snapshot``. Needs syrupy (``pip install 'detinfer[pytest]'``).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("detinfer", "detinfer (deterministic LLM snapshots)")
    group.addoption("--detinfer-model", default=None, help="Model of the detinfer_llm fixture: registry name or .gguf path.")
    group.addoption("--detinfer-threads", type=int, default=None, help="Threads of the detinfer_llm fixture (never changes a result).")
    parser.addini("detinfer_model", "Model of the detinfer_llm fixture (registry name or .gguf path).", default=None)


@pytest.fixture(scope="session")
def detinfer_llm(pytestconfig: pytest.Config):
    """The loaded model (:class:`detinfer.LLM`); a model that cannot be loaded fails the test with one line."""
    from ..api import load
    from ..errors import DetinferError

    model = pytestconfig.getoption("detinfer_model") or pytestconfig.getini("detinfer_model") or None
    try:
        return load(model, threads=pytestconfig.getoption("detinfer_threads"))
    except DetinferError as e:
        pytest.fail(f"detinfer_llm: {e}", pytrace=False)


@pytest.fixture
def detinfer_snapshot(request: pytest.FixtureRequest):
    """A syrupy snapshot storing detinfer results as token streams, one JSON file per assertion."""
    try:
        from .snapshot import TokenStreamExtension
    except ImportError:
        pytest.fail("detinfer_snapshot needs syrupy: pip install 'detinfer[pytest]'", pytrace=False)
    return request.getfixturevalue("snapshot").use_extension(TokenStreamExtension)
