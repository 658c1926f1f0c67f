"""The syrupy extension behind the pytest plugin's ``detinfer_snapshot`` (and tests/test_golden.py's golden/).

A snapshot is one token stream (detinfer/tokenstream.py) per file: canonical JSON under ``__snapshots__/<test
file>/<test name>.json``, written atomically. ``assert result == detinfer_snapshot`` passes when the stored and the
new stream are equal byte for byte; otherwise the assertion message names the first divergent step (and turn),
the expected and actual token (id and text) and the actual run's top-5 logits there. ``pytest --snapshot-update``
rewrites the files. A stored file is read as any record is (a regular file of bounded size, bounded JSON, a valid
token stream): one that is not fails the assertion with the reason, never hangs or raises from syrupy.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

from ..api import Result, SessionResult
from ..compute.sampler import top_logits
from ..errors import ManifestError
from ..fileio import atomic_write_text, parse_json, read_input_text
from ..records.manifest import RunManifest
from ..records.reader import parse_record
from ..records.session import SessionRecord
from ..records.tokenstream import (
    divergence_report,
    run_stream,
    session_stream,
    stream_json,
)

UNREADABLE = "(unreadable) "  # prefix of what a stored file that cannot be read compares as: never a stream's JSON


class TokenStreamExtension(SingleFileSnapshotExtension):
    """Stores a :class:`~detinfer.api.Result` or :class:`~detinfer.api.SessionResult` (or a RunManifest /
    SessionRecord) as its token stream; anything else raises TypeError."""

    _write_mode = WriteMode.TEXT
    file_extension = "json"
    _actual: Any = None  # the last value serialized: the run whose tokens and logits a failure message reports
    _location: str = ""  # the stored file last read

    def serialize(self, data: Any, *, exclude=None, include=None, matcher=None) -> str:
        self._actual = data
        if isinstance(data, (Result, RunManifest)):
            return stream_json(run_stream(data.manifest if isinstance(data, Result) else data))
        if isinstance(data, (SessionResult, SessionRecord)):
            return stream_json(session_stream(data.record if isinstance(data, SessionResult) else data))
        raise TypeError(f"detinfer_snapshot stores detinfer results (llm.complete, llm.chat, llm.session), not {type(data).__name__}")

    def read_snapshot_data_from_location(self, *, snapshot_location: str, snapshot_name: str, session_id: str) -> str | None:
        self._location = snapshot_location
        if not os.path.lexists(snapshot_location):
            return None
        try:
            return read_input_text(snapshot_location, ManifestError, "stored snapshot")
        except ManifestError as e:
            return UNREADABLE + str(e)

    def diff_lines(self, serialized_data: str, snapshot_data: str) -> Iterator[str]:
        stored = str(snapshot_data)
        try:
            if stored.startswith(UNREADABLE):
                raise ManifestError(stored.removeprefix(UNREADABLE))
            expected = parse_record(parse_json(stored, ManifestError, "stored snapshot", self._location), self._location,
                                    "stored snapshot").body  # fmt: skip
        except ManifestError as e:
            yield f"{e}; rewrite it with pytest --snapshot-update"
            return
        actual = parse_json(str(serialized_data), ManifestError, "snapshot", "this run")
        yield from divergence_report(expected.model_dump(mode="json"), actual, token_text=self._token_text(), top_at=self._top_at)

    def _token_text(self):
        data = self._actual
        return data.token_text if isinstance(data, (Result, SessionResult)) else None

    def _top_at(self, turn: int, step: int) -> list[tuple[int, float]]:
        data = self._actual
        if isinstance(data, (Result, RunManifest)):
            tops = (data.manifest if isinstance(data, Result) else data).output.top_logits
            return [tuple(x) for x in tops[step]] if step < len(tops) else []
        if isinstance(data, SessionResult):  # turns keep logits digests, not top logits: recompute that one step
            turns = data.record.turns
            if turn >= len(turns) or step >= len(turns[turn].generated_token_ids):
                return []
            history = [t for tr in turns[:turn] for t in tr.appended_token_ids + tr.generated_token_ids]
            tokens = history + turns[turn].appended_token_ids + turns[turn].generated_token_ids[:step]
            return top_logits(data.engine.forward(tokens, data.engine.new_cache()), 5)
        return []

    @classmethod
    def write_snapshot_collection(cls, *, snapshot_collection, name_order=None) -> None:
        atomic_write_text(snapshot_collection.location, next(iter(snapshot_collection)).data)
