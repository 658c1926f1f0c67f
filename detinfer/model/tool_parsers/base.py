"""What every tool-call format shares: the reply it parses into and how a format finds, checks and names calls."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable


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


# (text outside the calls, the parsed JSON of each call), or None when the markup is malformed
Split = Callable[[str], "tuple[str, list[Any]] | None"]


@dataclass(frozen=True)
class ToolCallFormat:
    """One model family's call markup.

    prefix / suffix: the text around one call's JSON (what a constraint enforcing a call must produce around it).
    marker: the text whose presence means a call begins (``prefix`` without the optional whitespace).
    opens_reply: the markup must start the reply (llama3); otherwise it may follow some text.
    arguments_key: the key holding the arguments in the call's JSON.
    split: the format's parser (see ``Split``); detects: whether a chat template's text writes this format.
    """

    name: str
    prefix: str
    suffix: str
    marker: str
    split: Split
    detects: Callable[[str], bool]
    opens_reply: bool = False
    arguments_key: str = "arguments"

    def marker_at(self, text: str) -> int | None:
        """Index where call markup begins in ``text`` (None if none does)."""
        if self.opens_reply:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped[:1] in ("{", "[") or stripped.startswith(self.marker) else None
        i = text.find(self.marker)
        return None if i < 0 else i

    def parse(self, text: str, tools: dict[str, dict | None], *, call_id_seed: str, parallel: bool = True) -> Reply:
        """The reply for generated ``text``: its calls if the markup is well-formed and names only functions in
        ``tools``, else the text as content. ``tools``: function name -> the JSON Schema its arguments must satisfy
        (a ``strict`` tool's parameters) or None. ``parallel`` False keeps only the first call. ``call_id_seed``: a hash
        that fixes the reply (the KV hash after it); call i gets id ``call_`` + sha256(seed:i)[:24]."""
        if self.marker_at(text) is None:
            return Reply(text)
        parsed = self.split(text)
        if parsed is None or not parsed[1]:
            return Reply(text)
        content, bodies = parsed
        calls = []
        for i, body in enumerate(bodies):
            args = body.get(self.arguments_key, body.get("arguments")) if isinstance(body, dict) else None
            name = body.get("name") if isinstance(body, dict) else None
            if not isinstance(name, str) or name not in tools or not isinstance(args, dict):
                return Reply(text)
            import jsonschema  # 50 ms of every start otherwise; only a reply that calls a tool needs it

            if tools[name] is not None and not jsonschema.Draft202012Validator(tools[name]).is_valid(args):
                return Reply(text)
            call_id = "call_" + hashlib.sha256(f"{call_id_seed}:{i}".encode()).hexdigest()[:24]
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})  # fmt: skip
        return Reply(content if content.strip() else None, calls if parallel else calls[:1])
