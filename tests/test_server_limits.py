"""A real `detinfer serve` process that no request can stop (issues 32 and 34): a ReDoS strict-tool request leaves
/health answering within 1 s and the drain on time, a streaming client that stops reading loses its slot after
--send-timeout although the kernel accepted its bytes, every endpoint honours --read-timeout, and SIGTERM answers
queued requests 503 at once and running ones with an error after --drain, with no traceback in the log.

One server for the module (its last test stops it), stepping one request at a time (--batch 1) so that a second
request waits in the queue; the streaming-shutdown test starts its own with --batch 2, two running and one queued."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from cli_helpers import start_server

from detinfer.compute.generate import GenerationResult
from detinfer.model.tool_parsers import FORMATS
from detinfer.serve.worker import Job

MODEL = "smollm2-135m-instruct-q4_1"
DRAIN_S, SEND_TIMEOUT_S, READ_TIMEOUT_S = 2.0, 1.5, 2.0
REDOS = "^(((a+)+)+)+b$"  # Python's re needs ~1 s for 12 a's, ~4 min for 16 (measured: x16 per 2 more)
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to a thousand."}], "max_tokens": 1500,
        "ignore_eos": True, "temperature": 0}  # fmt: skip


def _start(tmp_path: Path, name: str, batch: int) -> tuple[subprocess.Popen, str, Path]:
    log = tmp_path / f"{name}.stderr"
    proc, url = start_server("--threads", "1", "--ctx", "2048", "--chat-template", "chatml-tools", "--drain", DRAIN_S,
                             "--send-timeout", SEND_TIMEOUT_S, "--read-timeout", READ_TIMEOUT_S, "--batch", batch, log=log)  # fmt: skip
    return proc, url, log


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    proc, url, log = _start(tmp_path_factory.mktemp("served"), "served", batch=1)
    yield proc, url, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


def _admitted(url: str) -> int:
    return httpx.get(url + "/health", timeout=1).json()["admitted"]


def _wait_admitted(url: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _admitted(url) != n:
        assert time.monotonic() < deadline, f"admitted never became {n}"
        time.sleep(0.05)


def _redos_request(argument: str) -> dict:
    """A strict tool whose pattern backtracks exponentially in Python's re, and three few-shot turns in which the
    assistant calls it with ``argument``: the model then calls it with ``argument`` again (it really produces it)."""
    tool = {"type": "function", "function": {"name": "echo", "strict": True, "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": REDOS}}, "required": ["s"]}}}  # fmt: skip
    messages = [{"role": "system", "content": "You call the echo tool with the user's text."}]
    for k in range(3):
        call = {"id": f"c{k}", "type": "function", "function": {"name": "echo", "arguments": json.dumps({"s": argument})}}
        messages += [{"role": "user", "content": argument}, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": f"c{k}", "content": "ok"}]  # fmt: skip
    return {"model": MODEL, "messages": messages + [{"role": "user", "content": argument}], "tools": [tool],
            "temperature": 0, "max_tokens": 40}  # fmt: skip


def test_the_redos_request_leaves_health_answering_and_is_returned_as_content(served):
    """16 a's against ^(((a+)+)+)+b$ froze main's server for minutes (jsonschema's backtracking regex on the event
    loop); here RE2 rejects them in linear time: /health answers within 1 s throughout and the call, which breaks
    its strict schema, comes back as content. Control: the same few-shot with a matching argument is a tool call."""
    _, url, _ = served
    result: dict = {}

    def send() -> None:
        result["response"] = httpx.post(url + "/v1/chat/completions", json=_redos_request("a" * 16), timeout=120)

    sender = threading.Thread(target=send)
    sender.start()
    health = []
    while sender.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        health.append(time.perf_counter() - t0)
        time.sleep(0.1)
    sender.join()
    r = result["response"]
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message.get("tool_calls") is None and '"s": "' + "a" * 16 + '"' in message["content"], message
    assert health and max(health) < 1.0, health
    ok = httpx.post(url + "/v1/chat/completions", json=_redos_request("aaab"), timeout=120).json()["choices"][0]["message"]
    assert json.loads(ok["tool_calls"][0]["function"]["arguments"]) == {"s": "aaab"}, ok


def test_deep_json_in_generated_arguments_is_content():
    """Generated call markup nested past Python's recursion limit (a 500 on main) or past the JSON inputs' 64 levels
    (a call the client could not send back) is returned as content; the same call 3 deep is a call (control)."""
    fmt = FORMATS["hermes"]

    def reply(depth: int):
        res = GenerationResult()
        res.text = '<tool_call>\n{"name": "nest", "arguments": {"a": ' + "[" * depth + "]" * depth + "}}\n</tool_call>"
        res.kv_sha256 = "0" * 64
        return res, Job([1], None, False, tool_format=fmt, tools={"nest": None}).reply(res)  # type: ignore[arg-type]

    for depth in (3000, 100):
        res, r = reply(depth)
        assert r.tool_calls == [] and r.content == res.text
    assert reply(3)[1].tool_calls[0]["function"]["name"] == "nest"


def _nested(depth: int) -> str:
    return '{"a": ' + "[" * depth + "]" * depth + "}"


def test_deep_json_anywhere_in_a_request_is_a_400_in_openai_shape(served):
    """3,000 levels inside a message's tool-call arguments (a JSON string: chat and a Responses function_call item)
    or as a tool's or a response format's schema is a 400 naming where, before anything is generated; the same
    requests 3 deep are served (the control)."""
    _, url, _ = served

    def chat_call(arguments: str) -> dict:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}  # fmt: skip

    def responses_call(arguments: str) -> dict:
        return {"model": MODEL, "max_output_tokens": 1, "input": [
            {"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}  # fmt: skip

    def deep_schema_body(path: str, depth: int) -> str:
        nested = '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth
        if path == "/v1/chat/completions":
            return ('{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "response_format": '
                    '{"type": "json_schema", "json_schema": {"name": "x", "schema": %s}}}' % (MODEL, nested))  # fmt: skip
        return ('{"model": "%s", "max_output_tokens": 1, "input": "hi", "tools": [{"type": "function", "name": "f", '
                '"parameters": %s}]}' % (MODEL, nested))  # fmt: skip

    cases = [("/v1/chat/completions", chat_call, "messages.1.tool_calls.0.function.arguments"),
             ("/v1/responses", responses_call, "input.1.arguments")]
    for path, body, param in cases:
        r = httpx.post(url + path, json=body(_nested(3000)), timeout=60)
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
        assert r.json()["error"]["param"] == param and "deeper than 64" in r.json()["error"]["message"], r.text
        assert httpx.post(url + path, json=body(_nested(3)), timeout=60).status_code == 200
    for path in ("/v1/chat/completions", "/v1/responses"):
        r = httpx.post(url + path, content=deep_schema_body(path, 3000), headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 400 and "deeper than 64" in r.json()["error"]["message"], r.text
        ok = httpx.post(url + path, content=deep_schema_body(path, 3), headers={"Content-Type": "application/json"}, timeout=60)
        assert ok.status_code == 200, ok.text
    assert _admitted(url) == 0


@pytest.mark.parametrize("bad", ["get</tool_call>", "a b", "x" * 65, ""])
def test_a_tool_name_that_is_not_a_function_name_is_a_400_whatever_the_tool_choice(served, bad):
    """A tool name outside OpenAI's ``^[a-zA-Z0-9_-]{1,64}$`` (so one that could hold call markup) is a 400 naming it
    with tool_choice auto too, where no grammar is built, on chat and on Responses; control: the valid names pass."""
    _, url, _ = served
    for name, status in ((bad, 400), ("get_weather-2", 200)):
        chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto",
                "tools": [{"type": "function", "function": {"name": "ok"}}, {"type": "function", "function": {"name": name}}]}  # fmt: skip
        responses = {"model": MODEL, "max_output_tokens": 1, "input": "hi",
                     "tools": [{"type": "function", "name": "ok"}, {"type": "function", "name": name}]}  # fmt: skip
        for path, body, param in (("/v1/chat/completions", chat, "tools.1.function.name"), ("/v1/responses", responses, "tools.1.name")):
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == status, r.text
            if status == 400:
                assert r.json()["error"]["param"] == param, r.text


def test_a_stalled_stream_loses_its_slot_although_the_kernel_took_its_bytes(served):
    """A client that stops reading (a small receive buffer, as a slow link's) while the server's own send buffer
    could take all of the stream: the server notices that nothing is acknowledged and drops it after
    --send-timeout, long before the 1,500-token generation would end. Control: a client that reads slowly but
    steadily keeps its stream to the end."""
    _, url, _ = served
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps(dict(LONG, stream=True)).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        _wait_admitted(url, 1)
        t0 = time.monotonic()
        while _admitted(url):
            assert time.monotonic() - t0 < SEND_TIMEOUT_S + 6, "a stalled client still holds its slot"
            time.sleep(0.1)
        s.settimeout(30)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
        assert data.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in data  # dropped mid-stream
    finally:
        s.close()
    slow = dict(LONG, stream=True, max_tokens=150)
    lines = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=slow, timeout=60) as r:
        for chunk in r.iter_bytes(2048):
            lines.append(chunk)
            time.sleep(0.1)
    assert b"".join(lines).rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_every_endpoint_honours_read_timeout(served, path):
    _, url, _ = served
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"mo"
                  % path.encode())  # fmt: skip
        t0 = time.monotonic()
        s.settimeout(READ_TIMEOUT_S + 5)
        head = s.recv(1000).split(b"\r\n")[0]
        assert b" 408 " in head and time.monotonic() - t0 < READ_TIMEOUT_S + 1.5, (head, time.monotonic() - t0)


def _post_async(url: str, body: dict, out: dict, key: str) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            out[key] = (r.status_code, r.headers.get("retry-after"), r.json(), time.monotonic())
        except httpx.HTTPError as e:
            out[key] = ("error", None, repr(e), time.monotonic() - t0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _stop(proc: subprocess.Popen) -> float:
    """SIGTERM, then the seconds the process took to exit."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return time.monotonic() - t0


def _check_log(log: Path) -> None:
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI" not in text and "Cancel" not in text, text[-3000:]


def test_sigterm_running_request_gets_an_error_after_the_drain_queued_ones_503(served):
    """A long generation running, the ReDoS request and a stream queued behind it: SIGTERM answers both queued
    requests 503 with Retry-After at once (the stream had not started, so it gets its status), the running one a
    503 in OpenAI's shape after --drain; the process is gone within --drain + 1 s, with no traceback in its log."""
    proc, url, log = served
    out: dict = {}
    threads = [_post_async(url, LONG, out, "running")]
    _wait_admitted(url, 1)
    time.sleep(1.0)  # the worker has taken it
    threads += [_post_async(url, _redos_request("a" * 16), out, "queued"), _post_async(url, dict(LONG, stream=True), out, "stream")]
    _wait_admitted(url, 3)
    t0 = time.monotonic()
    took = _stop(proc)
    for t in threads:
        t.join(timeout=30)
    assert took < DRAIN_S + 1.0, took
    for key in ("queued", "stream"):
        status, retry, body, at = out[key]
        assert status == 503 and retry and body["error"]["code"] == "server_shutting_down", out[key]
        assert at - t0 < 1.0, at - t0
    status, retry, body, at = out["running"]
    assert status == 503 and body["error"]["type"] == "server_error" and "drain" in body["error"]["message"], out["running"]
    assert DRAIN_S - 0.5 < at - t0 < DRAIN_S + 1.0, at - t0
    _check_log(log)


def test_sigterm_ends_running_requests_with_errors_and_answers_the_queued_one_503(tmp_path):
    """With --batch 2, a stream and a plain request running together and a third queued behind them: SIGTERM ends
    the stream with an error event and [DONE], the plain one with a 503 naming the drain, and the queued one gets
    its 503 with Retry-After; no traceback in the log."""
    proc, url, log = _start(tmp_path, "stream", batch=2)
    try:
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", json=dict(LONG, stream=True), timeout=60) as r:
                events.extend(line for line in r.iter_lines() if line)

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        _wait_admitted(url, 1)
        while len(events) < 3:
            time.sleep(0.05)
        out: dict = {}
        running = _post_async(url, LONG, out, "running")
        _wait_admitted(url, 2)
        time.sleep(1.0)  # the worker has taken it beside the stream
        queued = _post_async(url, dict(LONG, max_tokens=4), out, "queued")
        _wait_admitted(url, 3)
        took = _stop(proc)
        for t in (streamer, running, queued):
            t.join(timeout=30)
        assert took < DRAIN_S + 1.0, took
        assert events[-1] == "data: [DONE]", events[-3:]
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down" and "drain" in error["message"], error
        status, _, body, _ = out["running"]
        assert status == 503 and "drain" in body["error"]["message"], out["running"]
        status, retry, body, _ = out["queued"]
        assert status == 503 and retry and body["error"]["code"] == "server_shutting_down", out["queued"]
        assert "drain" not in body["error"]["message"], out["queued"]  # it had not started
        _check_log(log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
