"""Llama 3.1+ JSON tool calling: the whole reply is ``{"name": ..., "parameters": {...}}`` (or a list of them),
optionally opened by ``<|python_tag|>``."""

from __future__ import annotations

import json
from typing import Any

from .base import ToolCallFormat

TAG = "<|python_tag|>"


def split(text: str) -> tuple[str, list[Any]] | None:
    try:
        calls = json.loads(text.strip().removeprefix(TAG))
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than the decoder recurses
        return None
    return "", calls if isinstance(calls, list) else [calls]


def detects(source: str) -> bool:
    return TAG in source or ("ipython" in source and "<|eom_id|>" in source)


FORMAT = ToolCallFormat("llama3", "", "", TAG, split, detects, opens_reply=True, arguments_key="parameters")
