"""The README's Python examples run as written: the "Python API" blocks in one namespace, and the "Use it in your
CI" test file in a fresh project with pytest, recording its snapshots and then passing against them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of one "## " section of the README, dedented."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^( *)```python\n(.*?)^\1```", body, flags=re.S | re.M)
    return ["\n".join(line[len(indent):] for line in code.splitlines()) for indent, code in blocks]


def test_the_python_api_examples_run(model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    blocks = python_blocks("Python API")
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README's own examples
    assert (tmp_path / "reply.json").is_file() and namespace["result"].status == "match"
    assert len(namespace["session"].texts) == 2 and namespace["body"]["object"] == "chat.completion"


def test_the_ci_test_file_records_then_passes(model_path: Path, tmp_path: Path):
    (code,) = python_blocks("Use it in your CI")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_readme_ci.py").write_text(code + "\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\ndetinfer_model = smollm2-135m-instruct-q4_1\n")
    shutil.copy(ROOT / "examples" / "ci" / "agent_session.json", tmp_path)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--detinfer-threads", "1"]
    first = subprocess.run([*cmd, "--snapshot-update"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=os.environ)
    assert first.returncode == 0 and "2 snapshots generated" in first.stdout, first.stdout + first.stderr
    assert sorted(p.name for p in (tmp_path / "tests" / "__snapshots__" / "test_readme_ci").iterdir()) == ["test_agent.json", "test_capital.json"]
    again = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=os.environ)
    assert again.returncode == 0 and "2 snapshots passed" in again.stdout, again.stdout + again.stderr
