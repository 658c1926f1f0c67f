"""The decode worker: one thread that owns the KV cache and the prefix cache and runs one job at a time.

numba's kernels and the KV cache are not shared across threads, and two thread pools on the same cores would
slow each other many-fold, so every generation of the server runs here, in arrival order. A job's ``emit`` is
called from this thread (thread-safe); the worker never waits for a client: a job whose client went away is
cancelled between two steps, and its partial cache stays an exact prefix for later requests. The reply is parsed
here, once, and travels with the "done" event: nothing a request contains is parsed or validated on the event loop.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..compute.constrain import Constraint
from ..compute.engine import Engine, set_threads
from ..compute.generate import GenerationResult, generate
from ..compute.prefix_cache import PrefixCache
from ..compute.sampling import Sampling
from ..errors import DetinferError
from ..fileio import parse_json
from ..model.chat import ChatTemplate
from ..model.tool_parsers import Reply, ToolCallFormat
from ..records.kv_dir import KVDir
from ..records.recorder import Exchange, Recorder
from .protocol import ApiError
from .schemas import ArgumentsValidator


@dataclass(eq=False)  # a job is itself (hashed by identity: Server.active)
class Job:
    """One generation handed to the worker: the prompt's token ids and sampling, how to reach the client (``emit``
    of ("start", None) when the worker takes it, ("step", Step), ("done", (GenerationResult, Reply)) or
    ("error", ApiError)), and what the reply and the recorder need. ``messages`` / ``note``: what a recorded turn
    keeps (``chat`` False: a raw /v1/completions prompt)."""

    prompt: list[int]
    sampling: Sampling
    stream: bool
    emit: Callable[[tuple[str, Any]], None] = lambda event: None  # set by Server.submit
    chat: bool = True
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_defs: list[dict[str, Any]] | None = None  # the request's tools as the chat template rendered them
    note: str | None = None
    logprobs_k: int | None = None  # None: no logprobs; else the top list's length (generate's logprobs_k)
    constraint: Constraint | None = None
    tool_format: ToolCallFormat | None = None  # None: the reply is text only
    tools: dict[str, ArgumentsValidator | None] = field(default_factory=dict)  # function name -> a strict tool's validator
    parallel_tool_calls: bool = True
    cancel: threading.Event = field(default_factory=threading.Event)
    recorded: bool | None = None  # with --record: whether the finished job's turn was written (set before "done")
    started: bool = False  # set by the worker when it takes the job

    def abort(self, error: ApiError) -> None:
        """End the job with ``error`` for its client (queued or running: the worker skips or stops it)."""
        self.cancel.set()
        self.emit(("error", error))

    def reply(self, res: GenerationResult) -> Reply:
        """The assistant reply of ``res``: its tool calls parsed when the request offered tools. Markup that does not
        parse (JSON nested past Python's recursion limit included), arguments nested deeper than the JSON inputs'
        limit (so the conversation can be sent back) and a strict tool's arguments that do not validate leave the
        whole text as content."""
        if self.tool_format is None:
            return Reply(res.text)
        try:  # the strict schemas are checked below, with bounded work (schemas.ArgumentsValidator)
            reply = self.tool_format.parse(res.text, dict.fromkeys(self.tools), call_id_seed=res.kv_sha256)
        except RecursionError:
            return Reply(res.text)
        for call in reply.tool_calls:
            fn = call["function"]
            try:
                arguments = parse_json(fn["arguments"], ValueError, "tool call arguments", "the reply")
            except ValueError:
                return Reply(res.text)
            validator = self.tools[fn["name"]]
            if validator is not None and not validator.is_valid(arguments):
                return Reply(res.text)
        return reply if self.parallel_tool_calls else Reply(reply.content, reply.tool_calls[:1])


class Worker:
    """The single decode thread (see the module docstring). ``record_dir``: record every finished job there."""

    def __init__(self, engine: Engine, *, threads: int | None, cache_bytes: int, record_dir: Path | None,
                 chat_template: ChatTemplate | None, drain_s: float, kv_dir: KVDir | None = None,
                 speculate: str | None = None):  # fmt: skip
        self.engine, self.threads, self.drain_s, self.speculate = engine, threads, drain_s, speculate
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.kv_dir = kv_dir
        self.prefix = PrefixCache(cache_bytes, store=kv_dir)
        self.recorder = Recorder(record_dir, engine, chat_template) if record_dir is not None else None
        self.thread = threading.Thread(target=self._loop, name="detinfer-decode", daemon=True)
        self.current: Job | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Cancel the running job and every queued one, then wait at most ``drain_s`` for the thread (a daemon: the
        process may exit while it finishes a step)."""
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
        self.thread.join(timeout=self.drain_s)
        if self.kv_dir is not None:
            self.kv_dir.close(timeout=self.drain_s)

    def _loop(self) -> None:
        set_threads(self.threads)  # numba's thread count is per calling thread
        cache = self.engine.new_cache()
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():
                continue
            self.current, job.started = job, True
            job.emit(("start", None))
            try:
                self._run(job, cache)
            except DetinferError as e:
                job.emit(("error", ApiError(400, str(e), code=type(e).__name__)))
            except Exception as e:  # keep serving; report the failure to this request only
                job.emit(("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")))
            finally:
                self.current = None

    def _run(self, job: Job, cache) -> None:
        res = GenerationResult()
        t0 = time.perf_counter()
        for step in generate(self.engine, job.prompt, job.sampling, cache=cache, result=res, logprobs_k=job.logprobs_k,
                             constraint=job.constraint, prefix_cache=self.prefix, speculate=self.speculate):  # fmt: skip
            if job.cancel.is_set():
                return  # client gone: the partial cache is still an exact prefix for later requests
            if job.stream or job.logprobs_k is not None:  # non-streaming logprobs are built from the same steps
                job.emit(("step", step))
        seconds = time.perf_counter() - t0
        reply = job.reply(res)
        if self.recorder is not None:
            ex = Exchange(job.prompt, job.chat, job.messages, job.note, res, job.sampling, reply,
                          job.tool_format.name if job.tool_format else None, job.constraint, seconds, job.tool_defs,
                          job.parallel_tool_calls)  # fmt: skip
            job.recorded = self.recorder.add(ex) is not None
        job.emit(("done", (res, reply)))
