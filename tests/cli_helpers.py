"""Running the CLI in-process against an isolated $DETINFER_HOME, and a real server in a subprocess (shared by the
CLI and server test modules)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from detinfer.cli import app
from detinfer.records.manifest import RunManifest, write_manifest

runner = CliRunner()


def cli(home: Path, *args):
    """Invoke ``detinfer ARGS`` with DETINFER_HOME=home and a wide terminal (so one-line errors stay one line)."""
    return runner.invoke(app, [str(a) for a in args], env={"DETINFER_HOME": str(home), "COLUMNS": "200"})


def detinfer(home: Path, *args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    """``detinfer ARGS`` in a subprocess (for inputs that would hang an in-process run if a check regressed)."""
    env = dict(os.environ, DETINFER_HOME=str(home), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "detinfer.cli", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)  # fmt: skip


def one_error_line(result, *needles: str, exit_code: int = 2) -> str:
    """The command (a :func:`cli` result or a :func:`detinfer` process) failed with ``exit_code``: no exception
    escaped, no traceback, exactly one ``error:`` line on stderr, the last, holding ``needles``."""
    exception = getattr(result, "exception", None)
    assert exception is None or isinstance(exception, SystemExit), repr(exception)
    code = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert "Traceback" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert code == exit_code, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip("\n").splitlines()[-1] == errors[0], result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def bad_input_row(result, *needles: str) -> str:
    """``replay`` / ``verify`` reported a file as bad input: exit 2, no traceback, the reason in the output."""
    assert "Traceback" not in result.output and result.exit_code == 2, result.output
    assert "bad input" in result.stdout and all(n in result.output for n in needles), result.output
    return result.output


def resealed(data: dict, path: Path) -> Path:
    """``data`` written as a manifest whose section hashes were recomputed (what anyone can do)."""
    write_manifest(RunManifest.model_validate(data), path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args, env: dict[str, str] | None = None, log: Path | None = None, timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """``detinfer serve ARGS`` in a subprocess on a free loopback port, once /health answers: (process, base URL).
    Its stderr goes to ``log`` (else a pipe); a server that exits, or does not answer within ``timeout`` seconds,
    fails the test with the end of its stderr."""
    port = free_port()
    stderr = log.open("w") if log is not None else subprocess.PIPE
    proc = subprocess.Popen([sys.executable, "-m", "detinfer.cli", "serve", "--port", str(port), *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=stderr, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=30)
            tail = log.read_text() if log is not None else proc.stderr.read()
            raise AssertionError("detinfer serve did not start: " + tail[-2000:])
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
