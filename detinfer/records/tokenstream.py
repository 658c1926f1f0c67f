"""Token streams: the reviewable record of a run or of an agent session, and where two of them first diverge.

A token stream is what must never move unless a person says so: the model's sha256, the settings, the prompt
token ids, the output token ids, the output text and the stop reason (per turn for a session). It is stored as
canonical JSON (sorted keys, two-space indent) so a pull request shows exactly which tokens moved. golden/ and
the pytest plugin's ``detinfer_snapshot`` (detinfer/snapshot.py) store the same records; ``detinfer verify``
re-executes the run records (golden records).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pydantic import BaseModel, ConfigDict

from ..compute.numerics import NUMERICS_1
from .manifest import RunManifest, TokenId, canonical_json
from .run import first_difference
from .session import ChatMessage, SessionRecord


class _Stream(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunStream(_Stream):
    """One run. ``settings``: ``chat`` plus the manifest's sampling and engine sections (n_ctx, kv_type) and, for a
    constrained run, its ``constraint``."""

    model_sha256: str
    settings: dict[str, Any]
    prompt_token_ids: list[TokenId]
    output_token_ids: list[TokenId]
    output_text: str
    stop_reason: str
    numerics: str = NUMERICS_1  # detinfer.numerics.NUMERICS of the recording; absent in numerics-1 files


class TurnStream(_Stream):
    """One turn of a session: the messages it appended, their token ids (``prompt_token_ids``), its output."""

    messages: list[ChatMessage]
    sampling: dict[str, Any]
    prompt_token_ids: list[TokenId]
    output_token_ids: list[TokenId]
    output_text: str
    stop_reason: str


class SessionStream(_Stream):
    """A multi-turn session: ``settings`` holds n_ctx, kv_type and the chat template's sha256."""

    model_sha256: str
    settings: dict[str, Any]
    turns: list[TurnStream]
    numerics: str = NUMERICS_1  # detinfer.numerics.NUMERICS of the recording; absent in numerics-1 files


def run_stream(m: RunManifest) -> RunStream:
    """The token stream of a run manifest."""
    return RunStream(
        model_sha256=m.model.sha256,
        settings={"chat": m.prompt.chat, **m.sampling.model_dump(), **m.engine.model_dump(),
                  **({"constraint": m.constraint.model_dump()} if m.constraint else {})},
        prompt_token_ids=m.prompt.token_ids,
        output_token_ids=m.output.token_ids,
        output_text=m.output.text,
        stop_reason=m.output.stop_reason,
        numerics=m.recorded_numerics(),
    )


def session_stream(record: SessionRecord) -> SessionStream:
    """The token stream of a session record, turn by turn."""
    return SessionStream(
        model_sha256=record.model.sha256,
        settings={**record.engine.model_dump(), "chat_template_sha256": record.chat_template_sha256},
        turns=[TurnStream(messages=t.messages, sampling=t.sampling, prompt_token_ids=t.appended_token_ids,
                          output_token_ids=t.generated_token_ids, output_text=t.text, stop_reason=t.stop_reason)
               for t in record.turns],
        numerics=record.numerics,
    )


def stream_json(stream: RunStream | SessionStream) -> str:
    """Canonical JSON of a token stream (the bytes stored in a snapshot or golden file)."""
    return canonical_json(stream.model_dump(mode="json"))


TokenText = Callable[[int], str]
# (turn index, step) -> the actual run's 5 highest (token id, logit) there, highest first ([] if unknown)
TopAt = Callable[[int, int], Sequence[tuple[int, float]]]


def divergence_report(expected: dict, actual: dict, *, token_text: TokenText | None = None, top_at: TopAt | None = None) -> list[str]:
    """Lines saying how two token streams (``stream_json`` parsed back, run or session) differ: fields that
    differ, then the first divergent turn and step with the expected and actual token (id and text) and the
    actual run's top-5 logits at that step (from ``top_at``). ``token_text`` decodes one token id (ids only
    without it). Empty if they are equal."""
    name = (lambda i: f"{i} {token_text(i)!r}") if token_text else str
    lines = [f"{field}: expected {expected.get(field)!r}, got {actual.get(field)!r}"
             for field in ("model_sha256",) if expected.get(field) != actual.get(field)]
    lines += [f"settings.{k}: expected {expected.get('settings', {}).get(k)!r}, got {actual.get('settings', {}).get(k)!r}"
              for k in sorted(set(expected.get("settings", {})) | set(actual.get("settings", {})))
              if expected.get("settings", {}).get(k) != actual.get("settings", {}).get(k)]
    e_turns, a_turns = expected.get("turns", [expected]), actual.get("turns", [actual])
    if len(e_turns) != len(a_turns):
        lines.append(f"turns: expected {len(e_turns)}, got {len(a_turns)}")
    for t, (e, a) in enumerate(zip(e_turns, a_turns)):
        before = len(lines)
        where = f"turn {t + 1}, " if "turns" in expected else ""
        if (i := first_difference(e.get("prompt_token_ids", []), a.get("prompt_token_ids", []))) is not None:
            lines.append(f"{where}prompt token ids differ from index {i}: expected {_at(e['prompt_token_ids'], i, name)}, "
                         f"got {_at(a['prompt_token_ids'], i, name)}")
        et, at = e.get("output_token_ids", []), a.get("output_token_ids", [])
        if (step := first_difference(et, at)) is not None:
            lines.append(f"{where}first divergent step {step} (of {len(et)} expected, {len(at)} generated):")
            lines.append(f"  expected token {_at(et, step, name)}")
            lines.append(f"  actual token   {_at(at, step, name)}")
            if top_at is not None and (top := top_at(t, step)):
                lines.append("  top-5 logits there (actual run): " + ", ".join(f"{name(i)} {v:.4f}" for i, v in top))
        for field in ("output_text", "stop_reason"):
            if e.get(field) != a.get(field):
                lines.append(f"{where}{field}: expected {e.get(field)!r}, got {a.get(field)!r}")
        if len(lines) > before:
            break  # later turns ran on a different history: the first divergent turn is the news
    return lines


def _at(ids: list[int], i: int, name: Callable[[int], str]) -> str:
    return name(ids[i]) if i < len(ids) else "(none: the stream ended)"
