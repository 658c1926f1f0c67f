"""Agent sessions: multi-turn conversations kept as token ids, recorded, and replayed exactly.

Each turn appends its messages to the conversation, then the model generates one assistant message. The
conversation is kept as **token ids**: generated tokens (including the end-of-turn token) are never re-tokenized,
so turn k+1's prompt begins with exactly turn k's prompt plus its generated tokens. The tokens appended for a
turn are the chat template's rendering of the new messages (the text the template adds after the history);
where the template would render the history differently from the tokens, the token history wins and the turn
record says so in ``template_note``.
"""

from __future__ import annotations

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
from ..errors import InputError, ManifestError
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
    canonical_json,
)
from .run import (
    first_difference,
    model_record,
    recorded_template,
    template_record,
    versions,
)

SESSION_SCHEMA_VERSION = 3
READABLE_SESSION_SCHEMAS = (1, 2, 3)  # 1: before ``chat_template``; 2: before per-turn ``constraint``, tool calls, ``kept_tokens``
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
    ``constraint``: the grammar this turn's output had to match, with its ``mask_digests`` chain."""

    OMIT_NONE = ("kept_tokens", "tool_calls", "tool_call_format", "constraint", "mask_digests")
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


class SessionRecord(_Strict):
    schema_version: Literal[1, 2, 3] = SESSION_SCHEMA_VERSION
    model: ModelRecord
    tokenizer_sha256: str
    chat_template_sha256: str | None
    chat_template: ChatTemplateRecord | None = None  # a --chat-template (built-in or file) with its text
    numerics: str = NUMERICS_1  # detinfer.numerics.NUMERICS of the recording; absent in numerics-1 records
    engine: EngineRecord
    turns: list[TurnRecord]
    informative: dict[str, Any] = {}


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
    """Validate a session script's JSON data; raises InputError naming ``where`` and the bad field or value."""
    try:
        script = SessionScript.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise InputError(f"{where}: {'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
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
                 tool_calls: list[dict] | None = None, kept: int | None = None) -> None:  # fmt: skip
        """Append a turn; ``kept``: history tokens the turn kept (the rest are dropped first), ``tool_calls``: the reply's calls."""
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            reply.update(content="", tool_calls=tool_calls)
        self.messages += messages + [reply]
        self.tokens = self.tokens[:kept] + appended + generated


def run_turn(
    engine: Engine,
    conv: Conversation,
    cache: KVCache,
    messages: list[dict],
    sampling: dict[str, Any],
    *,
    appended: list[int] | None = None,
    note: str | None = None,
    kept: int | None = None,
    tool_calls: list[dict] | None = None,
    on_step: Callable[[Step], None] | None = None,
    prefix_cache: PrefixCache | None = None,
    constraint: Constraint | None = None,
) -> TurnRecord:
    """Append ``messages`` (or the recorded ``appended`` token ids, when replaying) and generate one turn, its output
    matching ``constraint`` if given.

    Replaying, ``kept`` (a turn's ``kept_tokens``) drops the history after that many tokens first, and ``tool_calls``
    (the recorded reply's calls) go into the message history that later scripted turns are rendered after.

    The cache is reused for whatever prefix it holds; with ``prefix_cache``, a longer cached prefix (from another
    conversation or an earlier branch) is restored first, and the turn's final cache is stored there. Reuse is
    exact either way. Raises InputError naming the token counts if the turn would overflow n_ctx.
    """
    if appended is None:
        appended, note = conv.append_messages(messages)
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
                         prefix_cache=prefix_cache):
        if on_step:
            on_step(step)
    record = TurnRecord(
        messages=[ChatMessage(**m) for m in messages],
        sampling=sampling,
        appended_token_ids=appended,
        generated_token_ids=res.tokens,
        text=res.text,
        stop_reason=res.stop_reason,
        reused_tokens=res.reused_tokens,
        kv_sha256=res.kv_sha256,
        logits_digests=res.digests,
        template_note=note,
        seconds=round(time.perf_counter() - t0, 4),
        kept_tokens=kept,
        constraint=constraint,
        mask_digests=res.mask_digests if constraint is not None else None,
    )
    conv.add_turn(messages, appended, res.tokens, res.text, tool_calls, kept)
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


def write_session(record: SessionRecord, path: str | Path) -> None:
    """Write a session record atomically as canonical JSON."""
    atomic_write_text(path, canonical_json(record.model_dump(mode="json")))


def load_session(path: str | Path) -> SessionRecord:
    """Read a session record; ManifestError (one line) if unreadable, not JSON, another schema or invalid."""
    path = Path(path)
    data = read_json(path, ManifestError, "session record")
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
    return record


def _invalid_record(path: Path, e: ValidationError, prefix: str = "") -> ManifestError:
    err = e.errors()[0]
    return ManifestError(f"{path} is not a valid session record: {prefix}{'.'.join(str(x) for x in err['loc'])}: {err['msg']}")


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
) -> SessionRecord:
    """Run scripted turns (after replaying ``prior``'s turns exactly, for branching) and record them.

    The record is written to ``out`` after every turn, so a later failing turn loses nothing recorded before it.
    With ``kv_dir`` the KV cache is saved after each turn as ``turn-NNN.detkv``. ``template``: a --chat-template
    instead of the model's; a branch (``prior``) keeps the template ``prior`` recorded.
    """
    if prior is not None:
        template = _session_template(prior)
    conv = Conversation(engine, template)
    cache = engine.new_cache()
    records: list[TurnRecord] = []
    if prior is not None:
        for i, turn in enumerate(prior.turns):
            rec = run_turn(engine, conv, cache, [m.model_dump() for m in turn.messages], turn.sampling,
                           appended=turn.appended_token_ids, note=turn.template_note, kept=turn.kept_tokens,
                           tool_calls=turn.tool_calls, prefix_cache=prefix_cache, constraint=_recorded_constraint(turn))
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
                           prefix_cache=prefix_cache, constraint=constraint)
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


def _session_template(record: SessionRecord) -> ChatTemplate | None:
    """The --chat-template a session recorded (rebuilt from its text), or None for the model's own."""
    return recorded_template(record)  # same fields as a run manifest: chat_template, chat_template_sha256


def _recorded_constraint(turn: TurnRecord) -> Constraint | None:
    """A recorded turn's constraint, checked against its sha256 (ManifestError if edited)."""
    if turn.constraint is not None:
        turn.constraint.check_sha256()
    return turn.constraint


def compare_turn(expected: TurnRecord, actual: TurnRecord) -> list[str]:
    """Contract fields of a turn that differ (timings are never compared)."""
    fields = ("kept_tokens", "appended_token_ids", "generated_token_ids", "text", "stop_reason", "kv_sha256", "logits_digests",
              "mask_digests")
    return [f for f in fields if getattr(expected, f) != getattr(actual, f)]


def replay_turns(
    engine: Engine,
    record: SessionRecord,
    *,
    use_cache: bool = True,
    kv_dir: str | Path | None = None,
    until: int | None = None,
    warn: Callable[[str], None] | None = None,
    prefix_cache: PrefixCache | None = None,
) -> list[tuple[TurnRecord, list[str], int | None]]:
    """Re-execute recorded turns: for each, (actual turn, differing fields, first divergent step). A record of other
    numerics (detinfer/numerics.py) differs in every turn, named first.

    ``use_cache`` False recomputes every prefix from scratch (and ignores ``prefix_cache``); ``kv_dir`` restores
    each turn's prefix from the snapshot saved after the previous turn (a bad snapshot is a cache miss: recompute,
    warn).
    """
    if record.model.sha256 != engine.model_file.sha256:
        raise ManifestError(
            f"the session was recorded with model sha256 {record.model.sha256[:16]}... but {engine.model_file.path.name} "
            f"has {engine.model_file.sha256[:16]}...; pass the right file with --model"
        )
    conv = Conversation(engine, _session_template(record))
    cache = engine.new_cache()
    results = []
    for i, turn in enumerate(record.turns[:until]):
        if not use_cache:
            cache = engine.new_cache()
        elif kv_dir is not None and i > 0:
            cache = _restore_snapshot(engine, Path(kv_dir) / f"turn-{i:03d}.detkv", record.turns[i - 1].kv_sha256, warn) or cache
        actual = run_turn(engine, conv, cache, [m.model_dump() for m in turn.messages], turn.sampling,
                          appended=turn.appended_token_ids, note=turn.template_note, kept=turn.kept_tokens,
                          tool_calls=turn.tool_calls, prefix_cache=prefix_cache if use_cache else None,
                          constraint=_recorded_constraint(turn))
        diffs = compare_turn(turn, actual)
        if record.numerics != NUMERICS:
            diffs.insert(0, f"numerics (recorded with {record.numerics}; this detinfer computes {NUMERICS}: record the session again)")
        firsts = (first_difference(turn.logits_digests, actual.logits_digests),
                  first_difference(turn.generated_token_ids, actual.generated_token_ids))
        results.append((actual, diffs, min((k for k in firsts if k is not None), default=None)))
    return results


def _restore_snapshot(engine: Engine, path: Path, kv_sha256: str, warn: Callable[[str], None] | None) -> KVCache | None:
    """The cache saved in ``path``, or None (a miss, with a warning) if it cannot be loaded or its contents do not
    hash to ``kv_sha256``, the KV hash the session recorded after that turn (a forged or stale snapshot)."""
    from ..errors import DetinferError, KVFileError
    from .kvfile import load_kv

    try:
        snap = load_kv(path, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
        if snap.digest() != kv_sha256:
            raise KVFileError(f"its KV hash {snap.digest()[:16]}… differs from the {kv_sha256[:16]}… the session recorded")
        cache = engine.new_cache()
        cache.restore(snap)
        return cache
    except DetinferError as e:
        if warn:
            warn(f"KV snapshot {path} not used ({e}); recomputing")
        return None
