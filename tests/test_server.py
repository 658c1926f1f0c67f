"""The OpenAI-compatible server, end to end on loopback with the real model and the real ``openai`` client."""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from detinfer.compute.engine import Engine  # noqa: E402
from detinfer.compute.sampler import log_softmax_at, top_logits  # noqa: E402
from detinfer.compute.threads import fixed_threads  # noqa: E402
from detinfer.records.replay import replay_turns
from detinfer.records.session import load_session  # noqa: E402
from detinfer.serve.app import create_app  # noqa: E402
from detinfer.serve.serving import ServerSettings

KEY = "test-key-123"
MODEL = "smollm2-135m-instruct-q4_1"  # the registry name: any other model name is a 404
SYSTEM = "You are a terse assistant."


class _Running:
    def __init__(self, app, sndbuf: int | None = None):
        sock = socket.socket()
        if sndbuf:  # accepted connections inherit it: small buffers fill up like a slow link's
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
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
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}], **kw)
    return raw.parse(), raw.headers


def test_models_and_health(server, client, model_path):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL, model_path.name, model_path.stem]
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["admitted"] == 0


def test_a_model_the_server_does_not_serve_is_a_404_on_every_endpoint(server, client, model_path):
    """Any listed name (registry name, file name, stem) is served; another name is a 404 model_not_found in
    OpenAI's shape, never silently answered by the loaded model."""
    for name in (MODEL, model_path.name, model_path.stem):
        assert client.completions.create(model=name, prompt="Hi", max_tokens=1).usage.completion_tokens == 1
    calls = [lambda m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=1),
             lambda m: client.completions.create(model=m, prompt="hi", max_tokens=1),
             lambda m: client.responses.create(model=m, input="hi", max_output_tokens=1),
             lambda m: client.chat.completions.create(model=m, messages=[{"role": "user", "content": "hi"}], max_tokens=1, stream=True)]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as info:
            call("gpt-4o")
        err = info.value.response.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4o" in err["message"], err
    assert httpx.get(server.url + "/health").json()["admitted"] == 0


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
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a color."}],
        temperature=0.8, seed=7, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r1.choices[0].message.content
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][0]
    assert final.choices[0].finish_reason == r1.choices[0].finish_reason
    assert final.model_extra["detinfer"]["output_sha256"] == h1["x-detinfer-output-sha256"]
    assert final.model_extra["detinfer"]["kv_sha256"] == h1["x-detinfer-kv-sha256"]
    assert chunks[-1].usage.completion_tokens == u1.completion_tokens


def test_completions_stream_equals_nonstream(client):
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, seed=1)
    raw = client.completions.with_raw_response.create(**kw)
    r = raw.parse()
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == r.choices[0].text and r.choices[0].text.strip()


def test_tool_round_trip_messages_accepted_as_openai_clients_send_them(client):
    """A tool round trip, ``refusal: null``, ``name``, the developer role and content-part lists are accepted."""
    r = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]},
        {"role": "user", "content": "What is 2+3?", "name": "ann"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}])
    assert r.usage.completion_tokens >= 1
    same = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+3?", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 3}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}])
    assert same.usage.prompt_tokens == r.usage.prompt_tokens  # developer is rendered as system, parts joined


def test_tools_on_a_template_without_tool_support_are_400_naming_the_fix(client):
    """SmolLM2's own template ignores ``tools``: the request is refused, never served with the tools dropped."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, max_tokens=2, tools=tools, messages=[{"role": "user", "content": "2+3?"}])
    err = info.value.response.json()["error"]
    assert err["param"] == "tools" and "--chat-template chatml-tools" in err["message"], err
    with pytest.raises(openai.BadRequestError) as info:  # what cannot be honoured is named
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    assert info.value.response.json()["error"]["param"] == "messages.0.content.1"


@pytest.mark.parametrize("extra, param", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1.0}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"top_p": 2}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"extra_body": {"logprobs": 3}}, "logprobs"),
    ({"extra_body": {"top_k": -1}}, "top_k"),
    ({"extra_body": {"top_k": 2.5}}, "top_k"),
    ({"extra_body": {"min_p": 1.0}}, "min_p"),
    ({"extra_body": {"repeat_penalty": 0}}, "repeat_penalty"),
    ({"extra_body": {"repeat_last_n": -1}}, "repeat_last_n"),
    ({"extra_body": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"extra_body": {"ignore_eos": True}, "response_format": {"type": "json_object"}}, "ignore_eos"),
    ({"extra_body": {"repetition_penalty": 1.1}}, "repetition_penalty"),
])
def test_bad_parameters_are_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **extra)
    err = info.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


@pytest.mark.parametrize("path, body, param, code, needle", [
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_type",
     "expected a string or an array, got a number"),
    ("chat/completions", {"messages": [{"role": "user", "content": [5]}]}, "messages.0.content.0", "invalid_value", "dictionary"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop", "invalid_type", "got a number"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "invalid_value", "Field required"),
    ("chat/completions", {"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "5"}]}, "messages.2.tool_call_id", "invalid_value", "not the id of a call"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "5"}]},
     "messages.1.tool_call_id", "invalid_value", "preceding assistant message's tool_calls"),
    ("completions", {"prompt": [1.5]}, "prompt.0", "invalid_type", "expected a string or an integer"),
    ("completions", {"prompt": ""}, "prompt", "invalid_value", "empty"),
    ("completions", {"prompt": []}, "prompt", "invalid_value", "no tokens"),
])  # fmt: skip
def test_a_bad_request_names_the_parameter_as_sent_and_has_a_code(server, path, body, param, code, needle):
    """No pydantic union member ("content.str") in ``param``, no Python class name as ``code``."""
    r = httpx.post(f"{server.url}/v1/{path}", json=dict(model=MODEL, max_tokens=2, **body), timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and err["code"] == code and needle in err["message"], err


@pytest.mark.parametrize("value", [6, -1, True])
def test_bad_completion_logprobs_are_400(client, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=value)
    err = info.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "logprobs", err



EXTENSIONS = dict(top_k=3, min_p=0.05, repeat_penalty=1.3, repeat_last_n=16, ignore_eos=True)


def test_llamacpp_sampling_extensions_mean_what_they_mean_to_detinfer_run(server, engine, record_dir):
    """top_k, min_p, repeat_penalty, repeat_last_n and ignore_eos on completions, chat and Responses give the tokens
    `detinfer run` gives with the same Sampling, and are recorded; without them the output differs (control)."""
    from detinfer.compute.sampling import Sampling
    from detinfer.records.run import build_prompt, execute

    kw = dict(model=MODEL, temperature=0.9, seed=5, max_tokens=24)
    sampling = Sampling(temperature=0.9, seed=5, max_tokens=24, top_k=3, min_p=0.05, repetition_penalty=1.3,
                        repeat_last_n=16, ignore_eos=True)  # fmt: skip
    plain = httpx.post(server.url + "/v1/completions", json=dict(kw, prompt="The capital of France is"), timeout=60)
    comp = httpx.post(server.url + "/v1/completions", json=dict(kw, prompt="The capital of France is", **EXTENSIONS), timeout=60)
    ref = execute(engine, build_prompt(engine, text="The capital of France is"), sampling)
    assert comp.status_code == 200 and comp.json()["choices"][0]["text"] == ref.output.text
    assert comp.headers["x-detinfer-output-sha256"] == ref.output.tokens_sha256
    assert plain.headers["x-detinfer-output-sha256"] != comp.headers["x-detinfer-output-sha256"]  # the control
    messages = [{"role": "user", "content": "Name a color and say why."}]
    chat_ = httpx.post(server.url + "/v1/chat/completions", json=dict(kw, messages=messages, **EXTENSIONS), timeout=60)
    ref = execute(engine, build_prompt(engine, messages=messages, chat=True), sampling)
    assert chat_.json()["choices"][0]["message"]["content"] == ref.output.text
    resp = httpx.post(server.url + "/v1/responses", json=dict(model=MODEL, temperature=0.9, max_output_tokens=24,
                                                                input=messages, **EXTENSIONS), timeout=60)  # fmt: skip
    assert resp.status_code == 200, resp.text
    ref = execute(engine, build_prompt(engine, messages=messages, chat=True), sampling.model_copy(update={"seed": 0}))
    assert resp.json()["output"][0]["content"][0]["text"] == ref.output.text
    recorded = [t.sampling for p in record_dir.glob("session-*.json") for t in load_session(p).turns]
    assert sampling.model_dump() in recorded


def test_responses_status_is_consistent_on_the_response_and_its_items(client):
    """Cut by max_output_tokens: the response and its message item say incomplete, streamed or not; a reply that
    ends by itself says completed on both (control)."""
    cut = client.responses.create(model=MODEL, input="Write a long story about a ship.", max_output_tokens=5, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in cut.output] == ["incomplete"]
    events = list(client.responses.create(model=MODEL, input="Write a long story about a ship.", max_output_tokens=5,
                                          temperature=0, stream=True))  # fmt: skip
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"
    done = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done == ["incomplete"] and events[-1].response.output[0].content[0].text == cut.output[0].content[0].text
    whole = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=64, temperature=0)
    assert whole.status == "completed" and whole.incomplete_details is None and [i.status for i in whole.output] == ["completed"]

# --------------------------------------------------------------------------------------------- logprobs


def test_log_softmax_at_kernel():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(49152) * 4).astype(np.float32)
    logits[[5, 9]] = logits.max() + 1  # a tie at the top
    logits[7] = -np.inf
    ids = [i for i, _ in top_logits(logits, 20)]
    assert ids[:2] == [5, 9]
    got = log_softmax_at(logits, ids + [7])
    x = logits.astype(np.float64)
    ref = x[ids] - (x.max() + np.log(np.exp(x - x.max()).sum()))
    assert np.allclose(got[:-1], ref, rtol=0, atol=1e-5) and got[-1] == -np.inf
    assert got[0] == got[1] and all(a >= b for a, b in zip(got, got[1:-1]))
    assert sum(math.exp(v) for v in got[:-1]) <= 1.0
    assert log_softmax_at(logits, ids) == got[:-1]  # same bits, call after call
    one = np.full(10, -np.inf, np.float32)
    one[4] = 3.0
    assert log_softmax_at(one, [4, 0]) == [0.0, -np.inf]


def _chat_logprobs(client, content, stream=False, **kw):
    kw = dict(dict(temperature=0.8, seed=7, max_tokens=12, logprobs=True, top_logprobs=5), **kw)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    if not stream:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **kw)
        return raw.parse(), raw.http_response.json()["choices"][0]["logprobs"]
    entries = []
    text = ""
    for c in client.chat.completions.create(model=MODEL, messages=messages, stream=True, **kw):
        if c.choices and c.choices[0].logprobs is not None:
            entries += [e.model_dump() for e in c.choices[0].logprobs.content]
        if c.choices:
            text += c.choices[0].delta.content or ""
    return text, entries


def _check_entries(content, k):
    for e in content:
        assert bytes(e["bytes"]).decode("utf-8", errors="replace") == e["token"]
        assert e["logprob"] <= 0.0 and len(e["top_logprobs"]) == k
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert all(t <= 0.0 for t in tops) and tops == sorted(tops, reverse=True)
        assert sum(math.exp(t) for t in tops) <= 1.0 + 1e-6
        same = [t for t in e["top_logprobs"] if t["bytes"] == e["bytes"]]
        if same:
            assert e["logprob"] in [t["logprob"] for t in same]
        if tops:
            assert e["logprob"] <= tops[0]
            if e["logprob"] > tops[-1]:  # strictly above the k-th: the sampled token is in the list
                assert same


def test_chat_logprobs_stream_equals_nonstream_and_repeats(client):
    r1, lp1 = _chat_logprobs(client, "Name a fruit.")
    r2, lp2 = _chat_logprobs(client, "Name a fruit.")
    assert json.dumps(lp1) == json.dumps(lp2)  # identical bytes, cold vs warm prefix cache
    assert r1.choices[0].logprobs.refusal is None and lp1["refusal"] is None
    content = lp1["content"]
    assert len(content) == r1.usage.completion_tokens
    _check_entries(content, 5)
    text, streamed = _chat_logprobs(client, "Name a fruit.", stream=True)
    assert text == r1.choices[0].message.content
    assert json.dumps(streamed, sort_keys=True) == json.dumps(content, sort_keys=True)
    plain, _ = chat(client, "Name a fruit.")  # logprobs change nothing else
    assert plain.choices[0].message.content == r1.choices[0].message.content and plain.choices[0].logprobs is None
    r0, lp0 = _chat_logprobs(client, "Name a fruit.", top_logprobs=None)  # logprobs without top_logprobs: k = 0
    assert [e["logprob"] for e in lp0["content"]] == [e["logprob"] for e in content]
    assert all(e["top_logprobs"] == [] for e in lp0["content"])


def test_chat_greedy_token_is_top1_of_top20(client):
    r, lp = _chat_logprobs(client, "Count to five.", temperature=0, top_logprobs=20, max_tokens=16)
    content = lp["content"]
    assert len(content) == r.usage.completion_tokens >= 1
    _check_entries(content, 20)
    for e in content:
        top = e["top_logprobs"][0]
        assert (e["bytes"], e["logprob"]) == (top["bytes"], top["logprob"])
    # the raw distribution: the same logprobs at another temperature for the same tokens (first token: same prompt)
    _, hot = _chat_logprobs(client, "Count to five.", temperature=1.5, top_logprobs=20, max_tokens=1, seed=99)
    assert hot["content"][0]["top_logprobs"] == content[0]["top_logprobs"]


def test_completions_logprobs(client):
    kw = dict(model=MODEL, prompt="The capital of France is", temperature=0.8, max_tokens=8, seed=1, logprobs=3)
    raw = client.completions.with_raw_response.create(**kw)
    r = raw.parse()
    lp = raw.http_response.json()["choices"][0]["logprobs"]
    n = r.usage.completion_tokens
    assert [len(lp[key]) for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [n] * 4
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert lp["text_offset"][-1] <= len(r.choices[0].text)
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0.0 and 1 <= len(top) <= 4 and top[token] == value
        values = list(top.values())
        assert all(v <= 0.0 for v in values) and values[:3] == sorted(values[:3], reverse=True)
    raw2 = client.completions.with_raw_response.create(**kw)
    assert json.dumps(raw2.http_response.json()["choices"][0]["logprobs"]) == json.dumps(lp)
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for c in client.completions.create(stream=True, **kw):
        if c.choices:
            text += c.choices[0].text
            if c.choices[0].logprobs is not None:
                for key in merged:
                    merged[key] += getattr(c.choices[0].logprobs, key)
    assert text == r.choices[0].text and json.dumps(merged) == json.dumps(lp)
    greedy = client.completions.create(**dict(kw, temperature=0, logprobs=0)).choices[0].logprobs
    assert all(list(t) == [tok] for t, tok in zip(greedy.top_logprobs, greedy.tokens))


def test_prompt_too_long_and_huge_body(server, client):
    """A prompt of n_ctx tokens or more is OpenAI's context_length_exceeded (clients trim history on that code)."""
    for create, kw, param in [(client.completions.create, dict(prompt="hello " * 1100), "prompt"),
                              (client.completions.create, dict(prompt=[1] * 1024), "prompt"),
                              (client.chat.completions.create, dict(messages=[{"role": "user", "content": "hello " * 1100}]), "messages")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError) as info:
            create(model=MODEL, max_tokens=2, **kw)
        err = info.value.response.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param and "--ctx" in err["message"], err
    assert client.completions.create(model=MODEL, prompt=[1] * 1023, max_tokens=1).usage.prompt_tokens == 1023
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


def test_the_warm_up_and_every_forward_pass_run_on_the_decode_thread(engine, monkeypatch):
    # numba's OpenMP layer gives every thread that runs a parallel kernel its own pool: a warm-up on the main
    # thread left a second pool, and with more pool threads than cores 2-thread passes ran 2.5x slower than 1
    ran: list[tuple[str, int]] = []
    warm_up, forward_batch = Engine.warm_up, Engine.forward_batch
    monkeypatch.setattr(Engine, "warm_up", lambda e: (ran.append(("warm_up", threading.get_ident())), warm_up(e))[1])
    monkeypatch.setattr(Engine, "forward_batch", lambda e, b: (ran.append(("forward", threading.get_ident())), forward_batch(e, b))[1])
    app = create_app(engine, ServerSettings(threads=1))
    worker = app.state.server.worker
    worker.warm_up()
    running = _Running(app)
    try:
        openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=3)
    finally:
        running.stop()
    assert [k for k, _ in ran[:1]] == ["warm_up"] and "forward" in {k for k, _ in ran}
    assert {ident for _, ident in ran} == {worker.thread.ident} != {threading.get_ident()}
    engine.warm_up()  # the control: called here, the recorder sees this thread
    assert ran[-1] == ("warm_up", threading.get_ident())


def test_disconnect_frees_slot(server, client):
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
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
        r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.7, seed=11, max_tokens=24)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    files = [p for p in record_dir.glob("session-*.json") if "recorded assistant" in p.read_text()]
    assert len(files) == 1, files
    record = load_session(files[0])
    assert len(record.turns) == 3 and all(t.appended_token_ids for t in record.turns)
    assert [m.content for m in record.turns[1].messages] == ["And times 4?"]  # the reply is the previous turn's output
    assert record.turns[1].generated_token_ids and record.turns[2].reused_tokens > len(record.turns[0].appended_token_ids)
    with fixed_threads(1):
        results = replay_turns(engine, record)
    assert [diffs for _, diffs, _ in results] == [[], [], []]
    assert [a.text for a, _, _ in results] == [m["content"] for m in messages[2::2]]


def test_replay_of_the_whole_recording_in_a_fresh_process(server, client, record_dir, engine):
    """Every request the server recorded replays bit for bit in another process at another thread count."""
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "One more, recorded."}], seed=3, max_tokens=6)
    env = dict(os.environ, NUMBA_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "detinfer.cli", "replay", str(record_dir), "--threads", "1", "--json",
                           "--model", str(engine.model_file.path)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert rows and all(r["result"] == "match" for r in rows)
    assert len({r["session"] for r in rows}) == len(list(record_dir.glob("session-*.json")))


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_clients_that_never_read_are_dropped(engine, tmp_path):
    """Streaming clients that never read (tiny receive buffers) cannot hold slots: each is dropped after
    --send-timeout, /health answers throughout, memory stays bounded, a new request is then served, and every
    completed request was recorded and replays exactly."""
    record = tmp_path / "rec"
    running = _Running(create_app(engine, ServerSettings(max_queue=3, threads=1, record_dir=record, send_timeout=1.5)), sndbuf=8192)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story about a ship."}],
                       "max_tokens": 200, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 20}).encode()
    socks = []
    try:  # one read request first: what a first request allocates for good (code paths, tables) is not the stall's
        warm = httpx.post(running.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=300)
        assert warm.status_code == 200 and warm.text.rstrip().endswith("data: [DONE]")
        rss0 = _rss_bytes()
        for _ in range(7):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", running.port))
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        deadline, health_seconds = time.monotonic() + 180, []
        while httpx.get(running.url + "/health", timeout=10).json()["admitted"] < 3:  # every slot taken first
            assert time.monotonic() < deadline, "the requests were never admitted"
            time.sleep(0.05)
        while True:
            t0 = time.perf_counter()
            h = httpx.get(running.url + "/health", timeout=10).json()
            health_seconds.append(time.perf_counter() - t0)
            if h["admitted"] == 0:
                break
            assert time.monotonic() < deadline, f"stalled clients still hold slots: {h}"
            time.sleep(0.2)
        assert len(health_seconds) > 3 and max(health_seconds) < 10
        assert _rss_bytes() - rss0 < 64 << 20, f"{(_rss_bytes() - rss0) >> 20} MiB more"
        statuses = []
        for s in socks:  # every connection was answered (429 or a stream) and then closed by the server
            s.settimeout(30)
            data = b""
            while chunk := s.recv(1 << 20):
                data += chunk
            statuses.append(data.split(b" ", 2)[1])
        assert sorted(statuses) == [b"200"] * 3 + [b"429"] * 4, statuses
        c = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        done = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, seed=1)
        assert done.choices[0].message.content
    finally:
        for s in socks:
            s.close()
        running.stop()
    records = [load_session(p) for p in sorted(record.glob("session-*.json"))]
    assert any("Name a fruit." in m.content for r in records for m in r.turns[0].messages)
    for r in records:
        assert all(not diffs for _, diffs, _ in replay_turns(engine, r))


def test_chat_template_option_for_a_model_without_one(gemma_path, tmp_path):
    """Gemma 3 has no chat template: chat requests are a 400 naming --chat-template, unless the server was started
    with one; then the reply equals `detinfer run` with the same template, and the recording keeps it for replay."""
    from detinfer.compute.sampling import Sampling
    from detinfer.model.chat import ChatTemplate
    from detinfer.records.run import build_prompt, execute

    engine = Engine.load(gemma_path, n_ctx=256)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    running = _Running(create_app(engine, ServerSettings(threads=1)))
    try:
        c = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="gemma3-270m-q4_k_m", messages=messages, max_tokens=4)
        assert "--chat-template" in info.value.response.json()["error"]["message"]
    finally:
        running.stop()
    gemma = ChatTemplate.from_option("gemma")
    running = _Running(create_app(engine, ServerSettings(threads=1, chat_template=gemma, record_dir=tmp_path)))
    try:
        c = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="gemma3-270m-q4_k_m", messages=messages, max_tokens=8, temperature=0)
    finally:
        running.stop()
    ref = execute(engine, build_prompt(engine, messages=messages, chat=True, template=gemma),
                  Sampling(temperature=0.0, max_tokens=8), template=gemma)
    assert r.usage.prompt_tokens == len(ref.prompt.token_ids) and r.choices[0].message.content == ref.output.text
    record = load_session(next(tmp_path.glob("session-*.json")))
    assert record.chat_template.name == "gemma"
    assert all(not diffs for _, diffs, _ in replay_turns(engine, record))


# ------------------------------------------------------------------------------------------ --kv-dir restarts


def _ask(running: _Running, question: str) -> tuple[dict, httpx.Headers]:
    r = httpx.post(running.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json(), r.headers


def _once(engine, question: str, **settings) -> tuple[dict, httpx.Headers]:
    """A server started, asked one question and stopped (its lifespan ends: queued snapshot writes finish)."""
    running = _Running(create_app(engine, ServerSettings(threads=1, **settings)))
    try:
        return _ask(running, question)
    finally:
        running.stop()


def _same_reply(a, b) -> None:
    assert a[0]["choices"][0]["message"] == b[0]["choices"][0]["message"]
    for header in ("x-detinfer-output-sha256", "x-detinfer-kv-sha256"):
        assert a[1][header] == b[1][header]


def test_a_restarted_server_with_a_kv_dir_is_warm_with_the_same_bytes(engine, tmp_path: Path, caplog):
    """serve --kv-dir: the first request after a restart reuses the prompt from the folder (cached_tokens > 0) and
    answers byte for byte as the cold run did. Controls: a restart without the folder is cold; a snapshot file
    damaged on disk is refused with a warning and the run is cold, same bytes; a budget below one file keeps none."""
    question = "Name three primary colors and say why they are called primary."
    kv = tmp_path / "kv"
    cold = _once(engine, question, kv_dir=kv)
    assert cold[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    files = list(kv.glob("*.detkv"))
    assert len(files) == 1 and not list(kv.glob(".*.tmp"))
    saved = files[0].read_bytes()

    warm = _once(engine, question, kv_dir=kv)
    usage = warm[0]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    _same_reply(cold, warm)
    assert list(kv.glob("*.detkv")) == files and files[0].read_bytes() == saved  # the same cache: same name, same bytes

    without = _once(engine, question)
    assert without[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _same_reply(cold, without)

    for f in kv.glob("*.detkv"):  # one bit of K/V changed in every file: the checksum no longer holds
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="detinfer.kv_dir"):
        damaged = _once(engine, question, kv_dir=kv)
    assert damaged[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _same_reply(cold, damaged)
    assert any("checksum mismatch" in r.getMessage() for r in caplog.records), caplog.text

    tight = tmp_path / "tight"
    _once(engine, question, kv_dir=tight, kv_dir_bytes=1000)
    assert not list(tight.glob("*.detkv"))


def test_a_kv_dir_that_is_a_file_is_one_line(tmp_path: Path, model_path: Path):
    from cli_helpers import detinfer, one_error_line

    (tmp_path / "file").write_text("x")
    r = detinfer(tmp_path / "home", "serve", "--model", model_path, "--kv-dir", tmp_path / "file", "--port", "0")
    one_error_line(r, "--kv-dir")


def test_previous_response_id_continues_a_response_recorded_before_a_restart(engine, tmp_path: Path, caplog):
    """With --record, a response's conversation is kept in the record folder: after a restart previous_response_id
    continues it exactly as sending the whole conversation does. Controls: a restart without --record is a 400
    naming previous_response_id; a damaged file is a 400 with a warning, never used."""
    record = tmp_path / "runs"
    kw = {"model": MODEL, "max_output_tokens": 8, "temperature": 0}

    def post(running: _Running, **body) -> httpx.Response:
        return httpx.post(running.url + "/v1/responses", timeout=120, json={**kw, **body})

    running = _Running(create_app(engine, ServerSettings(threads=1, record_dir=record)))
    try:
        first = post(running, input="Name a primary color.").json()
    finally:
        running.stop()
    answer = first["output"][0]["content"][0]["text"]
    [saved] = list((record / "responses").rglob("*.response"))
    assert saved.name == first["id"] + ".response"

    running = _Running(create_app(engine, ServerSettings(threads=1, record_dir=record)))
    try:
        follow = post(running, input="Name another one.", previous_response_id=first["id"])
        whole = post(running, input=[{"role": "user", "content": "Name a primary color."},
                                     {"role": "assistant", "content": answer},
                                     {"role": "user", "content": "Name another one."}])  # fmt: skip
        assert follow.status_code == 200 and whole.status_code == 200, follow.text + whole.text
        assert follow.json()["output"][0]["content"] == whole.json()["output"][0]["content"]
        assert follow.json()["usage"]["input_tokens"] == whole.json()["usage"]["input_tokens"]
        saved.write_text('{"id": "' + first["id"] + '", "conversation": [')
        saved_id = first["id"]
        running.stop()
        running = _Running(create_app(engine, ServerSettings(threads=1, record_dir=record)))
        with caplog.at_level("WARNING", logger="detinfer.serve"):
            damaged = post(running, input="Name another one.", previous_response_id=saved_id)
        assert damaged.status_code == 400 and damaged.json()["error"]["param"] == "previous_response_id"
        assert any(saved.name in r.getMessage() for r in caplog.records), caplog.text
    finally:
        running.stop()

    running = _Running(create_app(engine, ServerSettings(threads=1)))
    try:
        cold = post(running, input="Name another one.", previous_response_id=first["id"])
    finally:
        running.stop()
    assert cold.status_code == 400 and cold.json()["error"]["param"] == "previous_response_id"
    assert "--record" in cold.json()["error"]["message"]


BATCH_REQUESTS = [  # (path, body): lengths, sampling and features differ, so batches change shape mid-run
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 6, "temperature": 0.8, "seed": 7}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Count to five."}],
                              "max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "seed": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8, "temperature": 0,
                              "logprobs": True, "top_logprobs": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a haiku about rain."}], "max_tokens": 30,
                              "temperature": 0.7, "seed": 1, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Give me a number as JSON."}], "max_tokens": 20,
                              "temperature": 0.5, "seed": 2, "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}),
    ("/v1/completions", {"prompt": "List numbers: 1, 2, 3,", "max_tokens": 20, "temperature": 0.6, "seed": 5, "stop": [" 7"]}),
]  # fmt: skip


def _response_bytes(url: str, path: str, body: dict) -> tuple:
    """A response with what is fresh per request dropped (id, created, and usage's cached_tokens, which reports the
    prefix cache's state): the status, the detinfer headers and every other byte of the body or of each SSE event."""

    def strip(obj: dict) -> str:
        obj = {k: v for k, v in obj.items() if k not in ("id", "created")}
        if obj.get("usage"):
            obj["usage"] = {k: v for k, v in obj["usage"].items() if k != "prompt_tokens_details"}
        return json.dumps(obj, sort_keys=True)

    r = httpx.post(url + path, json=dict(body, model=MODEL), timeout=120)
    headers = tuple(sorted((k, v) for k, v in r.headers.items() if k.startswith("x-detinfer")))
    if body.get("stream"):
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        content = [e if e == "[DONE]" else strip(json.loads(e)) for e in events]
    else:
        content = [strip(r.json())]
    return r.status_code, headers, content


def test_a_response_is_the_same_bytes_alone_and_beside_others(engine):
    """Continuous batching never changes a byte: each of 8 requests (greedy, seeded sampling, top-p, logprobs, a
    stream, a JSON-schema constraint, raw completions, a stop string) sent alone, then beside 1, 3 and 7 others
    arriving together in shuffled order, gives the same status, detinfer headers and body. The worker really
    stepped at least 4 sequences together. Control: logits of every sequence but a step's first perturbed when the step has
    several (what a batch-dependent kernel would do) changes responses."""
    running = _Running(create_app(engine, ServerSettings(max_queue=16, threads=1)))
    sizes: list[int] = []
    plain = engine.forward_batch

    def spy(batch, perturb=False):
        sizes.append(len(batch))
        out = plain(batch)
        if perturb and len(batch) > 1:
            rng = np.random.default_rng(len(sizes))
            out = [o if i == 0 else o + rng.normal(0, 3, o.shape).astype(o.dtype) for i, o in enumerate(out)]
        return out

    def together(indices: list[int]) -> dict[int, tuple]:
        barrier = threading.Barrier(len(indices))

        def one(i: int):
            barrier.wait()
            return i, _response_bytes(running.url, *BATCH_REQUESTS[i])

        with ThreadPoolExecutor(len(indices)) as pool:
            return dict(pool.map(one, indices))

    try:
        alone = {i: _response_bytes(running.url, *req) for i, req in enumerate(BATCH_REQUESTS)}
        assert all(status == 200 for status, _, _ in alone.values()), alone
        rng = np.random.default_rng(0)
        engine.forward_batch = spy
        for n in (2, 4, 8):
            indices = [int(i) for i in rng.permutation(len(BATCH_REQUESTS))[:n]]
            got = together(indices)
            for i in indices:
                assert got[i] == alone[i], (n, i, BATCH_REQUESTS[i])
        assert max(sizes) >= 4, sizes
        engine.forward_batch = lambda batch: spy(batch, perturb=True)
        got = together(list(range(len(BATCH_REQUESTS))))
        assert any(got[i] != alone[i] for i in got), "a batch-dependent perturbation went unnoticed"
    finally:
        del engine.forward_batch
        running.stop()
