"""Structured output from `detinfer serve` on loopback with the real model: response_format and tool_choice
required / named are enforced, give the same bytes streamed or not, warm or cold, at 1 or 2 threads, are recorded
and replayed; bad constraints are 400s; LangChain and pydantic-ai get validated objects back."""

from __future__ import annotations

import json

import httpx
import jsonschema
import numba
import pytest
from pydantic import BaseModel

openai = pytest.importorskip("openai")

from test_server import _Running  # noqa: E402

from detinfer.compute.constrain import json_schema_constraint  # noqa: E402
from detinfer.compute.engine import Engine, set_threads  # noqa: E402
from detinfer.compute.generate import GenerationResult, generate  # noqa: E402
from detinfer.compute.sampling import Sampling  # noqa: E402
from detinfer.model.chat import ChatTemplate  # noqa: E402
from detinfer.records.manifest import tokens_sha256  # noqa: E402
from detinfer.records.replay import replay_turns
from detinfer.records.session import load_session  # noqa: E402
from detinfer.serve.app import create_app  # noqa: E402
from detinfer.serve.chat_completions import ChatCompletions  # noqa: E402
from detinfer.serve.protocol import ChatRequest  # noqa: E402
from detinfer.serve.serving import ServerSettings  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": ADD}},
         {"type": "function", "function": {"name": "weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine.load(model_path, n_ctx=1024)


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sessions")


@pytest.fixture(scope="module")
def server(engine, record_dir):
    # chatml-tools: SmolLM2's own template does not render tools, so a forced tool call needs a tool-aware format
    settings = ServerSettings(threads=1, record_dir=record_dir, chat_template=ChatTemplate.builtin("chatml-tools"))
    running = _Running(create_app(engine, settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=dict(model="x", temperature=0.8, seed=3, max_tokens=60, **body),
                      timeout=120)  # fmt: skip


def _stream(server, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json=dict(model="x", temperature=0.8, seed=3, max_tokens=60, stream=True, **body)) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_json_schema_same_bytes_cold_warm_streamed_and_at_two_threads(server, engine):
    cold = _post(server, messages=MESSAGES, response_format=SCHEMA_FORMAT)
    assert cold.status_code == 200, cold.text
    body = cold.json()
    content = body["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), PERSON)
    assert body["choices"][0]["finish_reason"] == "stop"
    warm = _post(server, messages=MESSAGES, response_format=SCHEMA_FORMAT)
    assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert warm.json()["choices"] == body["choices"] and warm.headers["x-detinfer-output-sha256"] == cold.headers["x-detinfer-output-sha256"]
    chunks = _stream(server, messages=MESSAGES, response_format=SCHEMA_FORMAT)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == content
    assert chunks[-1]["detinfer"]["output_sha256"] == cold.headers["x-detinfer-output-sha256"]
    if numba.config.NUMBA_NUM_THREADS < 2:
        return
    req = ChatRequest.model_validate({"model": "x", "messages": MESSAGES})
    prompt = ChatCompletions(server.server.config.app.state.server).prepare(req).prompt
    res = GenerationResult()
    before = numba.get_num_threads()
    set_threads(2)  # this (test) thread's numba pool; the server's decode thread keeps its 1
    try:
        for _ in generate(engine, prompt, Sampling(temperature=0.8, seed=3, max_tokens=60), result=res,
                          constraint=json_schema_constraint(PERSON)):  # fmt: skip
            pass
    finally:
        set_threads(before)
    assert tokens_sha256(res.tokens) == cold.headers["x-detinfer-output-sha256"] and res.text == content


def test_negative_control_and_text_format(server):
    constrained = _post(server, messages=MESSAGES, response_format=SCHEMA_FORMAT)
    free = _post(server, messages=MESSAGES)
    text = _post(server, messages=MESSAGES, response_format={"type": "text"})
    assert free.headers["x-detinfer-output-sha256"] != constrained.headers["x-detinfer-output-sha256"]
    assert text.headers["x-detinfer-output-sha256"] == free.headers["x-detinfer-output-sha256"]


def test_json_object(client):
    # seed 1: a sampled object that closes within 80 tokens (others ramble on past it)
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Give a JSON object with your name."}],
                                       response_format={"type": "json_object"}, temperature=0.8, seed=1, max_tokens=80)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"])
def test_tool_choice_returns_a_validated_tool_call(client, server, tool_choice):
    kw = dict(model="x", messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS, tool_choice=tool_choice,
              temperature=0, max_tokens=60)  # fmt: skip
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name in ("add", "weather") if tool_choice == "required" else call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD if call.function.name == "add" else TOOLS[1]["function"]["parameters"])
    again = client.chat.completions.create(**kw)
    assert again.choices[0].message.tool_calls[0].id == call.id  # derived from the request and output, not random
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].id == call.id and deltas[0][0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body, param, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, "response_format", "Invalid type: foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}}, "response_format", '"not"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "description": "x" * 70000}}}},
     "response_format", "the cap is"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
])  # fmt: skip
def test_bad_constraints_are_400_before_any_token(server, body, param, expected):
    r = _post(server, messages=MESSAGES, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and expected in err["message"], err


def test_recorded_constrained_requests_replay(server, engine, record_dir):
    _post(server, messages=[{"role": "user", "content": "Name a city as JSON."}], response_format=SCHEMA_FORMAT)
    records = [load_session(p) for p in sorted(record_dir.glob("session-*.json"))]
    constrained = [r for r in records if any(t.constraint is not None for t in r.turns)]
    assert constrained
    for record in constrained:
        assert [diffs for _, diffs, _ in replay_turns(engine, record, use_cache=False)] == [[]] * len(record.turns)


# --------------------------------------------------------------------------------------------- frameworks


class Person(BaseModel):
    name: str
    age: int


def test_langchain_with_structured_output(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model="smollm2", base_url=server.url + "/v1", api_key="unused", temperature=0,
                                      max_tokens=60, max_retries=0)  # fmt: skip
    person = llm.with_structured_output(Person).invoke("Describe a person called Ann who is 31.")
    assert isinstance(person, Person) and person.name


def test_pydantic_ai_output_type(server):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="unused"))
    agent = Agent(model, output_type=Person, model_settings={"temperature": 0, "max_tokens": 80})
    result = agent.run_sync("Describe a person called Ann who is 31.")
    assert isinstance(result.output, Person) and result.output.name
