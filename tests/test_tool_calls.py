"""Tool-call formats (detinfer/tool_calls.py) and the built-in ``chatml-tools`` template, without a model."""

from __future__ import annotations

import json

import pytest

from detinfer.model.chat import ChatTemplate
from detinfer.model.tool_parsers import FORMATS, Reply, format_for_template
from detinfer.serve.serving import StreamSplitter

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = {"add": None, "multiply": None}
HERMES = FORMATS["hermes"]
TWO_CALLS = ('Adding first.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
             '<tool_call>{"name": "multiply", "arguments": {"a": 5, "b": 4}}</tool_call>')


def _calls(reply: Reply) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls]


def test_hermes_calls_become_tool_calls_with_content_outside_them():
    reply = HERMES.parse(TWO_CALLS, TOOLS, call_id_seed="kv")
    assert _calls(reply) == [("add", {"a": 2, "b": 3}), ("multiply", {"a": 5, "b": 4})]
    assert reply.content == "Adding first.\n\n"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in reply.tool_calls)
    assert reply.message()["tool_calls"] == reply.tool_calls


def test_call_ids_are_derived_from_the_seed_never_random():
    a, b = HERMES.parse(TWO_CALLS, TOOLS, call_id_seed="kv"), HERMES.parse(TWO_CALLS, TOOLS, call_id_seed="kv")
    assert a == b and a.tool_calls[0]["id"] != a.tool_calls[1]["id"]
    assert HERMES.parse(TWO_CALLS, TOOLS, call_id_seed="other").tool_calls[0]["id"] != a.tool_calls[0]["id"]  # control


def test_parallel_false_keeps_the_first_call():
    assert _calls(HERMES.parse(TWO_CALLS, TOOLS, call_id_seed="kv", parallel=False)) == [("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "add", "arguments": {"a": 2</tool_call>',  # bad JSON
    '<tool_call>{"name": "divide", "arguments": {"a": 2}}</tool_call>',  # a function that was not offered
    '<tool_call>{"arguments": {"a": 2}}</tool_call>',  # no name
    '<tool_call>{"name": "add", "arguments": "a=2"}</tool_call>',  # arguments not an object
    '<tool_call>[1, 2]</tool_call>',
])
def test_malformed_markup_is_returned_as_content(text):
    assert HERMES.parse(text, TOOLS, call_id_seed="kv") == Reply(text)


def test_a_strict_tool_call_must_satisfy_its_schema():
    ok = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert _calls(HERMES.parse(ok, {"add": ADD}, call_id_seed="kv")) == [("add", {"a": 2, "b": 3})]
    bad = ok.replace('"b": 3', '"b": "three"')
    assert HERMES.parse(bad, {"add": ADD}, call_id_seed="kv") == Reply(bad)
    assert _calls(HERMES.parse(bad, {"add": None}, call_id_seed="kv")) == [("add", {"a": 2, "b": "three"})]  # not strict


def test_llama3_and_mistral_formats():
    llama = FORMATS["llama3"].parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', TOOLS, call_id_seed="s")
    assert _calls(llama) == [("add", {"a": 1, "b": 2})] and llama.content is None
    assert FORMATS["llama3"].parse("The answer is {a}.", TOOLS, call_id_seed="s") == Reply("The answer is {a}.")
    mistral = FORMATS["mistral"].parse('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                                       '{"name": "multiply", "arguments": {"a": 3, "b": 3}}]', TOOLS, call_id_seed="s")  # fmt: skip
    assert _calls(mistral) == [("add", {"a": 1, "b": 2}), ("multiply", {"a": 3, "b": 3})]


def test_format_is_chosen_from_the_template_text():
    assert format_for_template(ChatTemplate.builtin("chatml-tools").source) is HERMES
    assert format_for_template("{{ '[TOOL_CALLS]' }}") is FORMATS["mistral"]
    assert format_for_template("{{ '<|python_tag|>' }}") is FORMATS["llama3"]
    assert format_for_template(ChatTemplate.builtin("chatml").source) is None


@pytest.mark.parametrize("size", [1, 2, 3, 7])
def test_streaming_never_sends_markup_and_ends_with_the_parsed_content(size):
    reply = HERMES.parse(TWO_CALLS, TOOLS, call_id_seed="kv")
    splitter = StreamSplitter(HERMES)
    sent = "".join(splitter.feed(TWO_CALLS[i:i + size]) for i in range(0, len(TWO_CALLS), size))
    assert "<" not in sent and sent == "Adding first.\n"
    assert sent + splitter.rest(reply, TWO_CALLS) == reply.content
    plain = "No tools <here> at all."  # control: text without calls streams whole
    splitter = StreamSplitter(HERMES)
    sent = "".join(splitter.feed(plain[i:i + size]) for i in range(0, len(plain), size))
    assert sent + splitter.rest(Reply(plain), plain) == plain


def test_chatml_tools_renders_tools_calls_and_results_and_equals_chatml_without_them():
    tpl = ChatTemplate.builtin("chatml-tools")
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert tpl.render(plain) == ChatTemplate.builtin("chatml").render(plain)
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    text = tpl.render(plain[:2] + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"}], tools=tools)
    assert text.startswith("<|im_start|>system\nS\n\n# Tools\n") and json.dumps(tools[0]) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n' in text
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>\n" in text
    parsed = HERMES.parse('<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>', {"add": ADD}, call_id_seed="x")
    assert _calls(parsed) == [("add", {"a": 2, "b": 3})]  # what the template renders, the parser reads back


def test_renders_tools_tells_templates_with_tool_support_apart():
    assert ChatTemplate.builtin("chatml-tools").renders_tools()
    assert not ChatTemplate.builtin("chatml").renders_tools() and not ChatTemplate.builtin("gemma").renders_tools()
