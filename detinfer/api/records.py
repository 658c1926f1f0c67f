"""Re-executing records from Python: verify files (manifests, golden streams, snapshots, sessions), replay sessions
turn by turn, re-run one manifest, branch a session, inspect a .detkv file, run the determinism self-test."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

from ..compute.engine import DEFAULT_CHUNK, check_chunk_size, set_threads
from ..compute.generate import Step
from ..compute.lockstep import DEFAULT_BATCH, check_batch
from ..compute.prefix_cache import PrefixCache
from ..compute.speculate import check_speculate
from ..errors import InputError
from ..records.engines import EngineCache
from ..records.kvfile import inspect_kv
from ..records.machine import describe as describe_machine
from ..records.machine import short as short_machine
from ..records.outcome import (
    BAD_INPUT,
    MATCH,
    MISMATCH,
    Outcome,
    exit_code,
    summary,
    to_json_lines,
)
from ..records.reader import collect, collect_sessions, read_record
from ..records.replay import branch as branch_record
from ..records.selftest import Row, matrix
from ..records.selftest import ok as selftest_ok
from ..records.session import SessionRecord, load_script, load_session
from ..records.verify import ReplayOptions, read_all, reexecute, reexecute_all
from ..records.verify import verify as verify_paths

VerifyResult = Outcome  # the name of earlier releases

__all__ = ["BAD_INPUT", "DEFAULT_BATCH", "MATCH", "MISMATCH", "Outcome", "ReplayOptions", "VerifyResult", "branch", "collect", "collect_sessions",
           "describe_machine", "exit_code", "inspect_kv", "load_script", "read_all", "replay", "rerun", "selftest", "selftest_ok",
           "short_machine", "summary", "to_json_lines", "verify"]


def _paths(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list:
    return [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)


def verify(paths: str | os.PathLike | Iterable[str | os.PathLike], *, model: str | os.PathLike | None = None,
           threads: int | None = None, on_result: Callable[[Outcome], None] | None = None, rederive: bool = False,
           batch: int = DEFAULT_BATCH) -> list[Outcome]:  # fmt: skip
    """Re-execute recorded files: run manifests, golden / snapshot token streams and session records (files, or
    folders searched for ``*.json``), each read once, and compare what the determinism contract covers. Returns one
    :class:`~detinfer.records.outcome.Outcome` per file, in order: ``status`` is "match", "mismatch" or "bad input" (a
    missing model, an edited record...), ``report()`` the lines saying what differs, ``turns`` a session's rows.
    ``model`` overrides the recorded model's file (its sha256 must match). ``on_result`` is called with each result
    as it is ready. ``rederive`` loads every model from its GGUF alone, using no derived file (see :func:`load`).
    ``batch``: the records of one model re-executed per forward step (lockstep; 1: one after another), never changing
    an outcome (only timings and a session's reused_tokens). Raises ManifestError for a path that does not exist,
    InputError for a bad ``threads`` or ``batch``."""
    set_threads(threads)
    return verify_paths(_paths(paths), model=None if model is None else str(model), on_result=on_result, rederive=rederive,
                        batch=batch)


def replay(paths: str | os.PathLike | Iterable[str | os.PathLike], *, model: str | os.PathLike | None = None,
           threads: int | None = None, use_cache: bool = True, kv_dir: str | os.PathLike | None = None,
           until: int | None = None, cache_bytes: int = 1 << 30, warn: Callable[[str], None] | None = None,
           on_result: Callable[[Outcome], None] | None = None, rederive: bool = False,
           speculate: str | None = None, batch: int = DEFAULT_BATCH) -> list[Outcome]:  # fmt: skip
    """Re-execute every turn of recorded sessions (files, or folders of ``*.json``): one Outcome per file with a row
    per turn (``turns``; ``rows()`` as ``detinfer replay --json`` prints them). ``use_cache`` False recomputes every
    prefix; ``kv_dir`` restores each turn's prefix from its .detkv snapshot and ``until`` replays the first N turns
    (both: one file); ``rederive`` as in :func:`verify` (not the prefix reuse ``use_cache`` is about); ``speculate``
    ("ngram") re-executes with speculative decoding (same bytes, see :func:`load`); ``batch`` as in :func:`verify`.
    InputError for a path that is not a session file or folder, or a bad option."""
    set_threads(threads)
    check_speculate(speculate)
    check_batch(batch)
    files = collect_sessions(_paths(paths))
    if (kv_dir is not None or until is not None) and len(files) > 1:
        raise InputError("--until, --then and --kv-dir apply to one session file, not a folder")
    if until is not None:
        turns = len(load_session(files[0]).turns)
        if not 1 <= until <= turns:
            raise InputError(f"--until {until} is out of range; the session has {turns} turns")
    options = ReplayOptions(use_cache=use_cache, kv_dir=None if kv_dir is None else Path(kv_dir), until=until, warn=warn,
                            speculate=speculate)
    engines = EngineCache(None if model is None else str(model), cache_bytes=cache_bytes, rederive=rederive)
    return reexecute_all(read_all(files), engines, options, batch=batch, on_result=on_result)


def rerun(path: str | os.PathLike, *, model: str | os.PathLike | None = None, threads: int | None = None,
          chunk_size: int = DEFAULT_CHUNK, on_step: Callable[[Step], None] | None = None,
          warm_up: Callable[[Callable[[], None]], None] | None = None, rederive: bool = False,
          speculate: str | None = None) -> Outcome:  # fmt: skip
    """Re-execute one run manifest from its recorded inputs (``detinfer run --manifest``), streaming its steps to
    ``on_step``: the Outcome (``reexecuted``: the new run's manifest, to save). ``chunk_size`` never changes a result;
    ``warm_up(compile)``, if given, runs the kernels' compile-or-load pass (the CLI shows a status around it);
    ``rederive`` as in :func:`verify`; ``speculate`` as in :func:`replay`.
    Raises DetinferError if the file is not a valid run manifest or its model cannot be loaded."""
    set_threads(threads)
    check_chunk_size(chunk_size)
    check_speculate(speculate)
    record = read_record(path, "manifest")
    if record.kind != "manifest":
        raise InputError(f"{path} is a {record.kind}, not a run manifest; re-execute it with detinfer "
                         f"{'replay' if record.kind.startswith('session') else 'verify'}")
    engines = EngineCache(None if model is None else str(model), rederive=rederive)
    engine = engines.for_record(record)
    (warm_up or (lambda compile_: compile_()))(engine.warm_up)
    out = reexecute(record, engines, ReplayOptions(chunk_size=chunk_size, on_step=on_step, speculate=speculate))
    if out.status == BAD_INPUT:
        raise InputError(out.message)
    return out


def branch(path: str | os.PathLike, until: int, script: str | os.PathLike, *, out: str | os.PathLike,
           model: str | os.PathLike | None = None, threads: int | None = None, cache_bytes: int = 1 << 30,
           on_step: Callable[[Step], None] | None = None, on_turn: Callable[[int, Any], None] | None = None,
           rederive: bool = False) -> SessionRecord:  # fmt: skip
    """Replay the first ``until`` turns of the session at ``path`` exactly, then run ``script``'s turns after them,
    writing the new session to ``out`` after every turn (``detinfer replay --until N --then SCRIPT --out FILE``);
    ``rederive`` as in :func:`verify`."""
    set_threads(threads)
    record = read_record(path)
    if record.kind != "session":
        raise InputError(f"{path} is a {record.kind}, not a session record; --then branches a recorded session")
    sc = load_script(script)
    engine = EngineCache(None if model is None else str(model), rederive=rederive).for_record(record)
    return branch_record(engine, record.body, until, sc.turns, sc.sampling, out=out, prefix_cache=PrefixCache(cache_bytes),
                         on_step=on_step, on_turn=on_turn)  # fmt: skip


def selftest(model: str | os.PathLike | None = None, *, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """The determinism matrix on this machine (``detinfer selftest``): one row per invariance, with its negative
    control; ``ok(rows)`` is whether every row holds. See records/selftest.py."""
    return matrix(EngineCache().load(model, 512, "f32"), None if model is None else str(model), on_row=on_row)
