"""Recording served requests as sessions: every finished request goes into a session file ``detinfer replay`` reads.

A chat request that repeats a recorded session's last request's messages followed by an assistant message (the
reply, as text or tool calls, however the client re-sends it) continues that session, as does any request whose
prompt token ids extend a session's last prompt + output. The turn records the tokens appended after the longest
common prefix with the history (and ``kept_tokens`` when that is not all of it, as for a client that re-sends
its calls as text); otherwise the request starts a new session file. One recorder belongs to one decode worker:
it is not safe to call from two threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..compute.constrain import Constraint
from ..compute.engine import Engine
from ..compute.generate import GenerationResult
from ..compute.sampling import Sampling
from ..model.chat import ChatTemplate
from ..model.tool_parsers import Reply
from .session import ChatMessage, TurnRecord, new_record, write_session


@dataclass(frozen=True)
class Exchange:
    """One finished request as the recorder keeps it: the prompt's token ids, whether it was a chat and its messages
    (as the chat template saw them; none for /v1/completions), a note for the record, the generation, its sampling,
    the parsed reply and the call format it was parsed with, the constraint and the decode seconds."""

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


class _Session:
    def __init__(self, path: Path):
        self.path = path
        self.turns: list[TurnRecord] = []
        self.history: list[int] = []  # last prompt + its generated tokens
        self.messages: list[dict] = []  # the last chat request's messages (its reply is the next message)
        self.n_messages = 0  # messages the next request repeats (the last request's plus the assistant reply)


class Recorder:
    """Writes every finished request into the session files of ``directory`` (see the module docstring)."""

    MAX_OPEN = 256  # sessions remembered for matching

    def __init__(self, directory: Path, engine: Engine, template: ChatTemplate | None = None):
        self.dir, self.engine, self.template = Path(directory), engine, template
        self.dir.mkdir(parents=True, exist_ok=True)
        taken = [int(p.stem.split("-")[1]) for p in self.dir.glob("session-*.json") if p.stem.split("-")[1].isdigit()]
        self.next_id = max(taken, default=0) + 1
        self.sessions: list[_Session] = []

    def _continued(self, prompt: list[int], messages: list[dict], chat: bool) -> _Session | None:
        def by_messages(s: _Session) -> bool:
            n = len(s.messages)
            return chat and 0 < n < len(messages) - 1 and messages[:n] == s.messages and messages[n]["role"] == "assistant"

        match = [s for s in self.sessions if by_messages(s)]
        if match:
            return max(match, key=lambda s: len(s.messages))
        match = [s for s in self.sessions if len(s.history) < len(prompt) and prompt[: len(s.history)] == s.history]
        return max(match, key=lambda s: len(s.history), default=None)

    def add(self, ex: Exchange) -> Path:
        """Record ``ex`` as the next turn of the session it continues, or as the first of a new one; returns the file."""
        prompt, messages, res = ex.prompt, ex.messages, ex.result
        sess = self._continued(prompt, messages, ex.chat)
        is_new = sess is None
        if sess is None:
            sess = _Session(self.dir / f"session-{self.next_id:06d}.json")
            new_messages = messages
        else:
            new_messages = messages[sess.n_messages:] if ex.chat else messages
        kept = 0
        while kept < min(len(sess.history), len(prompt) - 1) and sess.history[kept] == prompt[kept]:
            kept += 1
        turn = TurnRecord(
            messages=[ChatMessage(**m) for m in new_messages],
            sampling=ex.sampling.model_dump(),
            appended_token_ids=prompt[kept:],
            generated_token_ids=res.tokens,
            text=res.text,
            stop_reason=res.stop_reason,
            reused_tokens=res.reused_tokens,
            kv_sha256=res.kv_sha256,
            logits_digests=res.digests,
            template_note=ex.note,
            seconds=round(ex.seconds, 4),
            kept_tokens=kept if kept < len(sess.history) else None,
            tool_calls=ex.reply.tool_calls or None,
            tool_call_format=ex.tool_call_format if ex.reply.tool_calls else None,
            constraint=ex.constraint,
            mask_digests=res.mask_digests if ex.constraint is not None else None,
        )
        # The session changes only once the file is written: a turn that fails to record never poisons its follow-ups.
        write_session(new_record(self.engine, sess.turns + [turn], self.template), sess.path)
        sess.turns.append(turn)
        sess.history = prompt + res.tokens
        sess.messages = messages if ex.chat else []
        sess.n_messages = len(messages) + 1
        if is_new:
            self.next_id += 1
            self.sessions = self.sessions[-(self.MAX_OPEN - 1):] + [sess]
        return sess.path
