"""The Python API (detinfer.load, LLM.complete / chat / stream / session, detinfer.verify) on the real default
model, checked against the committed golden streams, the CLI's manifests and OpenAI's own response types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import start_server
from openai import OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion

import detinfer
from detinfer.errors import DetinferError, InputError, KVTypeError
from detinfer.records.replay import replay_turns
from detinfer.records.session import load_session

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def golden(name: str) -> dict:
    return json.loads((GOLDEN / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def llm(model_path: Path) -> detinfer.LLM:
    return detinfer.load(model_path, n_ctx=512)


def test_public_names():
    assert set(detinfer.__all__) >= {"load", "verify", "LLM", "Result", "Stream", "SessionResult", "DetinferError"}
    assert all(getattr(detinfer, name) is not None for name in detinfer.__all__)


def test_complete_gives_the_golden_tokens(llm: detinfer.LLM):
    g = golden("plain_greedy")
    run = llm.complete("The capital of France is", max_tokens=8)
    assert run.prompt_tokens == g["prompt_token_ids"]
    assert run.tokens == g["output_token_ids"][:8] and run.stop_reason == "max_tokens"
    assert run.text == llm.engine.tokenizer.decode(run.tokens) and g["output_text"].startswith(run.text)
    assert len(run.top_logits) == 8 and run.top_logits[0][0][0] == run.tokens[0]  # greedy: the top-1 token


def test_chat_of_a_string_is_the_cli_chat_prompt(llm: detinfer.LLM):
    g = golden("chat_greedy")
    run = llm.chat("Give me three tips for staying healthy.", max_tokens=6)
    assert run.prompt_tokens == g["prompt_token_ids"] and run.tokens == g["output_token_ids"][:6]
    assert run.manifest.prompt.text == "Give me three tips for staying healthy." and run.manifest.prompt.chat
    as_list = llm.chat([{"role": "user", "content": "Give me three tips for staying healthy."}], max_tokens=6)
    assert as_list.tokens == run.tokens and as_list.manifest.prompt.text is None


def test_stream_yields_the_steps_of_the_same_run(llm: detinfer.LLM):
    options = dict(temperature=0.8, top_p=0.9, seed=1234, max_tokens=10)
    stream = llm.stream(messages=[{"role": "user", "content": "Write a short poem about the sea."}], **options)
    assert stream.result is None
    steps = list(stream)
    done = llm.chat([{"role": "user", "content": "Write a short poem about the sea."}], **options)
    assert [s.token for s in steps] == done.tokens and "".join(s.text for s in steps) == done.text
    assert stream.result.manifest.contract() == done.manifest.contract()  # same bytes: tokens, KV hash, digests
    other_seed = llm.chat([{"role": "user", "content": "Write a short poem about the sea."}], **{**options, "seed": 7})
    assert other_seed.manifest.output.logits_digests != done.manifest.output.logits_digests  # negative control


def test_a_saved_manifest_verifies_and_an_edited_one_does_not(llm: detinfer.LLM, tmp_path: Path):
    run = llm.complete("Once upon a time", max_tokens=5, stop=["\n"])
    run.manifest.save(tmp_path / "run.json")
    (result,) = detinfer.verify(tmp_path / "run.json")
    assert result.status == "match" and result.report() == [], result
    data = json.loads((tmp_path / "run.json").read_text())
    data["output"]["text"] += "!"
    (tmp_path / "edited.json").write_text(json.dumps(data))
    (bad,) = detinfer.verify([tmp_path / "edited.json"])
    assert bad.status == "bad input" and "output" in bad.report()[0]  # the section hash names the edit


def test_to_openai_parses_as_openai_types(llm: detinfer.LLM):
    chat = llm.chat([{"role": "user", "content": "Hi"}], max_tokens=4).to_openai()
    parsed = ChatCompletion.model_validate(chat)
    assert parsed.choices[0].message.content == llm.chat([{"role": "user", "content": "Hi"}], max_tokens=4).text
    assert parsed.choices[0].finish_reason == "length" and parsed.usage.completion_tokens == 4
    completion = Completion.model_validate(llm.complete("Hello", max_tokens=3).to_openai())
    assert completion.object == "text_completion" and completion.usage.total_tokens == completion.usage.prompt_tokens + 3
    assert chat["id"] == llm.chat([{"role": "user", "content": "Hi"}], max_tokens=4).to_openai()["id"]


def test_session_replays_exactly(llm: detinfer.LLM, tmp_path: Path):
    session = llm.session({"sampling": {"max_tokens": 6},
                           "turns": [{"messages": [{"role": "user", "content": "What is 2 + 3?"}]},
                                     {"messages": [{"role": "user", "content": "Times 4?"}], "sampling": {"temperature": 0.7, "seed": 3}}]})
    assert len(session.texts) == 2 and all(session.texts)
    session.save(tmp_path / "s.json")
    assert [diffs for _, diffs, _ in replay_turns(llm.engine, load_session(tmp_path / "s.json"))] == [[], []]


@pytest.mark.parametrize(
    "call, error, needle",
    [
        (lambda llm: llm.complete("x", temprature=0.5), InputError, "unknown sampling option 'temprature'"),
        (lambda llm: llm.complete("x", top_p=1.5), InputError, "top_p=1.5"),
        (lambda llm: llm.complete("x", max_tokens=0), InputError, "invalid sampling parameter max_tokens=0: must be greater than or equal to 1"),
        (lambda llm: llm.complete("x", stop=[3]), InputError, "stop.0=3: must be a valid string"),
        (lambda llm: llm.complete(""), InputError, "empty"),
        (lambda llm: llm.complete("word " * 600), InputError, "the context holds 512"),
        (lambda llm: llm.chat([{"role": "user"}]), InputError, "has no 'content'"),
        (lambda llm: llm.chat([]), InputError, "empty"),
        (lambda llm: llm.stream("x", messages="y"), InputError, "exactly one"),
        (lambda llm: llm.session({"turns": []}), InputError, "turns"),
        (lambda llm: detinfer.load(llm.engine.model_file.path, kv_type="q8_0"), KVTypeError, "q8_0"),
        (lambda llm: detinfer.load("/nonexistent/model.gguf"), DetinferError, "does not exist"),
        (lambda llm: detinfer.verify(["/nonexistent/run.json"]), DetinferError, "does not exist"),
    ],
)
def test_bad_input_is_a_typed_one_line_error(llm: detinfer.LLM, call, error, needle: str):
    with pytest.raises(error) as e:
        call(llm)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_served_model_answers_as_the_api(llm: detinfer.LLM, model_path: Path):
    """`detinfer serve` loads its model through detinfer.load: a real server on loopback, asked with OpenAI's client,
    gives the API's tokens (same text and usage)."""
    proc, url = start_server("--model", model_path, "--ctx", "512", "--threads", "1", timeout=120)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "Name three primary colors."}]
        reply = client.chat.completions.create(model=model_path.name, messages=messages, temperature=0.7, top_p=0.9, seed=42, max_tokens=12)
        ours = ChatCompletion.model_validate(llm.chat(messages, temperature=0.7, top_p=0.9, seed=42, max_tokens=12).to_openai())
        assert reply.choices[0].message.content == ours.choices[0].message.content
        assert reply.usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == ours.usage.model_dump(include={"prompt_tokens", "completion_tokens"})
        assert reply.choices[0].finish_reason == ours.choices[0].finish_reason
    finally:
        proc.terminate()
        proc.wait(timeout=30)
