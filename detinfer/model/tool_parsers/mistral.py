"""Mistral tool calls: ``[TOOL_CALLS]`` then a JSON list of ``{"name": ..., "arguments": {...}}``."""

from __future__ import annotations

import json
from typing import Any

from .base import ToolCallFormat

MARKER = "[TOOL_CALLS]"


def split(text: str) -> tuple[str, list[Any]] | None:
    before, _, rest = text.partition(MARKER)
    try:
        calls = json.loads(rest)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the decoder recurses
        return None
    return before, calls if isinstance(calls, list) else [calls]


FORMAT = ToolCallFormat("mistral", MARKER, "", MARKER, split, lambda source: MARKER in source)
