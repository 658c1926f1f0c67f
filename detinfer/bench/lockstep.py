"""``detinfer bench lockstep``: the wall time of ``detinfer verify`` and ``detinfer batch`` one file at a time
(``--batch 1``) and in lockstep (``--batch N``: N sequences of a model per forward step), as a user runs them.

Every figure is a ``detinfer`` subprocess, model loads included, at each thread count; ``runs`` runs per arm,
alternating, after one warm-up of each. Three workloads: the committed ``manifests/`` folder (short outputs,
two 1.6k-token prefills, constrained runs); a JSONL batch of decode-heavy lines on both models (``LINES``), run
with ``detinfer batch``, whose folders of manifests must be byte-identical across arms; and ``verify`` of that
folder. A verify that does not match every file, or folders that differ, is an error, never a figure. The floor
(issue 35): ``verify manifests/`` at least 1.8x faster batched. Results go to ``bench/lockstep.json`` and a section
of docs/benchmarks.md (kept when the main suite rewrites it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..compute.lockstep import DEFAULT_BATCH
from ..errors import DetinferError, InputError
from .report import LOCKSTEP_BEGIN, LOCKSTEP_END, floor_table, stats, write_section
from .suite import _machine, machine_line

FLOOR = 1.8  # verify manifests/: one by one over lockstep
TOPICS = ("a lighthouse", "the moon", "a market", "an old clock", "a storm", "a garden", "a letter", "a train")
MAX_TOKENS = 96


def lines(models: Sequence[str]) -> list[dict]:
    """The decode-heavy batch: per model, one sampled chat line per topic of :data:`TOPICS`."""
    return [{"id": f"m{m}-{i}", "model": model, "chat": True, "chat_template": None if m == 0 else "gemma",
             "prompt": f"Write a short story about {topic}.", "sampling": {"temperature": 0.8, "seed": i, "max_tokens": MAX_TOKENS}}
            for m, model in enumerate(models) for i, topic in enumerate(TOPICS)]  # fmt: skip


def _detinfer(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "detinfer.cli", *args], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise DetinferError(f"detinfer {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return seconds, done.stdout


def _verify(folder: Path, batch: int, threads: int) -> float:
    seconds, stdout = _detinfer(["verify", str(folder), "--batch", str(batch), "--threads", str(threads), "--json"])
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    files = [r for r in rows if "status" in r and "path" in r]
    if not files or any(r["status"] != "match" for r in files):
        raise DetinferError(f"verify {folder} --batch {batch} did not match every file; report this")
    return seconds


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.json"))}


def run_lockstep(models: Sequence[str], *, threads: Sequence[int], runs: int, manifests: Path,
                 progress: Callable[[str], None]) -> dict:  # fmt: skip
    """Every workload at ``--batch 1`` and ``--batch DEFAULT_BATCH`` for each thread count (see the module docstring).
    Raises InputError for ``runs`` < 1 or a missing ``manifests`` folder, DetinferError if an arm changed a result."""
    if runs < 1:
        raise InputError(f"--runs must be at least 1, got {runs}")
    if not manifests.is_dir():
        raise InputError(f"{manifests} is not a folder of manifests; run the bench from the checkout")
    arms = (1, DEFAULT_BATCH)
    out: dict = {"machine": _machine(), "runs": runs, "batch": DEFAULT_BATCH, "max_tokens": MAX_TOKENS,
                 "lines": len(lines(models)), "threads": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "batch.jsonl").write_text("\n".join(json.dumps(line) for line in lines(models)) + "\n", encoding="utf-8")
        for n in threads:
            times: dict[str, dict[int, list[float]]] = {w: {b: [] for b in arms} for w in ("verify manifests/", "batch", "verify batch")}
            for run in range(runs + 1):  # run 0 warms up (numba's cache, the page cache)
                for b in arms:
                    progress(f"{n} thread(s), --batch {b}, run {run}/{runs}")
                    folder = work / f"out-{b}"
                    shutil.rmtree(folder, ignore_errors=True)
                    figures = {"verify manifests/": _verify(manifests, b, n),
                               "batch": _detinfer(["batch", str(work / "batch.jsonl"), "--out-dir", str(folder), "--batch", str(b),
                                                   "--threads", str(n)])[0],
                               "verify batch": _verify(folder, b, n)}  # fmt: skip
                    if run > 0:
                        for w, s in figures.items():
                            times[w][b].append(s)
                if _folder_bytes(work / "out-1") != _folder_bytes(work / f"out-{DEFAULT_BATCH}"):
                    raise DetinferError("detinfer batch wrote other manifests in lockstep; report this")
            out["threads"][str(n)] = {w: {str(b): stats(t).model_dump() for b, t in per.items()} for w, per in times.items()}
    return out


def floors(result: dict) -> list[tuple[str, str, bool]]:
    b = str(result["batch"])
    rows = []
    for n, row in result["threads"].items():
        ratio = row["verify manifests/"]["1"]["median"] / row["verify manifests/"][b]["median"]
        rows.append((f"{n}t: verify manifests/ --batch {b} >= {FLOOR}x faster than --batch 1", f"{ratio:.2f}x", ratio >= FLOOR))
    return rows


def markdown(result: dict) -> str:
    """The section of docs/benchmarks.md, between LOCKSTEP_BEGIN and LOCKSTEP_END."""
    m, b = result["machine"], str(result["batch"])
    lines_ = [LOCKSTEP_BEGIN, "## verify and batch in lockstep (`detinfer bench lockstep`)", "",
              f"{machine_line(m)}. Wall seconds of a `detinfer` process (model loads included), median of "
              f"{result['runs']} runs (min–max), one file at a time (`--batch 1`) and {b} sequences per forward step "
              f"(`--batch {b}`). *batch*: `detinfer batch` of {result['lines']} sampled chat lines of up to "
              f"{result['max_tokens']} tokens on both models, whose manifests were byte-identical in both arms (checked); "
              "*verify batch*: `detinfer verify` of those manifests. Every verify matched every file.", "",
              "| threads | workload | --batch 1 | --batch " + b + " | speed-up |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    for n, row in result["threads"].items():
        for w, per in row.items():
            one, many = per["1"], per[b]
            lines_.append(f"| {n} | {w} | {one['median']:g} ({one['min']:g}–{one['max']:g}) | {many['median']:g} "
                          f"({many['min']:g}–{many['max']:g}) | {one['median'] / many['median']:.2f}x |")  # fmt: skip
    lines_ += floor_table(floors(result))
    return "\n".join(lines_ + ["", LOCKSTEP_END]) + "\n"


def write_lockstep(result: dict, out: Path, markdown_path: Path) -> None:
    write_section(result, out, markdown_path, markdown(result), LOCKSTEP_BEGIN, LOCKSTEP_END)
