"""OpenAI-compatible HTTP server: one decode worker, bounded admission, prefix reuse, optional session recording.

Data path of a request: auth -> body (size-limited JSON) -> pydantic validation (``extra="forbid"``: every
unknown or unsupported parameter is a 400, never ignored) -> admission (a slot of ``--max-queue``, else 429) ->
prepare (template + tokenize, at most ``--max-inflight`` at once, in threads) -> the single decode worker
(one sequence at a time; numba kernels and the KV cache are not shared across threads) -> response or SSE.
The decode worker never waits for a client: a stream buffers at most its own ``max_tokens`` steps, and a client
that stops reading for ``--send-timeout`` seconds is dropped, so it cannot hold its admission slot forever.

Determinism: output depends only on (prompt token ids, temperature, top_p, seed, max tokens, stop, constraint), never on
queueing, streaming or the prefix cache (reuse is exact, see prefix_cache.py). Defaults follow OpenAI where it has
one: temperature 1, top_p 1; ``seed`` defaults to 0 (OpenAI has no fixed default), max tokens to the rest of the
context for chat and 16 for /v1/completions.

Logprobs (chat ``logprobs`` + ``top_logprobs`` 0..20, completions ``logprobs`` 0..5) are those of the model's raw
next-token distribution: the log-softmax of the unmodified logits, before temperature and top-p, with the fixed
summation order of ``sampler.log_softmax_at``; so they do not depend on the sampling parameters and the greedy token
is always top-1. Top lists are highest first, ties by lowest token id. There is one entry per sampled token
(``usage.completion_tokens`` of them), including an end-of-generation token and the tokens of a stop string, whose
text is not in the content. Completions' ``top_logprobs`` also hold the sampled token (OpenAI's "up to logprobs + 1"),
keyed by token text (the first, higher-ranked entry wins if two tokens share a text); ``text_offset`` counts
characters of the returned completion text. A -inf logprob is reported as -9999.0 (JSON has no infinity). Computed
only when requested; streaming carries each token's entry in the chunk of its step (possibly with empty text).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import queue
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..version import __version__
from ..model.chat import ChatTemplate
from ..compute.constrain import Constraint, json_schema_constraint, tool_call_constraint
from ..compute.engine import Engine, set_threads
from ..errors import ConstraintError, DetinferError
from ..fileio import parse_json
from ..compute.generate import DIGEST_SEED, GenerationResult, Step, check_prompt, generate
from ..records.manifest import tokens_sha256
from ..compute.numerics import NUMERICS
from ..compute.prefix_cache import PrefixCache
from ..compute.sampler import RNG_PERSON, WEIGHT_BITS, SamplingParams
from ..records.session import ChatMessage, TurnRecord, TurnSampling, effective_sampling, new_record, write_session
from .tool_calls import Reply, StreamSplitter, ToolCallFormat, format_for_template

MAX_BODY_BYTES = 1 << 20
BODY_TIMEOUT_S = 30.0
MAX_STOP = 4  # OpenAI's limit on stop sequences
FINISH = {"eos": "stop", "stop": "stop", "max_tokens": "length", "length": "length"}
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass(frozen=True)
class ServerSettings:
    max_queue: int = 8  # requests admitted at once (preparing, waiting for or in decode); more get 429
    max_inflight: int = 4  # requests preparing (template, tokenize) at once
    threads: int | None = None  # numba threads of the decode worker
    cache_bytes: int = 1 << 30  # prefix cache budget
    record_dir: Path | None = None
    api_key: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    send_timeout: float = 30.0  # seconds one SSE write may wait for a client that does not read
    chat_template: ChatTemplate | None = None  # --chat-template: used instead of the model's own (recorded)
    drain_s: float = 5.0  # on shutdown: seconds the decode worker gets to stop after its jobs are cancelled
    body_timeout: float = BODY_TIMEOUT_S  # seconds a client has to send the whole request body



# --------------------------------------------------------------------------------------------- errors


class ApiError(Exception):
    """An error response in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = status, message, param, code, type_, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors()[0]
    param = ".".join(str(x) for x in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized or unsupported request argument supplied: {param}", param=param, code="unsupported_parameter")
    return ApiError(400, f"Invalid value for {param}: {err['msg']}", param=param, code="invalid_value")


# --------------------------------------------------------------------------------------------- request models


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionCall(_Req):
    name: str
    arguments: str


class ToolCall(_Req):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Req):
    """A chat message as OpenAI clients send it; ``developer`` is rendered as ``system``. Content parts other than
    text (images, audio, files) cannot be honoured and are a 400 naming the part."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: None = None  # deprecated by OpenAI; clients echo it as null
    audio: None = None
    annotations: list[dict[str, Any]] | None = None  # citations of an earlier reply (output metadata, not rendered)

    def text(self, param: str) -> str | None:
        """The content as one string (text parts joined); ApiError naming ``param`` for a non-text part."""
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.get("type") not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{param}.{j}: only text content parts are supported, got type {part.get('type')!r}",
                               param=f"{param}.{j}", code="unsupported_value")  # fmt: skip
            texts.append(part["text"])
        return "".join(texts)

    def template_dict(self, i: int) -> dict[str, Any]:
        """The message as a chat template sees it (HF style: tool call arguments as objects when they parse as one)."""
        content = self.text(f"messages.{i}.content")
        if content is None:
            content = self.refusal
        if content is None and not self.tool_calls:
            raise ApiError(400, f"messages.{i}.content is required", param=f"messages.{i}.content")
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                msg[key] = getattr(self, key)
        return msg


class StreamOptions(_Req):
    include_usage: bool = False


class JsonSchemaFormat(_Req):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # accepted; the schema is enforced either way


class ResponseFormat(_Req):
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint.create("json_object")
        if self.json_schema is None:
            raise ApiError(400, "response_format of type json_schema needs a json_schema object", param="response_format.json_schema")
        return json_schema_constraint(self.json_schema.schema_ if self.json_schema.schema_ is not None else {})


class FunctionName(_Req):
    name: str


class NamedToolChoice(_Req):
    type: Literal["function"]
    function: FunctionName


class _Sampling(_Req):
    """Parameters shared by both endpoints. Ranges are OpenAI's; seed is the sampler's (0 <= seed < 2**64)."""

    model: str  # informative: the server serves one model and never resolves this as a name or path
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def check(self) -> None:
        """Reject what the engine cannot do exactly, naming the parameter (never silently ignored)."""
        if self.n not in (None, 1):
            raise ApiError(400, f"n={self.n} is not supported; only n=1", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not implemented; only 0 is accepted", param=name, code="unsupported_value")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ApiError(400, f"stop: at most {MAX_STOP} sequences, got {len(self.stop)}", param="stop", code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")

    @property
    def stops(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)


class FunctionDef(_Req):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Req):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # required / named: a constraint
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value")

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def constraint(self, fmt: ToolCallFormat | None) -> Constraint | None:
        """The constraint this request asks for: one tool call in the template's call format ``fmt`` for tool_choice
        required / named, else the response_format's; ApiError 400 naming the parameter if it is invalid."""
        param = "tool_choice" if self.forces_tool_call else "response_format"
        try:
            if self.forces_tool_call:
                if not self.tools:
                    raise ConstraintError(f"tool_choice {self.tool_choice!r} needs tools")
                name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None
                tools = [t.model_dump(exclude_none=True) for t in self.tools]
                return tool_call_constraint(tools, name, prefix=fmt.prefix, suffix=fmt.suffix, arguments_key=fmt.arguments_key)
            return self.response_format.constraint() if self.response_format is not None else None
        except ConstraintError as e:
            raise ApiError(400, str(e), param=param, code="invalid_value") from None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        super().check()
        for name, ok in (("echo", not self.echo), ("suffix", self.suffix is None),
                         ("best_of", self.best_of in (None, 1))):  # fmt: skip
            if not ok:
                raise ApiError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str) and len(self.prompt) != 1:
            raise ApiError(400, "prompt: only one prompt per request", param="prompt", code="unsupported_value")

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs


# --------------------------------------------------------------------------------------------- decode worker


@dataclass
class Job:
    """One generation handed to the worker. ``emit`` is called from the worker thread (thread-safe)."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: list[str]
    emit: Callable[[tuple[str, Any]], None]
    stream: bool
    record: dict[str, Any] | None = None  # messages and note for the session recorder
    logprobs_k: int | None = None  # None: no logprobs; else the top list's length (generate's logprobs_k)
    constraint: Constraint | None = None
    tool_format: ToolCallFormat | None = None  # None: the reply is text only
    tools: dict[str, dict | None] = field(default_factory=dict)  # function name -> strict schema or None
    parallel_tool_calls: bool = True
    cancel: threading.Event = field(default_factory=threading.Event)

    def reply(self, res: GenerationResult) -> Reply:
        """The assistant reply of ``res``: its tool calls parsed when the request offered tools."""
        if self.tool_format is None:
            return Reply(res.text)
        return self.tool_format.parse(res.text, self.tools, call_id_seed=res.kv_sha256, parallel=self.parallel_tool_calls)


class _Session:
    def __init__(self, path: Path):
        self.path = path
        self.turns: list[TurnRecord] = []
        self.history: list[int] = []  # last prompt + its generated tokens
        self.messages: list[dict] = []  # the last chat request's messages (its reply is the next message)
        self.n_messages = 0  # messages the next request repeats (the last request's plus the assistant reply)


class Recorder:
    """Writes every finished request into session files that ``detinfer replay`` re-executes.

    A chat request that repeats a recorded session's last request's messages followed by an assistant message (the
    reply, as text or tool calls, however the client re-sends it) continues that session, as does any request whose
    prompt token ids extend a session's last prompt + output. The turn records the tokens appended after the longest
    common prefix with the history (and ``kept_tokens`` when that is not all of it, as for a client that re-sends
    its calls as text); otherwise the request starts a new session file. Runs on the worker thread only.
    """

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

    def add(self, job: Job, res: GenerationResult, sampling: dict[str, Any], seconds: float) -> Path:
        prompt, chat = job.prompt, job.record["chat"]
        messages = job.record["messages"]
        sess = self._continued(prompt, messages, chat)
        is_new = sess is None
        if sess is None:
            sess = _Session(self.dir / f"session-{self.next_id:06d}.json")
            new_messages = messages
        else:
            new_messages = messages[sess.n_messages:] if chat else messages
        kept = 0
        while kept < min(len(sess.history), len(prompt) - 1) and sess.history[kept] == prompt[kept]:
            kept += 1
        reply = job.reply(res)
        turn = TurnRecord(
            messages=[ChatMessage(**m) for m in new_messages],
            sampling=sampling,
            appended_token_ids=prompt[kept:],
            generated_token_ids=res.tokens,
            text=res.text,
            stop_reason=res.stop_reason,
            reused_tokens=res.reused_tokens,
            kv_sha256=res.kv_sha256,
            logits_digests=res.digests,
            template_note=job.record.get("note"),
            seconds=round(seconds, 4),
            kept_tokens=kept if kept < len(sess.history) else None,
            tool_calls=reply.tool_calls or None,
            tool_call_format=job.tool_format.name if reply.tool_calls else None,
            constraint=job.constraint,
            mask_digests=res.mask_digests if job.constraint is not None else None,
        )
        # The session changes only once the file is written: a turn that fails to record never poisons its follow-ups.
        write_session(new_record(self.engine, sess.turns + [turn], self.template), sess.path)
        sess.turns.append(turn)
        sess.history = prompt + res.tokens
        sess.messages = messages if chat else []
        sess.n_messages = len(messages) + 1
        if is_new:
            self.next_id += 1
            self.sessions = self.sessions[-(self.MAX_OPEN - 1):] + [sess]
        return sess.path


class Worker:
    """The single decode thread: owns the KV cache and the prefix cache; runs one job at a time."""

    def __init__(self, engine: Engine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.prefix = PrefixCache(settings.cache_bytes)
        self.recorder = Recorder(settings.record_dir, engine, settings.chat_template) if settings.record_dir is not None else None
        self.thread = threading.Thread(target=self._loop, name="detinfer-decode", daemon=True)
        self.current: Job | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel the running job and every queued one, then wait at most ``drain_s`` for the thread (a daemon)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel.set()
        if (job := self.current) is not None:
            job.cancel.set()
        self.jobs.put(None)
        self.thread.join(timeout=self.settings.drain_s)

    def _loop(self) -> None:
        set_threads(self.settings.threads)  # numba's thread count is per calling thread
        cache = self.engine.new_cache()
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():
                continue
            self.current = job
            try:
                self._run(job, cache)
            except DetinferError as e:
                job.emit(("error", ApiError(400, str(e), code=type(e).__name__)))
            except Exception as e:  # keep serving; report the failure to this request only
                job.emit(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")))
            finally:
                self.current = None

    def _run(self, job: Job, cache) -> None:
        prompt = job.prompt
        self.prefix.restore_longest(cache, prompt)
        res = GenerationResult()
        t0 = time.perf_counter()
        for step in generate(self.engine, prompt, job.params, max_tokens=job.max_tokens, stop=job.stop, cache=cache, result=res,
                             logprobs_k=job.logprobs_k, constraint=job.constraint):  # fmt: skip
            if job.cancel.is_set():
                return  # client gone: the partial cache is still an exact prefix for later requests
            if job.stream or job.logprobs_k is not None:  # non-streaming logprobs are built from the same steps
                job.emit(("step", step))
        seconds = time.perf_counter() - t0
        self.prefix.store(cache)
        if self.recorder is not None and job.record is not None:
            sampling = effective_sampling(TurnSampling(temperature=job.params.temperature, top_p=job.params.top_p,
                                                       seed=job.params.seed, max_tokens=job.max_tokens, stop=job.stop), None)  # fmt: skip
            self.recorder.add(job, res, sampling, seconds)
        job.emit(("done", res))


# --------------------------------------------------------------------------------------------- the app


def numerics_spec(engine: Engine) -> str:
    """What besides the model and detinfer's version fixes the numbers (part of ``system_fingerprint``)."""
    return f"{NUMERICS};kv={engine.kv_type};rng={RNG_PERSON.decode()};weight_bits={WEIGHT_BITS};digest={DIGEST_SEED[:16]}"


def model_id(engine: Engine) -> str:
    from ..records.run import model_record

    return model_record(engine).registry_name or engine.model_file.path.stem


class Server:
    """Admission, preparation and response building around one Worker."""

    def __init__(self, engine: Engine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        self.worker = Worker(engine, settings)
        self.model_id = model_id(engine)
        spec = f"{engine.model_file.sha256}\n{__version__}\n{numerics_spec(engine)}"
        self.fingerprint = "fp_" + hashlib.sha256(spec.encode()).hexdigest()[:16]
        self.admitted = 0
        self._inflight: asyncio.Semaphore | None = None

    # admission ------------------------------------------------------------------------------
    def admit(self) -> None:
        if self.admitted >= self.settings.max_queue:
            raise ApiError(429, f"the server queue is full ({self.settings.max_queue} requests); retry later",
                           type_="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})  # fmt: skip
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1

    # preparation (runs in a thread) ---------------------------------------------------------
    def template(self) -> ChatTemplate:
        tpl = self.settings.chat_template or self.engine.chat_template
        if tpl is None:
            raise ApiError(400, f"{self.model_id} has no chat template; use /v1/completions, or start the server with "
                                "--chat-template", param="messages")  # fmt: skip
        return tpl

    def tool_format(self, tools: list[Tool] | None) -> ToolCallFormat | None:
        """The call format of the chat template when the request has tools; a 400 naming the fix when the template
        cannot render tools or writes calls in no format detinfer parses (tools are never silently dropped)."""
        if not tools:
            return None
        tpl = self.template()
        fmt = format_for_template(tpl.source)
        if not tpl.renders_tools() or fmt is None:
            what = "does not render tools" if not tpl.renders_tools() else "writes tool calls in no format detinfer parses"
            raise ApiError(400, f"the chat template of {self.model_id} {what}; start the server with "
                                "--chat-template chatml-tools", param="tools", code="unsupported_value")  # fmt: skip
        return fmt

    def prepare_chat(self, req: ChatRequest) -> tuple[list[int], list[dict]]:
        tok, tpl = self.engine.tokenizer, self.template()
        self.tool_format(req.tools)
        messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
        for msg in messages:  # HF templates expect arguments as objects (transformers' chat template docs)
            for call in msg.get("tool_calls", []):
                call["function"]["arguments"] = _json_object(call["function"]["arguments"])
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        rendered = tpl.render(messages, add_generation_prompt=True, bos_token=bos, eos_token=eos, tools=tools)
        return tok.encode(rendered, add_bos=tpl.add_bos, parse_special=True), messages

    def prepare_constraint(self, req: ChatRequest) -> Constraint | None:
        """The request's constraint, compiled once against the vocabulary so a bad one is a 400 before any token."""
        constraint = req.constraint(self.tool_format(req.tools) if req.forces_tool_call else None)
        if constraint is not None:
            try:
                constraint.check(self.engine.tokenizer)
            except ConstraintError as e:
                raise ApiError(400, str(e), param="tool_choice" if req.forces_tool_call else "response_format",
                               code="invalid_value") from None  # fmt: skip
        return constraint

    def prepare_completion(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and (not p or isinstance(p[0], int)):
            bad = [t for t in p if not 0 <= t < self.engine.config.n_vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary", param="prompt")
            return list(p)
        text = p if isinstance(p, str) else p[0]
        if text == "":
            raise ApiError(400, "prompt is empty", param="prompt")
        return self.engine.tokenizer.encode(text)

    def check_length(self, prompt: list[int]) -> None:
        check_prompt(self.engine, prompt)
        if len(prompt) >= self.engine.n_ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens but the context holds {self.engine.n_ctx} "
                           "(at least one must remain for the completion)", param="messages", code="context_length_exceeded")  # fmt: skip

    # serving --------------------------------------------------------------------------------
    async def submit(self, req: ChatRequest | CompletionRequest) -> tuple[Job, asyncio.Queue, Callable[[], None]]:
        """Admit, prepare and queue ``req``: (its job, the queue of its worker events, the release of its admission
        slot, to be called once when the response is done)."""
        chat = isinstance(req, ChatRequest)
        self.admit()
        released = False

        def release_once() -> None:
            nonlocal released
            if not released:
                released = True
                self.release()

        try:
            async with self._inflight:
                if chat:
                    prompt, messages = await anyio.to_thread.run_sync(self.prepare_chat, req)
                    constraint = await anyio.to_thread.run_sync(self.prepare_constraint, req)
                    record = {"chat": True, "messages": messages}
                else:
                    prompt = await anyio.to_thread.run_sync(self.prepare_completion, req)
                    constraint = None
                    record = {"chat": False, "messages": [], "note": "raw /v1/completions prompt (no chat template)"}
            self.check_length(prompt)
            limit = (req.max_completion_tokens or req.max_tokens) if chat else req.max_tokens
            max_tokens = limit or (self.engine.n_ctx - len(prompt) if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
            params = SamplingParams.create(temperature=float(1.0 if req.temperature is None else req.temperature),
                                           top_p=float(1.0 if req.top_p is None else req.top_p),
                                           seed=0 if req.seed is None else req.seed)  # fmt: skip
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            job = Job(prompt, params, max_tokens, req.stops, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
                      stream=bool(req.stream), record=record, logprobs_k=req.logprobs_k, constraint=constraint)  # fmt: skip
            if chat and req.tools and req.tool_choice != "none":
                job.tool_format = self.tool_format(req.tools)
                job.tools = {t.function.name: t.function.parameters if t.function.strict else None for t in req.tools}
                job.parallel_tool_calls = req.parallel_tool_calls is not False
            self.worker.jobs.put(job)
        except BaseException:
            release_once()
            raise
        return job, events, release_once

    async def collect(self, request: Request, job: Job, events: asyncio.Queue,
                      release: Callable[[], None]) -> tuple[GenerationResult, list[Step]] | None:  # fmt: skip
        """Wait for a non-streamed job: (its result, its steps), or None if the client went away (job cancelled)."""
        steps: list[Step] = []
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(events.get(), 0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        job.cancel.set()
                        return None
                    continue
                if kind == "error":
                    raise payload
                if kind == "step":
                    steps.append(payload)
                if kind == "done":
                    return payload, steps
        finally:
            job.cancel.set()
            release()

    async def serve(self, request: Request, req: ChatRequest | CompletionRequest) -> Response:
        chat = isinstance(req, ChatRequest)
        job, events, release_once = await self.submit(req)
        n_prompt = len(job.prompt)
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": self.model_id, "system_fingerprint": self.fingerprint}  # fmt: skip
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return _BoundedStream(self._sse(job, events, meta, chat, include_usage, n_prompt, release_once),
                                  self.settings.send_timeout, media_type="text/event-stream",
                                  headers={"Cache-Control": "no-cache"})  # fmt: skip
        done = await self.collect(request, job, events, release_once)
        if done is None:
            return Response(status_code=499)
        res, steps = done
        body = dict(meta, object="chat.completion" if chat else "text_completion", usage=self._usage(n_prompt, res))
        reply = job.reply(res)
        choice = {"index": 0, "finish_reason": "tool_calls" if reply.tool_calls else FINISH[res.stop_reason], "logprobs": None}
        if job.logprobs_k is not None:
            choice["logprobs"] = self._logprobs(chat, steps, 0)
        choice.update({"message": reply.message()} if chat else {"text": res.text})
        body["choices"] = [choice]
        return JSONResponse(body, headers={"x-detinfer-output-sha256": tokens_sha256(res.tokens), "x-detinfer-kv-sha256": res.kv_sha256})

    def _logprobs(self, chat: bool, steps: list[Step], offset: int) -> dict:
        """The ``logprobs`` object of a choice (or chunk) for the sampled steps in ``steps``; ``offset``: characters of
        completion text before the first of them."""
        tok = self.engine.tokenizer

        def entry(token_id: int, logprob: float) -> dict:
            b = tok.token_bytes(token_id)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": _finite(logprob), "bytes": list(b)}

        if chat:
            content = [dict(entry(s.token, s.logprob), top_logprobs=[entry(i, v) for i, v in s.top_logprobs])
                       for s in steps if s.token is not None]  # fmt: skip
            return {"content": content, "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for s in steps:
            if s.token is not None:
                top: dict[str, float] = {}
                for i, v in [*s.top_logprobs, (s.token, s.logprob)]:  # the sampled token too: up to logprobs + 1
                    top.setdefault(entry(i, v)["token"], _finite(v))
                out["tokens"].append(entry(s.token, s.logprob)["token"])
                out["token_logprobs"].append(_finite(s.logprob))
                out["top_logprobs"].append(top)
                out["text_offset"].append(offset)
            offset += len(s.text)
        return out

    @staticmethod
    def _usage(n_prompt: int, res: GenerationResult) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": len(res.tokens), "total_tokens": n_prompt + len(res.tokens),
                "prompt_tokens_details": {"cached_tokens": res.reused_tokens}}  # fmt: skip

    async def _sse(self, job: Job, events: asyncio.Queue, meta: dict, chat: bool, include_usage: bool, n_prompt: int,
                   release: Callable[[], None]):  # fmt: skip
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: dict | None, text: str | None, finish: str | None, logprobs: dict | None = None, **extra) -> str:
            choice = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
            choice.update({"delta": delta} if chat else {"text": text})
            return "data: " + json.dumps(dict(meta, object=obj, choices=[choice], **extra), ensure_ascii=False) + "\n\n"

        offset = 0  # characters of completion text sent so far (completions' text_offset)
        splitter = StreamSplitter(job.tool_format) if job.tool_format is not None else None
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None, None)
            while True:
                kind, payload = await events.get()
                if kind == "error":
                    yield "data: " + json.dumps(payload.body()) + "\n\n"
                    break
                if kind == "step":
                    step: Step = payload
                    offset += len(step.text)
                    text = step.text if splitter is None else splitter.feed(step.text)
                    if job.logprobs_k is not None and step.token is not None:
                        yield chunk({"content": text}, text, None, self._logprobs(chat, [step], offset - len(step.text)))
                    elif text:
                        yield chunk({"content": text}, text, None)
                    continue
                res: GenerationResult = payload
                reply = job.reply(res)
                if splitter is not None and (rest := splitter.rest(reply, res.text)):
                    yield chunk({"content": rest}, rest, None)
                for i, call in enumerate(reply.tool_calls):
                    yield chunk({"tool_calls": [dict(call, index=i)]}, None, None)
                ext = {"detinfer": {"output_sha256": tokens_sha256(res.tokens), "kv_sha256": res.kv_sha256}}
                yield chunk({}, "", "tool_calls" if reply.tool_calls else FINISH[res.stop_reason], **ext)
                if include_usage:
                    yield "data: " + json.dumps(dict(meta, object=obj, choices=[], usage=self._usage(n_prompt, res))) + "\n\n"
                break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel.set()  # a disconnected client cancels its generation (or its place in the queue)
            release()


class _BoundedStream(StreamingResponse):
    """An SSE response whose every write must complete within ``send_timeout`` seconds.

    A client that stops reading fills the socket buffers, and the write then waits forever; this drops such a
    client instead: the stream's generator is closed (cancelling the job and releasing its slot) and uvicorn
    closes the connection, as for a client that disconnected.
    """

    def __init__(self, content, send_timeout: float, **kw):
        super().__init__(content, **kw)
        self.send_timeout = send_timeout

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            await asyncio.wait_for(send(message), self.send_timeout)

        try:
            await super().stream_response(timed_send)
        except asyncio.TimeoutError:
            await self.body_iterator.aclose()


def _json_object(arguments: str) -> Any:
    """Tool call arguments as the object they encode, or the text as it is when it is not a JSON object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _finite(logprob: float) -> float:
    """-inf (a -inf logit) as -9999.0, OpenAI's convention: JSON has no infinity."""
    return -9999.0 if logprob == float("-inf") else logprob


async def _read_json(request: Request, limit: int, timeout: float = BODY_TIMEOUT_S) -> dict:
    """The request body as a JSON object (bounded depth, valid UTF-8 strings: fileio.parse_json); 413 above
    ``limit`` bytes (the rest is drained, not kept), 408 if it takes longer than ``timeout`` seconds to arrive."""
    size, body = 0, bytearray()
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 64 * limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the limit of {limit}", code="body_too_large")
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                size += len(part)
                if size <= limit:
                    body += part
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected while sending the body", code="client_disconnected") from None
    if size > limit:
        raise ApiError(413, f"request body of {size} bytes exceeds the limit of {limit}", code="body_too_large")
    data = parse_json(bytes(body), lambda msg: ApiError(400, f"the body is not valid JSON: {msg}", code="invalid_json"),
                      "request body", "body")  # fmt: skip
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return data


def _parse(model: type[_Sampling], data: dict) -> _Sampling:
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    req.check()
    return req


def create_app(engine: Engine, settings: ServerSettings = ServerSettings()) -> FastAPI:
    """The FastAPI app serving ``engine``; the decode worker starts and stops with the app's lifespan."""
    from .responses import Responses  # it builds on this module

    server = Server(engine, settings)
    responses = Responses(server)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server._inflight = asyncio.Semaphore(settings.max_inflight)
        server.worker.start()
        yield
        server.worker.stop()

    app = FastAPI(title="detinfer", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if settings.api_key is not None:
            header = request.headers.get("authorization", "").encode("latin-1")  # the header's raw bytes
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, settings.api_key.encode("utf-8")):
                return ApiError(401, "missing or invalid API key (Authorization: Bearer KEY)", code="invalid_api_key").response()
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(DetinferError)
    async def detinfer_error(request: Request, e: DetinferError):
        return ApiError(400, str(e), code=type(e).__name__).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):  # 404, 405...: OpenAI's shape, not {"detail"}
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        message = f"{request.method} {request.url.path}: {e.detail}"
        return ApiError(e.status_code, message, code=code, headers=getattr(e, "headers", None)).response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": server.model_id, "admitted": server.admitted, "max_queue": settings.max_queue}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_id, "object": "model", "created": 0, "owned_by": "detinfer"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.serve(request, _parse(ChatRequest, await _read_json(request, settings.max_body_bytes, settings.body_timeout)))

    @app.post("/v1/responses")
    async def responses_(request: Request):
        return await responses.serve(request, await _read_json(request, settings.max_body_bytes))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.serve(request, _parse(CompletionRequest, await _read_json(request, settings.max_body_bytes, settings.body_timeout)))

    return app
