"""Agent sessions: multi-turn conversations kept as token ids, recorded, and replayed exactly.

Each turn appends its messages to the conversation, then the model generates one assistant message. The
conversation is kept as **token ids**: generated tokens (including the end-of-turn token) are never re-tokenized,
so turn k+1's prompt begins with exactly turn k's prompt plus its generated tokens. The tokens appended for a
turn are the chat template's rendering of the new messages (the text the template adds after the history);
where the template would render the history differently from the tokens, the token history wins and the turn
record says so in ``template_note``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..compute.constrain import Constraint, json_schema_constraint
from ..compute.engine import Engine
from ..compute.generate import GenerationResult, Step, check_prompt, generate
from ..compute.kvcache import KVCache
from ..compute.numerics import NUMERICS, NUMERICS_1
from ..compute.prefix_cache import PrefixCache
from ..compute.sampling import Sampling, SamplingOverrides
from ..errors import InputError, ManifestError, first_error
from ..fileio import atomic_write_text, read_json
from ..model.chat import BUILTIN_TEMPLATES, ChatTemplate
from .machine import machine
from .manifest import (
    ChatTemplateRecord,
    Count,
    EngineRecord,
    ModelRecord,
    OmitNone,
    TokenId,
    section_hashes,
)
from .run import (
    model_record,
    recorded_template,
    template_record,
    versions,
)

SESSION_SCHEMA_VERSION = 4
# 1: before ``chat_template``; 2: before per-turn ``constraint``, tool calls, ``kept_tokens``; 3: before
# ``section_sha256`` and the turn fields that bind messages to tokens (``rendering``, ``tools``, ``reply_as_sent``)
READABLE_SESSION_SCHEMAS = (1, 2, 3, 4)
# A turn's fields that are recorded but never part of its hash or its comparison: timings and how much of the prompt
# a cache happened to hold (which depends on what ran before in the process)
INFORMATIVE_TURN_FIELDS = {"seconds", "reused_tokens"}
# A replayed turn keeps these of its record: how its messages render, and its reply's calls
BINDING_FIELDS = ("rendering", "tools", "reply_as_sent", "parallel_tool_calls", "tool_calls", "tool_call_format")
ROLES = ("system", "user", "assistant", "tool")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ChatMessage(OmitNone, _Strict):
    """A message as the chat template sees it. ``tool_calls``: an assistant's calls, OpenAI-shaped
    (``{"id", "type", "function": {"name", "arguments"}}``); ``tool_call_id``: the call a tool message answers."""

    OMIT_NONE = ("name", "tool_calls", "tool_call_id")
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class TurnConstraint(_Strict):
    """A script turn's constraint: exactly one of ``json_schema`` (a schema object), ``json_object`` (true),
    ``regex``, ``lark`` (grammar text)."""

    json_schema: dict[str, Any] | None = None
    json_object: Literal[True] | None = None
    regex: str | None = None
    lark: str | None = None

    def constraint(self) -> Constraint:
        given = {k: v for k, v in self.model_dump().items() if v is not None}
        if len(given) != 1:
            raise InputError(f"a turn's constraint needs exactly one of json_schema, json_object, regex, lark; got {sorted(given) or 'none'}")
        (kind, value), = given.items()
        if kind == "json_schema":
            return json_schema_constraint(value)
        return Constraint.create(kind, "" if kind == "json_object" else value)


class ScriptTurn(_Strict):
    messages: list[ChatMessage] = Field(min_length=1)
    sampling: SamplingOverrides | None = None
    constraint: TurnConstraint | None = None


class SessionScript(_Strict):
    """Input: ``{"model": ..., "sampling": {...}, "turns": [{"messages": [...], "sampling": {...}}, ...]}``."""

    model: str | None = None
    sampling: SamplingOverrides = SamplingOverrides()
    turns: list[ScriptTurn] = Field(min_length=1)


class TurnRecord(OmitNone, _Strict):
    """One turn. ``kept_tokens``: how many tokens of the history (previous prompt + output) the turn keeps before
    its appended tokens (None: all of them), for a client that re-sent the history rendered differently from the
    tokens, e.g. a tool call. ``tool_calls``: the calls parsed from ``text`` (format ``tool_call_format``).
    ``constraint``: the grammar this turn's output had to match, with its ``mask_digests`` chain.

    What binds ``messages`` to ``appended_token_ids`` (schema 4; replay re-renders and compares, records/binding.py):
    ``rendering`` "delta" (session run, chat: the chat template's text after the history, tokenized alone), "whole"
    (the server: the whole conversation so far, with ``tools``, rendered and tokenized, the tokens after the
    ``kept_tokens`` prefix appended) or "raw" (a /v1/completions prompt: no messages); ``reply_as_sent``: the
    previous reply as the request re-sent it, where that differs from the reply this record holds;
    ``parallel_tool_calls`` False: only the first call of ``text`` was taken."""

    OMIT_NONE = ("kept_tokens", "tool_calls", "tool_call_format", "constraint", "mask_digests", "rendering", "tools",
                 "reply_as_sent", "parallel_tool_calls")
    messages: list[ChatMessage]
    sampling: dict[str, Any]  # effective_sampling(): the options set, plus max_tokens and stop; load_session checks it
    appended_token_ids: list[TokenId]
    generated_token_ids: list[TokenId]
    text: str
    stop_reason: str
    reused_tokens: Count
    kv_sha256: str
    logits_digests: list[str]
    template_note: str | None = None
    seconds: float = Field(default=0.0, description="informative: never compared")
    kept_tokens: Count | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_format: str | None = None
    constraint: Constraint | None = None
    mask_digests: list[str] | None = None
    rendering: Literal["delta", "whole", "raw"] | None = None  # None: recorded before schema 4
    tools: list[dict[str, Any]] | None = None
    reply_as_sent: ChatMessage | None = None
    parallel_tool_calls: bool | None = None

    @classmethod
    def of(cls, res: GenerationResult, messages: list[dict[str, Any]], sampling: dict[str, Any], appended: list[int],
           constraint: Constraint | None, seconds: float, **rest: Any) -> TurnRecord:  # fmt: skip
        """The record of a turn that generated ``res`` after appending ``appended`` (``rest``: the optional fields)."""
        return cls(messages=[ChatMessage(**m) for m in messages], sampling=sampling, appended_token_ids=appended,
                   generated_token_ids=res.tokens, text=res.text, stop_reason=res.stop_reason,
                   reused_tokens=res.reused_tokens, kv_sha256=res.kv_sha256, logits_digests=res.digests,
                   seconds=round(seconds, 4), constraint=constraint,
                   mask_digests=res.mask_digests if constraint is not None else None, **rest)  # fmt: skip


class SessionRecord(_Strict):
    """A recorded session. ``section_sha256`` (schema 4) holds the sha256 of each section's canonical JSON:
    ``model``, ``tokenizer_sha256``, ``chat_template_sha256``, ``chat_template``, ``numerics``, ``engine``, and
    ``turn.N`` for each turn (without its informative fields), so an edited record is refused naming the section."""

    schema_version: Literal[1, 2, 3, 4] = SESSION_SCHEMA_VERSION
    model: ModelRecord
    tokenizer_sha256: str
    chat_template_sha256: str | None
    chat_template: ChatTemplateRecord | None = None  # a --chat-template (built-in or file) with its text
    numerics: str = NUMERICS_1  # detinfer.numerics.NUMERICS of the recording; absent in numerics-1 records
    engine: EngineRecord
    turns: list[TurnRecord]
    section_sha256: dict[str, str] = {}
    informative: dict[str, Any] = {}

    def compute_section_sha256(self) -> dict[str, str]:
        data = self.model_dump(mode="json")
        sections = {k: data[k] for k in ("model", "tokenizer_sha256", "chat_template_sha256", "chat_template", "numerics",
                                         "engine")}  # fmt: skip
        sections.update({f"turn.{i}": {k: v for k, v in t.items() if k not in INFORMATIVE_TURN_FIELDS}
                         for i, t in enumerate(data["turns"], start=1)})  # fmt: skip
        return section_hashes(sections)

    def sealed(self) -> "SessionRecord":
        """This record with ``section_sha256`` filled in (and the current schema version)."""
        return self.model_copy(update={"schema_version": SESSION_SCHEMA_VERSION, "section_sha256": self.compute_section_sha256()})


DEFAULT_SAMPLING = {"max_tokens": 128, "stop": []}


def effective_sampling(default: SamplingOverrides, override: SamplingOverrides | None) -> dict[str, Any]:
    """A turn's sampling as recorded: max_tokens and stop, and every option the session defaults or the turn's
    overrides set (the rest are :class:`Sampling`'s defaults)."""
    merged = dict(DEFAULT_SAMPLING)
    for src in (default, override):
        if src is not None:
            merged.update(src.model_dump(exclude_none=True))
    return merged


def load_script(path: str | Path) -> SessionScript:
    """Read a session script; raises InputError (one line) for unreadable, non-JSON or invalid scripts."""
    path = Path(path)
    return parse_script(read_json(path, InputError, "session script"), where=str(path))


def parse_script(data: Any, *, where: str = "session script") -> SessionScript:
    """Validate a session script's JSON data; raises InputError naming ``where`` and the bad field or value (a
    record of a run given instead is named as one)."""
    if isinstance(data, dict) and "schema_version" in data:
        kind = "a recorded session" if "turns" in data else "a run manifest"
        raise InputError(f"{where} is {kind}, not a session script: re-execute it with detinfer "
                         f"{'replay' if 'turns' in data else 'verify'}")  # fmt: skip
    try:
        script = SessionScript.model_validate(data)
    except ValidationError as e:
        raise InputError(f"{where}: {first_error(e)}") from None
    for turn in script.turns:
        Sampling.create(**effective_sampling(script.sampling, turn.sampling))  # reject bad values before running anything
    return script


class Conversation:
    """A conversation as token ids plus the messages that produced them (for rendering the next turn)."""

    def __init__(self, engine: Engine, template: ChatTemplate | None = None):
        self.template = template or engine.chat_template
        if self.template is None:
            raise InputError(
                f"{engine.model_file.path.name} has no chat template; sessions need one: pass --chat-template with a "
                f"built-in format ({', '.join(BUILTIN_TEMPLATES)}) or a jinja file"
            )
        self.engine = engine
        self.messages: list[dict] = []
        self.tokens: list[int] = []

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.template.render_with(self.engine.tokenizer, messages, add_generation_prompt=generation_prompt)

    def append_messages(self, messages: list[dict]) -> tuple[list[int], str | None]:
        """Tokens to append for ``messages`` followed by the assistant generation prompt, and a note when the
        template renders the existing history differently from its tokens (the tokens win)."""
        tok = self.engine.tokenizer
        full = self._render(self.messages + messages, True)
        if not self.tokens:
            return self.template.encode(tok, full), None
        history_text = tok.decode(self.tokens)
        note = None
        if full.startswith(history_text):
            delta = full[len(history_text):]
        else:
            before = self._render(self.messages, False)
            delta = full[len(before):] if full.startswith(before) else self._render(messages, True)
            note = "the chat template renders the history differently from its tokens; the token history was kept"
        return tok.encode(delta, add_bos=False, parse_special=True), note

    def add_turn(self, messages: list[dict], appended: list[int], generated: list[int], text: str,
                 tool_calls: list[dict] | None = None, kept: int | None = None, reply_as_sent: dict | None = None) -> None:  # fmt: skip
        """Append a turn; ``kept``: history tokens the turn kept (the rest are dropped first), ``tool_calls``: the
        reply's calls, ``reply_as_sent``: the previous reply as this turn's request re-sent it (it replaces that reply)."""
        if reply_as_sent is not None and self.messages:
            self.messages[-1] = reply_as_sent
        self.messages += messages + [reply_message(text, tool_calls)]
        self.tokens = self.tokens[:kept] + appended + generated


def reply_message(text: str, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    """An assistant reply as a conversation's message history holds it: its text, or its calls (then no text)."""
    if tool_calls:
        return {"role": "assistant", "content": "", "tool_calls": tool_calls}
    return {"role": "assistant", "content": text}


def run_turn(
    engine: Engine,
    conv: Conversation,
    cache: KVCache,
    messages: list[dict],
    sampling: dict[str, Any],
    *,
    recorded: TurnRecord | None = None,
    on_step: Callable[[Step], None] | None = None,
    prefix_cache: PrefixCache | None = None,
    constraint: Constraint | None = None,
    speculate: str | None = None,
) -> TurnRecord:
    """Append ``messages`` and generate one turn, its output matching ``constraint`` if given; or, replaying a
    ``recorded`` turn, append its token ids exactly (after keeping its ``kept_tokens`` of the history), and keep its
    reply (text or calls) and the fields that bind its messages for the message history later turns render after.

    The cache is reused for whatever prefix it holds; with ``prefix_cache``, a longer cached prefix (from another
    conversation or an earlier branch) is restored first, and the turn's final cache is stored there. Reuse is
    exact either way. ``speculate``: a drafter (compute.speculate) that looks up the whole conversation; never
    changes a byte. Raises InputError naming the token counts if the turn would overflow n_ctx.
    """
    if recorded is None:
        appended, note = conv.append_messages(messages)
        kept, tool_calls, bound = None, None, {"rendering": "delta"}
    else:
        appended, note, kept, tool_calls = recorded.appended_token_ids, recorded.template_note, recorded.kept_tokens, recorded.tool_calls
        bound = recorded.model_dump(include=set(BINDING_FIELDS))
    if kept is not None and kept > len(conv.tokens):
        raise InputError(f"the turn keeps {kept} history tokens but the history has {len(conv.tokens)}")
    history = conv.tokens[:kept]
    prompt = history + appended
    if len(prompt) >= engine.n_ctx:
        raise InputError(
            f"the conversation would reach {len(prompt)} tokens ({len(history)} history + {len(appended)} new) "
            f"but the context holds {engine.n_ctx}; raise --ctx"
        )
    check_prompt(engine, prompt)
    res = GenerationResult()
    t0 = time.perf_counter()
    for step in generate(engine, prompt, Sampling.create(**sampling), cache=cache, result=res, constraint=constraint,
                         prefix_cache=prefix_cache, speculate=speculate):
        if on_step:
            on_step(step)
    record = TurnRecord.of(res, messages, sampling, appended, constraint, time.perf_counter() - t0, template_note=note,
                           kept_tokens=kept, **bound)
    resent = recorded.reply_as_sent.model_dump() if recorded is not None and recorded.reply_as_sent is not None else None
    conv.add_turn(messages, appended, res.tokens, res.text, tool_calls, kept, resent)
    return record


def new_record(engine: Engine, turns: list[TurnRecord], template: ChatTemplate | None = None) -> SessionRecord:
    """The session record of ``turns``; ``template``: a --chat-template used instead of the model's (recorded with its text)."""
    import numba

    used = template or engine.chat_template
    return SessionRecord(
        model=model_record(engine),
        tokenizer_sha256=engine.tokenizer.hash,
        chat_template_sha256=used.hash if used else None,
        chat_template=template_record(template),
        numerics=NUMERICS,
        engine=EngineRecord(n_ctx=engine.n_ctx, kv_type=engine.kv_type),
        turns=turns,
        informative={"threads": numba.get_num_threads(), "versions": versions(), "model_path": str(engine.model_file.path),
                     "machine": machine()},
    )


def session_json(record: SessionRecord) -> str:
    """The JSON of a sealed ``record`` (the bytes written to its file): 2-space indent, UTF-8, keys in field order.
    Keys are not sorted: the objects a client sent (tools, tool-call arguments) keep the key order the chat template
    rendered, which replay renders again (records/binding.py). ``section_sha256`` hashes each section's canonical,
    sorted JSON."""
    return json.dumps(record.sealed().model_dump(mode="json"), indent=2, ensure_ascii=False) + "\n"


def write_session(record: SessionRecord, path: str | Path) -> None:
    """Seal and write a session record atomically as canonical JSON."""
    atomic_write_text(path, session_json(record))


def load_session(path: str | Path) -> SessionRecord:
    """Read a session record (:func:`parse_session`); ManifestError (one line) if unreadable or not JSON."""
    return parse_session(read_json(Path(path), ManifestError, "session record"), Path(path))


def parse_session(data: Any, path: Path) -> SessionRecord:
    """Check the parsed JSON ``data`` of the session record file ``path``; ManifestError (one line) if it is from
    another schema, invalid, or edited (naming the section)."""
    if not isinstance(data, dict) or data.get("schema_version") not in READABLE_SESSION_SCHEMAS:
        version = data.get("schema_version") if isinstance(data, dict) else None
        raise ManifestError(f"{path}: session schema_version {version!r} is not one this detinfer reads: {', '.join(map(str, READABLE_SESSION_SCHEMAS))}")
    try:
        record = SessionRecord.model_validate(data)
    except ValidationError as e:
        raise _invalid_record(path, e) from None
    for i, turn in enumerate(record.turns):  # values are checked here, before a replay uses any of them
        try:
            if missing := {"max_tokens", "stop"} - set(turn.sampling):  # every recorded turn states its limits
                raise InputError(f"{sorted(missing)[0]} is missing")
            Sampling.create(**turn.sampling)
        except InputError as e:
            raise ManifestError(f"{path} is not a valid session record: turns.{i}.sampling: {e}") from None
    if not isinstance(record.informative.get("model_path", ""), str):
        raise ManifestError(f"{path} is not a valid session record: informative.model_path must be a string")
    if record.schema_version >= 4:
        expected = record.compute_section_sha256()
        edited = sorted(set(expected) ^ set(record.section_sha256)) + [k for k in expected if record.section_sha256.get(k, expected[k]) != expected[k]]
        if edited:
            raise ManifestError(f"{path}: section(s) {', '.join(edited)} no longer match their sha256; the session record was edited")
    return record


def _invalid_record(path: Path, e: ValidationError, prefix: str = "") -> ManifestError:
    return ManifestError(f"{path} is not a valid session record: {first_error(e, prefix)}")


def run_session(
    engine: Engine,
    turns: list[ScriptTurn],
    default_sampling: SamplingOverrides,
    *,
    out: str | Path | None = None,
    prior: SessionRecord | None = None,
    kv_dir: str | Path | None = None,
    on_step: Callable[[Step], None] | None = None,
    on_turn: Callable[[int, TurnRecord], None] | None = None,
    prefix_cache: PrefixCache | None = None,
    template: ChatTemplate | None = None,
    speculate: str | None = None,
) -> SessionRecord:
    """Run scripted turns (after replaying ``prior``'s turns exactly, for branching) and record them.

    The record is written to ``out`` after every turn, so a later failing turn loses nothing recorded before it.
    With ``kv_dir`` the KV cache is saved after each turn as ``turn-NNN.detkv``. ``template``: a --chat-template
    instead of the model's; a branch (``prior``) keeps the template ``prior`` recorded. ``speculate`` as in run_turn.
    """
    if prior is not None:
        template = recorded_template(prior)
    conv = Conversation(engine, template)
    cache = engine.new_cache()
    records: list[TurnRecord] = []
    if prior is not None:
        for i, turn in enumerate(prior.turns):
            rec = run_turn(engine, conv, cache, [m.model_dump() for m in turn.messages], turn.sampling, recorded=turn,
                           prefix_cache=prefix_cache, constraint=recorded_constraint(turn), speculate=speculate)
            if compare_turn(turn, rec):
                raise ManifestError(f"turn {i + 1} of the recorded session does not replay exactly; cannot branch from it")
            records.append(turn)
    constraints = []
    for i, turn in enumerate(turns):  # every turn's constraint compiles before any token is generated
        try:
            constraints.append(turn.constraint.constraint() if turn.constraint is not None else None)
            if constraints[-1] is not None:
                constraints[-1].check(engine.tokenizer)
        except InputError as e:
            raise type(e)(f"turn {len(records) + i + 1}: {e}") from None
    for turn, constraint in zip(turns, constraints):
        sampling = effective_sampling(default_sampling, turn.sampling)
        try:
            rec = run_turn(engine, conv, cache, [m.model_dump() for m in turn.messages], sampling, on_step=on_step,
                           prefix_cache=prefix_cache, constraint=constraint, speculate=speculate)
        except InputError as e:
            if out is not None:
                write_session(new_record(engine, records, template), out)
            raise InputError(f"turn {len(records) + 1}: {e}") from None
        records.append(rec)
        if kv_dir is not None:
            from .kvfile import save_kv

            save_kv(Path(kv_dir) / f"turn-{len(records):03d}.detkv", cache, model_sha256=engine.model_file.sha256,
                    tokenizer_sha256=engine.tokenizer.hash)
        if out is not None:
            write_session(new_record(engine, records, template), out)
        if on_turn:
            on_turn(len(records), rec)
    return new_record(engine, records, template)


def recorded_constraint(turn: TurnRecord) -> Constraint | None:
    """A recorded turn's constraint, checked against its sha256 (ManifestError if edited)."""
    if turn.constraint is not None:
        turn.constraint.check_sha256()
    return turn.constraint


def compare_turn(expected: TurnRecord, actual: TurnRecord) -> list[str]:
    """Contract fields of a turn that differ (timings are never compared)."""
    fields = ("kept_tokens", "appended_token_ids", "generated_token_ids", "text", "stop_reason", "kv_sha256", "logits_digests",
              "mask_digests")
    return [f for f in fields if getattr(expected, f) != getattr(actual, f)]
