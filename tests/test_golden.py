"""Golden token streams: absolute references in golden/, compared by the pytest plugin's syrupy extension (the one
users' ``detinfer_snapshot`` uses; only the folder and file names differ).

`make golden-update` (pytest --snapshot-update) rewrites them; `git diff golden/` shows what moved. Unlike the
self-comparisons in test_determinism.py, these catch a change that moves every code path together.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from detinfer.integrations.snapshot import TokenStreamExtension
from golden import CASES, GEMMA3, run_case

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"


class GoldenJSONExtension(TokenStreamExtension):
    """One token stream per case, directly in golden/<case>.json (not syrupy's __snapshots__)."""

    @classmethod
    def dirname(cls, *, test_location) -> str:
        return str(GOLDEN_DIR)

    @classmethod
    def get_snapshot_name(cls, *, test_location, index=0) -> str:
        return str(index)


@pytest.fixture(scope="module")
def engines():
    return {}


@pytest.fixture
def golden(snapshot):
    return snapshot.use_extension(GoldenJSONExtension)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_golden_token_stream(case, engines, model_path, golden, request):
    path = request.getfixturevalue("gemma_path") if case.model == GEMMA3 else model_path
    assert run_case(engines, dataclasses.replace(case, model=str(path))) == golden(name=case.name)
