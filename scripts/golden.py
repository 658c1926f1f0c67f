"""The committed cases: golden token streams (golden/) and run manifests (manifests/).

Each case is a prompt plus sampling and engine settings. ``golden/<case>.json`` holds the run's token stream
(detinfer/records/tokenstream.py: model sha256, settings, prompt and output token ids, output text, stop reason), checked
by the pytest plugin's syrupy extension like any user's snapshot;
``manifests/<case>.json`` holds the full run manifest that ``detinfer verify`` re-executes.

``python scripts/golden.py manifests`` (``make manifests``) rewrites manifests/ — a no-op on an unchanged
engine: a file whose contract sections are unchanged is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from detinfer.api import Result
from detinfer.compute.constrain import Constraint
from detinfer.compute.engine import Engine
from detinfer.compute.sampling import Sampling
from detinfer.errors import DetinferError
from detinfer.model.chat import ChatTemplate
from detinfer.records.manifest import load_manifest, write_manifest
from detinfer.records.run import build_prompt, execute

ROOT = Path(__file__).resolve().parent.parent
LONG_TEXT = " ".join(
    f"Record {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} lamp in room {100 + i} was checked at {i % 24:02d}:{(7 * i) % 60:02d}"
    f" and found {'working' if i % 3 else 'broken'}."
    for i in range(60)
) + " Summary of the broken lamps:"


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    chat: bool = False
    sampling: dict = field(default_factory=dict)
    max_tokens: int = 32
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    kv_type: str = "f32"
    n_ctx: int = 2048
    model: str | None = None  # registry name; None: the default model
    chat_template: str | None = None  # --chat-template NAME for a model without its own
    constraint: tuple[str, str] | None = None  # (kind, text) of constrain.Constraint


GEMMA3 = "gemma3-270m-q4_k_m"
PERSON_SCHEMA = (
    '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, '
    '"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}, "hobbies": {"type": "array", "items": '
    '{"type": "string"}, "maxItems": 3}}, "required": ["name", "age", "city", "hobbies"], "additionalProperties": false}'
)


CASES = (
    Case("plain_greedy", "The capital of France is"),
    Case("chat_greedy", "Give me three tips for staying healthy.", chat=True, max_tokens=48),
    Case("seeded_sampling", "Write a short poem about the sea.", chat=True, sampling={"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1234}, max_tokens=40),
    Case("min_p_repetition_penalty", "List some fruits:", sampling={"temperature": 0.7, "min_p": 0.05, "repetition_penalty": 1.3, "seed": 5}),
    Case("stop_string", "The capital of France is", stop=("\n\n",)),
    Case("max_tokens", "Once upon a time", max_tokens=16, ignore_eos=True),
    Case("long_prompt", LONG_TEXT, max_tokens=16),
    Case("unicode_emoji", "Traduis en français : I love 🍕 and ☕ — 日本語も少し。 Emoji: 🎉👍", max_tokens=24),
    Case("f16_kv", "The capital of France is", kv_type="f16"),
    Case("gemma3_plain_greedy", "The capital of France is", model=GEMMA3),
    Case("gemma3_chat_greedy", "Give me three tips for staying healthy.", chat=True, chat_template="gemma", max_tokens=48, model=GEMMA3),
    Case("gemma3_seeded_sampling", "Once upon a time, in a small village at the edge of a great forest, there lived a", sampling={"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 1234}, max_tokens=40, model=GEMMA3),
    Case("gemma3_long_prompt", LONG_TEXT, max_tokens=16, model=GEMMA3),  # longer than the 512-token sliding window
    Case("gemma3_unicode_emoji", "Traduis en français : I love 🍕 and ☕ — 日本語も少し。 Emoji: 🎉👍", max_tokens=24, model=GEMMA3),
    Case("constraint_json_schema", "Describe a person as JSON.", chat=True, max_tokens=64, constraint=("json_schema", PERSON_SCHEMA)),
    Case("constraint_json_object", "Give a JSON object with your name.", chat=True, max_tokens=64,
         sampling={"temperature": 0.8, "top_p": 0.9, "seed": 2}, constraint=("json_object", "")),
    Case("constraint_regex", "What is 6 times 7?", chat=True, sampling={"temperature": 0.7, "seed": 3}, constraint=("regex", "[0-9]{1,3}")),
    Case("constraint_lark", "Pick a color.", chat=True, constraint=("lark", 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"\n')),
)


def run_case(engines: dict, case: Case, model: str | None = None) -> Result:
    """Run one case and return its result (``.manifest``: the run manifest): on ``case.model`` if set, else on
    ``model`` (None: the default model). Engines are cached by (model, n_ctx, kv_type) in ``engines``."""
    source = case.model or model
    key = (source, case.n_ctx, case.kv_type)
    if key not in engines:
        engines[key] = Engine.load(source, n_ctx=case.n_ctx, kv_type=case.kv_type)
    engine = engines[key]
    template = ChatTemplate.from_option(case.chat_template) if case.chat_template else None
    prompt = build_prompt(engine, text=case.text, chat=case.chat, template=template)
    sampling = Sampling.create(**case.sampling, max_tokens=case.max_tokens, stop=list(case.stop), ignore_eos=case.ignore_eos)
    constraint = Constraint.create(*case.constraint) if case.constraint else None
    return Result(execute(engine, prompt, sampling, template=template, constraint=constraint), engine)


def write_manifests(folder: Path, model: str | None = None) -> list[tuple[str, str]]:
    """(Re)write one manifest per case; returns (file, "unchanged" | "written") for each."""
    engines: dict = {}
    report = []
    for case in CASES:
        path = folder / f"{case.name}.json"
        m = run_case(engines, case, model).manifest
        try:
            unchanged = load_manifest(path).contract() == m.contract()
        except DetinferError:
            unchanged = False
        if not unchanged:
            write_manifest(m, path)
        report.append((str(path), "unchanged" if unchanged else "written"))
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("what", choices=["manifests"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dir", default=str(ROOT / "manifests"))
    args = ap.parse_args(argv)
    try:
        for path, status in write_manifests(Path(args.dir), args.model):
            print(f"{status:9} {path}")
    except DetinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
