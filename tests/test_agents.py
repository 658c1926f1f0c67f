"""Real agent frameworks driving a real ``detinfer serve`` (SmolLM2, ``--chat-template chatml-tools``, ``--record``)
on loopback: each runs a task that needs at least two tool calls, executes its tools through ``tool_calls``, and its
recording replays bit for bit in a fresh process.

The 135M model calls tools after two few-shot runs of the same kind of task (in the framework's own message types)
and greedy decoding makes every run the same, so the calls asserted here are exactly what the model does (its
arithmetic is wrong: add(3, 4) for "(3 + 3) * 4", and that is what is asserted).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import start_server

from detinfer.records.session import SessionRecord, session_json

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.frameworks

SYSTEM = "You are a calculator. Use the tools for every step."
EXAMPLES = [(1, 2, 5), (2, 6, 3)]  # few-shot tasks "(x + y) * z", solved with add, multiply, final_answer
TASK = "What is (3 + 3) * 4?"
CALLS = [("add", {"a": 3, "b": 4}), ("multiply", {"a": 7, "b": 4})]  # what the model calls for TASK
MAX_TOKENS = 40


def example_steps(x: int, y: int, z: int) -> list[tuple[str, dict, int]]:
    s = x + y
    return [("add", {"a": x, "b": y}, s), ("multiply", {"a": s, "b": z}, s * z), ("final_answer", {"answer": s * z}, s * z)]


class Calculator:
    """The tools, recording each execution."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        self.calls.append(("add", {"a": a, "b": b}))
        return a + b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers."""
        self.calls.append(("multiply", {"a": a, "b": b}))
        return a * b

    def final_answer(self, answer: int) -> int:
        """Give the final answer."""
        self.calls.append(("final_answer", {"answer": answer}))
        return answer


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("agent-sessions")


@pytest.fixture(scope="module")
def base_url(model_path, record_dir):
    """A real ``detinfer serve`` process on a free loopback port, stopped after the module."""
    proc, url = start_server("--model", model_path, "--threads", "1", "--ctx", "2048", "--chat-template", "chatml-tools",
                             "--record", record_dir, "--alias", "smollm2")  # fmt: skip
    yield url + "/v1"
    proc.terminate()
    proc.wait(timeout=60)


RUNS: dict[str, list[Path]] = {}  # test id -> the session files its agent run recorded


@pytest.fixture
def recorded(record_dir, request):
    """Call after a run: the sessions it recorded (loaded JSON); test_every_agent_run_replays replays them."""
    before = set(record_dir.glob("session-*.json"))

    def check() -> list[dict]:
        new = sorted(set(record_dir.glob("session-*.json")) - before)
        assert new, "the run recorded nothing"
        RUNS[request.node.name] = new
        return [json.loads(f.read_text()) for f in new]

    return check


def recorded_calls(sessions: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for s in sessions for t in s["turns"] for c in t.get("tool_calls") or []]  # fmt: skip


def assert_agent_run(calc: Calculator, sessions: list[dict], *, final: bool = True) -> None:
    """The tools ran exactly as the server's tool_calls said, in one recorded session per agent run."""
    assert calc.calls[:2] == CALLS
    if final:
        assert calc.calls[2:] == [("final_answer", {"answer": 28})]
    assert recorded_calls(sessions)[: len(calc.calls)] == calc.calls
    assert len(sessions) == 1 and len(sessions[0]["turns"]) >= 3  # the whole run is one session


# --------------------------------------------------------------------------------------------- openai-agents


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents(base_url, recorded, api):
    agents = pytest.importorskip("agents")
    calc = Calculator()
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    agents.set_tracing_disabled(True)
    model = (agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel)("smollm2", client)
    tools = [agents.function_tool(f) for f in (calc.add, calc.multiply, calc.final_answer)]
    agent = agents.Agent(name="calculator", instructions=SYSTEM, tools=tools, model=model,
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS),
                         tool_use_behavior=agents.StopAtTools(stop_at_tool_names=["final_answer"]))  # fmt: skip
    items: list[dict] = []
    for k, (x, y, z) in enumerate(EXAMPLES):
        items.append({"role": "user", "content": f"What is ({x} + {y}) * {z}?"})
        for i, (name, args, result) in enumerate(example_steps(x, y, z)):
            items += [{"type": "function_call", "call_id": f"ex{k}{i}", "name": name, "arguments": json.dumps(args)},
                      {"type": "function_call_output", "call_id": f"ex{k}{i}", "output": str(result)}]  # fmt: skip
    result = asyncio.run(agents.Runner.run(agent, items + [{"role": "user", "content": TASK}], max_turns=5))
    assert str(result.final_output) == "28"
    assert_agent_run(calc, recorded())


# --------------------------------------------------------------------------------------------- pydantic-ai


def test_pydantic_ai(base_url, recorded):
    pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.messages import (
        ModelRequest,
        ModelResponse,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Answer(BaseModel):
        answer: int

    calc = Calculator()
    model = OpenAIResponsesModel("smollm2", provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    # Text output stays allowed: an output tool alone makes pydantic-ai send tool_choice "required".
    agent = Agent(model, instructions=SYSTEM, output_type=[ToolOutput(Answer, name="final_answer"), str],
                  tools=[calc.add, calc.multiply], model_settings={"temperature": 0, "max_tokens": MAX_TOKENS})  # fmt: skip
    history = []
    for k, (x, y, z) in enumerate(EXAMPLES):
        history.append(ModelRequest(parts=[UserPromptPart(f"What is ({x} + {y}) * {z}?")]))
        for i, (name, args, result) in enumerate(example_steps(x, y, z)):
            history += [ModelResponse(parts=[ToolCallPart(name, json.dumps(args), tool_call_id=f"ex{k}{i}")]),
                        ModelRequest(parts=[ToolReturnPart(name, result, tool_call_id=f"ex{k}{i}")])]  # fmt: skip
    result = agent.run_sync(TASK, message_history=history)
    assert result.output == Answer(answer=28)  # the final_answer output tool, called by the model
    sessions = recorded()
    assert_agent_run(calc, sessions, final=False)
    assert recorded_calls(sessions) == CALLS + [("final_answer", {"answer": 28})]


# --------------------------------------------------------------------------------------------- LangChain


def test_langchain_bind_tools_agent_loop(base_url, recorded):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import (
        AIMessage,
        HumanMessage,
        SystemMessage,
        ToolMessage,
    )
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    calc = Calculator()
    tools = {t.name: t for t in map(tool, (calc.add, calc.multiply, calc.final_answer))}
    llm = ChatOpenAI(model="smollm2", base_url=base_url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    messages = [SystemMessage(SYSTEM)]
    for k, (x, y, z) in enumerate(EXAMPLES):
        messages.append(HumanMessage(f"What is ({x} + {y}) * {z}?"))
        for i, (name, args, result) in enumerate(example_steps(x, y, z)):
            messages += [AIMessage("", tool_calls=[{"name": name, "args": args, "id": f"ex{k}{i}"}]),
                         ToolMessage(str(result), tool_call_id=f"ex{k}{i}")]  # fmt: skip
    messages.append(HumanMessage(TASK))
    bound = llm.bind_tools(list(tools.values()))
    for _ in range(5):  # the agent loop: call the model, run the tools it asks for, until final_answer
        ai = bound.invoke(messages)
        messages.append(ai)
        for call in ai.tool_calls:
            messages.append(ToolMessage(str(tools[call["name"]].invoke(call["args"])), tool_call_id=call["id"]))
        if not ai.tool_calls or ai.tool_calls[-1]["name"] == "final_answer":
            break
    assert_agent_run(calc, recorded())


# --------------------------------------------------------------------------------------------- smolagents


@pytest.mark.filterwarnings("ignore:Function .* has decorators other than @tool")  # about its remote executor
def test_smolagents_tool_calling_agent(base_url, recorded):
    smolagents = pytest.importorskip("smolagents")
    from smolagents.memory import ActionStep, TaskStep
    from smolagents.monitoring import Timing

    calc = Calculator()

    @smolagents.tool
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return calc.add(a, b)

    @smolagents.tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return calc.multiply(a, b)

    # smolagents' defaults: it sends tool_choice "required", which the server enforces as a tool-call constraint
    model = smolagents.OpenAIServerModel("smollm2", api_base=base_url, api_key="unused", temperature=0, max_tokens=MAX_TOKENS)
    agent = smolagents.ToolCallingAgent(tools=[add, multiply], model=model, max_steps=3, verbosity_level=0)
    for x, y, z in EXAMPLES:  # earlier solved tasks in the agent's memory: the few-shot turns
        agent.memory.steps.append(TaskStep(task=f"What is ({x} + {y}) * {z}?"))
        for i, (name, args, result) in enumerate(example_steps(x, y, z)):
            agent.memory.steps.append(ActionStep(step_number=i + 1, timing=Timing(start_time=0.0, end_time=0.0), observations=str(result),
                                                 model_output=f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"))  # fmt: skip
    agent.run(TASK, reset=False)
    steps = [s for s in agent.memory.steps[-4:] if isinstance(s, ActionStep)]
    # its own prompt: other calls (the forced call is compact JSON, unlike the few-shot calls: with flexible
    # whitespace the model writes "b": 3 here)
    calls = [("add", {"a": 3, "b": 4}), ("multiply", {"a": 7, "b": 9})]
    assert [(c.name, c.arguments) for s in steps for c in s.tool_calls or []][:2] == calls  # parsed by the server
    sessions = recorded()
    assert calc.calls[:2] == calls and recorded_calls(sessions)[:2] == calls
    assert sessions[0]["turns"][1]["kept_tokens"] is not None  # smolagents re-sends calls as text: the turn says so


# ------------------------------------------------------------------------------------------ OpenAI Node SDK

NODE_PROJECT = Path(__file__).parent / "node"  # package.json + package-lock.json (openai 6.49.0) + the script


def test_openai_node_sdk_stream_helper_round_trip(base_url, recorded, tmp_path):
    """The Node SDK's tool loop: stream() -> finalChatCompletion() returns the call, and its own message sent back
    as it is (the SDK adds ``parsed`` and, for a strict tool, ``parsed_arguments``: asserted present, so the
    leniency is exercised) is answered, not a 400; the run records as one session and replays below."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    project = tmp_path / "node"
    shutil.copytree(NODE_PROJECT, project)
    install = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=project, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    if install.returncode != 0:
        pytest.skip(f"npm ci could not install openai from the registry: {install.stderr.strip().splitlines()[-1:]}")
    r = subprocess.run([node, "stream_round_trip.mjs"], cwd=project, capture_output=True, text=True, timeout=300,
                       env={"PATH": os.environ["PATH"], "BASE_URL": base_url})  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["finish_reason"] == "tool_calls", out
    [call] = out["message"]["tool_calls"]
    assert "parsed" in out["message"] and call["function"]["parsed_arguments"] == {"a": 2, "b": 3}
    assert out["follow"]["status"] == 200 and out["follow"]["content"], out
    [session] = recorded()
    assert recorded_calls([session]) == [("add", {"a": 2, "b": 3})] and len(session["turns"]) == 2


# ------------------------------------------------------------------------------------------ the llm CLI


def test_llm_cli_with_an_extra_openai_models_entry(base_url, record_dir, tmp_path):
    """simonw's ``llm`` with the README's ``extra-openai-models.yaml`` entry: a prompt, ``--functions`` (the tool
    reaches the server: it is in the recorded turn's tools; the 135M model answers in text here) and ``--schema``
    (constrained: the reply is JSON with the schema's keys). Each request is recorded and replayed below. Control:
    without ``supports_tools`` llm itself refuses --functions."""
    llm = Path(sys.executable).parent / "llm"
    if not llm.exists():
        pytest.skip("llm is not installed (pip install 'detinfer[frameworks]')")
    entry = {"model_id": "detinfer", "model_name": "smollm2", "api_base": base_url, "supports_tools": True, "supports_schema": True}
    (tmp_path / "extra-openai-models.yaml").write_text(json.dumps([entry, {**entry, "model_id": "bare", "supports_tools": False}]))
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(llm), *args, "-o", "temperature", "0", "-o", "max_tokens", "24"], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    before = set(record_dir.glob("session-*.json"))
    hi = run("-m", "detinfer", "--no-stream", "Say hi.")
    assert hi.returncode == 0 and hi.stdout.strip(), hi.stderr
    tool = run("-m", "detinfer", "--functions", "def add(a: int, b: int) -> int:\n    return a + b", "What is 2+3?")
    assert tool.returncode == 0, tool.stderr
    # a closed object: llm's "name, age int" DSL leaves it open, and a 135M model then adds keys up to max_tokens
    closed = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    person = run("-m", "detinfer", "--schema", json.dumps(closed), "Invent a person.")
    assert person.returncode == 0, person.stderr
    assert set(json.loads(person.stdout)) == {"name", "age"}
    refused = run("-m", "bare", "--functions", "def add(a: int, b: int) -> int:\n    return a + b", "What is 2+3?")
    assert refused.returncode != 0 and "does not support tools" in refused.stderr

    new = sorted(set(record_dir.glob("session-*.json")) - before)
    turns = [t for f in new for t in json.loads(f.read_text())["turns"]]
    assert len(turns) == 3 and any(d["function"]["name"] == "add" for d in turns[1]["tools"] or []), turns[1].get("tools")
    RUNS["test_llm_cli_with_an_extra_openai_models_entry"] = new


def test_every_agent_run_replays_in_a_fresh_process(base_url, model_path, tmp_path):
    """All the agent runs above, replayed bit for bit by one ``detinfer replay`` process (after the server's). Control:
    a copy of one run whose last recorded reply was edited is reported as a mismatch, and only that one."""
    assert set(RUNS) >= {"test_openai_agents[chat]", "test_openai_agents[responses]", "test_pydantic_ai",
                         "test_langchain_bind_tools_agent_loop", "test_smolagents_tool_calling_agent"}, sorted(RUNS)
    for files in RUNS.values():
        for f in files:
            shutil.copy(f, tmp_path / f.name)
    edited = json.loads(RUNS["test_langchain_bind_tools_agent_loop"][0].read_text())
    edited["turns"][-1]["text"] += " "
    (tmp_path / "session-edited-unsealed.json").write_text(json.dumps(edited))  # caught by its section hash
    (tmp_path / "session-edited.json").write_text(session_json(SessionRecord.model_validate(edited)))  # resealed
    proc = subprocess.run([sys.executable, "-m", "detinfer.cli", "replay", str(tmp_path), "--threads", "1", "--json",
                           "--model", str(model_path)], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert {Path(r["session"]).name: r["result"] for r in rows if r["result"] != "match"} == {
        "session-edited.json": "mismatch", "session-edited-unsealed.json": "bad input"}
    assert [r["differs"] for r in rows if r["result"] == "mismatch"] == [["text"]]
    assert [r["message"] for r in rows if r["result"] == "bad input"][0].endswith(
        f"section(s) turn.{len(edited['turns'])} no longer match their sha256; the session record was edited")
    for test, files in RUNS.items():
        turns = [r for r in rows if Path(r["session"]).name in {f.name for f in files}]
        assert turns and all(r["result"] == "match" for r in turns), (test, turns)


# --------------------------------------------------------------------------------------------- the wire format


def _schema(*names: str) -> dict:
    return {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": list(names)}


FUNCTIONS = [{"name": "add", "description": "Add two integers.", "parameters": _schema("a", "b")},
             {"name": "multiply", "description": "Multiply two integers.", "parameters": _schema("a", "b")},
             {"name": "final_answer", "description": "Give the final answer.", "parameters": _schema("answer")}]  # fmt: skip


def few_shot_chat() -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for k, (x, y, z) in enumerate(EXAMPLES):
        messages.append({"role": "user", "content": f"What is ({x} + {y}) * {z}?"})
        for i, (name, args, result) in enumerate(example_steps(x, y, z)):
            call = {"id": f"ex{k}{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"ex{k}{i}", "content": str(result)}]  # fmt: skip
    return messages + [{"role": "user", "content": TASK}]


def test_streamed_tool_calls_equal_the_response_and_markup_is_never_content(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    kw = dict(model="smollm2", messages=few_shot_chat(), tools=[{"type": "function", "function": f} for f in FUNCTIONS],
              temperature=0, max_tokens=MAX_TOKENS)  # fmt: skip
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    calls = [c.model_dump() for c in r.choices[0].message.tool_calls]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS[:1]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed = [t.model_dump(exclude={"index"}) for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert streamed == calls and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert client.chat.completions.create(**kw).choices[0].message.tool_calls[0].id == calls[0]["id"]  # ids repeat
    none = client.chat.completions.create(**kw, tool_choice="none")  # control: the same text, not parsed
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content.startswith("<tool_call>\n{")


def test_responses_stream_and_previous_response_id(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    chat = few_shot_chat()
    items: list[dict] = []
    for m in chat[1:]:
        if m["role"] == "assistant":
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]  # fmt: skip
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append({"role": m["role"], "content": m["content"]})
    kw = dict(model="smollm2", instructions=SYSTEM, tools=[dict(f, type="function") for f in FUNCTIONS], temperature=0,
              max_output_tokens=MAX_TOKENS)  # fmt: skip
    first = client.responses.create(input=items, **kw)
    assert [(o.type, o.name, json.loads(o.arguments)) for o in first.output] == [("function_call", *CALLS[0])]
    events = list(client.responses.create(input=items, stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "response.function_call_arguments.done" in [e.type for e in events]
    assert events[-1].response.output == first.output and events[-1].response.id == first.id
    result = {"type": "function_call_output", "call_id": first.output[0].call_id, "output": "7"}
    follow = client.responses.create(input=[result], previous_response_id=first.id, **kw)
    whole = client.responses.create(input=items + [o.model_dump(exclude={"id", "status"}) for o in first.output] + [result], **kw)
    assert [(o.name, o.arguments) for o in follow.output] == [(o.name, o.arguments) for o in whole.output]
    assert [(o.name, json.loads(o.arguments)) for o in follow.output] == CALLS[1:2]
    assert follow.usage.input_tokens == whole.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(input=[result], previous_response_id="resp_unknown", **kw)
    assert info.value.response.json()["error"]["param"] == "previous_response_id"


def test_a_recorded_agent_run_branches_after_any_turn(base_url, model_path, tmp_path):
    """``replay --until 2 --then``: the LangChain run's first two turns (add, multiply) replay exactly, then a scripted
    tool result continues the run from there."""
    run = RUNS.get("test_langchain_bind_tools_agent_loop")
    assert run, "the LangChain run did not record"
    record = json.loads(run[0].read_text())
    multiply = record["turns"][1]["tool_calls"][0]
    script = tmp_path / "then.json"
    script.write_text(json.dumps({"sampling": {"temperature": 0, "max_tokens": MAX_TOKENS}, "turns": [
        {"messages": [{"role": "tool", "content": "28", "tool_call_id": multiply["id"]}]}]}))  # fmt: skip
    out = tmp_path / "branch.json"
    proc = subprocess.run([sys.executable, "-m", "detinfer.cli", "replay", str(run[0]), "--until", "2", "--then", str(script),
                           "--out", str(out), "--threads", "1", "--model", str(model_path)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    branch = json.loads(out.read_text())
    assert branch["turns"][:2] == record["turns"][:2] and len(branch["turns"]) == 3
    assert branch["turns"][2]["messages"] == [{"role": "tool", "content": "28", "tool_call_id": multiply["id"]}]
    assert branch["turns"][2]["generated_token_ids"] and "<tool_response>\n28\n</tool_response>" not in branch["turns"][2]["text"]
