"""verify: re-execute recorded manifests and golden token streams, and report exactly what differs.

Only contract fields are compared (see manifest.py); threads, chunk size, timings and the machine are shown,
never compared. A file recorded with other numerics (detinfer/numerics.py) is a mismatch that says so. A manifest whose model is missing or has another sha256 is reported as bad input, not as a mismatch.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numba
from pydantic import ValidationError

from ..compute.constrain import Constraint
from ..compute.engine import Engine
from ..compute.generate import GenerationResult, generate
from ..compute.kvcache import parse_kv_type
from ..compute.numerics import NUMERICS
from ..compute.sampling import Sampling, missing_fields
from ..errors import DetinferError, ManifestError
from ..fileio import load_json, read_json
from ..model.chat import BUILTIN_TEMPLATES, ChatTemplate
from ..model.registry import name_for_sha256
from .binding import check_stream_turns
from .manifest import (
    EngineRecord,
    PromptRecord,
    RunManifest,
    load_manifest,
    tokens_sha256,
)
from .replay import replay_turns
from .run import (
    Difference,
    engine_for_manifest,
    excerpts,
    execute,
    first_difference,
    reexecute,
)
from .session import load_session
from .tokenstream import RunStream, SessionStream

MATCH, MISMATCH, BAD_INPUT = "match", "mismatch", "bad input"


@dataclass
class Divergence:
    """The first step where outputs differ: expected vs actual token (id, text) and top-5 logits."""

    step: int
    expected_token: int | None
    actual_token: int | None
    expected_text: str
    actual_text: str
    expected_top: list = field(default_factory=list)
    actual_top: list = field(default_factory=list)


@dataclass
class VerifyResult:
    path: str
    status: str
    model: str = ""
    steps: int = 0
    seconds: float = 0.0
    message: str = ""
    differences: list[dict] = field(default_factory=list)
    divergence: Divergence | None = None
    threads: int | None = None
    recorded_on: dict[str, str] = field(default_factory=dict)  # detinfer.machine.machine() of the recording
    reexecuted_on: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "divergence"}
        d["divergence"] = self.divergence.__dict__ if self.divergence else None
        return d

    def report(self) -> list[str]:
        """What differs, as plain lines (empty for a match): the message, each differing field, the first
        divergent step with the expected and actual token, and the top-5 logits there."""
        if self.status == MATCH:
            return []
        lines = [self.message.removeprefix(f"{self.path}: ")]  # load errors name the file already
        lines += [f"  {d['field']}: expected {d['expected']} got {d['actual']}" for d in self.differences]
        if (dv := self.divergence) is not None:
            lines.append(f"  first divergent step {dv.step}: expected token {dv.expected_token} {dv.expected_text}, "
                         f"got {dv.actual_token} {dv.actual_text}")
            if dv.expected_top or dv.actual_top:
                lines += [f"  top-5 expected {dv.expected_top}", f"  top-5 actual   {dv.actual_top}"]
        return lines


def collect(paths: Iterable[str | Path]) -> list[Path]:
    """Manifest files from files and folders (folders: every *.json below them, sorted).

    Raises ManifestError for a path that does not exist.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*.json") if q.is_file()))
        elif os.path.lexists(p):  # a file, or something that is not (reported as bad input by verify_file)
            files.append(p)
        else:
            raise ManifestError(f"{p} does not exist; pass manifest files or folders")
    return files


def _divergence(engine: Engine, et: list[int], expected_top: list, actual: RunManifest, step: int | None) -> Divergence | None:
    """First divergent step (the first differing logits digest if known, else the first differing token)."""
    at = actual.output.token_ids
    if step is None:
        step = next((i for i in range(max(len(et), len(at))) if i >= len(et) or i >= len(at) or et[i] != at[i]), None)
    if step is None:
        return None
    tok = engine.tokenizer

    def token(ids, i):
        return (ids[i], repr(tok.decode([ids[i]]))) if i < len(ids) else (None, "(none)")

    (e_id, e_text), (a_id, a_text) = token(et, step), token(at, step)
    top = lambda tops: [list(x) for x in tops[step]] if step < len(tops) else []  # noqa: E731
    return Divergence(step, e_id, a_id, e_text, a_text, top(expected_top), top(actual.output.top_logits))


def _is_golden(path: Path) -> bool:
    try:
        data = load_json(path, ManifestError, "manifest")
    except DetinferError:
        return False  # load_manifest reports it
    return isinstance(data, dict) and "output_token_ids" in data and "schema_version" not in data


def _golden_settings(path: Path, record: RunStream) -> tuple[int, str, bool, Sampling, Constraint | None]:
    """(n_ctx, kv_type, chat, sampling, constraint) from a golden record's settings; ManifestError naming a missing or
    bad key."""
    settings = dict(record.settings)
    try:
        n_ctx, kv_type, chat = settings.pop("n_ctx"), settings.pop("kv_type"), settings.pop("chat")
        EngineRecord(n_ctx=n_ctx, kv_type=parse_kv_type(kv_type))  # a quantized KV type is rejected with its reason
        constraint = Constraint.model_validate(settings.pop("constraint")) if "constraint" in settings else None
        if missing := missing_fields(settings):  # a record states every option
            raise KeyError(missing[0])
        sampling = Sampling.model_validate(settings)
    except KeyError as e:
        raise ManifestError(f"{path} is not a valid golden record: settings.{e.args[0]} is missing") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ManifestError(f"{path} is not a valid golden record: settings.{loc}: {err['msg']}") from None
    if not isinstance(chat, bool):
        raise ManifestError(f"{path} is not a valid golden record: settings.chat must be true or false, got {chat!r}")
    if constraint is not None:
        constraint.check_sha256()
    return n_ctx, kv_type, chat, sampling, constraint


def verify_golden(path: Path, engines: dict[tuple, Engine], *, model: str | None = None) -> VerifyResult:
    """Re-run a golden token stream (golden/<case>.json, or a pytest snapshot of a run) from its settings and compare
    tokens, text and stop reason."""
    t0 = time.perf_counter()
    try:
        try:
            record = RunStream.model_validate(load_json(path, ManifestError, "golden record"))
        except ValidationError as e:
            raise ManifestError(f"{path} is not a valid golden record: {e.errors()[0]['msg']}") from None
        n_ctx, kv_type, chat, sampling, constraint = _golden_settings(path, record)
        key = (record.model_sha256, n_ctx, kv_type)
        if key not in engines:  # a golden record names its model by sha256 only: the registry knows which that is
            source = model if model is not None else name_for_sha256(record.model_sha256)
            engine = Engine.load(source, n_ctx=key[1], kv_type=key[2])
            if engine.model_file.sha256 != record.model_sha256:
                raise ManifestError(
                    f"{path} was recorded with model sha256 {record.model_sha256[:16]}..., not "
                    f"{engine.model_file.path.name}; pass that model with --model"
                )
            engines[key] = engine
        engine = engines[key]
        ids = record.prompt_token_ids
        prompt = PromptRecord(text=None, chat=chat, rendered="", token_ids=ids, tokens_sha256=tokens_sha256(ids))
        actual = execute(engine, prompt, sampling, constraint=constraint)
    except DetinferError as e:
        return VerifyResult(str(path), BAD_INPUT, message=str(e), seconds=time.perf_counter() - t0)
    diffs = [
        Difference(name, *excerpts(a, b)).__dict__
        for name, a, b in (("output_token_ids", record.output_token_ids, actual.output.token_ids), ("output_text", record.output_text, actual.output.text),
                           ("stop_reason", record.stop_reason, actual.output.stop_reason))
        if a != b
    ]
    if record.numerics != NUMERICS:
        diffs.insert(0, Difference("numerics", record.numerics, NUMERICS).__dict__)
    result = VerifyResult(str(path), MISMATCH if diffs else MATCH, model=engine.model_file.path.name, steps=len(record.output_token_ids),
                          seconds=time.perf_counter() - t0, differences=diffs, threads=actual.informative.threads,
                          reexecuted_on=actual.informative.machine)
    if diffs:
        result.divergence = _divergence(engine, record.output_token_ids, [], actual, None)
        result.message = _mismatch_message(record.numerics, [d["field"] for d in diffs])
    return result


def _is_session(path: Path) -> bool:
    """A session record (``session run --out``, ``serve --record``) or a session snapshot (its token stream)."""
    try:
        data = load_json(path, ManifestError, "session record")
    except DetinferError:
        return False
    return isinstance(data, dict) and "turns" in data


def _session_engine(engines: dict[tuple, Engine], sha256: str, n_ctx: int, kv_type: str, source, path: Path) -> Engine:
    key = (sha256, n_ctx, kv_type)
    if key not in engines:
        engine = Engine.load(source, n_ctx=n_ctx, kv_type=kv_type)
        if engine.model_file.sha256 != sha256:
            raise ManifestError(f"{path} was recorded with model sha256 {sha256[:16]}..., not {engine.model_file.path.name}; "
                                "pass that model with --model")
        engines[key] = engine
    return engines[key]


def verify_session(path: Path, engines: dict[tuple, Engine], *, model: str | None = None) -> VerifyResult:
    """Re-execute every turn of a session record (all its hashes compared, as ``detinfer replay``) or of a session
    snapshot (token ids, text and stop reason); the first differing turn is reported."""
    t0 = time.perf_counter()
    try:
        data = read_json(path, ManifestError, "session")
        if "schema_version" in data:
            record = load_session(path)
            source = model or record.model.registry_name or record.informative.get("model_path")
            engine = _session_engine(engines, record.model.sha256, record.engine.n_ctx, record.engine.kv_type, source, path)
            expected = [(t.generated_token_ids, t.text, t.stop_reason) for t in record.turns]
            turns = [(actual.generated_token_ids, actual.text, actual.stop_reason, diffs)
                     for actual, diffs, _ in replay_turns(engine, record, use_cache=True)]
        else:
            stream = SessionStream.model_validate(data)
            settings = stream.settings
            engine = _session_engine(engines, stream.model_sha256, settings["n_ctx"], settings["kv_type"],
                                     model or name_for_sha256(stream.model_sha256), path)
            expected = [(t.output_token_ids, t.output_text, t.stop_reason) for t in stream.turns]
            check_stream_turns(engine, _stream_template(engine, settings.get("chat_template_sha256"), path), stream.turns)
            turns = replay_stream(engine, stream)
    except ValidationError as e:
        return VerifyResult(str(path), BAD_INPUT, message=f"{path} is not a valid session snapshot: {e.errors()[0]['msg']}",
                            seconds=time.perf_counter() - t0)
    except KeyError as e:
        return VerifyResult(str(path), BAD_INPUT, message=f"{path} is not a valid session snapshot: {e.args[0]!r} is missing",
                            seconds=time.perf_counter() - t0)
    except DetinferError as e:
        return VerifyResult(str(path), BAD_INPUT, message=str(e), seconds=time.perf_counter() - t0)
    result = VerifyResult(str(path), MATCH, model=engine.model_file.path.name, steps=sum(len(e[0]) for e in expected),
                          seconds=time.perf_counter() - t0, threads=numba.get_num_threads())
    for i, ((e_ids, e_text, e_stop), (a_ids, a_text, a_stop, diffs)) in enumerate(zip(expected, turns), start=1):
        if diffs:
            result.status, result.message = MISMATCH, f"turn {i} differs: {', '.join(diffs)}"
            result.differences = [Difference(f"turn {i}.{name}", *excerpts(a, b)).__dict__
                                  for name, a, b in (("output_token_ids", e_ids, a_ids), ("text", e_text, a_text), ("stop_reason", e_stop, a_stop)) if a != b]
            step = first_difference(e_ids, a_ids)
            if step is not None:
                pick = lambda ids: (ids[step], repr(engine.tokenizer.decode([ids[step]]))) if step < len(ids) else (None, "(none)")  # noqa: E731
                (e_id, e_tok), (a_id, a_tok) = pick(e_ids), pick(a_ids)
                result.divergence = Divergence(step, e_id, a_id, e_tok, a_tok)
            break
    return result


def _stream_template(engine: Engine, sha256: str | None, path: Path) -> ChatTemplate:
    """The chat template a session snapshot names by sha256: the model's own or a built-in format (a snapshot does not
    keep a template's text); ManifestError for any other, whose messages could not be checked."""
    candidates = [engine.chat_template] + [ChatTemplate.builtin(name) for name in BUILTIN_TEMPLATES]
    found = next((t for t in candidates if t is not None and t.hash == sha256), None)
    if found is None:
        raise ManifestError(f"{path}: the snapshot's chat template {str(sha256)[:16]}... is neither the model's nor a built-in "
                            "format, so its messages cannot be checked against its tokens")  # fmt: skip
    return found


def replay_stream(engine: Engine, stream: SessionStream) -> list[tuple[list[int], str, str, list[str]]]:
    """Run a session snapshot's turns again from their recorded token ids (each turn's prompt is the history plus
    its appended ids, on one KV cache): per turn (output ids, text, stop reason, fields that differ)."""
    history, cache, turns = [], engine.new_cache(), []
    for turn in stream.turns:
        prompt = history + turn.prompt_token_ids
        res = GenerationResult()
        for _ in generate(engine, prompt, Sampling.create(**turn.sampling), cache=cache, result=res):
            pass
        got = (res.tokens, res.text, res.stop_reason)
        diffs = [f for f, a, b in zip(("output_token_ids", "text", "stop_reason"), (turn.output_token_ids, turn.output_text, turn.stop_reason), got) if a != b]
        turns.append((*got, diffs))
        history = prompt + res.tokens
    return turns


def _mismatch_message(recorded_numerics: str, fields: list[str]) -> str:
    """ "differs: ...", led by the numerics case when the file was recorded with other numerics."""
    message = "differs: " + ", ".join(fields)
    if recorded_numerics != NUMERICS:
        return (f"recorded with numerics {recorded_numerics.rsplit('/', 1)[-1]}; this detinfer computes numerics "
                f"{NUMERICS.rsplit('/', 1)[-1]} ({NUMERICS}); re-record with make manifests / make golden-update; {message}")
    return message


def verify_file(path: Path, engines: dict[tuple, Engine], *, model: str | None = None) -> VerifyResult:
    """Re-execute one manifest, golden record or session. Engines are cached by (model sha256, n_ctx, kv_type)."""
    if _is_golden(path):
        return verify_golden(path, engines, model=model)
    if _is_session(path):
        return verify_session(path, engines, model=model)
    t0 = time.perf_counter()
    try:
        manifest = load_manifest(path)
        key = (manifest.model.sha256, manifest.engine.n_ctx, manifest.engine.kv_type)
        if key not in engines:
            engines[key] = engine_for_manifest(manifest, model)
        engine = engines[key]
        actual, comparison = reexecute(manifest, engine)
    except DetinferError as e:
        return VerifyResult(str(path), BAD_INPUT, message=str(e), seconds=time.perf_counter() - t0)
    result = VerifyResult(
        str(path),
        MATCH if comparison.match else MISMATCH,
        model=manifest.model.registry_name or manifest.model.file_name,
        steps=len(manifest.output.token_ids),
        seconds=time.perf_counter() - t0,
        differences=[d.__dict__ for d in comparison.differences],
        threads=actual.informative.threads,
        recorded_on=manifest.informative.machine,
        reexecuted_on=actual.informative.machine,
    )
    if not comparison.match:
        result.divergence = _divergence(engine, manifest.output.token_ids, manifest.output.top_logits, actual, comparison.first_divergent_step)
        result.message = _mismatch_message(manifest.recorded_numerics(), [d.field for d in comparison.differences])
    return result


def verify(paths: Iterable[str | Path], *, model: str | None = None, on_result: Callable[[VerifyResult], None] | None = None) -> list[VerifyResult]:
    """Verify every manifest under ``paths``; returns one result per file (in order)."""
    engines: dict[tuple, Engine] = {}
    results = []
    for path in collect(paths):
        r = verify_file(path, engines, model=model)
        results.append(r)
        if on_result:
            on_result(r)
    return results


def exit_code(results: list[VerifyResult]) -> int:
    """2 if any file is bad input, else 1 if any mismatch, else 0."""
    if any(r.status == BAD_INPUT for r in results):
        return 2
    return 1 if any(r.status == MISMATCH for r in results) else 0


def summary(results: list[VerifyResult]) -> dict:
    return {
        "summary": True,
        "files": len(results),
        "match": sum(r.status == MATCH for r in results),
        "mismatch": sum(r.status == MISMATCH for r in results),
        "bad_input": sum(r.status == BAD_INPUT for r in results),
        "exit_code": exit_code(results),
    }


def to_json_lines(results: list[VerifyResult]) -> str:
    return "\n".join([json.dumps(r.to_json(), sort_keys=True) for r in results] + [json.dumps(summary(results), sort_keys=True)])
