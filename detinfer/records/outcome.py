"""The outcome of re-executing one recorded file, the same for every kind of record and every way of running it
(``verify``, ``replay``, ``run --manifest``, the Python API, Ray): match, mismatch or bad input, with a report that
says exactly what differs, and per turn for a session."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

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
class Outcome:
    """One file re-executed. ``status``: MATCH, MISMATCH or BAD_INPUT (``message`` says why); ``differences``: the
    contract fields that differ ({field, expected, actual}); ``divergence``: the first divergent step; ``turns``: for a
    session, one row per turn (turn, result, differs, first_divergent_step, reused_tokens, steps, and expected /
    actual (id, text) at a divergence). ``threads``, ``seconds``, ``overlapped`` (re-executed in lockstep beside other
    files, so ``seconds`` overlaps theirs) and the machines are informative."""

    path: str
    status: str
    kind: str = ""  # manifest, golden, session, session-snapshot ("" when the file could not be read)
    model: str = ""
    steps: int = 0
    seconds: float = 0.0
    message: str = ""
    differences: list[dict] = field(default_factory=list)
    divergence: Divergence | None = None
    threads: int | None = None
    overlapped: bool = False
    recorded_on: dict[str, str] = field(default_factory=dict)  # detinfer.records.machine.machine() of the recording
    reexecuted_on: dict[str, str] = field(default_factory=dict)
    turns: list[dict[str, Any]] = field(default_factory=list)
    reexecuted: Any = field(default=None, repr=False)  # a run manifest's re-execution (its RunManifest), to save

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("divergence", "turns", "reexecuted")}
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
            lines += [f"  top-5 {side} {top}" for side, top in (("expected", dv.expected_top), ("actual  ", dv.actual_top))
                      if top]  # a golden stream records no logits: no empty "expected []"
        return lines

    def rows(self) -> list[dict[str, Any]]:
        """``replay``'s rows: one per turn of a session, or one row (turn None) for a file that could not be replayed."""
        if self.turns:
            return [dict(session=self.path, **t) for t in self.turns]
        return [{"session": self.path, "turn": None, "result": self.status, "differs": [], "message": self.message,
                 "first_divergent_step": None, "reused_tokens": 0, "steps": self.steps}]  # fmt: skip


def bad_input(path: str, message: str, seconds: float = 0.0, model: str = "") -> Outcome:
    return Outcome(path, BAD_INPUT, message=message, seconds=seconds, model=model)


def exit_code(outcomes: list[Outcome]) -> int:
    """2 if any file is bad input, else 1 if any mismatch, else 0."""
    if any(r.status == BAD_INPUT for r in outcomes):
        return 2
    return 1 if any(r.status == MISMATCH for r in outcomes) else 0


def summary(outcomes: list[Outcome]) -> dict:
    """The counts of ``outcomes`` by status, and their exit code (the last of ``--json``'s lines)."""
    return {
        "summary": True,
        "files": len(outcomes),
        "match": sum(r.status == MATCH for r in outcomes),
        "mismatch": sum(r.status == MISMATCH for r in outcomes),
        "bad_input": sum(r.status == BAD_INPUT for r in outcomes),
        "exit_code": exit_code(outcomes),
    }


def to_json_lines(outcomes: list[Outcome]) -> str:
    return "\n".join([json.dumps(r.to_json(), sort_keys=True) for r in outcomes] + [json.dumps(summary(outcomes), sort_keys=True)])
