"""The OpenAI-compatible server, end to end on loopback with the real model and the real ``openai`` client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numba
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from detinfer.engine import Engine, set_threads  # noqa: E402
from detinfer.server import ServerSettings, create_app  # noqa: E402
from detinfer.session import load_session, replay_turns  # noqa: E402

KEY = "test-key-123"
SYSTEM = "You are a terse assistant."


class _Running:
    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, n_ctx=1024)


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(engine, record_dir):
    # one decode thread: the test's own client threads share these two cores, and numba's pool spins when waiting
    running = _Running(create_app(engine, ServerSettings(max_queue=8, max_inflight=4, threads=1, record_dir=record_dir)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, content: str, **kw):
    kw.setdefault("temperature", 0.8)
    kw.setdefault("seed", 7)
    kw.setdefault("max_tokens", 12)
    raw = client.chat.completions.with_raw_response.create(
        model="x", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}], **kw)
    return raw.parse(), raw.headers


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smollm2-135m-instruct-q4_1"]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["admitted"] == 0


def test_chat_stream_equals_nonstream_and_seed_repeats(client):
    r1, h1 = chat(client, "Name a color.")
    r2, h2 = chat(client, "Name a color.")  # warm prefix cache now
    assert r1.choices[0].message.content == r2.choices[0].message.content
    assert h1["x-detinfer-output-sha256"] == h2["x-detinfer-output-sha256"]
    assert h1["x-detinfer-kv-sha256"] == h2["x-detinfer-kv-sha256"]
    assert r1.system_fingerprint == r2.system_fingerprint and r1.system_fingerprint.startswith("fp_")
    u1, u2 = r1.usage, r2.usage
    assert u1.prompt_tokens == u2.prompt_tokens and u1.total_tokens == u1.prompt_tokens + u1.completion_tokens
    assert u2.prompt_tokens_details.cached_tokens == u2.prompt_tokens - 1  # all but the last prompt token reused
    chunks = list(client.chat.completions.create(
        model="x", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}],
        temperature=0.8, seed=7, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r1.choices[0].message.content
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == r1.choices[0].finish_reason
    assert final.model_extra["detinfer"]["output_sha256"] == h1["x-detinfer-output-sha256"]
    assert final.model_extra["detinfer"]["kv_sha256"] == h1["x-detinfer-kv-sha256"]
    assert chunks[-1].usage.completion_tokens == u1.completion_tokens


def test_completions_stream_equals_nonstream(client):
    kw = dict(model="x", prompt="The capital of France is", temperature=0, max_tokens=8, seed=1)
    raw = client.completions.with_raw_response.create(**kw)
    r = raw.parse()
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == r.choices[0].text and r.choices[0].text.strip()


def test_tool_messages_accepted(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    r = client.chat.completions.create(model="x", temperature=0, max_tokens=4, tools=tools, tool_choice="auto", messages=[
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}])
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"top_p": 2}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"logprobs": True}, "logprobs"),
    ({"extra_body": {"top_k": 5}}, "top_k"),
    ({"extra_body": {"repetition_penalty": 1.1}}, "repetition_penalty"),
])
def test_bad_parameters_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra)
    err = info.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_prompt_too_long_and_huge_body(server, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="x", prompt="hello " * 1100, max_tokens=2)
    assert "context" in info.value.response.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   content=b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_api_key_required(engine):
    running = _Running(create_app(engine, ServerSettings(api_key=KEY)))
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert httpx.get(running.url + "/health").status_code == 401
        ok = openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0).models.list()
        assert ok.data[0].id
    finally:
        running.stop()


def test_disconnect_frees_slot(server, client):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
            "model": "x", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
            "temperature": 0, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["admitted"]:
        assert time.monotonic() < deadline, "the slot of a disconnected client was not freed"
        time.sleep(0.1)
    r1, _ = chat(client, "Name a color.")  # the worker moved on
    assert r1.choices[0].message.content


def test_bounded_load(server, client, capsys):
    """24 concurrent clients at once: each gets the reference completion or a 429 with Retry-After; no hang."""
    prompts = ["Say hi.", "Count to three."]
    refs = {p: chat(client, p, max_tokens=8)[0].choices[0].message.content for p in prompts}

    def one(i):
        p = prompts[i % 2]
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        t0 = time.perf_counter()
        try:
            text = chat(c, p, max_tokens=8)[0].choices[0].message.content
            return "ok", time.perf_counter() - t0, text == refs[p]
        except openai.RateLimitError as e:
            return "429", time.perf_counter() - t0, bool(e.response.headers.get("retry-after"))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(24) as pool:
        results = list(pool.map(one, range(24), timeout=30))
    wall = time.perf_counter() - t0
    assert all(good for _, _, good in results), results
    ok = sorted(t for kind, t, _ in results if kind == "ok")
    n429 = sum(kind == "429" for kind, _, _ in results)
    assert ok and len(ok) + n429 == 24
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "smollm2-135m-instruct-q4_1",
                                                         "admitted": 0, "max_queue": 8}
    with capsys.disabled():
        q = statistics.quantiles(ok, n=20) if len(ok) > 1 else [ok[0]] * 19
        print(f"\nload: {len(ok)} served, {n429} x 429, p50 {statistics.median(ok):.2f} s, p95 {q[18]:.2f} s, wall {wall:.1f} s")


def test_recorded_conversation_replays(server, client, engine, record_dir):
    messages = [{"role": "system", "content": "You are Bob, a recorded assistant."}]
    for question in ("What is 2 + 3?", "And times 4?", "Thanks."):
        messages.append({"role": "user", "content": question})
        r = client.chat.completions.create(model="x", messages=messages, temperature=0.7, seed=11, max_tokens=24)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    files = [p for p in record_dir.glob("session-*.json") if "recorded assistant" in p.read_text()]
    assert len(files) == 1, files
    record = load_session(files[0])
    assert len(record.turns) == 3 and all(t.appended_token_ids for t in record.turns)
    assert [m.content for m in record.turns[1].messages] == ["And times 4?"]  # the reply is the previous turn's output
    assert record.turns[1].generated_token_ids and record.turns[2].reused_tokens > len(record.turns[0].appended_token_ids)
    before = numba.get_num_threads()
    set_threads(1)
    try:
        results = replay_turns(engine, record)
    finally:
        numba.set_num_threads(before)
    assert [diffs for _, diffs, _ in results] == [[], [], []]
    assert [a.text for a, _, _ in results] == [m["content"] for m in messages[2::2]]


def test_replay_of_the_whole_recording_in_a_fresh_process(server, client, record_dir, engine):
    """Every request the server recorded replays bit for bit in another process at another thread count."""
    client.chat.completions.create(model="x", messages=[{"role": "user", "content": "One more, recorded."}], seed=3, max_tokens=6)
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "detinfer.cli", "replay", str(record_dir), "--threads", "1", "--json",
                           "--model", str(engine.model_file.path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert rows and all(r["result"] == "match" for r in rows)
    assert len({r["session"] for r in rows}) == len(list(record_dir.glob("session-*.json")))
