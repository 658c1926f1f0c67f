"""Tool calls: which markup a chat template's model writes for a call, and how a reply's text becomes OpenAI
``tool_calls``. One small module per format, registered here by name:

- ``hermes`` (Hermes, Qwen 2.5/3, detinfer's ``chatml-tools``): ``<tool_call>{...}</tool_call>`` blocks;
- ``llama3`` (Llama 3.1+ JSON tool calling): the whole reply is the call's JSON, optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of calls.

Parsing never fails: markup that is not well-formed (bad JSON, an unknown function, a missing name) leaves the
whole text as content. Call ids are derived from the reply's KV hash and the call's index, never random, so a
replayed request returns the same bytes. The formats sit in model/ beside the chat templates that write them:
records re-parse a recorded reply to check its ``tool_calls``, and the server streams replies with them.
"""

from __future__ import annotations

from . import hermes, llama3, mistral
from .base import Reply, ToolCallFormat

# In detection order: a template naming several markers is taken as the first.
FORMATS: dict[str, ToolCallFormat] = {m.FORMAT.name: m.FORMAT for m in (hermes, mistral, llama3)}

__all__ = ["FORMATS", "Reply", "ToolCallFormat", "format_for_template"]


def format_for_template(source: str) -> ToolCallFormat | None:
    """The call format a chat template's text writes for an assistant's calls, or None if it names none."""
    return next((f for f in FORMATS.values() if f.detects(source)), None)
