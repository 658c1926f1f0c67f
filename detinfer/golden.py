"""The committed cases: golden token streams (golden/) and run manifests (manifests/).

Each case is a prompt plus sampling and engine settings. ``golden/<case>.json`` holds the reduced, reviewable
record (model sha256, settings, prompt and output token ids, output text) checked by syrupy snapshots;
``manifests/<case>.json`` holds the full run manifest that ``detinfer verify`` re-executes.

``python -m detinfer.golden manifests`` (``make manifests``) rewrites manifests/ — a no-op on an unchanged
engine: a file whose contract sections are unchanged is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from .chat import ChatTemplate
from .engine import Engine
from .errors import DetinferError
from .manifest import RunManifest, canonical_json, load_manifest, write_manifest
from .numerics import NUMERICS_1
from .run import build_prompt, execute, sampling_record
from .sampler import SamplingParams

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


GEMMA3 = "gemma3-270m-q4_k_m"


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
)


class GoldenRecord(BaseModel):
    """The reviewable part of a run: what must never move unless a person says so."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    case: str
    model_sha256: str
    settings: dict
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    output_text: str
    numerics: str = NUMERICS_1  # detinfer.numerics.NUMERICS of the recording; absent in numerics-1 files


def run_case(engines: dict, case: Case, model: str | None = None) -> RunManifest:
    """Run one case and return its manifest: on ``case.model`` if set, else on ``model`` (None: the default
    model). Engines are cached by (model, n_ctx, kv_type) in ``engines``."""
    source = case.model or model
    key = (source, case.n_ctx, case.kv_type)
    if key not in engines:
        engines[key] = Engine.load(source, n_ctx=case.n_ctx, kv_type=case.kv_type)
    engine = engines[key]
    template = ChatTemplate.from_option(case.chat_template) if case.chat_template else None
    prompt = build_prompt(engine, text=case.text, chat=case.chat, template=template)
    sampling = sampling_record(SamplingParams.create(**case.sampling), max_tokens=case.max_tokens, stop=case.stop, ignore_eos=case.ignore_eos)
    return execute(engine, prompt, sampling, template=template)


def golden_record(case: Case, m: RunManifest) -> GoldenRecord:
    return GoldenRecord(
        case=case.name,
        model_sha256=m.model.sha256,
        settings={"chat": case.chat, **m.sampling.model_dump(), **m.engine.model_dump()},
        prompt_token_ids=m.prompt.token_ids,
        output_token_ids=m.output.token_ids,
        output_text=m.output.text,
        numerics=m.recorded_numerics(),
    )


def write_manifests(folder: Path, model: str | None = None) -> list[tuple[str, str]]:
    """(Re)write one manifest per case; returns (file, "unchanged" | "written") for each."""
    engines: dict = {}
    report = []
    for case in CASES:
        path = folder / f"{case.name}.json"
        m = run_case(engines, case, model)
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


def golden_json(record: GoldenRecord) -> str:
    return canonical_json(record.model_dump(mode="json"))


if __name__ == "__main__":
    sys.exit(main())
