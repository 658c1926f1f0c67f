"""Running the CLI in-process against an isolated $DETINFER_HOME (shared by the CLI test modules)."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from detinfer.cli import app

runner = CliRunner()


def cli(home: Path, *args):
    """Invoke ``detinfer ARGS`` with DETINFER_HOME=home and a wide terminal (so one-line errors stay one line)."""
    return runner.invoke(app, [str(a) for a in args], env={"DETINFER_HOME": str(home), "COLUMNS": "200"})
