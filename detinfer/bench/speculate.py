"""``detinfer bench speculate``: decode tok/s with and without ``--speculate ngram``, on a task that repeats its
context (a tool result and a list to be quoted back in full) and on free text.

In process, one engine per model, at each thread count (held with compute.threads.fixed_threads); the plain and
the speculative run alternate, ``runs`` times each, after one warm-up of both. Every speculative run's tokens,
logits digests and KV digest are compared with the plain run's: a difference is an error, never a figure. Figures
are the median (min, max) of decode tok/s, with the share of drafted tokens taken. The floors (issue 35): at
least 1.8x on the repeating task, at least 0.95x on free text. With a llama.cpp peer, its own prompt lookup against
its plain decoding on the same prompt ids, and whether lookup kept its text (bench/worker.py ``lookup_figures``). Results go to ``bench/speculate.json`` and a section
of docs/benchmarks.md (kept when the main suite rewrites the file).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ..compute.engine import Engine
from ..compute.generate import GenerationResult, generate
from ..compute.sampling import Sampling
from ..compute.threads import fixed_threads
from ..errors import DetinferError, InputError
from ..model.chat import ChatTemplate
from ..records.run import build_prompt
from .report import SPECULATE_BEGIN, SPECULATE_END, display_name, floor_table, stats, write_section
from .suite import _machine, machine_line, peer_dir, worker_env

_TOOL_RESULT = {"location": "Lyon, France", "forecast": [
    {"day": "Monday", "high_c": 14, "low_c": 6, "conditions": "light rain"},
    {"day": "Tuesday", "high_c": 16, "low_c": 7, "conditions": "cloudy"},
    {"day": "Wednesday", "high_c": 19, "low_c": 9, "conditions": "sunny"}], "units": "metric"}
TASKS = {
    "repeat": [
        {"role": "user", "content": "Call the weather tool for Lyon."},
        {"role": "assistant", "content": "The tool returned:\n" + json.dumps(_TOOL_RESULT, indent=2)},
        {"role": "user", "content": "Repeat the tool result above back to me exactly, in full, as JSON."},
    ],
    "free": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message in a bottle."}],
}
MAX_TOKENS = 160
FLOORS = {"repeat": 1.8, "free": 0.95}
ARMS = ("plain", "ngram")


def _generate(engine: Engine, prompt: list[int], speculate: str | None) -> GenerationResult:
    res = GenerationResult()
    for _ in generate(engine, prompt, Sampling(max_tokens=MAX_TOKENS), result=res, speculate=speculate):
        pass
    return res


def _bytes(res: GenerationResult) -> tuple:
    return res.tokens, res.digests, res.kv_sha256


def _llama_cpp(model: str, n: int, runs: int, prompts: dict[str, list[int]], peers_dir: Path) -> dict:
    """llama.cpp's prompt lookup vs its plain decoding on ``prompts`` (bench/worker.py lookup_figures), in a worker
    process that imports the host peer."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "prompts.json"
        path.write_text(json.dumps(prompts))
        done = subprocess.run([sys.executable, "-m", "detinfer.bench.worker", "lookup", "--model", model, "--threads", str(n),
                               "--runs", str(runs), "--prompts", str(path), "--tokens", str(MAX_TOKENS)],
                              capture_output=True, text=True, env=worker_env("llama-cpp", "host", n, peers_dir))  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise DetinferError(f"the llama.cpp lookup worker failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1])


def run_speculate(models: Sequence[str], *, threads: Sequence[int], runs: int, progress: Callable[[str], None],
                  peer: bool = False, peers_dir: Path = Path(".bench")) -> dict:  # fmt: skip
    """Every task of :data:`TASKS`, greedy, for every model and thread count (see the module docstring); with
    ``peer``, llama.cpp's prompt lookup beside it on the same prompt ids. Raises InputError for ``runs`` < 1 or a
    peer that is not built, DetinferError if speculation changed a byte."""
    if runs < 1:
        raise InputError(f"--runs must be at least 1, got {runs}")
    if peer and not (peer_dir(peers_dir, "host") / "BUILD").exists():
        raise InputError(f"no llama.cpp build in {peer_dir(peers_dir, 'host')}; run `make bench-peers` or drop --peer")
    out: dict = {"machine": _machine(), "runs": runs, "max_tokens": MAX_TOKENS, "models": {}}
    for model in models:
        engine = Engine.load(model, n_ctx=1024)
        template = None if engine.chat_template is not None else ChatTemplate.builtin("gemma")  # Gemma 3 270M is a base model
        per_model: dict = {}
        for n in threads:
            with fixed_threads(n):
                row: dict = {}
                prompts = {task: build_prompt(engine, messages=messages, template=template).token_ids for task, messages in TASKS.items()}
                for task, prompt in prompts.items():
                    progress(f"{display_name(model)}: {n} thread(s), {task}")
                    results = {arm: [_generate(engine, prompt, None if arm == "plain" else arm)] for arm in ARMS}  # warm-up
                    for _ in range(runs):
                        for arm in ARMS:
                            results[arm].append(_generate(engine, prompt, None if arm == "plain" else arm))
                    want = _bytes(results["plain"][0])
                    if any(_bytes(r) != want for rs in results.values() for r in rs):
                        raise DetinferError(f"{display_name(model)} {task}: speculative decoding changed the output; report this")
                    last = results["ngram"][-1]
                    row[task] = {
                        "tokens": len(last.tokens),
                        "drafted": last.draft_tokens,
                        "accepted": last.accepted_tokens,
                        **{arm: stats([r.timings.decode_tokens / r.timings.decode_s for r in rs[1:]]).model_dump() for arm, rs in results.items()},
                    }
                if peer:
                    progress(f"{display_name(model)}: {n} thread(s), llama.cpp lookup")
                    for task, fig in _llama_cpp(model, n, runs, prompts, peers_dir).items():
                        row[task]["llama_cpp"] = fig
                per_model[str(n)] = row
        out["models"][model] = per_model
    return out


def floors(result: dict) -> list[tuple[str, str, bool]]:
    """(floor, measured, holds) for every model, thread count and task."""
    rows = []
    for model, per_model in result["models"].items():
        for n, row in per_model.items():
            for task, fig in row.items():
                ratio = fig["ngram"]["median"] / fig["plain"]["median"]  # detinfer's own floors
                rows.append((f"{display_name(model)} {n}t {task}: ngram >= {FLOORS[task]}x plain", f"{ratio:.2f}x", ratio >= FLOORS[task]))
    return rows


def markdown(result: dict) -> str:
    """The section of docs/benchmarks.md, between SPECULATE_BEGIN and SPECULATE_END."""
    m = result["machine"]
    lines = [SPECULATE_BEGIN, "## Speculative decoding (`detinfer bench speculate`)", "",
             f"{machine_line(m)}, greedy, up to {result['max_tokens']} tokens, decode tok/s median of "
             f"{result['runs']} runs (min–max). *repeat*: the model quotes a tool result from its context back in full; "
             "*free*: a short story. Every speculative run gave the plain run's tokens, logits digests and KV digest "
             "(checked by the bench). Taken: drafted tokens that were sampled as drafted.", "",
             "| model | threads | task | tokens | plain | ngram | speed-up | taken |", "|---|---:|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for model, per_model in result["models"].items():
        for n, row in per_model.items():
            for task, f in row.items():
                p, s = f["plain"], f["ngram"]
                taken = f"{f['accepted']}/{f['drafted']}" if f["drafted"] else "0/0"
                lines.append(f"| {display_name(model)} | {n} | {task} | {f['tokens']} | {p['median']:g} ({p['min']:g}–{p['max']:g}) | "
                             f"{s['median']:g} ({s['min']:g}–{s['max']:g}) | {s['median'] / p['median']:.2f}x | {taken} |")  # fmt: skip
    peer = [(model, n, task, f["llama_cpp"]) for model, per_model in result["models"].items() for n, row in per_model.items()
            for task, f in row.items() if "llama_cpp" in f]  # fmt: skip
    if peer:
        lines += ["", "llama.cpp's own speculation on the same prompt ids (llama-cpp-python's prompt lookup, "
                  "`LlamaPromptLookupDecoding(num_pred_tokens=10)`, against its plain greedy decoding; decode tok/s: the "
                  "completion's tokens over its wall time minus a prefill alone). *same text*: whether lookup gave the text "
                  "plain decoding gave.", "", "| model | threads | task | plain | lookup | speed-up | same text |",
                  "|---|---:|---|---:|---:|---:|---|"]  # fmt: skip
        for model, n, task, f in peer:
            p, s = f["plain"], f["lookup"]
            lines.append(f"| {display_name(model)} | {n} | {task} | {p['median']:g} ({p['min']:g}–{p['max']:g}) | "
                         f"{s['median']:g} ({s['min']:g}–{s['max']:g}) | {s['median'] / p['median']:.2f}x | {'yes' if f['same_text'] else '**no**'} |")  # fmt: skip
    lines += floor_table(floors(result))
    return "\n".join(lines + ["", SPECULATE_END]) + "\n"


def write_speculate(result: dict, out: Path, markdown_path: Path) -> None:
    """``result`` as JSON at ``out`` and as the speculation section of ``markdown_path`` (replaced, or appended)."""
    write_section(result, out, markdown_path, markdown(result), SPECULATE_BEGIN, SPECULATE_END)
