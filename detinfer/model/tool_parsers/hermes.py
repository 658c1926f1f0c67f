"""Hermes / Qwen 2.5-3 tool calls (and detinfer's ``chatml-tools``): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call, possibly after some text."""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolCallFormat

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_JSON_WS = re.compile(r"[ \t\n\r]*")


def split(text: str) -> tuple[str, list[Any]] | None:
    """Each block's JSON is read by a JSON decoder from its opening tag, then its closing tag is expected (the last
    block may be unclosed): markup inside the JSON's strings (an argument holding ``</tool_call>``) is data. None
    when a block's JSON is malformed or is followed by anything but its closing tag."""
    decoder = json.JSONDecoder()
    outside, bodies, pos = [], [], 0
    try:
        while (start := text.find(OPEN, pos)) >= 0:
            outside.append(text[pos:start])
            body, end = decoder.raw_decode(text, _JSON_WS.match(text, start + len(OPEN)).end())
            end = _JSON_WS.match(text, end).end()
            if text.startswith(CLOSE, end):
                end += len(CLOSE)
            elif end < len(text):
                return None
            bodies.append(body)
            pos = end
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the decoder recurses
        return None
    outside.append(text[pos:])
    return "".join(outside), bodies


FORMAT = ToolCallFormat("hermes", OPEN + "\n", "\n" + CLOSE, OPEN, split, lambda source: OPEN in source)
