"""Hermes / Qwen 2.5-3 tool calls (and detinfer's ``chatml-tools``): ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, one block per call, possibly after some text."""

from __future__ import annotations

import json
import re
from typing import Any

from .base import ToolCallFormat


def split(text: str) -> tuple[str, list[Any]] | None:
    try:
        pieces = re.split(r"<tool_call>(.*?)(?:</tool_call>|\Z)", text, flags=re.S)
        return "".join(pieces[0::2]), [json.loads(b) for b in pieces[1::2]]
    except ValueError:
        return None


FORMAT = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "<tool_call>", split, lambda source: "<tool_call>" in source)
