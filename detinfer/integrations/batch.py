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

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..compute.sampling import Sampling
from ..errors import DetinferError, InputError
from ..fileio import atomic_write_text, load_json, parse_json, read_input_text

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # a file name in DIR: no separators, no "..", no hidden files
WRITTEN, SKIPPED, BAD_INPUT = "written", "skipped", "bad input"
R = TypeVar("R")


@dataclass
class WorkerState:
    """What a worker keeps between items: engines by (model sha256 or path, n_ctx, kv_type), loaded once, and a
    prefix cache per engine (replay)."""

    engines: dict[tuple, Any] = field(default_factory=dict)
    prefix_caches: dict[tuple, Any] = field(default_factory=dict)


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


def read_batch(path: Path, *, model: str | None = None, n_ctx: int = 4096, kv_type: str = "f32") -> list[BatchItem]:
    """Parse a JSONL batch file (blank lines are skipped). A line that is not JSON or not a valid run is kept as a
    bad-input item, so the other lines still run. Raises InputError for an unreadable file, no lines, or an id
    used twice (naming both line numbers)."""
    text = read_input_text(path, InputError, "batch file")
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
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            error = f"{path}:{n}: {where + ': ' if where else ''}{err['msg']}"
        if spec is not None:
            if spec.id in seen:
                raise InputError(f"{path}: id {spec.id!r} is used on lines {seen[spec.id]} and {n}; ids name the output files and must be unique")
            seen[spec.id] = n
        items.append(BatchItem(n, id_, spec, error, model, n_ctx, kv_type))
    if not items:
        raise InputError(f"{path} has no batch lines; write one JSON object per line with an id and a prompt")
    return items


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
    from ..model.registry import DEFAULT_MODEL, REGISTRY
    from ..records.run import build_prompt, execute

    spec = item.spec
    template = ChatTemplate.from_option(spec.chat_template) if spec.chat_template is not None else None
    messages = [m.model_dump() for m in spec.messages] if spec.messages is not None else None
    prompt = build_prompt(engine, text=spec.prompt, messages=messages, chat=spec.chat, template=template)
    check_prompt(engine, prompt.token_ids)
    manifest = execute(engine, prompt, spec.sampling, template=template)
    model = spec.model or item.model or DEFAULT_MODEL
    where = model if model in REGISTRY else str(engine.model_file.path)  # a registry path differs between nodes
    informative = manifest.informative.model_copy(update={"threads": 0, "timings": {}, "cpu": "", "model_path": where})
    return manifest.model_copy(update={"informative": informative})


def batch_task(state: WorkerState, item: BatchItem, *, pull: bool = False) -> BatchResult:
    """Run one batch item; bad input (a bad line, prompt, model or sampling value) is a BAD_INPUT result."""
    from ..compute.engine import Engine
    from ..model.registry import DEFAULT_MODEL
    from ..records.manifest import canonical_json

    t0 = time.perf_counter()
    if item.spec is None:
        return BatchResult(item.line, item.id, BAD_INPUT, message=item.error or "")
    try:
        model = item.spec.model or item.model or DEFAULT_MODEL
        key = (model, item.n_ctx, item.kv_type)
        if key not in state.engines:
            _ensure(model, pull)
            state.engines[key] = Engine.load(model, n_ctx=item.n_ctx, kv_type=item.kv_type)
        manifest = batch_manifest(state.engines[key], item)
    except DetinferError as e:
        return BatchResult(item.line, item.id, BAD_INPUT, message=f"{item.id}: {e}", seconds=time.perf_counter() - t0)
    return BatchResult(item.line, item.id, WRITTEN, tokens=len(manifest.output.token_ids), seconds=time.perf_counter() - t0,
                       manifest=canonical_json(manifest.sealed().model_dump(mode="json")))


class BatchWriter:
    """The driver's side of a batch: writes each manifest atomically as its result arrives (in finishing order)."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir

    def path(self, id_: str) -> Path:
        return self.out_dir / f"{id_}.json"

    def pending(self, items: list[BatchItem], resume: bool) -> tuple[list[BatchItem], list[BatchResult]]:
        """(items to run, SKIPPED results for ids already in the folder). Without ``resume`` an id already there
        is an InputError: a batch never overwrites a manifest silently."""
        done = [it for it in items if it.spec is not None and self.path(it.id).is_file()]
        if done and not resume:
            raise InputError(f"{self.out_dir} already holds {len(done)} of this batch's manifests (e.g. {self.path(done[0].id).name}); "
                             "pass --resume to skip them, or choose another --out-dir")
        skip = {it.id for it in done}
        return [it for it in items if it.id not in skip], [BatchResult(it.line, it.id, SKIPPED) for it in done]

    def write(self, result: BatchResult) -> None:
        if result.manifest is not None:
            atomic_write_text(self.path(result.id), result.manifest)
            result.manifest = None


# ------------------------------------------------------------------------------------------ verify and replay


def _registry_name_of(path: Path) -> str | None:
    """The registry model a manifest, golden record or session record names (None if none or unreadable: the
    task itself then reports what is wrong with the file)."""
    from ..model.registry import name_for_sha256

    try:
        data = load_json(path, InputError, "record")
        model = data.get("model")
        return model.get("registry_name") if isinstance(model, dict) else name_for_sha256(data.get("model_sha256"))
    except (DetinferError, AttributeError):
        return None


def verify_task(state: WorkerState, path: str, *, model: str | None = None, pull: bool = False) -> Any:
    """``verify`` of one manifest or golden record (a VerifyResult; bad input is its status, never raised)."""
    from ..records.verify import BAD_INPUT as VERIFY_BAD_INPUT
    from ..records.verify import VerifyResult, verify_file

    try:
        if model is None:
            _ensure(_registry_name_of(Path(path)), pull)
    except DetinferError as e:
        return VerifyResult(path, VERIFY_BAD_INPUT, message=str(e))
    return verify_file(Path(path), state.engines, model=model)


@dataclass
class ReplayResult:
    """``replay`` of one session file: one row per turn, or a single bad-input row."""

    path: str
    rows: list[dict]

    @property
    def status(self) -> str:
        return BAD_INPUT if any(r["result"] == BAD_INPUT for r in self.rows) else "mismatch" if any(r["differs"] for r in self.rows) else "match"

    @property
    def steps(self) -> int:
        return sum(r["steps"] for r in self.rows)


def replay_rows(state: WorkerState, path: str, *, model: str | None = None, use_cache: bool = True,
                kv_dir: Path | None = None, until: int | None = None, cache_bytes: int = 1 << 30,
                warn: Callable[[str], None] | None = None) -> list[dict]:  # fmt: skip
    """Re-execute the turns of one session file: one row per turn (session, turn, result, differs,
    first_divergent_step, reused_tokens, steps, and expected/actual (id, text) at a divergence). Raises
    DetinferError for a bad file or model."""
    from ..compute.engine import Engine
    from ..compute.prefix_cache import PrefixCache
    from ..records.session import load_session
    from ..records.replay import replay_turns

    record = load_session(path)
    key = (record.model.sha256, record.engine.n_ctx, record.engine.kv_type)
    if key not in state.engines:
        state.engines.clear()  # one model in memory at a time
        state.prefix_caches.clear()
        state.engines[key] = Engine.load(model or record.model.registry_name or record.informative.get("model_path"),
                                         n_ctx=record.engine.n_ctx, kv_type=record.engine.kv_type)
        state.prefix_caches[key] = PrefixCache(cache_bytes)
    engine = state.engines[key]
    results = replay_turns(engine, record, use_cache=use_cache, kv_dir=kv_dir, until=until,
                           prefix_cache=state.prefix_caches[key], warn=warn)
    rows = []
    for i, ((actual, diffs, step), expected) in enumerate(zip(results, record.turns), start=1):
        row = {"session": path, "turn": i, "result": "match" if not diffs else "mismatch", "differs": diffs,
               "first_divergent_step": step, "reused_tokens": actual.reused_tokens, "steps": len(actual.generated_token_ids)}
        if diffs and step is not None:
            pick = lambda ids: (ids[step], engine.tokenizer.decode([ids[step]])) if step < len(ids) else (None, "")  # noqa: E731
            row["expected"], row["actual"] = pick(expected.generated_token_ids), pick(actual.generated_token_ids)
        rows.append(row)
    return rows


def replay_task(state: WorkerState, path: str, *, pull: bool = False, **options) -> ReplayResult:
    """``replay`` of one session file; a bad file or model is one bad-input row for that file."""
    try:
        if options.get("model") is None:
            _ensure(_registry_name_of(Path(path)), pull)
        return ReplayResult(path, replay_rows(state, path, **options))
    except DetinferError as e:
        return replay_failed(path, str(e))


def session_files(paths: Sequence[Path]) -> list[Path]:
    """Session files from files and folders (a folder: its *.json, sorted). Raises InputError for a missing path
    or no files at all."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        elif p.is_file():
            files.append(p)
        elif p.exists():
            raise InputError(f"{p} is not a regular file; pass session files or folders")
        else:
            raise InputError(f"{p} does not exist; pass session files or folders")
    if not files:
        raise InputError(f"no session files (*.json) in {', '.join(map(str, paths))}")
    return files


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
    and a name (``path`` or ``id``)."""

    def __init__(self, console, verb: str, total: int, where: str):
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
        )
        from rich.progress import Progress as Bar

        self.console, self.verb, self.total, self.where = console, verb, total, where
        self.done = self.mismatches = self.bad = self.tokens = 0
        self.t0 = time.perf_counter()
        self.bar = None
        if console.is_terminal:
            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("{task.fields[mismatches]} mismatches, {task.fields[rate]} tok/s"),
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
            self.console.print(f"[{self.done}/{self.total}] {escape(str(name))}: {result.status} ({result.steps} tokens, "
                               f"{self.mismatches} mismatches so far, {self.rate():.1f} tok/s)", soft_wrap=True, markup=False)

    def close(self, interrupted: bool = False, summary: bool = True) -> None:
        if self.bar is not None:
            self.bar.stop()
        if not summary:
            return
        seconds = time.perf_counter() - self.t0
        head = "interrupted: " if interrupted else ""
        self.console.print(f"{head}{self.verb} {self.done}/{self.total} {self.where} in {seconds:.1f} s: "
                           f"{self.mismatches} mismatch, {self.bad} bad input; {self.tokens} tokens, {self.rate():.1f} tok/s",
                           soft_wrap=True, markup=False)


def verify_failed(path: str, reason: str) -> Any:
    from ..records.verify import BAD_INPUT as VERIFY_BAD_INPUT
    from ..records.verify import VerifyResult

    return VerifyResult(path, VERIFY_BAD_INPUT, message=f"{path}: {reason}")


def replay_failed(path: str, reason: str) -> ReplayResult:
    return ReplayResult(path, [{"session": path, "turn": None, "result": BAD_INPUT, "differs": [], "message": reason,
                                "first_divergent_step": None, "reused_tokens": 0, "steps": 0}])


def batch_failed(item: BatchItem, reason: str) -> BatchResult:
    return BatchResult(item.line, item.id, BAD_INPUT, message=f"{item.id}: {reason}")
