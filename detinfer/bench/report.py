"""``bench/results.json`` (:class:`BenchReport`, schema 2) and the ``docs/benchmarks.md`` it renders to.

Figures are tok/s keyed ``prefill_<tokens>_tok_s`` / ``decode_<tokens>_tok_s``, each the median, min and max of
the runs. Per model and instruction set (ISA): every engine at every thread count, and what each engine reports it
was compiled for. The markdown has one detinfer / llama.cpp table per ISA (floor: ≥ 1.1× in every cell), the
1B-class table (tok/s, GB/s of weights streamed per decoded token against the measured read bandwidth; floors ≥ 80%
and ≥ 1.1×), then per suite model the host-only figures (fastmath cost of the contract, RSS, start-up, session),
the KV-cache curve and the warnings.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from ..errors import InputError
from ..fileio import atomic_write_text, read_json
from ..records.manifest import canonical_json

SCHEMA_VERSION = 2
MAX_WARNINGS_SHOWN = 12  # in docs/benchmarks.md; the results file keeps them all
PEER_FLOOR = 1.1  # issue 20: detinfer / llama.cpp in every cell, on every ISA
BANDWIDTH_FLOOR = 0.80  # issue 37 (issue 20: 70%): 1B-class decode weight GB/s / measured read GB/s
# llama-cpp-python 0.3.36 on SmolLM2 Q4_1 on the project's 2-core machine (docs/determinism.md): the documented
# reference when the peer cannot run here. Labelled as such wherever it is used.
REFERENCE_LLAMA_CPP = {
    "smollm2-135m-instruct-q4_1": {
        1: {"prefill_64_tok_s": 204, "prefill_512_tok_s": 197, "prefill_2048_tok_s": 160, "decode_128_tok_s": 65},
        2: {"prefill_64_tok_s": 385, "prefill_512_tok_s": 379, "prefill_2048_tok_s": 304, "decode_128_tok_s": 104},
    }
}
DECODE = "decode_128_tok_s"
FLOOR_FIGURES = ("prefill_512_tok_s", DECODE)  # the figures issue 6's scaling and contract-cost floors name
PEER_FLOORS = {1: {DECODE: 1.2}, 2: {DECODE: 1.3, "prefill_512_tok_s": 1.0}}  # issue 6: detinfer / llama.cpp at threads
SCALING_FLOOR = 1.8  # issue 20: 2-thread / 1-thread, prefill 512 and decode
WARM_START_FLOOR_S = {"smollm2-135m-instruct-q4_1": 1.0}  # issue 20; other models 1.5 s
COLD_START_FLOOR_S = 10.0  # issue 20, with a progress message


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Stats(_Strict):
    """Median, min and max of ``runs`` samples."""

    median: float
    min: float
    max: float
    runs: int


class EngineRun(_Strict):
    """One engine at one thread count: each figure's stats (tok/s) and the worker process's peak RSS."""

    engine: Literal["detinfer", "detinfer-fastmath", "llama-cpp"]
    figures: dict[str, Stats]
    peak_rss_mb: float


class ThreadRun(_Strict):
    threads: int
    engines: list[EngineRun]


class IsaRun(_Strict):
    """One instruction set (``host``: each engine's default, the host CPU; ``avx2``: AVX2 + FMA, AVX-512 off).

    detinfer_env: the compile-target variables the detinfer workers ran with ({}: numba's default target);
    flags: engine -> what the engine itself reports it was compiled for (numba's target and a probe of the code it
    compiles; llama.cpp's ``llama_print_system_info()``); peer_build: how the llama.cpp peer was built."""

    isa: str
    detinfer_env: dict[str, str]
    flags: dict[str, str]
    peer_build: str | None = None
    threads: list[ThreadRun] = []


class StartTimes(_Strict):
    """Seconds from process start to the end of ``detinfer run --max-tokens 1`` with an empty / a filled JIT cache."""

    cold_s: Stats
    warm_s: Stats
    progress_message: bool  # the cold runs printed the compile progress message on stderr


class SessionFigures(_Strict):
    """The 20-turn scripted session with prefix reuse vs recomputing every prefix, and KV snapshot save/load."""

    turns: int
    history_tokens: int
    with_reuse_s: Stats
    no_cache_s: Stats
    snapshot_tokens: int
    snapshot_bytes: int
    snapshot_save_ms: Stats
    snapshot_load_ms: Stats


class ModelReport(_Strict):
    """One model. kind "suite": the full cells on every ISA plus the host-only figures; "large": the 1B-class cells.
    weight_bytes_per_token: bytes of every weight matrix a decoded token streams, as stored in the GGUF (the output
    matrix, which is token_embd when tied, included; the embedding rows looked up are not)."""

    model: str
    kind: Literal["suite", "large"] = "suite"
    status: Literal["ok", "skipped"]
    reason: str | None = None  # why a model was skipped
    sha256: str = ""
    model_file_bytes: int = 0
    weight_bytes_per_token: int = 0
    kv_bytes_at_n_ctx: int = 0
    isas: list[IsaRun] = []
    start: StartTimes | None = None
    session: SessionFigures | None = None

    def isa(self, name: str) -> IsaRun | None:
        return next((r for r in self.isas if r.isa == name), None)


class BandwidthRun(_Strict):
    """This machine's memory bandwidth at ``threads`` Python threads, GB/s (1e9 bytes): read = a sum over an array
    far larger than the caches, copy = bytes read + bytes written by a copy of it."""

    threads: int
    array_bytes: int
    read_gb_s: Stats
    copy_gb_s: Stats


class KVTarget(_Strict):
    """Total time to generate ``tokens`` tokens with the KV cache and with the naive loop, and their ratio."""

    tokens: int
    cached_s: float
    naive_s: float
    naive_kind: Literal["measured", "extrapolated lower bound"]
    ratio: float  # naive_s / cached_s


class KVCurve(_Strict):
    """``detinfer bench kv``: greedy generation after a short prompt with the KV cache (one forward per token) and
    with a naive loop that recomputes the whole sequence every step. Step i produces generated token i, at
    position prompt_tokens + i; step 0 is the prompt's prefill in both arms."""

    date: str
    model: str
    threads: int
    prompt_tokens: int
    cached_step_s: list[float]
    naive_step_s: list[float]  # shorter than cached_step_s if the naive arm stopped at its time budget
    naive_budget_s: float
    naive_stopped_early: bool
    tokens_identical: bool  # every token the naive arm produced equals the cached arm's
    compared_tokens: int
    first_mismatch: int | None = None  # step of the first differing token
    separation_step: int | None = None  # from here on the naive arm's cumulative time stays >= 2x the cached arm's
    targets: list[KVTarget]
    warnings: list[str] = []
    plot: str | None = None


class BenchReport(_Strict):
    """``bench/results.json``. ``kv_curve`` is filled in by ``detinfer bench kv`` (:mod:`detinfer.bench_kv`)."""

    schema_version: Literal[2] = SCHEMA_VERSION
    date: str
    machine: dict[str, str | int]
    n_ctx: int
    runs_per_figure: int
    large_runs_per_figure: int = 0  # of the 1B-class models
    peer: str | None = None
    isas: list[str] = []
    bandwidth: list[BandwidthRun] = []
    models: list[ModelReport]
    warnings: list[str] = []
    kv_curve: KVCurve | None = None


def stats(samples: list[float], digits: int = 2) -> Stats:
    """Median, min and max of ``samples`` (at least one)."""
    r = lambda v: round(v, digits)  # noqa: E731
    return Stats(median=r(statistics.median(samples)), min=r(min(samples)), max=r(max(samples)), runs=len(samples))


def load_report(path: Path) -> BenchReport:
    """Read ``bench/results.json``; raises InputError if it is unreadable or not of this schema."""
    from pydantic import ValidationError

    data = read_json(path, InputError, "benchmark results file")
    try:
        return BenchReport.model_validate(data)
    except ValidationError as e:
        raise InputError(f"{path} is not a benchmark results file of schema {SCHEMA_VERSION} ({e.errors()[0]['msg']}); "
                         "regenerate it with `detinfer bench` or pass another path") from None


PROFILE_BEGIN, PROFILE_END = "<!-- profile: bench/profile.py -->", "<!-- /profile -->"
BUSY_BEGIN, BUSY_END = "<!-- busy: detinfer bench busy -->", "<!-- /busy -->"
SPECULATE_BEGIN, SPECULATE_END = "<!-- speculate: detinfer bench speculate -->", "<!-- /speculate -->"
SERVE_BEGIN, SERVE_END = "<!-- serve: detinfer bench serve -->", "<!-- /serve -->"
LOCKSTEP_BEGIN, LOCKSTEP_END = "<!-- lockstep: detinfer bench lockstep -->", "<!-- /lockstep -->"
KEPT_SECTIONS = ((BUSY_BEGIN, BUSY_END), (SPECULATE_BEGIN, SPECULATE_END), (SERVE_BEGIN, SERVE_END), (LOCKSTEP_BEGIN, LOCKSTEP_END),
                 (PROFILE_BEGIN, PROFILE_END))


def kept_section(markdown_path: Path) -> str:
    """The sections other commands wrote into an existing markdown file (KEPT_SECTIONS: the busy-core and
    speculation figures, the server under load, verify and batch in lockstep, the per-kernel profile, each between its
    markers), or ""."""
    try:
        text = markdown_path.read_text(encoding="utf-8")
    except OSError:
        return ""
    kept = []
    for begin, end_mark in KEPT_SECTIONS:
        start, end = text.find(begin), text.find(end_mark)
        if 0 <= start < end:
            kept.append(text[start : end + len(end_mark)] + "\n")
    return "".join(kept)


def write_section(result: dict, out: Path, markdown_path: Path, section: str, begin: str, end: str) -> None:
    """``result`` as JSON at ``out`` (atomically) and ``section`` in ``markdown_path`` (:func:`replace_section`)."""
    atomic_write_text(out, json.dumps(result, indent=1, sort_keys=True) + "\n")
    replace_section(markdown_path, section, begin, end)


def replace_section(markdown_path: Path, section: str, begin: str, end: str) -> None:
    """``section`` (markdown from ``begin`` to ``end``, both included, then a newline) in ``markdown_path``: the
    section there replaced, or appended; every other section kept; the file written atomically."""
    try:
        text = markdown_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = ""
    start, stop = text.find(begin), text.find(end)
    if 0 <= start < stop:
        text = text[:start] + section + text[stop + len(end) + 1 :]
    else:
        text = text + ("\n" if text and not text.endswith("\n\n") else "") + section
    atomic_write_text(markdown_path, text)


def write_report(report: BenchReport, out: Path, markdown_path: Path) -> None:
    """Write the report as canonical JSON and as markdown, each atomically; the markdown keeps the profile section
    bench/profile.py wrote into it."""
    atomic_write_text(out, canonical_json(report.model_dump()))
    atomic_write_text(markdown_path, markdown(report, markdown_path.parent) + kept_section(markdown_path))


# ---- markdown ---------------------------------------------------------------------------------------------------

Floor = tuple[str, str, bool]  # (floor, measured value, holds)


def _fmt(s: Stats) -> str:
    return f"{s.median:g} ({s.min:g}–{s.max:g})"


def _times(v: float) -> str:
    return f"{v:.2f}×"


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def floor_table(floors: list[tuple[str, str, bool]]) -> list[str]:
    """Markdown lines of a blank line and a table of (floor, measured, holds) rows."""
    return ["", "| floor | measured | holds |", "|---|---:|---|"] + [f"| {f} | {v} | {_yes(ok)} |" for f, v, ok in floors]


def figure_label(name: str) -> str:
    """A figure's name in tables: "prefill_512_tok_s" -> "prefill 512"."""
    return name.removesuffix("_tok_s").replace("_", " ")


def display_name(model: str) -> str:
    """A model's name in tables: a registry name as is, a path by its file name."""
    return Path(model).name


def _engine(run: ThreadRun, name: str) -> EngineRun | None:
    return next((e for e in run.engines if e.engine == name), None)


def _medians(tr: ThreadRun, engine: str) -> dict[str, float] | None:
    e = _engine(tr, engine)
    return None if e is None else {name: s.median for name, s in e.figures.items()}


def _cells(m: ModelReport, isa: str) -> list[tuple[int, str, Stats, Stats | None]]:
    """(threads, figure, detinfer stats, llama.cpp stats or None) of every cell of ``m`` on ``isa``."""
    run = m.isa(isa)
    rows = []
    for tr in run.threads if run else []:
        ours, peer = _engine(tr, "detinfer"), _engine(tr, "llama-cpp")
        rows += [(tr.threads, name, s, peer.figures.get(name) if peer else None) for name, s in ours.figures.items()]
    return rows


def _peer_cell(peer: Stats | None, ours: Stats) -> tuple[str, str, str]:
    """The llama.cpp, ratio and floor cells of a table row ("–" without a measured peer)."""
    if peer is None:
        return "–", "–", "–"
    ratio = ours.median / peer.median
    return _fmt(peer), _times(ratio), _yes(ratio >= PEER_FLOOR)


def _floor_count(rows: list[tuple[int, str, Stats, Stats | None]]) -> str:
    measured = [ours.median / peer.median >= PEER_FLOOR for _, _, ours, peer in rows if peer is not None]
    return (f"Floor detinfer / llama.cpp ≥ {PEER_FLOOR}× per cell: holds in {sum(measured)} of {len(measured)} cells."
            if measured else "llama.cpp was not measured side by side (`--peer llama-cpp`).")


def builds_markdown(report: BenchReport) -> list[str]:
    """How each engine was built or compiled per ISA, as recorded by the first model measured on it."""
    lines = ["## Engines per instruction set", ""]
    for isa in report.isas:
        run = next((r for m in report.models if m.status == "ok" and (r := m.isa(isa))), None)
        if run is None:
            continue
        env = " ".join(f"{k}={v!r}" for k, v in run.detinfer_env.items()) or "numba's default target (the host CPU)"
        lines.append(f"- **{isa}**: detinfer with {env}" + (", in its own JIT cache" if run.detinfer_env else "")
                     + f"; compiled code: {run.flags.get('detinfer', '?')}.")
        if run.peer_build or "llama-cpp" in run.flags:
            info = run.flags.get("llama-cpp")
            lines.append(f"  llama.cpp: {run.peer_build or 'build not recorded'}; "
                         + (f"`llama_print_system_info()`: `{info.strip()}`." if info else "did not run (see the warnings)."))
    return lines + [""]


def isa_markdown(report: BenchReport, isa: str) -> list[str]:
    """The side-by-side table of the suite models on ``isa``: detinfer, llama.cpp and their ratio per cell."""
    suite = [m for m in report.models if m.kind == "suite" and m.status == "ok" and m.isa(isa)]
    if not suite:
        return []
    lines = [f"## detinfer vs llama.cpp: {isa}", "",
             f"Median (min–max) of {report.runs_per_figure} run(s), tok/s; engines alternate run by run.", "",
             f"| model | threads | cell | detinfer | llama.cpp | detinfer / llama.cpp | ≥ {PEER_FLOOR}× |", "|---" * 7 + "|"]
    every = []
    for m in suite:
        rows = _cells(m, isa)
        every += rows
        lines += [f"| {display_name(m.model)} | {t} | {figure_label(n)} | {_fmt(ours)} | " + " | ".join(_peer_cell(peer, ours)) + " |"
                  for t, n, ours, peer in rows]
    return lines + ["", _floor_count(every), ""]


def large_markdown(report: BenchReport) -> list[str]:
    """The 1B-class table: tok/s side by side and, for decode, GB/s of weights against the read bandwidth."""
    large = [m for m in report.models if m.kind == "large"]
    if not large:
        return []
    read = {b.threads: b.read_gb_s.max for b in report.bandwidth}
    lines = ["## 1B-class models", ""]
    lines += [f"- {display_name(m.model)}: " + (f"{m.weight_bytes_per_token / 1e9:.3f} GB of weight matrices streamed per decoded "
                                          f"token (sha256 {m.sha256[:12]}…)" if m.status == "ok" else f"skipped: {m.reason}")
              for m in large]
    lines += [f"- Read bandwidth at {b.threads} thread(s): {b.read_gb_s.max:g} GB/s (best of {b.read_gb_s.runs}; median "
              f"{b.read_gb_s.median:g}), copy {b.copy_gb_s.max:g} GB/s (read + write), over a {b.array_bytes / 2**30:g} GiB array."
              for b in report.bandwidth]
    lines += ["", f"Median (min–max) of {report.large_runs_per_figure} run(s), tok/s, token ids fed directly (seeded random). "
              f"Weight GB/s = weight bytes per token × decode tok/s; floors ≥ {PEER_FLOOR}× llama.cpp and ≥ "
              f"{BANDWIDTH_FLOOR:.0%} of the read bandwidth at the same thread count.", "",
              f"| model | ISA | threads | cell | detinfer | llama.cpp | detinfer / llama.cpp | ≥ {PEER_FLOOR}× | weight GB/s "
              f"| of read bandwidth | ≥ {BANDWIDTH_FLOOR:.0%} |", "|---" * 11 + "|"]
    every = []
    for m in large:
        for isa in report.isas:
            rows = _cells(m, isa)
            every += rows
            for t, n, ours, peer in rows:
                gb = "–", "–", "–"
                if n.startswith("decode_") and t in read:
                    gb_s = m.weight_bytes_per_token * ours.median / 1e9
                    gb = f"{gb_s:.2f}", f"{gb_s / read[t]:.0%}", _yes(gb_s / read[t] >= BANDWIDTH_FLOOR)
                lines.append(f"| {display_name(m.model)} | {isa} | {t} | {figure_label(n)} | {_fmt(ours)} | "
                             + " | ".join(_peer_cell(peer, ours) + gb) + " |")
    return lines + ["", _floor_count(every), ""]


def _ratio_rows(m: ModelReport, names: list[str]) -> tuple[list[str], list[Floor]]:
    """Host table rows of thread scaling, cost of the contract and detinfer / llama.cpp (measured, else the
    reference), and the floors they decide."""
    percent = lambda v: f"{v:+.1%}"  # noqa: E731
    row = lambda label, t, values, fmt: f"| {label} | {t} | " + " | ".join(fmt(values[n]) for n in names) + " |"  # noqa: E731
    lines = ["| ratio | threads | " + " | ".join(map(figure_label, names)) + " |", "|---" * (len(names) + 2) + "|"]
    floors: list[Floor] = []
    by_t = {tr.threads: tr for tr in m.isa("host").threads}
    checked = [n for n in FLOOR_FIGURES if n in names]
    if 1 in by_t and 2 in by_t:
        one, two = _medians(by_t[1], "detinfer"), _medians(by_t[2], "detinfer")
        scale = {n: two[n] / one[n] for n in names}
        lines.append(row("thread scaling (2 / 1 thread)", "", scale, _times))
        floors += [(f"2-thread / 1-thread scaling, {figure_label(n)} ≥ {SCALING_FLOOR}×", _times(scale[n]), scale[n] >= SCALING_FLOOR)
                   for n in checked]
    for t, tr in by_t.items():
        contract, fast = _medians(tr, "detinfer"), _medians(tr, "detinfer-fastmath")
        if fast is not None:
            cost = {n: fast[n] / contract[n] - 1 for n in names}
            lines.append(row("cost of the contract (fastmath / contract − 1)", t, cost, percent))
            floors += [(f"cost of the contract, {figure_label(n)}, {t} thread(s) ≤ 10%", percent(cost[n]), cost[n] <= 0.10) for n in checked]
        peer, label, note = _medians(tr, "llama-cpp"), "detinfer / llama.cpp (measured side by side)", ""
        if peer is None:
            peer = REFERENCE_LLAMA_CPP.get(m.model, {}).get(t)
            label, note = "detinfer / llama.cpp **reference** (NUMERICS.md, not measured in this run)", " (reference)"
        if peer is None or not set(names) <= set(peer):
            continue
        ratio = {n: contract[n] / peer[n] for n in names}
        lines.append(row(label, t, ratio, _times))
        floors += [(f"{figure_label(n)} at {t} thread(s) ≥ {f}× llama.cpp{note}", _times(ratio[n]), ratio[n] >= f)
                   for n, f in PEER_FLOORS.get(t, {}).items() if n in names]
    return lines, floors


def _other_figures(m: ModelReport, n_ctx: int) -> tuple[list[str], list[Floor]]:
    """Peak RSS, start times and the session, as bullet lines, and the floors they decide."""
    rss = max(e.peak_rss_mb for tr in m.isa("host").threads for e in tr.engines if e.engine == "detinfer")
    budget = (m.model_file_bytes + m.kv_bytes_at_n_ctx) / 2**20 + 150
    lines = [f"- Peak RSS (contract engine's worker, after the largest prefill): {rss:g} MB against GGUF "
             f"{m.model_file_bytes / 2**20:.1f} MB + KV at n_ctx {n_ctx} {m.kv_bytes_at_n_ctx / 2**20:.1f} MB."]
    floors = [("peak RSS ≤ GGUF + KV bytes + 150 MB", f"{rss:g} MB ≤ {budget:.0f} MB", rss <= budget)]
    if (s := m.start) is not None:
        lines.append(f"- Start to first token (`detinfer run --max-tokens 1`, whole process): cold (empty JIT cache) {_fmt(s.cold_s)} s, "
                     f"warm {_fmt(s.warm_s)} s; progress message while compiling: {'shown' if s.progress_message else 'NOT shown'}.")
        warm = WARM_START_FLOOR_S.get(m.model, 1.5)
        floors += [(f"warm start to first token ≤ {warm:g} s", f"{s.warm_s.median:g} s", s.warm_s.median <= warm),
                   (f"cold start ≤ {COLD_START_FLOOR_S:g} s with a progress message", f"{s.cold_s.median:g} s",
                    s.cold_s.median <= COLD_START_FLOOR_S and s.progress_message)]
    if (se := m.session) is not None:
        lines += [f"- {se.turns}-turn session ({se.history_tokens} history tokens): {_fmt(se.with_reuse_s)} s with prefix reuse vs "
                  f"{_fmt(se.no_cache_s)} s recomputing every prefix: {se.no_cache_s.median / se.with_reuse_s.median:.1f}× (medians).",
                  f"- KV snapshot of {se.snapshot_tokens} tokens: {se.snapshot_bytes:,} bytes, save {_fmt(se.snapshot_save_ms)} ms, "
                  f"load {_fmt(se.snapshot_load_ms)} ms."]
    return lines, floors


def _model_markdown(m: ModelReport, runs: int, n_ctx: int) -> list[str]:
    """A suite model's host section: every engine's figures, the ratios, the other figures and the floors."""
    if m.status == "skipped":
        return [f"## {display_name(m.model)}", "", f"Skipped: {m.reason}", ""]
    if m.isa("host") is None:
        return []
    threads = m.isa("host").threads
    names = list(threads[0].engines[0].figures)
    lines = [f"## {display_name(m.model)} (host)", "", f"Median (min–max) of {runs} run(s), tok/s; engines alternate run by run.", "",
             "| threads | engine | " + " | ".join(map(figure_label, names)) + " | peak RSS MB |", "|---" * (len(names) + 3) + "|"]
    lines += [f"| {tr.threads} | {e.engine} | " + " | ".join(_fmt(e.figures[n]) for n in names) + f" | {e.peak_rss_mb:g} |"
              for tr in threads for e in tr.engines]
    ratio_lines, ratio_floors = _ratio_rows(m, names)
    other_lines, other_floors = _other_figures(m, n_ctx)
    floors = ratio_floors + other_floors
    return (lines + [""] + (ratio_lines + [""] if len(ratio_lines) > 2 else []) + other_lines
            + floor_table(floors) + [""])


def kv_markdown(kv: KVCurve, folder: Path) -> list[str]:
    """The KV-cache curve section of docs/benchmarks.md (written in ``folder``, which the plot's link is relative to)."""
    lines = ["## KV cache vs recomputing the prefix", "",
             f"`detinfer bench kv` on {kv.date}: {kv.model}, {kv.threads} thread(s), greedy after a {kv.prompt_tokens}-token prompt. "
             f"The naive loop recomputes the whole sequence for every token"
             + (f" and stopped at its {kv.naive_budget_s:g} s budget after {len(kv.naive_step_s)} tokens" if kv.naive_stopped_early else "")
             + ". Tokens: " + (f"identical in all {kv.compared_tokens} steps compared." if kv.tokens_identical
                              else f"**differ** from step {kv.first_mismatch} (of {kv.compared_tokens} compared)."), ""]
    if kv.plot:
        lines += [f"![time per token and cumulative time against position]({os.path.relpath(kv.plot, folder)})", ""]
    lines += ["| tokens generated | with KV cache s | naive s | naive is | naive / cached |", "|---|---|---|---|---|"]
    lines += [f"| {t.tokens} | {t.cached_s:.3g} | {t.naive_s:.4g} | {t.naive_kind} | {t.ratio:.1f}× |" for t in kv.targets]
    last = kv.targets[-1]
    lines += ["", f"Floor: cached vs naive at {last.tokens} tokens ≥ 20× less total time: {last.ratio:.1f}× ({last.naive_kind}): "
              f"{_yes(last.ratio >= 20)}."]
    if kv.naive_stopped_early:
        lines.append("An extrapolated lower bound adds, for every step the naive arm did not run, the median time of its last "
                     "five measured steps: each later step recomputes a longer sequence, so it cannot be faster.")
    if kv.warnings:
        lines += [""] + [f"- warning: {w}" for w in kv.warnings]
    return lines + [""]


def markdown(report: BenchReport, folder: Path) -> str:
    """The report as docs/benchmarks.md in ``folder``: how the engines were built, one side-by-side table per ISA,
    the 1B-class table, each suite model's host figures, the KV-cache curve, warnings."""
    mc = report.machine
    lines = ["# Benchmarks", "",
             f"Generated by `make bench` (`detinfer bench`) on {report.date}: {mc['cpu']} ({mc.get('isa', '?')}), {mc['cores']} cores, "
             f"Python {mc['python']}, n_ctx {report.n_ctx}. Figures are measured, never asserted in tests; `detinfer-fastmath` is "
             "the same engine with fastmath kernels (benchmark only, not deterministic), the reference for the cost of the contract.", ""]
    if report.peer is None:
        lines += ["llama.cpp was not run side by side (`--peer llama-cpp`, peers built by `make bench-peers`); ratios marked "
                  "**reference** use the llama-cpp-python 0.3.36 figures measured on the same model and machine in NUMERICS.md.", ""]
    lines += builds_markdown(report)
    for isa in report.isas:
        lines += isa_markdown(report, isa)
    lines += large_markdown(report)
    for m in report.models:
        if m.kind == "suite":
            lines += _model_markdown(m, report.runs_per_figure, report.n_ctx)
    if report.kv_curve is not None:
        lines += kv_markdown(report.kv_curve, folder)
    if report.warnings:
        shown = report.warnings[:MAX_WARNINGS_SHOWN]
        lines += ["## Warnings during the runs", "", f"{len(report.warnings)} warning(s); the figures they name may be low.", ""]
        lines += [f"- {w}" for w in shown] + ([f"- … and {len(report.warnings) - len(shown)} more in the results file"]
                                              if len(report.warnings) > len(shown) else []) + [""]
    return "\n".join(lines)
