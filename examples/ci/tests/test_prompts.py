"""This project's prompts and agent session, pinned token for token.

`pytest` fails with the first divergent step the day a model, a library or a prompt change moves one token;
`pytest --snapshot-update` records the new streams (review them with `git diff tests/__snapshots__`).
"""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = json.loads((ROOT / "prompts.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", PROMPTS, ids=lambda case: case["name"])
def test_prompt(detinfer_llm, detinfer_snapshot, case):
    assert detinfer_llm.chat(case["messages"], **case["sampling"]) == detinfer_snapshot


def test_agent_session(detinfer_llm, detinfer_snapshot):
    assert detinfer_llm.session(ROOT / "agent_session.json") == detinfer_snapshot
