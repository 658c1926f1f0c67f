"""What a reader reads in a session record is what was computed: each turn's messages render (with the chat template
and the turn's tools) to exactly the token ids it recorded, and its tool calls are exactly what its text parses to.

Replaying a session re-executes its token ids; without this check an edited message ("What is 2 + 3?" turned into
anything else) would still replay as a match. The check re-derives every turn before any token is generated and
raises ManifestError naming the first turn that does not bind (bad input, never a match or a mismatch):

- ``rendering`` "delta" (session run, chat; and records of schema 1-3, which predate the field): the template's text
  after the history, tokenized alone, as :meth:`session.Conversation.append_messages` computes it, with the same
  ``template_note``;
- "whole" (the server): the whole conversation (the history's messages, the previous reply as the request re-sent it
  when it did so differently, this turn's messages) rendered with the turn's ``tools`` and tokenized equals the
  history's first ``kept_tokens`` tokens plus the appended ones;
- "raw" (/v1/completions): no messages to bind.

Only a "whole" turn records ``tools`` (no other rendering uses them), and there each tool result's ``tool_call_id``
names a call of the assistant message before it (as OpenAI requires of a request): no template renders call ids,
so that rule is what ties a result to its call. Fields that no computation reads (a message's ``name`` where the
template does not render it) are kept as the client sent them and bound by nothing but the seal.

A server record of schema 1-3 holds neither its tools nor the replies as re-sent, so its later turns cannot be bound:
they fail the check with the advice to record the session again.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..compute.engine import Engine
from ..errors import ManifestError
from ..model.chat import ChatTemplate, unanswered_tool_result
from ..model.tool_parsers import FORMATS
from .session import Conversation, SessionRecord, TurnRecord


def _tool_schemas(turn: TurnRecord) -> dict[str, dict | None]:
    """Function name -> the schema a strict tool's arguments were checked against (None: not strict). Records without
    ``tools`` (schema 1-3) name only the functions their calls used."""
    if turn.tools is None:
        return {c["function"]["name"]: None for c in turn.tool_calls or []}
    fns = [t.get("function", {}) for t in turn.tools]
    return {f["name"]: (f.get("parameters") if f.get("strict") else None) for f in fns if isinstance(f.get("name"), str)}


def _check_calls(i: int, turn: TurnRecord) -> None:
    if turn.tool_call_format is None:
        if turn.tool_calls:
            raise ManifestError(f"turn {i} records tool_calls without a tool_call_format; the record was edited")
        return
    fmt = FORMATS.get(turn.tool_call_format)
    if fmt is None:
        raise ManifestError(f"turn {i}: tool_call_format {turn.tool_call_format!r} is none of {', '.join(FORMATS)}")
    reply = fmt.parse(turn.text, _tool_schemas(turn), call_id_seed=turn.kv_sha256, parallel=turn.parallel_tool_calls is not False)
    if reply.tool_calls != (turn.tool_calls or []):
        raise ManifestError(f"turn {i}: its tool_calls are not the calls its text parses to; the record was edited")


def _unbound(i: int, what: str, schema: int) -> ManifestError:
    hint = "; a server recording of session schema < 4 cannot be checked: record it again" if schema < 4 else "; the record was edited"
    return ManifestError(f"turn {i}: its {what} do not render to its recorded token ids{hint}")


def check_session(engine: Engine, record: SessionRecord, template: ChatTemplate | None) -> None:
    """Raise ManifestError naming the first turn of ``record`` whose messages or tool calls do not bind (see the module
    docstring). ``template``: the session's recorded --chat-template, or None for the model's own."""
    conv = Conversation(engine, template)
    tok, tpl = engine.tokenizer, conv.template
    if record.chat_template_sha256 is not None and record.chat_template_sha256 != tpl.hash:
        raise ManifestError(f"the session was rendered with chat template {record.chat_template_sha256[:16]}..., not this "
                            f"model's {tpl.hash[:16]}...; pass the model it was recorded with")  # fmt: skip
    for i, turn in enumerate(record.turns, start=1):
        messages = [m.model_dump() for m in turn.messages]
        resent = turn.reply_as_sent.model_dump() if turn.reply_as_sent is not None else None
        if turn.tools is not None and turn.rendering != "whole":
            raise ManifestError(f"turn {i} records tools, which its {turn.rendering or 'delta'} rendering does not use; "
                                "the record was edited")  # fmt: skip
        if turn.rendering == "raw":
            if messages:
                raise ManifestError(f"turn {i} is a raw prompt but records messages; the record was edited")
        elif turn.rendering == "whole":
            history = conv.messages[:-1] + [resent] if resent is not None and conv.messages else list(conv.messages)
            if (j := unanswered_tool_result(history + messages)) is not None and j >= len(history):
                raise ManifestError(f"turn {i}: message {j - len(history)} answers tool call id "
                                    f"{(history + messages)[j]['tool_call_id']!r}, which the assistant message before it "
                                    "did not make; the record was edited")  # fmt: skip
            ids = tpl.encode(tok, tpl.render_with(tok, history + messages, tools=turn.tools))
            if ids != conv.tokens[: turn.kept_tokens] + turn.appended_token_ids:
                raise _unbound(i, "messages and tools", record.schema_version)
        elif turn.kept_tokens is not None or resent is not None:
            raise _unbound(i, "messages", record.schema_version)
        elif conv.append_messages(messages) != (turn.appended_token_ids, turn.template_note):
            raise _unbound(i, "messages", record.schema_version)
        _check_calls(i, turn)
        conv.add_turn(messages, turn.appended_token_ids, turn.generated_token_ids, turn.text, turn.tool_calls,
                      turn.kept_tokens, resent)  # fmt: skip


def check_stream_turns(engine: Engine, template: ChatTemplate, turns: Sequence[Any]) -> None:
    """The same for a session snapshot's turns (``messages``, ``prompt_token_ids``, ``output_token_ids``,
    ``output_text``), which sessions run by the Python API make: every turn renders as a "delta"."""
    conv = Conversation(engine, template)
    for i, turn in enumerate(turns, start=1):
        messages = [m.model_dump() for m in turn.messages]
        appended, _ = conv.append_messages(messages)
        if appended != turn.prompt_token_ids:
            raise ManifestError(f"turn {i}: its messages do not render to its prompt_token_ids; the snapshot was edited")
        conv.add_turn(messages, appended, turn.output_token_ids, turn.output_text)
