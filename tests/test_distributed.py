"""Ray fan-out (`verify/replay --ray`, `batch`) against a real local Ray cluster, on the real SmolLM2 model.

One cluster per module (ray.init with 2 CPUs, bound to 127.0.0.1); the library runs in this process as the
driver and the CLI runs in subprocesses that join the cluster by its address. Batch manifests are compared byte
for byte: without Ray, with one actor, with two actors in another order, and after a worker is killed mid-item.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from detinfer.cli import _bare_ray
from detinfer.compute.sampling import SamplingOverrides
from detinfer.errors import InputError
from detinfer.integrations.batch import (
    BAD_INPUT,
    WRITTEN,
    BatchWriter,
    WorkerState,
    batch_failed,
    batch_task,
    read_batch,
    reexecute_task,
)
from detinfer.integrations.distributed import check_address, fan_out, run_on_ray
from detinfer.records.engines import EngineCache
from detinfer.records.outcome import MATCH, Outcome
from detinfer.records.session import ScriptTurn, run_session
from detinfer.records.verify import read_all, reexecute_file

ROOT = Path(__file__).resolve().parent.parent
LINES = [  # short runs: plain, chat, seeded sampling, messages with a stop string, an f32 greedy list
    {"id": "plain", "prompt": "The capital of France is", "sampling": {"max_tokens": 6}},
    {"id": "chat", "prompt": "Name a color.", "chat": True, "sampling": {"max_tokens": 6}},
    {"id": "sampled", "prompt": "Write about the sea.", "sampling": {"max_tokens": 6, "temperature": 0.8, "top_p": 0.9, "seed": 7}},
    {"id": "messages", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Count to five."}],
     "sampling": {"max_tokens": 6, "stop": ["4"]}},
    {"id": "numbers", "prompt": "1, 2, 3,", "sampling": {"max_tokens": 6}},
]


TEST_BUDGET_S = 300  # each test here ends by then, hung cluster or not


@pytest.fixture(autouse=True)
def bounded():
    """Fail a test that runs longer than TEST_BUDGET_S instead of letting a stuck Ray call hang CI."""
    def expire(*_):
        raise TimeoutError(f"test ran over {TEST_BUDGET_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_BUDGET_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def cluster(model_path):
    """A local Ray cluster of 2 CPUs owned by this module; yields its address. Stopped (only what it started) at
    the end."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # node address 127.0.0.1: loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    import ray

    ctx = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 2**20)
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def _run_batch(batch: Path, out_dir: Path, **kw) -> list:
    """The driver side of `batch` through the library: each result written as it arrives."""
    writer = BatchWriter(out_dir)
    todo, _ = writer.pending(read_batch(batch), resume=False)
    return fan_out(batch_task, todo, lambda i, r: writer.write(r), batch_failed, **kw)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.json"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, batch_file) -> dict[str, bytes]:
    """The batch run in this process, without Ray: the bytes every other run must reproduce."""
    out = tmp_path_factory.mktemp("no-ray")
    results = _run_batch(batch_file, out)
    assert [r.status for r in results] == [WRITTEN] * len(LINES), [r.message for r in results]
    return _files(out)


def _cli(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "detinfer.cli", *map(str, args)], cwd=kw.pop("cwd", ROOT), capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_batch_manifests_are_byte_identical_without_ray_with_one_actor_and_two_in_any_order(cluster, batch_file, reference, tmp_path):
    assert sorted(reference) == sorted(f"{line['id']}.json" for line in LINES)
    one = tmp_path / "one"
    _run_batch(batch_file, one, ray=cluster, actors=1)
    assert _files(one) == reference

    items = read_batch(batch_file)
    random.Random(3).shuffle(items)
    pids: set[int] = set()
    writer = BatchWriter(tmp_path / "two")
    run_on_ray(batch_task, items, lambda i, r: writer.write(r), batch_failed, address=cluster, actors=2,
               on_dispatch=lambda i, pid: pids.add(pid))
    assert len(pids) == 2  # both actors ran items
    assert _files(tmp_path / "two") == reference

    # a batch manifest is a normal run manifest: verify re-executes it
    assert reexecute_file(tmp_path / "two" / "sampled.json", EngineCache()).status == MATCH
    # negative control: another seed on one line changes that file's bytes, so the comparison above can fail
    changed = tmp_path / "changed.jsonl"
    changed.write_text(json.dumps({**LINES[2], "sampling": {**LINES[2]["sampling"], "seed": 8}}) + "\n")
    _run_batch(changed, tmp_path / "changed")
    assert (tmp_path / "changed" / "sampled.json").read_bytes() != reference["sampled.json"]


def test_a_worker_killed_mid_item_is_retried_on_another_and_nothing_is_lost_or_counted_twice(cluster, batch_file, reference, tmp_path):
    items = read_batch(batch_file)
    dispatched: list[tuple[int, int]] = []
    killed: list[int] = []

    def on_dispatch(i: int, pid: int) -> None:
        dispatched.append((i, pid))
        if not killed:
            # the first item's worker is killed as soon as the item is sent: a fresh worker takes far longer than
            # this to load the model, so the item is in flight (a kill 0.5 s later lost that race on a fast runner)
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

    arrived: list[int] = []
    writer = BatchWriter(tmp_path / "out")
    results = run_on_ray(batch_task, items, lambda i, r: (arrived.append(i), writer.write(r)), batch_failed,
                         address=cluster, actors=2, on_dispatch=on_dispatch)
    first = dispatched[0][0]
    runs_of_first = [pid for i, pid in dispatched if i == first]
    assert len(runs_of_first) == 2 and runs_of_first[1] != killed[0]  # run again, by another worker process
    assert sorted(arrived) == list(range(len(items)))  # every item reported exactly once
    assert [r.id for r in results] == [line["id"] for line in LINES] and all(r.status == WRITTEN for r in results)
    assert _files(tmp_path / "out") == reference
    with pytest.raises(ProcessLookupError):
        os.kill(killed[0], 0)


def test_verify_with_ray_gives_the_same_json_and_exit_code_and_a_bad_file_is_bad_input_only(cluster, tmp_path):
    good = ROOT / "manifests" / "stop_string.json"
    broken = tmp_path / "broken.json"
    broken.write_text(good.read_text()[:500])
    args = ["verify", good, broken, ROOT / "golden" / "stop_string.json", "--threads", "1", "--json"]
    plain = _cli(*args)
    fanned = _cli(*args, "--ray", cluster)
    assert plain.returncode == fanned.returncode == 2, fanned.stderr[-2000:]
    # how it ran is informative: its time, and whether it ran in lockstep beside other files (here, not on Ray)
    strip = lambda out: [{k: v for k, v in json.loads(line).items() if k not in ("seconds", "overlapped")}  # noqa: E731
                         for line in out.splitlines()]  # fmt: skip
    assert strip(fanned.stdout) == strip(plain.stdout)
    rows = strip(fanned.stdout)
    assert [r.get("status") for r in rows[:3]] == [MATCH, BAD_INPUT, MATCH]
    # CI log: one plain line per finished item and a summary line
    assert len(re.findall(r"^\[\d/3\] ", fanned.stderr, re.M)) == 3 and "verified 3/3 on Ray" in fanned.stderr, fanned.stderr
    # --ray alone starts a cluster of its own on this machine (and stops it)
    local = _cli(*args, "--ray")
    assert local.returncode == 2 and strip(local.stdout) == strip(plain.stdout) and "on Ray (local)" in local.stderr, local.stderr[-2000:]


def test_replay_with_ray_matches_replay_without(cluster, tmp_path):
    from detinfer.compute.engine import Engine

    engine = Engine.load(None, n_ctx=512)
    for name, text in (("a", "What is 2 + 3?"), ("b", "Name a fruit.")):
        turns = [ScriptTurn(messages=[{"role": "user", "content": text}]), ScriptTurn(messages=[{"role": "user", "content": "Thanks."}])]
        run_session(engine, turns, SamplingOverrides(max_tokens=4), out=tmp_path / "sessions" / f"{name}.json")
    (tmp_path / "sessions" / "c.json").write_text("{}")
    plain = _cli("replay", tmp_path / "sessions", "--threads", "1", "--json")
    fanned = _cli("replay", tmp_path / "sessions", "--json", "--ray", cluster)
    assert plain.returncode == fanned.returncode == 2, fanned.stderr[-2000:]
    # the same rows, except how many prompt tokens a turn found in its worker's prefix cache (informative: it
    # depends on which sessions that worker replayed before)
    strip = lambda out: [{k: v for k, v in row.items() if k != "reused_tokens"} for row in json.loads(out)]  # noqa: E731
    assert strip(fanned.stdout) == strip(plain.stdout)
    assert [(Path(r["session"]).name, r["result"]) for r in json.loads(fanned.stdout)] == [
        ("a.json", "match"), ("a.json", "match"), ("b.json", "match"), ("b.json", "match"), ("c.json", BAD_INPUT)]


def test_ctrl_c_keeps_written_results_and_resume_finishes_the_batch(cluster, reference, tmp_path):
    from detinfer.records.manifest import load_manifest

    # long items first (96 tokens each: without ignore_eos the model ends them after one), so the run is still busy
    # when it is interrupted, however fast the workers start
    longer = [{"id": f"long-{i}", "prompt": f"Tell a story about the number {i}.", "sampling": {"max_tokens": 96, "ignore_eos": True}}
              for i in range(8)]  # fmt: skip
    batch_file = tmp_path / "prompts.jsonl"
    batch_file.write_text("".join(json.dumps(line) + "\n" for line in longer + LINES))
    out = tmp_path / "out"
    # A suite started in the background without job control inherits SIGINT ignored, and exec keeps an ignored
    # signal ignored: the child gets a terminal's Ctrl-C disposition instead (a handled signal resets to default).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "detinfer.cli", "batch", batch_file, "--out-dir", out, "--ray", cluster],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 120
    while not list(out.glob("*.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "Traceback" not in stderr, stderr[-2000:]
    written = _files(out)
    assert 1 <= len(written) < len(longer) + len(LINES)
    assert all(reference[k] == v for k, v in written.items() if k in reference)
    assert all(load_manifest(out / k) for k in written)  # complete, sealed manifests
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no partial files

    again = _cli("batch", batch_file, "--out-dir", out)
    assert again.returncode == 2 and "pass --resume" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    resumed = _cli("batch", batch_file, "--out-dir", out, "--resume", "--threads", "1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{len(written)} skipped" in resumed.stdout and f"ran {len(longer) + len(LINES) - len(written)}/" in resumed.stderr
    final = _files(out)
    assert sorted(final) == sorted(f"{line['id']}.json" for line in longer + LINES)
    assert {k: v for k, v in final.items() if k in reference} == reference and all(final[k] == v for k, v in written.items())


def test_a_bad_batch_line_is_bad_input_for_that_line_only(tmp_path):
    batch = tmp_path / "b.jsonl"
    batch.write_text(json.dumps(LINES[0]) + "\nnot json\n" + json.dumps({"id": "../x", "prompt": "a"}) + "\n"
                     + json.dumps({"id": "hot", "prompt": "a", "sampling": {"temperature": -1}}) + "\n")
    items = read_batch(batch)
    state = WorkerState()
    results = [batch_task(state, item) for item in items]
    assert [(r.id, r.status) for r in results] == [("plain", WRITTEN), ("line-2", BAD_INPUT), ("../x", BAD_INPUT), ("hot", BAD_INPUT)]
    assert len(state.engines()) == 1  # a worker loads a model once and keeps it
    assert "not a JSON batch line" in results[1].message and "id" in results[2].message and "temperature" in results[3].message
    batch.write_text(json.dumps(LINES[0]) + "\n" + json.dumps(LINES[0]) + "\n")
    with pytest.raises(InputError, match="used on lines 1 and 2"):
        read_batch(batch)


def test_without_ray_installed_ray_is_a_one_line_error_naming_the_install(tmp_path):
    code = ("import sys; sys.modules['ray'] = None; sys.argv = ['detinfer'] + sys.argv[1:]\n"
            "from detinfer.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code, "verify", "manifests/stop_string.json", "--ray"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --ray needs Ray, which is not installed; install it with: pip install 'detinfer[ray]'"


def test_ray_address_forms():
    assert _bare_ray(["verify", "x.json", "--ray"]) == ["verify", "x.json", "--ray", "local"]
    assert _bare_ray(["verify", "--ray", "--json"]) == ["verify", "--ray", "local", "--json"]
    assert _bare_ray(["verify", "--ray", "auto"]) == ["verify", "--ray", "auto"]
    for ok in ("local", "auto", "ray://head:10001", "10.0.0.5:6379"):
        assert check_address(ok) == ok
    with pytest.raises(InputError, match="put files before --ray"):
        check_address("manifests/")


def test_a_file_that_cannot_be_read_is_bad_input_before_any_worker_runs():
    (item,) = read_all([Path("no/such/manifest.json")])
    r = reexecute_task(WorkerState(), item, pull=True)
    assert r.status == BAD_INPUT and "no/such/manifest.json" in r.message


def test_a_cluster_too_small_for_the_actors_is_refused(cluster):
    with pytest.raises(InputError, match=r"3 actors × 1 threads need more CPUs than the Ray cluster has \(2\)"):
        run_on_ray(batch_task, [None], lambda i, r: None, batch_failed, address=cluster, actors=3)


def test_progress_on_a_terminal_is_a_bar_and_in_a_log_plain_lines():
    import io

    from rich.console import Console

    from detinfer.integrations.batch import ItemProgress
    results = [Outcome("a.json", MATCH, steps=10), Outcome("b.json", "mismatch", steps=5)]
    for terminal in (True, False):
        buf = io.StringIO()
        progress = ItemProgress(Console(file=buf, force_terminal=terminal, width=120, highlight=False), "verified", 2, "on Ray (auto)")
        for i, r in enumerate(results):
            progress(i, r)
        if terminal:
            assert progress.bar is not None and progress.bar.tasks[0].completed == 2
            assert progress.bar.tasks[0].fields["mismatches"] == 1
        progress.close()
        text = buf.getvalue()
        assert "verified 2/2 on Ray (auto)" in text and "1 mismatch, 0 bad input; 15 tokens" in text
        assert ("[2/2] b.json: mismatch (5 tokens, 1 mismatches so far" in text) != terminal
