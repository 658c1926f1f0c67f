"""Recording served requests as sessions: every finished request goes into a session file ``detinfer replay`` reads.

One run of a conversation is one file. A chat request continues a recorded session when it repeats that session's
last request (the same messages, as the chat template saw them, and the same tools) followed by an assistant
message (the reply, as text or tool calls, however the client re-sends it) and new messages; among the sessions it
continues, the one whose token history shares the longest prefix with the new prompt wins, ties going to the most
recently updated. Anything else (another system prompt or tools block, an edited earlier message) starts a new
session, so two runs of one conversation never mix in one file. A /v1/completions request continues a completions
session whose prompt + output its token ids extend.

The turn records the tokens appended after the longest common prefix with the history (``kept_tokens`` when that is
not all of it, as for a client that re-sends its calls as text), the request's tools and the reply as re-sent, so
replay can check that the messages render to those tokens (records/binding.py, rendering "whole").

Files: a new session takes the next free ``session-NNNNNN.json``, created exclusively (fileio.publish_new), so two
servers recording into one folder, or a file or link already at that name, never replace a record: the name is
skipped with a warning. A record that cannot be written (a full disk, a path replaced by a link) is one warning and
the request is answered anyway, reported as unrecorded. One recorder belongs to one decode worker: it is not safe to
call from two threads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..compute.constrain import Constraint
from ..compute.engine import Engine
from ..compute.generate import GenerationResult
from ..compute.kvcache import common_prefix
from ..compute.sampling import Sampling
from ..errors import DetinferError
from ..fileio import publish_new
from ..model.chat import ChatTemplate
from ..model.tool_parsers import Reply
from .session import (
    ChatMessage,
    TurnRecord,
    new_record,
    reply_message,
    session_json,
    write_session,
)

log = logging.getLogger("detinfer.record")


@dataclass(frozen=True)
class Exchange:
    """One finished request as the recorder keeps it: the prompt's token ids, whether it was a chat, its messages and
    tools as the chat template saw them (none for /v1/completions), a note for the record, the generation, its
    sampling, the parsed reply, the call format the reply was parsed with (None: no tools offered) and whether parallel
    calls were kept, the constraint and the decode seconds."""

    prompt: list[int]
    chat: bool
    messages: list[dict[str, Any]]
    note: str | None
    result: GenerationResult
    sampling: Sampling
    reply: Reply
    tool_call_format: str | None
    constraint: Constraint | None
    seconds: float
    tools: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool = True


@dataclass
class _Session:
    path: Path
    chat: bool
    turns: list[TurnRecord] = field(default_factory=list)
    history: list[int] = field(default_factory=list)  # last prompt + its generated tokens
    messages: list[dict] = field(default_factory=list)  # the last chat request's messages (its reply comes next)
    tools: list[dict] | None = None  # the last chat request's tools
    reply: dict | None = None  # the last reply as the record holds it (what a re-sent one is compared with)


class Recorder:
    """Writes every finished request into the session files of ``directory`` (see the module docstring)."""

    MAX_OPEN = 256  # sessions remembered for matching

    def __init__(self, directory: Path, engine: Engine, template: ChatTemplate | None = None):
        self.dir, self.engine, self.template = Path(directory), engine, template
        self.dir.mkdir(parents=True, exist_ok=True)
        taken = [int(p.stem.split("-")[1]) for p in self.dir.glob("session-*.json") if p.stem.split("-")[1].isdigit()]
        self.next_id = max(taken, default=0) + 1
        self.sessions: list[_Session] = []  # least recently updated first

    def _continued(self, ex: Exchange) -> _Session | None:
        """The session ``ex`` continues (see the module docstring), or None."""
        if ex.chat:
            def carries(s: _Session) -> bool:
                n = len(s.messages)
                return (s.chat and 0 < n < len(ex.messages) - 1 and ex.messages[:n] == s.messages
                        and ex.messages[n]["role"] == "assistant" and ex.tools == s.tools)  # fmt: skip
        else:
            def carries(s: _Session) -> bool:
                return not s.chat and len(s.history) < len(ex.prompt) and ex.prompt[: len(s.history)] == s.history

        order = [(s, i) for i, s in enumerate(self.sessions) if carries(s)]
        if not order:
            return None
        return max(order, key=lambda si: (common_prefix(si[0].history, ex.prompt), si[1]))[0]

    def _turn(self, ex: Exchange, sess: _Session | None) -> TurnRecord:
        res, prompt = ex.result, ex.prompt
        history = sess.history if sess is not None else []
        new_messages, resent = ex.messages, None
        if sess is not None and ex.chat:
            n = len(sess.messages)
            new_messages = ex.messages[n + 1:]
            resent = ex.messages[n] if ex.messages[n] != sess.reply else None
        kept = min(common_prefix(history, prompt), len(prompt) - 1)
        return TurnRecord.of(
            res, new_messages, ex.sampling.model_dump(), prompt[kept:], ex.constraint, ex.seconds,
            template_note=ex.note,
            kept_tokens=kept if kept < len(history) else None,
            tool_calls=ex.reply.tool_calls or None,
            tool_call_format=ex.tool_call_format,
            rendering="whole" if ex.chat else "raw",
            tools=ex.tools,
            reply_as_sent=ChatMessage(**resent) if resent is not None else None,
            parallel_tool_calls=None if ex.parallel_tool_calls else False,
        )

    def _publish(self, turn: TurnRecord, chat: bool) -> _Session:
        """A new session file holding ``turn``, at the first free name from next_id on."""
        data = session_json(new_record(self.engine, [turn], self.template)).encode("utf-8")
        while True:
            path = self.dir / f"session-{self.next_id:06d}.json"
            self.next_id += 1
            if publish_new(path, data):
                return _Session(path, chat)
            log.warning("detinfer: %s already exists (another server's record, or a file or link put there); "
                        "recording into the next free name", path)  # fmt: skip

    def add(self, ex: Exchange) -> Path | None:
        """Record ``ex`` as the next turn of the session it continues, or as the first of a new one; returns the file,
        or None (with one warning) when it could not be written: the request is answered anyway."""
        sess = self._continued(ex)
        turn = self._turn(ex, sess)
        try:
            if sess is None:
                sess = self._publish(turn, ex.chat)
            else:  # the session changes only once its file is written: a failed turn never poisons its follow-ups
                write_session(new_record(self.engine, sess.turns + [turn], self.template), sess.path)
        except (OSError, DetinferError) as e:
            log.warning("detinfer: the request was answered but not recorded: %s", getattr(e, "strerror", None) or e)
            return None
        sess.turns.append(turn)
        sess.history = ex.prompt + ex.result.tokens
        sess.messages, sess.tools = (ex.messages, ex.tools) if ex.chat else ([], None)
        sess.reply = reply_message(ex.result.text, ex.reply.tool_calls or None)
        if sess in self.sessions:
            self.sessions.remove(sess)
        self.sessions = self.sessions[-(self.MAX_OPEN - 1):] + [sess]
        return sess.path
