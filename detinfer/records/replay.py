"""Replaying recorded sessions: every turn re-executed from its recorded token ids and compared with what it
recorded, after the record's messages were checked against those ids (records/binding.py); and branching, which
replays a prefix of turns exactly before running new scripted ones."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..compute.engine import Engine
from ..compute.kvcache import KVCache
from ..compute.numerics import NUMERICS
from ..compute.prefix_cache import PrefixCache
from ..compute.sampling import SamplingOverrides
from ..errors import DetinferError, InputError, KVFileError, ManifestError
from .binding import check_session
from .kvfile import load_kv
from .run import first_difference, recorded_template
from .session import (
    Conversation,
    ScriptTurn,
    SessionRecord,
    TurnRecord,
    compare_turn,
    recorded_constraint,
    run_session,
    run_turn,
)


def replay_turns(
    engine: Engine,
    record: SessionRecord,
    *,
    use_cache: bool = True,
    kv_dir: str | Path | None = None,
    until: int | None = None,
    warn: Callable[[str], None] | None = None,
    prefix_cache: PrefixCache | None = None,
    speculate: str | None = None,
) -> list[tuple[TurnRecord, list[str], int | None]]:
    """Re-execute recorded turns: for each, (actual turn, differing fields, first divergent step). A record of other
    numerics (detinfer/numerics.py) differs in every turn, named first.

    ``use_cache`` False recomputes every prefix from scratch (and ignores ``prefix_cache``); ``kv_dir`` restores
    each turn's prefix from the snapshot saved after the previous turn (a bad snapshot is a cache miss: recompute,
    warn); ``speculate``: a drafter (compute.speculate), never changing a byte. Raises ManifestError (bad input) for a record of another model or whose messages do not bind to its tokens
    (records/binding.py).
    """
    if record.model.sha256 != engine.model_file.sha256:
        raise ManifestError(
            f"the session was recorded with model sha256 {record.model.sha256[:16]}... but {engine.model_file.path.name} "
            f"has {engine.model_file.sha256[:16]}...; pass the right file with --model"
        )
    template = recorded_template(record)
    check_session(engine, record, template)  # an edited message is bad input before any token, never a match
    conv = Conversation(engine, template)
    cache = engine.new_cache()
    results = []
    for i, turn in enumerate(record.turns[:until]):
        if not use_cache:
            cache = engine.new_cache()
        elif kv_dir is not None and i > 0:
            cache = _restore_snapshot(engine, Path(kv_dir) / f"turn-{i:03d}.detkv", record.turns[i - 1].kv_sha256, warn) or cache
        actual = run_turn(engine, conv, cache, [m.model_dump() for m in turn.messages], turn.sampling, recorded=turn,
                          prefix_cache=prefix_cache if use_cache else None, constraint=recorded_constraint(turn), speculate=speculate)
        diffs = compare_turn(turn, actual)
        if record.tokenizer_sha256 != engine.tokenizer.hash:
            diffs.insert(0, "tokenizer_sha256")
        if record.numerics != NUMERICS:
            diffs.insert(0, f"numerics (recorded with {record.numerics}; this detinfer computes {NUMERICS}: record the session again)")
        firsts = (first_difference(turn.logits_digests, actual.logits_digests),
                  first_difference(turn.generated_token_ids, actual.generated_token_ids))
        results.append((actual, diffs, min((k for k in firsts if k is not None), default=None)))
    return results


def _restore_snapshot(engine: Engine, path: Path, kv_sha256: str, warn: Callable[[str], None] | None) -> KVCache | None:
    """The cache saved in ``path``, or None (a miss, with a warning) if it cannot be loaded or its contents do not
    hash to ``kv_sha256``, the KV hash the session recorded after that turn (a forged or stale snapshot)."""
    try:
        snap = load_kv(path, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
        if snap.digest() != kv_sha256:
            raise KVFileError(f"its KV hash {snap.digest()[:16]}… differs from the {kv_sha256[:16]}… the session recorded")
        cache = engine.new_cache()
        cache.restore(snap)
        return cache
    except DetinferError as e:
        if warn:
            warn(f"KV snapshot {path} not used ({e}); recomputing")
        return None


def branch(engine: Engine, record: SessionRecord, until: int, turns: list[ScriptTurn], default_sampling: SamplingOverrides,
           **options) -> SessionRecord:  # fmt: skip
    """Replay the first ``until`` turns of ``record`` exactly, then run the scripted ``turns`` after them: the new
    session (``options`` as :func:`session.run_session`'s: out, prefix_cache, on_step, on_turn...). Raises
    InputError for an ``until`` outside 1..the record's turns, ManifestError like :func:`replay_turns`, or if a
    replayed turn does not reproduce its record."""
    if not 1 <= until <= len(record.turns):
        raise InputError(f"--until {until} is out of range; the session has {len(record.turns)} turns")
    prior = record.model_copy(update={"turns": record.turns[:until]})
    check_session(engine, prior, recorded_template(prior))
    return run_session(engine, turns, default_sampling, prior=prior, **options)
