"""Tool calls: which markup a chat template's model writes for a call, and how a reply's text becomes OpenAI
``tool_calls``.

A format is chosen from the chat template's text (the markup it renders for an assistant's calls):

- ``hermes`` (Hermes, Qwen 2.5/3, detinfer's ``chatml-tools``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, possibly after some text;
- ``llama3`` (Llama 3.1+ JSON tool calling): the whole reply is ``{"name": ..., "parameters": {...}}``, optionally
  opened by ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``.

Parsing never fails: markup that is not well-formed (bad JSON, an unknown function, a missing name) leaves the
whole text as content. Call ids are derived from the reply's KV hash and the call's index, never random, so a
replayed request returns the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema


@dataclass(frozen=True)
class Reply:
    """An assistant reply: ``content`` (None when the reply is only calls) and OpenAI-shaped ``tool_calls``
    (``{"id", "type": "function", "function": {"name", "arguments": JSON text}}``)."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The reply as a chat completion ``message`` object."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's call markup.

    prefix / suffix: the text around one call's JSON (what a constraint enforcing a call must produce around it).
    marker: the text whose presence means a call begins (``prefix`` without the optional whitespace).
    opens_reply: the markup must start the reply (llama3); otherwise it may follow some text.
    arguments_key: the key holding the arguments in the call's JSON.
    """

    name: str
    prefix: str
    suffix: str
    marker: str
    opens_reply: bool = False
    arguments_key: str = "arguments"

    def _bodies(self, text: str) -> tuple[str, list[Any]] | None:
        """(text outside the calls, the parsed JSON of each call) or None when the markup is malformed."""
        try:
            if self.name == "hermes":
                pieces = re.split(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, flags=re.S)
                return "".join(pieces[0::2]), [json.loads(b) for b in pieces[1::2]]
            if self.name == "mistral":
                before, _, rest = text.partition(self.marker)
                calls = json.loads(rest)
                return before, calls if isinstance(calls, list) else [calls]
            body = text.strip().removeprefix("<|python_tag|>")
            calls = json.loads(body)
            return "", calls if isinstance(calls, list) else [calls]
        except ValueError:
            return None

    def marker_at(self, text: str) -> int | None:
        """Index where call markup begins in ``text`` (None if none does)."""
        if self.opens_reply:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped[:1] in ("{", "[") or stripped.startswith("<|python_tag|>") else None
        i = text.find(self.marker)
        return None if i < 0 else i

    def parse(self, text: str, tools: dict[str, dict | None], *, call_id_seed: str, parallel: bool = True) -> Reply:
        """The reply for generated ``text``: its calls if the markup is well-formed and names only functions in
        ``tools``, else the text as content. ``tools``: function name -> the JSON Schema its arguments must satisfy
        (a ``strict`` tool's parameters) or None. ``parallel`` False keeps only the first call. ``call_id_seed``: a hash
        that fixes the reply (the KV hash after it); call i gets id ``call_`` + sha256(seed:i)[:24]."""
        if self.marker_at(text) is None:
            return Reply(text)
        parsed = self._bodies(text)
        if parsed is None or not parsed[1]:
            return Reply(text)
        content, bodies = parsed
        calls = []
        for i, body in enumerate(bodies):
            args = body.get(self.arguments_key, body.get("arguments")) if isinstance(body, dict) else None
            name = body.get("name") if isinstance(body, dict) else None
            if not isinstance(name, str) or name not in tools or not isinstance(args, dict):
                return Reply(text)
            if tools[name] is not None and not jsonschema.Draft202012Validator(tools[name]).is_valid(args):
                return Reply(text)
            call_id = "call_" + hashlib.sha256(f"{call_id_seed}:{i}".encode()).hexdigest()[:24]
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})  # fmt: skip
        return Reply(content if content.strip() else None, calls if parallel else calls[:1])


FORMATS = {
    "hermes": ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "<tool_call>"),
    "llama3": ToolCallFormat("llama3", "", "", "<|python_tag|>", opens_reply=True, arguments_key="parameters"),
    "mistral": ToolCallFormat("mistral", "[TOOL_CALLS]", "", "[TOOL_CALLS]"),
}


def format_for_template(source: str) -> ToolCallFormat | None:
    """The call format a chat template's text writes for an assistant's calls, or None if it names none."""
    if "<tool_call>" in source:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in source:
        return FORMATS["mistral"]
    if "<|python_tag|>" in source or ("ipython" in source and "<|eom_id|>" in source):
        return FORMATS["llama3"]
    return None


class StreamSplitter:
    """Splits a streamed reply into content that is safe to send now and call markup, held back until the end.

    ``feed(piece)`` adds the next piece of generated text and returns the new content to send; leading whitespace
    and any text that could begin call markup are held, so markup is never sent as content.
    """

    def __init__(self, fmt: ToolCallFormat):
        self.fmt, self.sent, self.text = fmt, 0, ""

    def feed(self, piece: str) -> str:
        self.text += piece
        text = self.text
        at = self.fmt.marker_at(text)
        if at is None and self.fmt.opens_reply:
            at = len(text) if not text.strip() or "<|python_tag|>".startswith(text.strip()) else None
        if at is None:
            at = len(text)
            for k in range(min(len(self.fmt.marker), len(text)), 0, -1):  # a partial marker at the end
                if self.fmt.marker.startswith(text[-k:]):
                    at = len(text) - k
                    break
        if not text[:at].strip() or at <= self.sent:
            return ""
        new, self.sent = text[self.sent:at], at
        return new

    def rest(self, reply: Reply, text: str) -> str:
        """Content still to send at the end: the parsed reply's content (or the whole text) after what was sent."""
        content = reply.content if reply.tool_calls else text
        return (content or "")[self.sent:]
