"""The decode worker: one thread that owns the KV caches and the prefix cache and steps up to ``batch`` jobs together.

numba's kernels and the KV caches are not shared across threads, and two thread pools on the same cores would
slow each other many-fold, so every generation of the server runs here. Jobs are taken in arrival order; a new one
joins the running ones at the next step boundary (continuous batching), and each step is one
``Engine.forward_batch`` over every job that needs a forward (a prefill chunk, a decode row, a draft window), in
which each sequence gets exactly the bytes it gets alone: a response never depends on what ran beside it. A job's
``emit`` is called from this thread (thread-safe); the worker never waits for a client: a job whose client went
away is cancelled between two steps, and its partial cache stays an exact prefix for later requests. The reply is
parsed here, once, and travels with the "done" event: nothing a request contains is parsed or validated on the
event loop.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..compute.constrain import Constraint
from ..compute.engine import DEFAULT_CHUNK, Engine, set_threads
from ..compute.generate import Decoding, GenerationResult
from ..compute.kvcache import KVCache, common_prefix
from ..compute.lockstep import DEFAULT_BATCH
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
                 speculate: str | None = None, batch: int = DEFAULT_BATCH):  # fmt: skip
        self.engine, self.threads, self.drain_s, self.speculate, self.batch = engine, threads, drain_s, speculate, batch
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.kv_dir = kv_dir
        self.prefix = PrefixCache(cache_bytes, store=kv_dir)
        self.recorder = Recorder(record_dir, engine, chat_template) if record_dir is not None else None
        self.thread = threading.Thread(target=self._loop, name="detinfer-decode", daemon=True)
        self.running: list[_Running] = []  # the jobs of the current step (only the decode thread changes it)
        self._warmed: Future[bool] = Future()  # the thread's warm-up: whether it compiled, or what it raised

    def start(self) -> None:
        """Start the decode thread (once; a second call does nothing)."""
        if self.thread.ident is None:
            self.thread.start()

    def warm_up(self) -> bool:
        """Start the decode thread and wait while it compiles or loads every kernel (Engine.warm_up); True if it
        compiled. It must be that thread: numba's OpenMP layer gives each thread that runs a parallel kernel a
        thread pool of its own, and with more pool threads than cores they stop spinning between parallel regions,
        so each region waits for a wake-up (a server whose main thread warmed up decoded 4 rows at 2 threads 2.5x
        slower than at 1, README's Performance). Raises what the warm-up raised."""
        self.start()
        return self._warmed.result()

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
        for r in list(self.running):
            r.job.cancel.set()
        self.jobs.put(None)
        self.thread.join(timeout=self.drain_s)
        if self.kv_dir is not None:
            self.kv_dir.close(timeout=self.drain_s)

    def _loop(self) -> None:
        set_threads(self.threads)  # numba's thread count is per calling thread
        try:
            self._warmed.set_result(self.engine.warm_up())
        except Exception as e:  # noqa: BLE001 - raised by warm_up; requests still get it as their own error
            self._warmed.set_exception(e)
        free: list[KVCache] = []  # caches no job holds, kept for the prefixes they hold
        stopping = False
        while True:
            while not stopping and len(self.running) < self.batch:  # new jobs join at a step boundary
                try:
                    job = self.jobs.get(block=not self.running)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                elif not job.cancel.is_set():
                    self._admit(job, free)
            if not self.running:
                if stopping:
                    return
                continue
            self._advance(free)

    def _admit(self, job: Job, free: list[KVCache]) -> None:
        """Start ``job`` on the free cache that holds the longest prefix of its prompt (or a new one)."""
        job.started = True
        job.emit(("start", None))
        best = max(range(len(free)), key=lambda i: common_prefix(free[i].tokens, job.prompt), default=None)
        cache = free.pop(best) if best is not None else self.engine.new_cache()
        try:
            decoding = Decoding(self.engine, job.prompt, job.sampling, cache=cache, logprobs_k=job.logprobs_k,
                                constraint=job.constraint, prefix_cache=self.prefix, speculate=self.speculate,
                                prefill_chunk=DEFAULT_CHUNK)  # fmt: skip
        except Exception as e:
            free.append(cache)
            job.emit(("error", _api_error(e)))
            return
        self.running.append(_Running(job, decoding, time.perf_counter()))

    def _advance(self, free: list[KVCache]) -> None:
        """One forward step over every running job that needs one (Engine.forward_batch: each gets the bytes it
        gets alone), then each job's steps up to its next forward; finished, failed and cancelled jobs leave and
        their caches go back to ``free`` (an exact prefix for later requests)."""

        def leave(r: _Running, error: Exception | None = None) -> None:
            self.running.remove(r)
            r.decoding.close()
            free.append(r.decoding.cache)
            del free[: -self.batch]  # the most recently used caches are kept
            if error is not None:
                r.job.emit(("error", _api_error(error)))

        for r in [r for r in self.running if r.job.cancel.is_set()]:
            leave(r)
        needs = [(r, need) for r in self.running if (need := r.decoding.need()) is not None]
        if needs:
            try:
                out = self.engine.forward_batch([(tokens, r.decoding.cache, all_logits) for r, (tokens, all_logits) in needs])
            except Exception as e:  # keep serving; report the failure to the requests of this step only
                for r, _ in needs:
                    leave(r, e)
                return
            for (r, _), logits in zip(needs, out):
                r.decoding.put(logits)
        for r in list(self.running):
            job, decoding = r.job, r.decoding
            try:
                while not decoding.done and decoding.need() is None and not job.cancel.is_set():
                    step = decoding.step()
                    if job.stream or job.logprobs_k is not None:  # non-streaming logprobs are built from the same steps
                        job.emit(("step", step))
                if decoding.done:
                    self._finish(r)
                    leave(r)
            except Exception as e:
                leave(r, e)

    def _finish(self, r: _Running) -> None:
        job, res = r.job, r.decoding.result
        seconds = time.perf_counter() - r.t0
        reply = job.reply(res)
        if self.recorder is not None:
            ex = Exchange(job.prompt, job.chat, job.messages, job.note, res, job.sampling, reply,
                          job.tool_format.name if job.tool_format else None, job.constraint, seconds, job.tool_defs,
                          job.parallel_tool_calls)  # fmt: skip
            job.recorded = self.recorder.add(ex) is not None
        job.emit(("done", (res, reply)))


@dataclass(eq=False)
class _Running:
    job: Job
    decoding: Decoding
    t0: float


def _api_error(e: Exception) -> ApiError:
    """A job's failure for its client: bad input is a 400 naming it, anything else a 500 (the server keeps serving)."""
    if isinstance(e, DetinferError):
        return ApiError(400, str(e), code=type(e).__name__)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type_="server_error")
