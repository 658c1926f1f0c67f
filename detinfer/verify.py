"""verify: re-execute recorded manifests and golden token streams, and report exactly what differs.

Only contract fields are compared (see manifest.py); threads, chunk size, timings and the machine are shown,
never compared. A file recorded with other numerics (detinfer/numerics.py) is a mismatch that says so. A manifest whose model is missing or has another sha256 is reported as bad input, not as a mismatch.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from pydantic import ValidationError

from .engine import Engine
from .errors import DetinferError, ManifestError
from .golden import GoldenRecord
from .kvcache import parse_kv_type
from .manifest import EngineRecord, PromptRecord, RunManifest, SamplingRecord, load_manifest, tokens_sha256
from .numerics import NUMERICS
from .registry import name_for_sha256
from .run import Difference, engine_for_manifest, excerpts, execute, reexecute

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


def collect(paths: Iterable[str | Path]) -> list[Path]:
    """Manifest files from files and folders (folders: every *.json below them, sorted).

    Raises ManifestError for a path that does not exist.
    """
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(q for q in p.rglob("*.json") if q.is_file()))
        elif p.is_file():
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
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "case" in data and "schema_version" not in data


def _golden_settings(path: Path, record: GoldenRecord) -> tuple[int, str, bool, SamplingRecord]:
    """(n_ctx, kv_type, chat, sampling) from a golden record's settings; ManifestError naming a missing or bad key."""
    settings = dict(record.settings)
    try:
        n_ctx, kv_type, chat = settings.pop("n_ctx"), settings.pop("kv_type"), settings.pop("chat")
        EngineRecord(n_ctx=n_ctx, kv_type=parse_kv_type(kv_type))  # a quantized KV type is rejected with its reason
        sampling = SamplingRecord(**settings)
    except KeyError as e:
        raise ManifestError(f"{path} is not a valid golden record: settings.{e.args[0]} is missing") from None
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ManifestError(f"{path} is not a valid golden record: settings.{loc}: {err['msg']}") from None
    if not isinstance(chat, bool):
        raise ManifestError(f"{path} is not a valid golden record: settings.chat must be true or false, got {chat!r}")
    return n_ctx, kv_type, chat, sampling


def verify_golden(path: Path, engines: dict[tuple, Engine], *, model: str | None = None) -> VerifyResult:
    """Re-run a golden token stream (golden/<case>.json) from its settings and compare tokens and text."""
    t0 = time.perf_counter()
    try:
        try:
            record = GoldenRecord.model_validate_json(path.read_text(encoding="utf-8"))
        except ValidationError as e:
            raise ManifestError(f"{path} is not a valid golden record: {e.errors()[0]['msg']}") from None
        n_ctx, kv_type, chat, sampling = _golden_settings(path, record)
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
        actual = execute(engine, prompt, sampling)
    except DetinferError as e:
        return VerifyResult(str(path), BAD_INPUT, message=str(e), seconds=time.perf_counter() - t0)
    diffs = [
        Difference(name, *excerpts(a, b)).__dict__
        for name, a, b in (("output_token_ids", record.output_token_ids, actual.output.token_ids), ("output_text", record.output_text, actual.output.text))
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


def _mismatch_message(recorded_numerics: str, fields: list[str]) -> str:
    """ "differs: ...", led by the numerics case when the file was recorded with other numerics."""
    message = "differs: " + ", ".join(fields)
    if recorded_numerics != NUMERICS:
        return (f"recorded with numerics {recorded_numerics.rsplit('/', 1)[-1]}; this detinfer computes numerics "
                f"{NUMERICS.rsplit('/', 1)[-1]} ({NUMERICS}); re-record with make manifests / make golden-update; {message}")
    return message


def verify_file(path: Path, engines: dict[tuple, Engine], *, model: str | None = None) -> VerifyResult:
    """Re-execute one manifest (or golden record). Engines are cached by (model sha256, n_ctx, kv_type)."""
    if _is_golden(path):
        return verify_golden(path, engines, model=model)
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
