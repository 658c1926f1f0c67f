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

from test_server import MODEL, _Running  # noqa: E402

from detinfer.compute.engine import Engine, set_threads  # noqa: E402
from detinfer.compute.generate import GenerationResult, generate  # noqa: E402
from detinfer.compute.sampling import Sampling  # noqa: E402
from detinfer.model.chat import ChatTemplate  # noqa: E402
from detinfer.records.manifest import tokens_sha256  # noqa: E402
from detinfer.records.replay import replay_turns
from detinfer.records.session import load_session  # noqa: E402
from detinfer.serve.app import create_app  # noqa: E402
from detinfer.serve.chat_completions import ChatCompletions  # noqa: E402
from detinfer.serve.protocol import ChatRequest, ResponseFormat  # noqa: E402
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
    settings = ServerSettings(threads=1, record_dir=record_dir, chat_template=ChatTemplate.builtin("chatml-tools"), aliases=("smollm2",))
    running = _Running(create_app(engine, settings))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _post(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0.8, "seed": 3, "max_tokens": 60, **body},
                      timeout=120)  # fmt: skip


def _stream(server, **body) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=120,
                      json=dict(model=MODEL, temperature=0.8, seed=3, max_tokens=60, stream=True, **body)) as r:
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
    req = ChatRequest.model_validate({"model": MODEL, "messages": MESSAGES})
    prompt = ChatCompletions(server.server.config.app.state.server).prepare(req).prompt
    res = GenerationResult()
    before = numba.get_num_threads()
    set_threads(2)  # this (test) thread's numba pool; the server's decode thread keeps its 1
    try:
        for _ in generate(engine, prompt, Sampling(temperature=0.8, seed=3, max_tokens=60), result=res,
                          constraint=ResponseFormat.model_validate(SCHEMA_FORMAT).constraint()):  # as enforced  # fmt: skip
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
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give a JSON object with your name."}],
                                       response_format={"type": "json_object"}, temperature=0.8, seed=1, max_tokens=80)  # fmt: skip
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"])
def test_tool_choice_returns_a_validated_tool_call(client, server, tool_choice):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is 2 plus 3?"}], tools=TOOLS, tool_choice=tool_choice,
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


# --------------------------------------------------------------------------------------------- strict, compact, as received

LOOSE = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
RAMBLE = [{"role": "user", "content": "Describe a person as JSON with many details."}]


def _format(schema: dict, strict: bool) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


def _recorded_constraint(record_dir, output_sha256: str):
    for path in record_dir.glob("session-*.json"):
        for turn in load_session(path).turns:
            if tokens_sha256(turn.generated_token_ids) == output_sha256 and turn.constraint is not None:
                return turn.constraint
    raise AssertionError("no recorded turn with that output")


def test_strict_closes_every_object_and_the_json_is_compact(server, record_dir):
    """strict: true closes the schema's objects (OpenAI's strict mode): the model stops after the declared keys,
    where the same schema without strict rambles on to max_tokens (the control). The output is compact JSON unless
    the schema's own x-guidance says otherwise (the control: flexible whitespace gives newlines). The recording
    keeps the schema as enforced."""
    strict = _post(server, messages=RAMBLE, response_format=_format(LOOSE, True), temperature=0, max_tokens=80)
    loose = _post(server, messages=RAMBLE, response_format=_format(LOOSE, False), temperature=0, max_tokens=80)
    s, lo = strict.json()["choices"][0], loose.json()["choices"][0]
    assert s["finish_reason"] == "stop" and set(json.loads(s["message"]["content"])) == {"name", "age"}
    assert lo["finish_reason"] == "length" and lo["message"]["content"].count('":') > 2  # keys the schema never named
    content = s["message"]["content"]
    assert content == json.dumps(json.loads(content), separators=(",", ":"), ensure_ascii=False)
    flexible = dict(LOOSE, **{"x-guidance": {"whitespace_flexible": True}})
    spaced = _post(server, messages=RAMBLE, response_format=_format(flexible, True), temperature=0, max_tokens=80)
    assert "\n" in spaced.json()["choices"][0]["message"]["content"]
    enforced = json.loads(_recorded_constraint(record_dir, strict.headers["x-detinfer-output-sha256"]).text)
    assert enforced == {"x-guidance": {"whitespace_flexible": False}, **LOOSE, "additionalProperties": False}
    assert "additionalProperties" not in json.loads(_recorded_constraint(record_dir, loose.headers["x-detinfer-output-sha256"]).text)
    kept = json.loads(_recorded_constraint(record_dir, spaced.headers["x-detinfer-output-sha256"]).text)
    assert kept["x-guidance"] == {"whitespace_flexible": True}


def test_nested_objects_are_closed_and_a_strict_tool_is_closed_in_a_forced_call(server, record_dir):
    from detinfer.serve.schemas import closed

    nested = {"type": "object", "properties": {"who": LOOSE, "tags": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "string"}}}},
              "alt": {"anyOf": [{"type": "object"}, {"type": "string"}]}, "data": {"const": {"type": "object"}}}, "$defs": {"d": {"properties": {}}}}  # fmt: skip
    c = closed(nested)
    assert c["additionalProperties"] is False and c["properties"]["who"]["additionalProperties"] is False
    assert c["properties"]["tags"]["items"]["additionalProperties"] is False and c["$defs"]["d"]["additionalProperties"] is False
    assert c["properties"]["alt"]["anyOf"] == [{"type": "object", "additionalProperties": False}, {"type": "string"}]
    assert c["properties"]["data"] == {"const": {"type": "object"}}  # data, not a schema
    tool = {"type": "function", "function": {"name": "person", "strict": True, "parameters": LOOSE}}
    r = _post(server, messages=RAMBLE, tools=[tool], tool_choice={"type": "function", "function": {"name": "person"}},
              temperature=0, max_tokens=80)  # fmt: skip
    call = r.json()["choices"][0]["message"]["tool_calls"][0]
    assert set(json.loads(call["function"]["arguments"])) == {"name", "age"}
    enforced = _recorded_constraint(record_dir, r.headers["x-detinfer-output-sha256"])
    assert enforced.kind == "lark" and json.dumps(LOOSE | {"additionalProperties": False}, separators=(",", ":")) in enforced.text


def test_the_cap_applies_to_the_schema_as_the_client_sent_it(server):
    """The 64 KiB cap is on the schema's compact JSON: one of 60 KiB is served although json.dumps' default
    spacing would make it 70 KiB (the size main measured), and one of 70 KiB compact is a 400."""
    from detinfer.compute.constrain import MAX_CONSTRAINT_BYTES

    def enum_schema(n: int) -> dict:
        return {"type": "object", "properties": {"c": {"type": "string", "enum": [f"v{i:05d}" for i in range(n)]}}, "required": ["c"]}

    fits = enum_schema(6900)
    assert len(json.dumps(fits, separators=(",", ":"))) < MAX_CONSTRAINT_BYTES < len(json.dumps(fits))
    ok = _post(server, messages=MESSAGES, response_format=_format(fits, True), temperature=0, max_tokens=12)
    assert ok.status_code == 200, ok.text
    assert json.loads(ok.json()["choices"][0]["message"]["content"])["c"] in fits["properties"]["c"]["enum"]
    big = _post(server, messages=MESSAGES, response_format=_format(enum_schema(8000), True), max_tokens=2)
    assert big.status_code == 400 and "as compact JSON" in big.json()["error"]["message"], big.text


@pytest.mark.parametrize("parameters, expected", [
    ({"type": "foo"}, "Invalid type: foo"),
    ({"$ref": "#"}, "can never be satisfied"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "("}}}, "unclosed group"),
    ({"$ref": "http://127.0.0.1:9/schema.json"}, "Default retriever does not fetch"),
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)a"}}}, "look-around"),
], ids=["type-foo", "self-ref", "bad-pattern", "remote-ref", "lookahead"])  # fmt: skip
def test_a_hostile_strict_tool_schema_is_a_400_naming_the_tool_before_generating(server, parameters, expected):
    tools = [TOOLS[0], {"type": "function", "function": {"name": "hostile", "strict": True, "parameters": parameters}}]
    for tool_choice in ("auto", "required"):
        r = _post(server, messages=MESSAGES, tools=tools, tool_choice=tool_choice, max_tokens=400)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools.1.function.parameters" and "'hostile'" in err["message"] and expected in err["message"], err
    ok = _post(server, messages=MESSAGES, tools=[TOOLS[0], {"type": "function", "function": {"name": "hostile", "parameters": parameters}}],
               max_tokens=2)  # the control: the same schema without strict is only rendered, never enforced
    assert ok.status_code == 200, ok.text


# --------------------------------------------------------------------------------------------- the Responses API


def test_responses_text_format_is_chat_response_format(server, client, engine, record_dir):
    """text.format json_schema (strict or not) and json_object give the bytes chat's response_format gives for the
    same conversation, echo the format, are recorded with the constraint as enforced and replay."""
    for fmt in ({"type": "json_schema", "name": "person", "schema": LOOSE, "strict": True},
                {"type": "json_schema", "name": "person", "schema": PERSON}, {"type": "json_object"}):
        chat_format = fmt if fmt["type"] == "json_object" else {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        chat = _post(server, messages=RAMBLE, response_format=chat_format, temperature=0, max_tokens=60)
        raw = client.responses.with_raw_response.create(model=MODEL, input=RAMBLE[0]["content"], text={"format": fmt},
                                                        temperature=0, max_output_tokens=60)  # fmt: skip
        resp = raw.parse()
        assert raw.headers["x-detinfer-output-sha256"] == chat.headers["x-detinfer-output-sha256"]
        assert resp.output[0].content[0].text == chat.json()["choices"][0]["message"]["content"]
        assert resp.text.format.type == fmt["type"]
        assert _recorded_constraint(record_dir, raw.headers["x-detinfer-output-sha256"]).text
    bad = httpx.post(server.url + "/v1/responses", timeout=60, json={"model": MODEL, "input": "hi", "text": {
        "format": {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text
    records = [load_session(p) for p in sorted(record_dir.glob("session-*.json"))]
    for record in records:
        if any(t.constraint is not None for t in record.turns):
            assert all(not diffs for _, diffs, _ in replay_turns(engine, record, use_cache=False))


# --------------------------------------------------------------------------------------------- SDK leniency


def test_messages_as_the_sdks_give_them_back_are_accepted(server, client):
    """openai-python's parse() and stream() helpers add ``parsed``, ``parsed_arguments`` and a tool call's ``index``
    to the reply; re-sending that reply (as the Node SDK's stream().finalChatCompletion() users do) is a 200. An
    unknown field elsewhere stays a 400 (the control)."""

    class Add(BaseModel):
        a: int
        b: int

    tools = [openai.pydantic_function_tool(Add, name="add")]
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    kw = dict(model=MODEL, tools=tools, tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0, max_tokens=40)
    parsed = client.chat.completions.parse(messages=messages, **kw).choices[0].message
    assert parsed.tool_calls[0].function.parsed_arguments == Add.model_validate_json(parsed.tool_calls[0].function.arguments)
    with client.chat.completions.stream(messages=messages, **kw) as stream:
        final = stream.get_final_completion().choices[0].message
    sent = final.model_dump(exclude_unset=True, mode="json")  # what openai-python sends for a message model
    assert "parsed" in sent and "parsed_arguments" in sent["tool_calls"][0]["function"] and "index" in sent["tool_calls"][0]
    for reply in (parsed, final):
        follow = messages + [reply, {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "5"}]
        assert client.chat.completions.create(model=MODEL, messages=follow, tools=tools, max_tokens=4).choices[0]
    node_style = {"role": "assistant", "content": None, "refusal": None, "parsed": None, "tool_calls": [{
        "id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}', "parsed_arguments": {"a": 2, "b": 3}}}]}
    body = {"model": MODEL, "tools": tools, "max_tokens": 4,
            "messages": messages + [node_style, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]}  # fmt: skip
    ok = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert ok.status_code == 200, ok.text
    same = dict(body, messages=messages + [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "add", "arguments": '{"a":2,"b":3}'}}]}, body["messages"][-1]])  # fmt: skip
    again = httpx.post(server.url + "/v1/chat/completions", json=same, timeout=60)  # the helper fields change nothing
    assert again.json()["usage"]["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert again.headers["x-detinfer-output-sha256"] == ok.headers["x-detinfer-output-sha256"]
    for extra, param in ((dict(body, logit_bias={}), "logit_bias"), (dict(body, messages=[dict(messages[0], foo=1)]), "messages.0.foo")):
        bad = httpx.post(server.url + "/v1/chat/completions", json=extra, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
