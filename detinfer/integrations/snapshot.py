"""The syrupy extension behind the pytest plugin's ``detinfer_snapshot`` (and tests/test_golden.py's golden/).

A snapshot is one token stream (detinfer/tokenstream.py) per file: canonical JSON under ``__snapshots__/<test
file>/<test name>.json``, written atomically. ``assert result == detinfer_snapshot`` passes when the stored and the
new stream are equal byte for byte; otherwise the assertion message names the first divergent step (and turn),
the expected and actual token (id and text) and the actual run's top-5 logits there. ``pytest --snapshot-update``
rewrites the files.
"""

from __future__ import annotations

from typing import Any, Iterator

from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

from ..api import Result, SessionResult
from ..compute.sampler import top_logits
from ..fileio import atomic_write_text
from ..records.manifest import RunManifest
from ..records.session import SessionRecord
from ..records.tokenstream import (
    divergence_report,
    parse_stream,
    run_stream,
    session_stream,
    stream_json,
)


class TokenStreamExtension(SingleFileSnapshotExtension):
    """Stores a :class:`~detinfer.api.Result` or :class:`~detinfer.api.SessionResult` (or a RunManifest /
    SessionRecord) as its token stream; anything else raises TypeError."""

    _write_mode = WriteMode.TEXT
    file_extension = "json"
    _actual: Any = None  # the last value serialized: the run whose tokens and logits a failure message reports

    def serialize(self, data: Any, *, exclude=None, include=None, matcher=None) -> str:
        self._actual = data
        if isinstance(data, (Result, RunManifest)):
            return stream_json(run_stream(data.manifest if isinstance(data, Result) else data))
        if isinstance(data, (SessionResult, SessionRecord)):
            return stream_json(session_stream(data.record if isinstance(data, SessionResult) else data))
        raise TypeError(f"detinfer_snapshot stores detinfer results (llm.complete, llm.chat, llm.session), not {type(data).__name__}")

    def diff_lines(self, serialized_data: str, snapshot_data: str) -> Iterator[str]:
        expected, actual = parse_stream(str(snapshot_data)), parse_stream(str(serialized_data))
        lines = divergence_report(expected, actual, token_text=self._token_text(), top_at=self._top_at) if expected else []
        yield from lines or super().diff_lines(serialized_data, snapshot_data)

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
