"""Fan-out work: verify, replay and batch generation as independent items, run in one process or on Ray.

Each kind of item is a *task*: a picklable function ``task(state, payload) -> result`` that never raises for bad
input (a DetinferError becomes a "bad input" result for that item only). :func:`run_local` runs tasks in this
process; ``distributed.run_on_ray`` runs the same tasks on Ray actors. Which worker ran an item can never change
its result: a batch manifest's ``informative`` section holds nothing that depends on the worker (no threads,
timings, CPU), so it is the same bytes wherever, and in whatever order, it ran.

A batch file is JSONL, one run per line::

    {"id": "q1", "prompt": "The capital of France is", "sampling": {"max_tokens": 16}}
    {"id": "q2", "messages": [{"role": "user", "content": "Hi"}], "model": "gemma3-270m-q4_k_m", "chat_template": "gemma"}

and writes ``DIR/<id>.json``, a normal run manifest (``detinfer verify`` re-executes it).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..compute.lockstep import DEFAULT_BATCH, check_batch, lockstep
from ..compute.sampling import Sampling
from ..errors import DetinferError, InputError, first_error
from ..fileio import atomic_write_text, parse_json, read_input_text
from ..model.registry import name_for_sha256
from ..records.engines import EngineCache
from ..records.manifest import load_manifest
from ..records.outcome import Outcome, bad_input
from ..records.reader import Record
from ..records.verify import ReplayOptions, reexecute

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a file name in DIR: no separators, no "..", no hidden files
WRITTEN, SKIPPED, BAD_INPUT = "written", "skipped", "bad input"
R = TypeVar("R")


@dataclass
class WorkerState:
    """What a worker keeps between items: its engine caches (records/engines.py), one per --model override, so each
    model is loaded once per worker whatever the item."""

    caches: dict[tuple[str | None, bool], EngineCache] = field(default_factory=dict)

    def engines(self, model: str | None = None, *, rederive: bool = False) -> EngineCache:
        if (model, rederive) not in self.caches:
            self.caches[model, rederive] = EngineCache(model, rederive=rederive)
        return self.caches[model, rederive]


# ------------------------------------------------------------------------------------------------ batch lines


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchMessage(_Strict):
    role: str
    content: str


class BatchLine(_Strict):
    """One JSONL line: ``id`` (the output's file name), exactly one of ``prompt`` / ``messages``, ``chat`` (render
    ``prompt`` as a user message), and optional ``model`` (registry name or .gguf path every node can read),
    ``chat_template`` (built-in name or jinja file) and ``sampling``."""

    id: str = Field(pattern=ID_PATTERN)
    prompt: str | None = None
    messages: list[BatchMessage] | None = None
    chat: bool = False
    model: str | None = None
    chat_template: str | None = None
    sampling: Sampling = Sampling()

    @field_validator("id", mode="wrap")
    @classmethod
    def _file_name(cls, value: Any, handler: Any) -> str:
        try:
            return handler(value)
        except ValidationError:  # pydantic's message is the regex itself
            if not isinstance(value, str):
                raise
            raise ValueError(f"{json.dumps(value)} cannot name a file: use 1-128 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit") from None

    @model_validator(mode="after")
    def _one_prompt(self) -> "BatchLine":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt, messages")
        return self


@dataclass(frozen=True)
class BatchItem:
    """A batch line as shipped to a worker: its 1-based ``line`` number, ``id`` (``line-N`` when the line has
    none), the parsed line or the reason it is bad input, and the engine settings of the whole batch."""

    line: int
    id: str
    spec: BatchLine | None
    error: str | None
    model: str | None = None  # the batch's default model (--model)
    n_ctx: int = 4096
    kv_type: str = "f32"
    rederive: bool = False  # load the models from their GGUF alone (Engine.load)


@dataclass
class BatchResult:
    """One batch item's outcome. ``manifest`` is the canonical JSON the driver writes (None after writing)."""

    line: int
    id: str
    status: str
    message: str = ""
    tokens: int = 0
    seconds: float = 0.0
    manifest: str | None = None

    @property
    def steps(self) -> int:
        return self.tokens


def read_batch(path: Path, *, model: str | None = None, n_ctx: int = 4096, kv_type: str = "f32",
               rederive: bool = False) -> list[BatchItem]:  # fmt: skip
    """Parse a JSONL batch file (blank lines are skipped). A line that is not JSON or not a valid run is kept as a
    bad-input item, so the other lines still run. Raises InputError for an unreadable file, no lines, a file that
    is one JSON document over several lines (a manifest, say: not JSONL), or an id used twice (naming both line
    numbers)."""
    text = read_input_text(path, InputError, "batch file")
    if "\n" in text.strip() and _one_document(text):
        raise InputError(f"{path} is one JSON document over several lines, not JSONL: a batch file holds one JSON object "
                         "per line, each with an id and a prompt")  # fmt: skip
    items: list[BatchItem] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        spec, error, id_ = None, None, f"line-{n}"
        try:
            data = parse_json(raw, InputError, "batch line", f"{path}:{n}")
            if isinstance(data, dict) and isinstance(data.get("id"), str):
                id_ = data["id"]
            spec = BatchLine.model_validate(data)
        except InputError as e:
            error = str(e)
        except ValidationError as e:
            error = f"{path}:{n}: {first_error(e)}"
        if spec is not None:
            if spec.id in seen:
                raise InputError(f"{path}: id {spec.id!r} is used on lines {seen[spec.id]} and {n}; ids name the output files and must be unique")
            seen[spec.id] = n
        items.append(BatchItem(n, id_, spec, error, model, n_ctx, kv_type, rederive))
    if not items:
        raise InputError(f"{path} has no batch lines; write one JSON object per line with an id and a prompt")
    return items


def _one_document(text: str) -> bool:
    """Whether ``text`` parses as a single JSON value (its first line alone does not, or it would be one line)."""
    try:
        parse_json(text, InputError, "batch file")
    except InputError:
        return False
    return True


def prepare_batch(path: Path, out_dir: Path, *, resume: bool = False, model: str | None = None, n_ctx: int = 4096,
                  kv_type: str = "f32", rederive: bool = False) -> tuple["BatchWriter", list[BatchItem], list[BatchResult]]:  # fmt: skip
    """Everything ``detinfer batch`` checks before running: the output folder, the KV type, the batch file's lines and
    ids, and which ids --resume skips. (writer, items to run, SKIPPED results); InputError / KVTypeError otherwise.
    A --model path is made absolute: Ray workers see the driver's path, not its working folder."""
    from ..compute.kvcache import parse_kv_type
    from ..fileio import check_output_dir
    from ..model.registry import REGISTRY

    check_output_dir(out_dir, "--out-dir")
    parse_kv_type(kv_type)
    if model is not None and model not in REGISTRY:
        model = str(Path(model).expanduser().absolute())
    writer = BatchWriter(out_dir)
    todo, skipped = writer.pending(read_batch(path, model=model, n_ctx=n_ctx, kv_type=kv_type, rederive=rederive), resume)
    return writer, todo, skipped


def _ensure(model: str | None, pull: bool) -> None:
    """On a worker with ``pull``: make a registry model present (a hash-verified pull if it is missing)."""
    from ..model.registry import DEFAULT_MODEL, REGISTRY, ensure_model

    name = model or DEFAULT_MODEL
    if pull and name in REGISTRY:
        ensure_model(name, progress=False)


def batch_manifest(engine, item: BatchItem) -> Any:
    """Run one batch line on ``engine``: the sealed RunManifest, with a worker-independent ``informative`` section
    (threads 0, no timings, no CPU; the registry name or the file's path as model_path). Raises DetinferError for bad input."""
    from ..compute.generate import check_prompt
    from ..model.chat import ChatTemplate
    from ..model.registry import REGISTRY
    from ..records.run import build_prompt, execute

    spec = item.spec
    template = ChatTemplate.from_option(spec.chat_template) if spec.chat_template is not None else None
    messages = [m.model_dump() for m in spec.messages] if spec.messages is not None else None
    prompt = build_prompt(engine, text=spec.prompt, messages=messages, chat=spec.chat, template=template)
    check_prompt(engine, prompt.token_ids)
    manifest = execute(engine, prompt, spec.sampling, template=template)
    model = _model(item)
    where = model if model in REGISTRY else str(engine.model_file.path)  # a registry path differs between nodes
    informative = manifest.informative.model_copy(update={"threads": 0, "timings": {}, "cpu": "", "model_path": where})
    return manifest.model_copy(update={"informative": informative})


def batch_task(state: WorkerState, item: BatchItem, *, pull: bool = False) -> BatchResult:
    """Run one batch item; bad input (a bad line, prompt, model or sampling value) is a BAD_INPUT result."""
    t0 = time.perf_counter()
    if item.spec is None:
        return BatchResult(item.line, item.id, BAD_INPUT, message=item.error or "")
    try:
        model = _model(item)
        _ensure(model, pull)
        engine = state.engines(rederive=item.rederive).load(model, item.n_ctx, item.kv_type)
    except DetinferError as e:
        return BatchResult(item.line, item.id, BAD_INPUT, message=f"{item.id}: {e}", seconds=time.perf_counter() - t0)
    return _batch_run(item, engine, t0)


def _model(item: BatchItem) -> str:
    from ..model.registry import DEFAULT_MODEL

    return item.spec.model or item.model or DEFAULT_MODEL


def _batch_run(item: BatchItem, engine, t0: float | None = None) -> BatchResult:
    """One (valid) batch line on ``engine``, or a lockstep view of it."""
    from ..records.manifest import canonical_json

    t0 = time.perf_counter() if t0 is None else t0
    try:
        manifest = batch_manifest(engine, item)
    except DetinferError as e:
        return BatchResult(item.line, item.id, BAD_INPUT, message=f"{item.id}: {e}", seconds=time.perf_counter() - t0)
    return BatchResult(item.line, item.id, WRITTEN, tokens=len(manifest.output.token_ids), seconds=time.perf_counter() - t0,
                       manifest=canonical_json(manifest.sealed().model_dump(mode="json")))


def batch_lockstep(items: Sequence[BatchItem], on_result: Callable[[int, BatchResult], None], *,
                   batch: int = DEFAULT_BATCH) -> list[BatchResult]:  # fmt: skip
    """:func:`batch_task` over every item in this process, in lockstep: the lines of one model (and n_ctx, KV type)
    ``batch`` per forward step (compute/lockstep.py), the same manifests as one by one. Results in item order;
    ``on_result(index, result)`` as each finishes."""
    check_batch(batch)
    state, results = WorkerState(), [None] * len(items)

    def done(i: int, result: BatchResult) -> None:
        results[i] = result
        on_result(i, result)

    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        if item.spec is None:
            done(i, batch_task(state, item))
        else:
            groups.setdefault((_model(item), item.n_ctx, item.kv_type, item.rederive), []).append(i)
    for (model, n_ctx, kv_type, rederive), indices in groups.items():
        try:
            engine = state.engines(rederive=rederive).load(model, n_ctx, kv_type)
        except DetinferError:  # each line gets the error with its own id
            for i in indices:
                done(i, batch_task(state, items[i]))
            continue
        lockstep(engine, [partial(_batch_run, items[i]) for i in indices], batch=batch,
                 on_result=lambda k, result: done(indices[k], result))  # fmt: skip
    return results


class BatchWriter:
    """The driver's side of a batch: writes each manifest atomically as its result arrives (in finishing order)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir

    def path(self, id_: str) -> Path:
        return self.out_dir / f"{id_}.json"

    def pending(self, items: list[BatchItem], resume: bool) -> tuple[list[BatchItem], list[BatchResult]]:
        """(items to run, SKIPPED results for ids already in the folder). Without ``resume`` an id already there
        is an InputError: a batch never overwrites a manifest silently."""
        done = [it for it in items if it.spec is not None and self.path(it.id).is_file() and (not resume or self._valid(it.id))]
        if done and not resume:
            raise InputError(f"{self.out_dir} already holds {len(done)} of this batch's manifests (e.g. {self.path(done[0].id).name}); "
                             "pass --resume to skip them, or choose another --out-dir")
        skip = {it.id for it in done}
        return [it for it in items if it.id not in skip], [BatchResult(it.line, it.id, SKIPPED) for it in done]

    def _valid(self, id_: str) -> bool:
        """Whether the manifest already written for ``id_`` reads back whole and unedited (a batch killed while
        writing leaves none half-written, but a file may have been damaged since): --resume runs an invalid one
        again, replacing it."""
        try:
            load_manifest(self.path(id_))
        except DetinferError:
            return False
        return True

    def write(self, result: BatchResult) -> None:
        if result.manifest is not None:
            atomic_write_text(self.path(result.id), result.manifest)
            result.manifest = None


# ------------------------------------------------------------------------------------------ verify and replay


def reexecute_task(state: WorkerState, item: Record | Outcome, *, model: str | None = None,
                   options: ReplayOptions = ReplayOptions(), pull: bool = False) -> Outcome:  # fmt: skip
    """``verify`` / ``replay`` of one record (an Outcome; bad input is its status, never raised). A file that could
    not be read arrives as its outcome already."""
    if isinstance(item, Outcome):
        return item
    try:
        if model is None:
            _ensure(next(iter(item.model_names), None) or name_for_sha256(item.model_sha256), pull)
    except DetinferError as e:
        return bad_input(str(item.path), str(e))
    return reexecute(item, state.engines(model), options)


def reexecute_failed(item: Record | Outcome, reason: str) -> Outcome:
    path = str(item.path)
    return bad_input(path, f"{path}: {reason}")


# ------------------------------------------------------------------------------------------ running and progress


def run_local(task: Callable[[WorkerState, Any], R], payloads: Sequence[Any], on_result: Callable[[int, R], None]) -> list[R]:
    """Run ``task`` on every payload in this process, in order; ``on_result(index, result)`` after each."""
    state, results = WorkerState(), []
    for i, payload in enumerate(payloads):
        results.append(task(state, payload))
        on_result(i, results[-1])
    return results


class ItemProgress:
    """Items as they finish, on stderr: a rich bar on a terminal (done/total, mismatches so far, tokens/s), one
    plain line per item elsewhere (CI logs), and a summary line at the end. A result needs ``status``, ``steps``
    and a name (``path`` or ``id``). ``compares``: the items are re-executions, which can mismatch (a batch's runs
    cannot: no mismatch count is shown)."""

    def __init__(self, console, verb: str, total: int, where: str, compares: bool = True):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bar

        self.console, self.verb, self.total, self.where, self.compares = console, verb, total, where, compares
        self.done = self.mismatches = self.bad = self.tokens = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if console.is_terminal:
            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[mismatches]} mismatches, " * compares + "{task.fields[rate]} tok/s"),
                           TimeElapsedColumn(), console=console, transient=True)
            self.task = self.bar.add_task(f"{verb} {where}", total=total, mismatches=0, rate="0")
            self.bar.start()

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def __call__(self, _index: int, result: Any) -> None:
        from rich.markup import escape

        self.done += 1
        self.mismatches += result.status == "mismatch"
        self.bad += result.status == BAD_INPUT
        self.tokens += result.steps
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, mismatches=self.mismatches, rate=f"{self.rate():.1f}")
        else:
            name = getattr(result, "path", None) or result.id
            so_far = f"{self.mismatches} mismatches so far, " * self.compares
            ran = result.status != BAD_INPUT  # nothing ran: no tokens or rate to show
            self.console.print(f"[{self.done}/{self.total}] {escape(str(name))}: {result.status}"
                               + f" ({result.steps} tokens, {so_far}{self.rate():.1f} tok/s)" * ran, soft_wrap=True, markup=False)  # fmt: skip

    def close(self, interrupted: bool = False, summary: bool = True) -> None:
        if self.bar is not None:
            self.bar.stop()
        if not summary:
            return
        seconds = time.perf_counter() - self.t0
        head = "interrupted: " if interrupted else ""
        self.console.print(f"{head}{self.verb} {self.done}/{self.total} {self.where} in {seconds:.1f} s: "
                           f"{f'{self.mismatches} mismatch, ' * self.compares}{self.bad} bad input"
                           + f"; {self.tokens} tokens, {self.rate():.1f} tok/s" * (self.tokens > 0),
                           soft_wrap=True, markup=False)  # fmt: skip


def batch_failed(item: BatchItem, reason: str) -> BatchResult:
    return BatchResult(item.line, item.id, BAD_INPUT, message=f"{item.id}: {reason}")
