"""What every endpoint shares: admission, preparation in threads, the hand-off to the decode worker, waiting for a
job, and the pieces of a response (usage, SSE with a send deadline, text held back while it may be call markup).

Data path of a request: auth -> body (size-limited JSON, protocol.read_json) -> pydantic validation (protocol.py)
-> admission (a slot of ``--max-queue``, else 429) -> prepare (template + tokenize + constraint, at most
``--max-inflight`` at once, in threads) -> the single decode worker (worker.py) -> the endpoint's response or SSE.
The worker never waits for a client: a stream buffers at most its own ``max_tokens`` steps, and a client that
stops reading for ``--send-timeout`` seconds is dropped, so it cannot hold its admission slot forever. A streamed
response starts (status 200) only when the worker takes its job, so a request refused while queued still gets its
own status. On shutdown (:meth:`Server.begin_drain`) queued requests get 503 with Retry-After at once and running
ones, after ``--drain`` seconds, a 503 error (a JSON body, or an SSE error event and ``data: [DONE]``).

Determinism: output depends only on (prompt token ids, sampling, constraint), never on queueing, streaming or the
prefix cache (reuse is exact, see compute/prefix_cache.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..compute.engine import Engine
from ..compute.generate import (
    DIGEST_SEED,
    OPENAI_FINISH_REASON,
    GenerationResult,
    Step,
)
from ..compute.lockstep import DEFAULT_BATCH
from ..compute.numerics import NUMERICS
from ..compute.sampler import RNG_PERSON, WEIGHT_BITS
from ..compute.speculate import check_speculate
from ..errors import ConstraintError
from ..model.chat import ChatTemplate
from ..model.registry import name_for_sha256
from ..model.tool_parsers import Reply, ToolCallFormat, format_for_template
from ..records.kv_dir import KVDir
from ..records.manifest import tokens_sha256
from ..version import __version__
from .protocol import BODY_TIMEOUT_S, MAX_BODY_BYTES, ApiError, SamplingFields, Tool
from .worker import Job, Worker


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
    drain_s: float = 5.0  # on shutdown: seconds running requests may go on before they are cancelled
    body_timeout: float = BODY_TIMEOUT_S  # seconds a client has to send the whole request body
    aliases: tuple[str, ...] = ()  # --alias: more names a request's ``model`` may give (as vLLM's --served-model-name)
    kv_dir: Path | None = None  # --kv-dir: the prefix cache's snapshots also on disk, reloaded at start
    kv_dir_bytes: int = 4 << 30  # --kv-dir-bytes: that folder's budget for this model's files
    speculate: str | None = None  # --speculate: the decode worker's drafter (compute.speculate; same bytes)
    batch: int = DEFAULT_BATCH  # --batch: sequences the decode worker steps together (each gets its bytes alone)


STOP_S = 0.25  # seconds the app's shutdown waits for the decode thread (its jobs are cancelled by then)
RETRY_AFTER = {"Retry-After": "1"}


def _shutting_down(message: str) -> ApiError:
    """The 503 (with Retry-After) of a request refused or cancelled because the server is shutting down."""
    return ApiError(503, message, type_="server_error", code="server_shutting_down", headers=RETRY_AFTER)


def numerics_spec(engine: Engine) -> str:
    """What besides the model and detinfer's version fixes the numbers (part of ``system_fingerprint``)."""
    return f"{NUMERICS};kv={engine.kv_type};rng={RNG_PERSON.decode()};weight_bits={WEIGHT_BITS};digest={DIGEST_SEED[:16]}"


class Server:
    """Admission, preparation and the decode worker of one model; the endpoints (chat_completions.py,
    completions.py, responses.py) build their requests' jobs and responses around it."""

    def __init__(self, engine: Engine, settings: ServerSettings):
        self.engine, self.settings = engine, settings
        kv_dir = None
        if settings.kv_dir is not None:
            cfg = engine.config
            kv_dir = KVDir(settings.kv_dir, settings.kv_dir_bytes, model_sha256=engine.model_file.sha256,
                           tokenizer_sha256=engine.tokenizer.hash, kv_type=engine.kv_type,
                           shape=(cfg.n_attn_layer, cfg.n_head_kv, cfg.head_dim))  # fmt: skip
        self.worker = Worker(engine, threads=settings.threads, cache_bytes=settings.cache_bytes,
                             record_dir=settings.record_dir, chat_template=settings.chat_template, drain_s=STOP_S,
                             kv_dir=kv_dir, speculate=check_speculate(settings.speculate), batch=settings.batch)  # fmt: skip
        self.model_id = name_for_sha256(engine.model_file.sha256) or engine.model_file.path.stem
        path = engine.model_file.path
        # every name a request's model may give: registry name, file name, stem, then the aliases
        self.names = list(dict.fromkeys([self.model_id, path.name, path.stem, *settings.aliases]))
        spec = f"{engine.model_file.sha256}\n{__version__}\n{numerics_spec(engine)}"
        self.fingerprint = "fp_" + hashlib.sha256(spec.encode()).hexdigest()[:16]
        self.admitted = 0
        self.draining = False
        self.active: set[Job] = set()  # submitted jobs whose response is not done
        self._inflight: asyncio.Semaphore | None = None

    def start(self) -> None:
        self._inflight = asyncio.Semaphore(self.settings.max_inflight)
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    def begin_drain(self) -> None:
        """Shutdown has begun (SIGTERM / Ctrl-C, from listen.py): refuse new requests, answer queued ones 503 now,
        and cancel running ones with a 503 after ``drain_s`` seconds."""
        self.draining = True
        for job in list(self.active):
            if not job.started:
                job.abort(_shutting_down("the server is shutting down; the request was not started, retry it"))
        asyncio.get_running_loop().call_later(self.settings.drain_s, self._cancel_running)

    def _cancel_running(self) -> None:
        for job in list(self.active):
            job.abort(_shutting_down(f"the server is shutting down; the request was cancelled after the drain time of "
                                     f"{self.settings.drain_s:g} s"))  # fmt: skip

    def check_model(self, name: str) -> None:
        """ApiError 404 model_not_found unless ``name`` is one of :attr:`names` (never answered by another model)."""
        if name not in self.names:
            raise ApiError(404, f"The model {name!r} does not exist on this server; it serves {self.model_id!r}, also "
                                f"known as {', '.join(repr(n) for n in self.names[1:])} (serve --alias NAME adds names)",
                           param="model", code="model_not_found")  # fmt: skip

    # admission ------------------------------------------------------------------------------
    def admit(self) -> None:
        if self.draining:
            raise _shutting_down("the server is shutting down")
        if self.admitted >= self.settings.max_queue:
            raise ApiError(429, f"the server queue is full ({self.settings.max_queue} requests); retry later",
                           type_="rate_limit_error", code="queue_full", headers=RETRY_AFTER)  # fmt: skip
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1

    # preparation (runs in a thread) ---------------------------------------------------------
    def template(self) -> ChatTemplate:
        tpl = self.settings.chat_template or self.engine.chat_template
        if tpl is None:
            raise ApiError(400, f"{self.model_id} has no chat template; use /v1/completions, or start the server with "
                                "--chat-template", param="messages", code="unsupported_value")  # fmt: skip
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

    def check_constraint(self, job: Job, param: str) -> None:
        """Compile ``job``'s constraint against the vocabulary, so a bad one is a 400 naming ``param`` before any token."""
        if job.constraint is not None:
            try:
                job.constraint.check(self.engine.tokenizer)
            except ConstraintError as e:
                raise ApiError(400, str(e), param=param, code="invalid_value") from None

    def check_length(self, prompt: list[int], param: str) -> None:
        """A 400 naming ``param`` for a prompt of no tokens, or OpenAI's ``context_length_exceeded`` for one of n_ctx
        tokens or more (at least one position must remain for the completion)."""
        n_ctx = self.engine.n_ctx
        if not prompt:
            raise ApiError(400, f"{param}: the prompt has no tokens", param=param, code="invalid_value")
        if len(prompt) >= n_ctx:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens but the context holds {n_ctx} (at least one must remain for "
                           f"the completion); shorten it, or start the server with a larger --ctx (this model allows up to "
                           f"{self.engine.config.n_ctx_train})", param=param, code="context_length_exceeded")  # fmt: skip

    # serving --------------------------------------------------------------------------------
    async def submit(self, prepare: Callable[[], Job]) -> tuple[Job, asyncio.Queue, Callable[[], None]]:
        """Admit a request, build its job with ``prepare`` (in a thread) and queue it: (the job, the queue of its
        worker events, the release of its admission slot, to be called once when the response is done)."""
        self.admit()
        released = False

        def release_once() -> None:
            nonlocal released
            if not released:
                released = True
                self.release()

        try:
            async with self._inflight:
                job = await anyio.to_thread.run_sync(prepare)
            if self.draining:
                self.admit()  # the 503 of a server shutting down
            loop = asyncio.get_running_loop()
            events: asyncio.Queue = asyncio.Queue()
            job.emit = lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)
            self.active.add(job)
            self.worker.jobs.put(job)
        except BaseException:
            release_once()
            raise

        def release_job() -> None:
            self.active.discard(job)
            release_once()

        return job, events, release_job

    async def _next(self, request: Request, job: Job, events: asyncio.Queue) -> tuple[str, Any] | None:
        """The job's next worker event; None (and the job cancelled) if the client went away meanwhile."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    return None

    async def started(self, request: Request, job: Job, events: asyncio.Queue, release: Callable[[], None]) -> bool:
        """Wait until the worker takes ``job`` (before a stream's status line goes out): True, or False if the client
        went away; an error before the start (a 503 while queued, say) is raised as its ApiError."""
        try:
            event = await self._next(request, job, events)
        except BaseException:
            job.cancel.set()
            release()
            raise
        if event is None or event[0] == "error":
            job.cancel.set()
            release()
            if event is not None:
                raise event[1]
            return False
        return True

    async def collect(self, request: Request, job: Job, events: asyncio.Queue,
                      release: Callable[[], None]) -> tuple[GenerationResult, Reply, list[Step]] | None:  # fmt: skip
        """Wait for a non-streamed job: (its result, its parsed reply, its steps), or None if the client went away
        (job cancelled)."""
        steps: list[Step] = []
        try:
            while (event := await self._next(request, job, events)) is not None:
                kind, payload = event
                if kind == "error":
                    raise payload
                if kind == "step":
                    steps.append(payload)
                if kind == "done":
                    return payload[0], payload[1], steps
            return None
        finally:
            job.cancel.set()
            release()


class Endpoint(Protocol):
    """How one endpoint (chat completions, completions) prepares its job and shapes its choices; :func:`respond`
    does the rest. A choice is ``{"index", "finish_reason", "logprobs"}`` plus the endpoint's content keys."""

    id_prefix: str  # "chatcmpl", "cmpl"
    object: str  # of a whole response
    chunk_object: str  # of a streamed chunk

    def prepare(self, req: Any) -> Job: ...  # runs in a thread
    def message(self, reply: Reply, res: GenerationResult) -> dict[str, Any]: ...  # a whole response's content
    def opening(self) -> dict[str, Any] | None: ...  # the first chunk's content, before any token (or None)
    def text(self, text: str) -> dict[str, Any]: ...  # a chunk's content for streamed text
    def calls(self, calls: list[dict[str, Any]]) -> dict[str, Any]: ...  # a chunk's content for tool calls
    def closing(self) -> dict[str, Any]: ...  # the last chunk's content (with the finish reason)
    def logprobs(self, steps: list[Step], offset: int) -> dict[str, Any]: ...  # ``offset``: characters before steps


def detinfer_hashes(res: GenerationResult, job: Job | None = None) -> dict[str, Any]:
    """What a response carries to prove its bytes: the output tokens' and the final KV cache's sha256, and with
    --record, ``recorded`` False when the turn could not be written (the server's log says why)."""
    out: dict[str, Any] = {"output_sha256": tokens_sha256(res.tokens), "kv_sha256": res.kv_sha256}
    if job is not None and job.recorded is False:
        out["recorded"] = False
    return out


def detinfer_headers(res: GenerationResult, job: Job) -> dict[str, str]:
    """:func:`detinfer_hashes` as response headers (``x-detinfer-output-sha256``, ``-kv-sha256``, ``-recorded``)."""
    return {f"x-detinfer-{k.replace('_', '-')}": str(v).lower() if isinstance(v, bool) else v for k, v in detinfer_hashes(res, job).items()}


def finish_reason(reply: Reply, res: GenerationResult) -> str:
    return "tool_calls" if reply.tool_calls else OPENAI_FINISH_REASON[res.stop_reason]


async def respond(server: Server, request: Request, req: SamplingFields, endpoint: Endpoint) -> Response:
    """Serve ``req`` on ``endpoint``: a JSON response, or an SSE stream ending with ``data: [DONE]``."""
    server.check_model(req.model)
    job, events, release = await server.submit(lambda: endpoint.prepare(req))
    meta = {"id": f"{endpoint.id_prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": server.model_id,
            "system_fingerprint": server.fingerprint}  # fmt: skip
    if req.stream:
        if not await server.started(request, job, events, release):
            return Response(status_code=499)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return BoundedStream(_sse(endpoint, job, events, meta, include_usage, release), server.settings.send_timeout)
    done = await server.collect(request, job, events, release)
    if done is None:
        return Response(status_code=499)
    res, reply, steps = done
    choice = {"index": 0, "finish_reason": finish_reason(reply, res), "logprobs": None}
    if job.logprobs_k is not None:
        choice["logprobs"] = endpoint.logprobs(steps, 0)
    body = dict(meta, object=endpoint.object, choices=[dict(choice, **endpoint.message(reply, res))],
                usage=usage(len(job.prompt), res))
    return JSONResponse(body, headers=detinfer_headers(res, job))


async def _sse(endpoint: Endpoint, job: Job, events: asyncio.Queue, meta: dict, include_usage: bool, release: Callable[[], None]):
    def chunk(content: dict, finish: str | None = None, logprobs: dict | None = None, **extra) -> str:
        choice = dict({"index": 0, "finish_reason": finish, "logprobs": logprobs}, **content)
        return "data: " + json.dumps(dict(meta, object=endpoint.chunk_object, choices=[choice], **extra), ensure_ascii=False) + "\n\n"

    offset = 0  # characters of completion text sent so far (completions' text_offset)
    splitter = StreamSplitter(job.tool_format) if job.tool_format is not None else None
    try:
        if (opening := endpoint.opening()) is not None:
            yield chunk(opening)
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
                    yield chunk(endpoint.text(text), logprobs=endpoint.logprobs([step], offset - len(step.text)))
                elif text:
                    yield chunk(endpoint.text(text))
                continue
            if kind != "done":  # "start"
                continue
            res, reply = payload
            if splitter is not None and (rest := splitter.rest(reply, res.text)):
                yield chunk(endpoint.text(rest))
            for i, call in enumerate(reply.tool_calls):
                yield chunk(endpoint.calls([dict(call, index=i)]))
            yield chunk(endpoint.closing(), finish_reason(reply, res), detinfer=detinfer_hashes(res, job))
            if include_usage:
                yield "data: " + json.dumps(dict(meta, object=endpoint.chunk_object, choices=[], usage=usage(len(job.prompt), res))) + "\n\n"
            break
        yield "data: [DONE]\n\n"
    finally:
        job.cancel.set()  # a disconnected client cancels its generation (or its place in the queue)
        release()


def usage(n_prompt: int, res: GenerationResult) -> dict[str, Any]:
    """Chat and completions ``usage`` with exact counts; ``cached_tokens``: prompt tokens reused from the prefix cache."""
    return {"prompt_tokens": n_prompt, "completion_tokens": len(res.tokens), "total_tokens": n_prompt + len(res.tokens),
            "prompt_tokens_details": {"cached_tokens": res.reused_tokens}}  # fmt: skip


def finite(logprob: float) -> float:
    """-inf (a -inf logit) as -9999.0, OpenAI's convention: JSON has no infinity."""
    return -9999.0 if logprob == float("-inf") else logprob


class BoundedStream(StreamingResponse):
    """An SSE response whose every write must complete within ``send_timeout`` seconds.

    A client that stops reading fills the socket buffers, and the write then waits forever; this drops such a
    client instead: the stream's generator is closed (cancelling the job and releasing its slot) and uvicorn
    closes the connection, as for a client that disconnected.
    """

    def __init__(self, content, send_timeout: float, **kw):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, **kw)
        self.send_timeout = send_timeout

    async def stream_response(self, send) -> None:
        async def timed_send(message) -> None:
            await asyncio.wait_for(send(message), self.send_timeout)

        try:
            await super().stream_response(timed_send)
        except asyncio.TimeoutError:
            await self.body_iterator.aclose()


class StreamSplitter:
    """Splits a streamed reply into content that is safe to send now and call markup, held back until the end.

    ``feed(piece)`` adds the next piece of generated text and returns the new content to send; leading whitespace
    and any text that could begin call markup are held, so markup is never sent as content.
    """

    def __init__(self, fmt: ToolCallFormat):
        self.fmt, self.sent, self.text = fmt, 0, ""

    def feed(self, piece: str) -> str:
        self.text += piece
        text = self.text
        at = self.fmt.marker_at(text)
        if at is None and self.fmt.opens_reply:
            at = len(text) if not text.strip() or self.fmt.marker.startswith(text.strip()) else None
        if at is None:
            at = len(text)
            for k in range(min(len(self.fmt.marker), len(text)), 0, -1):  # a partial marker at the end
                if self.fmt.marker.startswith(text[-k:]):
                    at = len(text) - k
                    break
        if not text[:at].strip() or at <= self.sent:
            return ""
        new, self.sent = text[self.sent:at], at
        return new

    def rest(self, reply: Reply, text: str) -> str:
        """Content still to send at the end: the parsed reply's content (or the whole text) after what was sent."""
        content = reply.content if reply.tool_calls else text
        return (content or "")[self.sent:]
