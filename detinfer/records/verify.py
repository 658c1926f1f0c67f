"""Re-executing records: every kind of recorded file (records/reader.py) run again and compared with what it
recorded, into one :class:`~detinfer.records.outcome.Outcome` (match, mismatch or bad input, with the report).

Only contract fields are compared (records/manifest.py); threads, chunk size, timings and the machine are shown,
never compared. A file recorded with other numerics (compute/numerics.py) is a mismatch that says so. A file whose
model is missing or has another sha256, or whose messages do not bind to its tokens (records/binding.py), is bad
input, not a mismatch. ``verify``, ``replay``, ``run --manifest``, the Python API and the Ray fan-out all call
:func:`reexecute`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numba

from ..compute.engine import DEFAULT_CHUNK, Engine
from ..compute.generate import GenerationResult, Step, generate
from ..compute.lockstep import DEFAULT_BATCH, check_batch, lockstep
from ..compute.numerics import NUMERICS
from ..compute.prefix_cache import PrefixCache
from ..compute.sampling import Sampling
from ..errors import DetinferError, ManifestError
from ..model.chat import BUILTIN_TEMPLATES, ChatTemplate
from ..model.registry import name_for_sha256
from .binding import check_stream_turns
from .engines import EngineCache
from .manifest import PromptRecord, RunManifest, tokens_sha256
from .outcome import BAD_INPUT, MATCH, MISMATCH, Divergence, Outcome, bad_input
from .reader import Record, collect, read_record
from .replay import replay_turns
from .run import Difference, excerpts, execute, first_difference, reexecute_manifest
from .tokenstream import SessionStream


@dataclass(frozen=True)
class ReplayOptions:
    """How sessions are replayed: ``use_cache`` False recomputes every prefix from scratch; ``kv_dir`` restores each
    turn's prefix from its saved .detkv snapshot; ``until`` replays only the first N turns; ``warn`` is told of a
    snapshot that was not used; ``chunk_size`` / ``on_step`` apply to a run manifest's re-execution; ``speculate``
    re-executes with a drafter (compute.speculate; same bytes)."""

    use_cache: bool = True
    kv_dir: Path | None = None
    until: int | None = None
    warn: Callable[[str], None] | None = None
    chunk_size: int = DEFAULT_CHUNK  # prefill chunk of a manifest's re-execution (never changes a result)
    on_step: Callable[[Step], None] | None = None  # each step of a manifest's re-execution, as it is produced
    speculate: str | None = None


def _token(engine: Engine, ids: list[int], i: int) -> tuple[int | None, str]:
    return (ids[i], repr(engine.tokenizer.decode([ids[i]]))) if i < len(ids) else (None, "(none)")


def _divergence(engine: Engine, expected: list[int], actual: list[int], step: int | None, expected_top: list = (),
                actual_top: list = ()) -> Divergence | None:  # fmt: skip
    """The first divergent step (the given one, else the first differing token) with both tokens and top-5 logits."""
    step = first_difference(expected, actual) if step is None else step
    if step is None:
        return None
    top = lambda tops: [list(x) for x in tops[step]] if step < len(tops) else []  # noqa: E731
    (e_id, e_text), (a_id, a_text) = _token(engine, expected, step), _token(engine, actual, step)
    return Divergence(step, e_id, a_id, e_text, a_text, top(expected_top), top(actual_top))


def _mismatch_message(recorded_numerics: str, fields: list[str]) -> str:
    """ "differs: ...", led by the numerics case when the file was recorded with other numerics."""
    message = "differs: " + ", ".join(fields)
    if recorded_numerics != NUMERICS:
        return (f"recorded with numerics {recorded_numerics.rsplit('/', 1)[-1]}; this detinfer computes numerics "
                f"{NUMERICS.rsplit('/', 1)[-1]} ({NUMERICS}); re-record with make manifests / make golden-update; {message}")
    return message


def _manifest(record: Record, engine: Engine, options: ReplayOptions) -> Outcome:
    manifest: RunManifest = record.body
    actual, comparison = reexecute_manifest(manifest, engine, chunk_size=options.chunk_size, on_step=options.on_step,
                                            speculate=options.speculate)
    out = Outcome(str(record.path), MATCH if comparison.match else MISMATCH, model=manifest.model.registry_name or manifest.model.file_name,
                  steps=len(manifest.output.token_ids),
                  differences=[d.__dict__ for d in comparison.differences], threads=actual.informative.threads,
                  recorded_on=manifest.informative.machine, reexecuted_on=actual.informative.machine, reexecuted=actual)  # fmt: skip
    if not comparison.match:
        out.divergence = _divergence(engine, manifest.output.token_ids, actual.output.token_ids, comparison.first_divergent_step,
                                     manifest.output.top_logits, actual.output.top_logits)  # fmt: skip
        out.message = _mismatch_message(manifest.recorded_numerics(), [d.field for d in comparison.differences])
    return out


def _golden(record: Record, engine: Engine, _: ReplayOptions) -> Outcome:
    stream, g = record.body, record.golden
    ids = stream.prompt_token_ids
    prompt = PromptRecord(text=None, chat=g.chat, rendered="", token_ids=ids, tokens_sha256=tokens_sha256(ids))
    actual = execute(engine, prompt, g.sampling, constraint=g.constraint)
    diffs = [Difference(name, *excerpts(a, b)).__dict__ for name, a, b in (
        ("output_token_ids", stream.output_token_ids, actual.output.token_ids), ("output_text", stream.output_text, actual.output.text),
        ("stop_reason", stream.stop_reason, actual.output.stop_reason)) if a != b]  # fmt: skip
    if stream.numerics != NUMERICS:
        diffs.insert(0, Difference("numerics", stream.numerics, NUMERICS).__dict__)
    out = Outcome(str(record.path), MISMATCH if diffs else MATCH, steps=len(stream.output_token_ids), differences=diffs,
                  threads=actual.informative.threads, reexecuted_on=actual.informative.machine)  # fmt: skip
    if diffs:
        out.divergence = _divergence(engine, stream.output_token_ids, actual.output.token_ids, None, [], actual.output.top_logits)
        out.message = _mismatch_message(stream.numerics, [d["field"] for d in diffs])
    return out


def _turn_outcome(out: Outcome, engine: Engine, rows: list[dict], expected: list[tuple[list[int], str, str]],
                  actual: list[tuple[list[int], str, str]]) -> Outcome:  # fmt: skip
    """Fill ``out`` from per-turn rows: the first differing turn names the mismatch."""
    out.turns, out.steps = rows, sum(len(e[0]) for e in expected)
    for i, (row, (e_ids, e_text, e_stop), (a_ids, a_text, a_stop)) in enumerate(zip(rows, expected, actual), start=1):
        if row["differs"]:
            out.status, out.message = MISMATCH, f"turn {i} differs: {', '.join(row['differs'])}"
            out.differences = [Difference(f"turn {i}.{name}", *excerpts(a, b)).__dict__
                               for name, a, b in (("output_token_ids", e_ids, a_ids), ("text", e_text, a_text), ("stop_reason", e_stop, a_stop))
                               if a != b]  # fmt: skip
            out.divergence = _divergence(engine, e_ids, a_ids, None)
            break
    return out


def _session(record: Record, engine: Engine, options: ReplayOptions, prefix_cache: PrefixCache) -> Outcome:
    body = record.body
    results = replay_turns(engine, body, use_cache=options.use_cache, kv_dir=options.kv_dir, until=options.until,
                           warn=options.warn, prefix_cache=prefix_cache if options.use_cache else None,
                           speculate=options.speculate)  # fmt: skip
    rows, expected, actual = [], [], []
    for i, ((got, diffs, step), want) in enumerate(zip(results, body.turns), start=1):
        row = {"turn": i, "result": "match" if not diffs else "mismatch", "differs": diffs, "first_divergent_step": step,
               "reused_tokens": got.reused_tokens, "steps": len(got.generated_token_ids)}  # fmt: skip
        if diffs and step is not None:
            row["expected"], row["actual"] = (_token(engine, want.generated_token_ids, step), _token(engine, got.generated_token_ids, step))
        rows.append(row)
        expected.append((want.generated_token_ids, want.text, want.stop_reason))
        actual.append((got.generated_token_ids, got.text, got.stop_reason))
    out = Outcome(str(record.path), MATCH, threads=numba.get_num_threads(), recorded_on=body.informative.get("machine", {}))
    return _turn_outcome(out, engine, rows, expected, actual)


def _stream_template(engine: Engine, sha256: str | None, path: Path) -> ChatTemplate:
    """The chat template a session snapshot names by sha256: the model's own or a built-in format (a snapshot does not
    keep a template's text); ManifestError for any other, whose messages could not be checked."""
    candidates = [engine.chat_template] + [ChatTemplate.builtin(name) for name in BUILTIN_TEMPLATES]
    found = next((t for t in candidates if t is not None and t.hash == sha256), None)
    if found is None:
        raise ManifestError(f"{path}: the snapshot's chat template {str(sha256)[:16]}... is neither the model's nor a built-in "
                            "format, so its messages cannot be checked against its tokens")  # fmt: skip
    return found


def _session_snapshot(record: Record, engine: Engine, _: ReplayOptions) -> Outcome:
    """A session snapshot's turns run again from their recorded token ids (each turn's prompt is the history plus its
    appended ids, on one KV cache), after its messages were checked against those ids."""
    stream: SessionStream = record.body
    check_stream_turns(engine, _stream_template(engine, stream.settings.get("chat_template_sha256"), record.path), stream.turns)
    history, cache, rows, expected, actual = [], engine.new_cache(), [], [], []
    for i, turn in enumerate(stream.turns, start=1):
        prompt = history + turn.prompt_token_ids
        res = GenerationResult()
        for _ in generate(engine, prompt, Sampling.create(**turn.sampling), cache=cache, result=res):
            pass
        want, got = (turn.output_token_ids, turn.output_text, turn.stop_reason), (res.tokens, res.text, res.stop_reason)
        diffs = [f for f, a, b in zip(("output_token_ids", "text", "stop_reason"), want, got) if a != b]
        rows.append({"turn": i, "result": "mismatch" if diffs else "match", "differs": diffs,
                     "first_divergent_step": first_difference(want[0], got[0]), "reused_tokens": 0, "steps": len(res.tokens)})  # fmt: skip
        expected.append(want)
        actual.append(got)
        history = prompt + res.tokens
    return _turn_outcome(Outcome(str(record.path), MATCH, threads=numba.get_num_threads()), engine, rows, expected, actual)


_KINDS = {"manifest": _manifest, "golden": _golden, "session-snapshot": _session_snapshot}


def _reexecute_on(record: Record, engine: Engine, options: ReplayOptions, prefix_cache: PrefixCache) -> Outcome:
    """:func:`reexecute` on ``engine`` (the record's, or a lockstep view of it), sessions reusing ``prefix_cache``."""
    t0 = time.perf_counter()
    try:
        if record.kind == "session":
            out = _session(record, engine, options, prefix_cache)
        else:
            out = _KINDS[record.kind](record, engine, options)
    except DetinferError as e:
        return _bad_record(record, e, time.perf_counter() - t0)
    out.kind, out.seconds = record.kind, time.perf_counter() - t0
    out.model = out.model or name_for_sha256(record.model_sha256) or engine.model_file.path.name
    return out


def _bad_record(record: Record, e: DetinferError, seconds: float = 0.0) -> Outcome:
    """The bad-input outcome of a record that was read, with the model it names (a missing model's row says which)."""
    named = name_for_sha256(record.model_sha256) or next((Path(n).name for n in record.model_names), "")
    return bad_input(str(record.path), str(e), seconds, model=named)


def reexecute(record: Record, engines: EngineCache, options: ReplayOptions = ReplayOptions()) -> Outcome:
    """Run ``record`` again on its model (from ``engines``) and compare; bad input (a missing model, a record that does
    not bind) is the outcome's status, never raised."""
    try:
        engine = engines.for_record(record)
    except DetinferError as e:
        return _bad_record(record, e)
    return _reexecute_on(record, engine, options, engines.prefix_cache(engine))


def reexecute_all(items: Sequence[Record | Outcome], engines: EngineCache, options: ReplayOptions = ReplayOptions(), *,
                  batch: int = DEFAULT_BATCH, on_result: Callable[[Outcome], None] | None = None) -> list[Outcome]:  # fmt: skip
    """:func:`reexecute` of every record (an Outcome: a file that could not be read, kept as it is), one outcome per
    item in order. The records of one model are re-executed in lockstep, ``batch`` of them per forward step
    (compute/lockstep.py; 1: one after another): the same outcomes either way, except for the timings and a session's
    ``reused_tokens`` (sessions run beside each other cannot reuse what the others have not computed yet).
    ``on_result`` is called with each outcome as it is ready (in finishing order). InputError for a ``batch`` below 1."""
    check_batch(batch)
    outcomes: list[Outcome | None] = [None] * len(items)

    def done(i: int, outcome: Outcome) -> None:
        outcomes[i] = outcome
        if on_result is not None:
            on_result(outcome)

    if batch == 1:
        for i, item in enumerate(items):
            done(i, item if isinstance(item, Outcome) else reexecute(item, engines, options))
        return outcomes
    groups: dict[tuple, list[int]] = {}  # records by the engine they run on (EngineCache.for_record's key)
    for i, item in enumerate(items):
        if isinstance(item, Outcome):
            done(i, item)
        else:
            groups.setdefault((item.model_sha256, item.n_ctx, item.kv_type), []).append(i)
    for indices in groups.values():
        runs = []
        for i in indices:
            try:
                runs.append((i, engines.for_record(items[i])))
            except DetinferError as e:
                done(i, _bad_record(items[i], e))
        if runs:
            engine = runs[0][1]
            tasks = [partial(_reexecute_on, items[i], options=options, prefix_cache=engines.prefix_cache(engine)) for i, _ in runs]
            def finished(k: int, outcome: Outcome) -> None:
                outcome.overlapped = len(runs) > 1  # lockstep runs synchronously: ``runs`` is this group's
                done(runs[k][0], outcome)

            lockstep(engine, tasks, batch=batch, on_result=finished)
    return outcomes


def read_all(paths: Iterable[str | Path]) -> list[Record | Outcome]:
    """The record of every path, read once, or the bad-input outcome of a file that cannot be read."""
    items: list[Record | Outcome] = []
    for path in paths:
        try:
            items.append(read_record(path))
        except DetinferError as e:
            items.append(bad_input(str(path), str(e)))
    return items


def reexecute_file(path: str | os.PathLike, engines: EngineCache, options: ReplayOptions = ReplayOptions()) -> Outcome:
    """:func:`reexecute` of the record at ``path``, read once; a file that cannot be read is a bad-input outcome."""
    return reexecute_all(read_all([path]), engines, options, batch=1)[0]


def verify(paths: Iterable[str | Path], *, model: str | None = None, options: ReplayOptions = ReplayOptions(),
           on_result: Callable[[Outcome], None] | None = None, rederive: bool = False,
           batch: int = DEFAULT_BATCH) -> list[Outcome]:  # fmt: skip
    """Re-execute every record under ``paths`` (files, or folders searched for ``*.json``): one outcome per file, in
    order, ``batch`` records of a model per forward step (:func:`reexecute_all`). ``model`` overrides the recorded
    model's file; ``rederive`` loads every model from its GGUF alone (:class:`EngineCache`). Raises ManifestError for
    a path that does not exist, InputError for a ``batch`` below 1."""
    check_batch(batch)
    return reexecute_all(read_all(collect(paths)), EngineCache(model, rederive=rederive), options, batch=batch, on_result=on_result)


__all__ = ["BAD_INPUT", "MATCH", "MISMATCH", "Outcome", "ReplayOptions", "read_all", "reexecute", "reexecute_all",
           "reexecute_file", "verify"]
