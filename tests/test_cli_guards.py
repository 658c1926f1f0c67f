"""Options that would be silently ignored are refused; corrupt inputs are refused, not shown as fine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import cli, detinfer, one_error_line

from detinfer.compute.engine import Engine
from detinfer.records.kvfile import save_kv


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("guards")
    manifest = tmp / "run.json"
    r = cli(tmp, "run", "--model", model_path, "--prompt", "The capital of France is", "--max-tokens", "3", "--out", manifest, "--quiet")
    assert r.exit_code == 0, r.output
    script = tmp / "s.json"
    script.write_text(json.dumps({"sampling": {"max_tokens": 3}, "turns": [{"messages": [{"role": "user", "content": "Hi"}]}]}))
    session = tmp / "session.json"
    r = cli(tmp, "session", "run", script, "--model", model_path, "--out", session, "--quiet")
    assert r.exit_code == 0, r.output
    return tmp, manifest, script, session


def _one_line_error(r, *needles):
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.output
    for n in needles:
        assert n in lines[0], r.output


@pytest.mark.parametrize("option", [["--max-tokens", "4"], ["--seed", "3"], ["--ctx", "128"], ["--kv-type", "f16"], ["--chat"]])
def test_manifest_with_a_recorded_option_is_refused(recorded, model_path, option):
    tmp, manifest, _, _ = recorded
    _one_line_error(cli(tmp, "run", "--manifest", manifest, "--model", model_path, *option), option[0])


def test_replay_branch_options_are_checked(recorded, model_path):
    tmp, _, script, session = recorded
    _one_line_error(cli(tmp, "replay", session, "--model", model_path, "--until", "1", "--then", script), "--out")
    _one_line_error(cli(tmp, "replay", session, "--model", model_path, "--out", tmp / "x.json"), "--then")
    _one_line_error(cli(tmp, "replay", session, "--model", model_path, "--until", "0"), "--until 0")


def test_messages_with_an_unknown_role_are_refused(recorded, model_path):
    tmp = recorded[0]
    path = tmp / "msgs.json"
    path.write_text(json.dumps([{"role": "bot", "content": "hi"}]))
    _one_line_error(cli(tmp, "run", "--model", model_path, "--messages", path), "'bot'")


def test_kv_inspect_refuses_a_corrupt_file(recorded, model_path):
    tmp = recorded[0]
    engine = Engine.load(model_path, n_ctx=64)
    cache = engine.new_cache()
    engine.forward([1, 2, 3], cache)
    path = tmp / "a.detkv"
    save_kv(path, cache, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
    assert cli(tmp, "kv", "inspect", path).exit_code == 0
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    r = cli(tmp, "kv", "inspect", path)
    assert r.exit_code == 2 and "checksum mismatch" in r.output.splitlines()[-1], r.output


def test_info_ctx_out_of_range(recorded, model_path):
    _one_line_error(cli(recorded[0], "info", model_path, "--ctx", "100000"), "--ctx 100000")
    _one_line_error(cli(recorded[0], "info", model_path, "--ctx", "-5"), "--ctx -5")


def test_chunk_size_zero_before_loading(recorded):
    _one_line_error(cli(recorded[0], "run", "--model", Path("/nonexistent.gguf"), "--prompt", "x", "--chunk-size", "0"), "--chunk-size")


QUICK_EXIT = """
import atexit, pathlib, sys, threading, time
from detinfer.cli import _quick_exit
out = pathlib.Path(sys.argv[1])
threading.Thread(target=lambda: (time.sleep(0.5), (out / "thread").write_text("done"))).start()
atexit.register(lambda: (out / "atexit").write_text("done"))
print("buffered stdout", end="")
_quick_exit(eval(sys.argv[2]))
"""


@pytest.mark.parametrize(("code", "status"), [("None", 0), ("2", 2), ("'a message'", 1)])
def test_quick_exit_does_what_a_normal_exit_must(tmp_path: Path, code: str, status: int):
    """The command skips the interpreter's teardown, not the rest: a running non-daemon thread (a repacked-weights
    save) finishes, atexit handlers run, buffered stdout is written, the exit status is kept."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout into a pipe is then buffered
    r = subprocess.run([sys.executable, "-c", QUICK_EXIT, str(tmp_path), code], capture_output=True, text=True, timeout=60, env=env)
    assert (r.returncode, r.stdout) == (status, "buffered stdout")
    assert (tmp_path / "thread").read_text() == (tmp_path / "atexit").read_text() == "done"
    assert r.stderr == ("a message\n" if status == 1 else "")


@pytest.mark.parametrize(("args", "needles"), [
    (["run", "--temperature", "abc"], ["error: --temperature: must be a valid number", "(see `detinfer run --help`)"]),
    (["run", "--threads", "x"], ["error: --threads: must be a valid integer"]),
    (["verify", "--batch", "0"], ["error: --batch: must be greater than or equal to 1"]),  # as --max-tokens 0 reads
    (["models", "--json"], ["No such option: --json", "(see `detinfer models --help`)"]),
    (["run", "--max-token", "3"], ["No such option: --max-token (Possible options: --max-tokens) (see"]),
    (["run", "--bogus"], ["No such option: --bogus (see `detinfer run --help`)"]),  # click would offer --out
    (["run", "--manifest", "a.json", "--manifest=b.json"], ["--manifest is given twice; give it once (see"]),  # click ran b
    (["bogus"], ["No such command 'bogus' (see `detinfer --help`)"]),
    (["session", "run"], ["Missing argument 'script'", "(see `detinfer session run --help`)"]),
    (["run", "--prompt"], ["Option '--prompt' requires an argument", "--help`)"]),
], ids=["bad-value", "bad-int", "out-of-range", "unknown-option", "near-miss", "no-near-option", "given-twice",
        "unknown-command", "missing-argument", "missing-value"])  # fmt: skip
def test_usage_errors_are_one_line(tmp_path, args, needles):
    """typer draws a usage error in a box of several lines; here it is one line like every other error, exit 2."""
    r = detinfer(tmp_path, *args, timeout=60)
    assert r.stdout == "" and "╭" not in r.stderr, r.stderr
    one_error_line(r, *needles)


def test_no_arguments_still_show_the_help(tmp_path):
    """Negative control for the test above: a group called bare shows its help (exit 2, as click does), not an error."""
    r = detinfer(tmp_path, "session", timeout=60)
    assert r.returncode == 2 and "run" in r.stdout and "error:" not in r.stdout + r.stderr, r.stdout + r.stderr
