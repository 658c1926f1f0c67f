"""Agent sessions: a 20-turn session recorded at 2 threads replays bit for bit at 1 thread, with and without
the prefix cache, and from persisted KV snapshots in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest
from typer.testing import CliRunner

from detinfer.cli import app
from detinfer.compute.engine import Engine, set_threads
from detinfer.compute.numerics import NUMERICS
from detinfer.records.machine import machine
from detinfer.records.replay import replay_turns
from detinfer.records.session import SessionRecord, load_session

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "data" / "agent20.json"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, model_path):
    """The 20-turn script run once at 2 threads, with snapshots saved after every turn."""
    tmp = tmp_path_factory.mktemp("session")
    out, kv = tmp / "session.json", tmp / "kv"
    result = CliRunner().invoke(app, ["session", "run", str(SCRIPT), "--model", str(model_path), "--ctx", "2048",
                                      "--threads", "2", "--out", str(out), "--kv-dir", str(kv), "--quiet"])
    assert result.exit_code == 0, result.output
    return out, kv


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, n_ctx=2048)


def test_record_holds_every_turn_as_tokens(recorded, engine):
    record = load_session(recorded[0])
    assert len(record.turns) == 20 and record.informative["threads"] == 2
    history: list[int] = []
    for i, turn in enumerate(record.turns):
        assert turn.generated_token_ids, f"turn {i + 1} generated nothing"
        # turn k+1's prompt begins with exactly turn k's prompt plus its generated tokens: the reuse proves it
        if i:
            assert turn.reused_tokens == len(history) - 1
        history += turn.appended_token_ids + turn.generated_token_ids
    assert any(t.stop_reason == "eos" for t in record.turns)
    assert len({t.kv_sha256 for t in record.turns}) == 20


def test_a_record_of_other_numerics_is_named_in_every_turn(recorded, engine):
    record = load_session(recorded[0])
    assert record.numerics == NUMERICS and record.informative["machine"] == machine()
    data = json.loads(Path(recorded[0]).read_text())
    del data["numerics"]  # as written before numerics 2: such a record is numerics 1
    old = SessionRecord.model_validate(data)
    for actual, diffs, step in replay_turns(engine, old, until=2):
        assert diffs[0].startswith(f"numerics (recorded with detinfer-numerics/1; this detinfer computes {NUMERICS}"), diffs
        assert diffs[1:] == [], diffs  # the outputs themselves match: only the numerics id is named


@pytest.mark.parametrize("use_cache", [True, False], ids=["prefix-cache", "no-cache"])
def test_replay_at_one_thread_is_bit_identical(recorded, engine, use_cache):
    record = load_session(recorded[0])
    limit = numba.config.NUMBA_NUM_THREADS
    set_threads(1)
    try:
        results = replay_turns(engine, record, use_cache=use_cache)
    finally:
        set_threads(limit)
    for i, (actual, diffs, step) in enumerate(results, start=1):
        assert not diffs, f"turn {i}: {diffs} differ (first divergent step {step})"
        assert actual.reused_tokens == (0 if not use_cache else record.turns[i - 1].reused_tokens)


def test_replay_from_snapshots_in_a_fresh_process(recorded, model_path):
    out, kv = recorded
    assert len(list(kv.glob("turn-*.detkv"))) == 20
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "detinfer.cli", "replay", str(out), "--kv-dir", str(kv), "--threads", "1",
                           "--model", str(model_path), "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert [r["result"] for r in rows] == ["match"] * 20
    assert "warning" not in proc.stderr


def test_corrupt_snapshot_is_a_cache_miss_not_a_wrong_answer(recorded, engine, tmp_path):
    out, kv = recorded
    bad = tmp_path / "kv"
    bad.mkdir()
    for f in kv.glob("turn-00[1-3].detkv"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        (bad / f.name).write_bytes(bytes(data))
    record = load_session(out).model_copy(update={"turns": load_session(out).turns[:4]})
    warnings: list[str] = []
    results = replay_turns(engine, record, kv_dir=bad, warn=warnings.append)
    assert all(not diffs for _, diffs, _ in results)
    assert len(warnings) == 3 and all("recomputing" in w for w in warnings)


def test_branch_from_a_turn(recorded, engine, tmp_path):
    out, _ = recorded
    more = tmp_path / "more.json"
    more.write_text(json.dumps({"sampling": {"max_tokens": 8}, "turns": [{"messages": [{"role": "user", "content": "Now count to three."}]}]}))
    branched = tmp_path / "branched.json"
    result = CliRunner().invoke(app, ["replay", str(out), "--until", "3", "--then", str(more), "--out", str(branched),
                                      "--model", str(engine.model_file.path)])
    assert result.exit_code == 0, result.output
    original, new = load_session(out), load_session(branched)
    assert len(new.turns) == 4 and new.turns[:3] == original.turns[:3]
    assert new.turns[3].messages[0].content == "Now count to three."
    # the branch replays exactly too
    assert all(not d for _, d, _ in replay_turns(engine, new))


def test_bad_scripts_fail_with_one_line(tmp_path, model_path):
    cases = {
        "unknown_role.json": {"turns": [{"messages": [{"role": "robot", "content": "hi"}]}]},
        "empty_turns.json": {"turns": []},
        "not_string.json": {"turns": [{"messages": [{"role": "user", "content": 5}]}]},
        "bad_sampling.json": {"sampling": {"top_p": 2}, "turns": [{"messages": [{"role": "user", "content": "hi"}]}]},
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(data))
        result = CliRunner().invoke(app, ["session", "run", str(path), "--model", str(model_path)])
        assert result.exit_code == 2, (name, result.output)
        assert "Traceback" not in result.output and result.output.strip().count("\n") == 0, result.output


def test_overflowing_turn_keeps_earlier_turns(tmp_path, model_path):
    script = {"sampling": {"max_tokens": 4}, "turns": [
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": "word " * 200}]},
    ]}
    path, out = tmp_path / "s.json", tmp_path / "out.json"
    path.write_text(json.dumps(script))
    result = CliRunner().invoke(app, ["session", "run", str(path), "--model", str(model_path), "--ctx", "128", "--out", str(out), "--quiet"])
    assert result.exit_code == 2 and "turn 2" in result.output and "128" in result.output, result.output
    assert len(load_session(out).turns) == 1
