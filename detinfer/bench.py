"""Benchmarks (``make bench``): prefill and decode throughput at 1 and 2 threads, peak RSS, warm start,
the 20-turn session with prefix reuse vs recomputation, and KV snapshot save/load.

Each thread count runs in its own process (numba's thread pool is per process, and peak RSS is per process).
Every figure is the median of ``--repeats`` runs with min and max. Results go to ``bench/results.json``.
Speed is measured here only, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .fileio import atomic_write_text
from .manifest import canonical_json, cpu_name

PREFILL_SIZES = (64, 512)
DECODE_TOKENS = 128
N_CTX = 4096


def _stats(samples: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(samples), 2), "min": round(min(samples), 2), "max": round(max(samples), 2)}


def _cpu_times() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # total, idle + iowait


def _busy_warning(window_s: float = 0.3) -> str | None:
    """A warning if other processes keep a core busy right now (2-thread numba runs slow down many-fold then)."""
    try:
        total0, idle0 = _cpu_times()
        time.sleep(window_s)
        total1, idle1 = _cpu_times()
    except OSError:
        return None
    busy = (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(1, total1 - total0))
    return f"{busy:.1f} cores busy before a run: figures may be low" if busy > 0.3 else None


def worker(model: str | None, threads: int, repeats: int) -> dict:
    """Measure in this process: returns tok/s statistics and peak RSS."""
    from .engine import Engine, set_threads

    set_threads(threads)
    engine = Engine.load(model, n_ctx=N_CTX)
    text = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
    ids = engine.tokenizer.encode(text)
    engine.forward(ids[:8], engine.new_cache())  # compile / load every kernel before timing
    results: dict[str, object] = {"threads": threads, "warnings": []}
    for n in PREFILL_SIZES:
        rates = []
        for _ in range(repeats):
            if (w := _busy_warning()) is not None:
                results["warnings"].append(w)
            cache = engine.new_cache()
            t0 = time.perf_counter()
            engine.forward(ids[:n], cache)
            rates.append(n / (time.perf_counter() - t0))
        results[f"prefill_{n}_tok_s"] = _stats(rates)
    rates = []
    for _ in range(repeats):
        cache = engine.new_cache()
        logits = engine.forward(ids[:16], cache)
        t0 = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            logits = engine.forward([int(logits.argmax())], cache)
        rates.append(DECODE_TOKENS / (time.perf_counter() - t0))
    results[f"decode_{DECODE_TOKENS}_tok_s"] = _stats(rates)
    results["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    results["kv_bytes_at_n_ctx"] = engine.kv_bytes()
    results["model_file_bytes"] = engine.model_file.size
    return results


def session_bench(model: str | None, threads: int) -> dict:
    """The 20-turn scripted session (tests/data/agent20.json) with prefix reuse vs recomputing every prefix, and
    KV snapshot save/load time and size per 1,000 tokens."""
    import tempfile

    from .engine import Engine, set_threads
    from .kvfile import load_kv, save_kv
    from .prefix_cache import PrefixCache
    from .session import load_script, replay_turns, run_session

    set_threads(threads)
    script = load_script(Path(__file__).resolve().parent.parent / "tests" / "data" / "agent20.json")
    engine = Engine.load(model or script.model, n_ctx=2048)
    t0 = time.perf_counter()
    record = run_session(engine, script.turns, script.sampling, prefix_cache=PrefixCache(1 << 30))
    cached_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    replayed = replay_turns(engine, record, use_cache=False)
    naive_s = time.perf_counter() - t0
    assert all(not diffs for _, diffs, _ in replayed), "the no-cache replay must give the same bytes"
    cache = engine.new_cache()
    text = " ".join(f"line {i} of the snapshot benchmark text." for i in range(200))
    engine.forward(engine.tokenizer.encode(text)[:1000], cache)
    result = {"turns": len(record.turns), "history_tokens": sum(len(t.appended_token_ids) + len(t.generated_token_ids) for t in record.turns),
              "with_reuse_s": round(cached_s, 2), "no_cache_s": round(naive_s, 2), "speedup": round(naive_s / cached_s, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.detkv"
        t0 = time.perf_counter()
        size = save_kv(path, cache, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
        save_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        load_kv(path, model_sha256=engine.model_file.sha256)
        load_s = time.perf_counter() - t0
    result.update({"snapshot_tokens": cache.n_tokens, "snapshot_bytes": size, "snapshot_save_ms": round(save_s * 1e3, 1),
                   "snapshot_load_ms": round(load_s * 1e3, 1)})
    return result


def warm_start(model: str | None, repeats: int) -> dict[str, float]:
    """Seconds from process start to the end of a one-token `detinfer run` (JIT cache warm)."""
    cmd = [sys.executable, "-m", "detinfer.cli", "run", "--prompt", "Hello", "--max-tokens", "1", "--quiet"]
    if model:
        cmd += ["--model", model]
    subprocess.run(cmd, check=True, capture_output=True)  # fills the JIT cache
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return _stats(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("mode", nargs="?", default="suite", choices=["suite", "worker", "session"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results.json")
    ap.add_argument("--markdown", default="docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.mode == "worker":
        print(json.dumps(worker(args.model, args.threads, args.repeats)))
        return 0
    if args.mode == "session":
        print(json.dumps(session_bench(args.model, args.threads)))
        return 0
    runs = []
    for threads in (1, 2):
        cmd = [sys.executable, "-m", "detinfer.bench", "worker", "--threads", str(threads), "--repeats", str(args.repeats)]
        if args.model:
            cmd += ["--model", args.model]
        env = dict(os.environ, NUMBA_NUM_THREADS=str(max(2, threads)))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        runs.append(json.loads(proc.stdout))
        print(json.dumps(runs[-1]), flush=True)
    proc = subprocess.run([sys.executable, "-m", "detinfer.bench", "session", "--threads", "2"] + (["--model", args.model] if args.model else []),
                          capture_output=True, text=True, env=dict(os.environ, NUMBA_NUM_THREADS="2"))
    if proc.returncode != 0:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    session = json.loads(proc.stdout)
    print(json.dumps(session), flush=True)
    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": args.model or "smollm2-135m-instruct-q4_1",
        "n_ctx": N_CTX,
        "runs": runs,
        "session_20_turns": session,
        "warm_start_to_first_token_s": warm_start(args.model, args.repeats),
    }
    atomic_write_text(args.out, canonical_json(report))
    atomic_write_text(args.markdown, markdown(report))
    print(f"wrote {args.out} and {args.markdown}")
    return 0


def markdown(report: dict) -> str:
    """The results as a markdown table (docs/benchmarks.md)."""
    fmt = lambda s: f"{s['median']} ({s['min']}–{s['max']})"  # noqa: E731
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `make bench` on {report['date']}: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
        f"model {report['model']}, n_ctx {report['n_ctx']}. Each figure: median (min–max) of the runs.",
        "",
        "| threads | prefill 64 tok/s | prefill 512 tok/s | decode 128 tok/s | peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(f"| {r['threads']} | {fmt(r['prefill_64_tok_s'])} | {fmt(r['prefill_512_tok_s'])} | "
                     f"{fmt(r['decode_128_tok_s'])} | {r['peak_rss_mb']} |")
    s = report["session_20_turns"]
    w = report["warm_start_to_first_token_s"]
    lines += [
        "",
        f"- Peak RSS vs GGUF size + KV bytes: {report['runs'][-1]['peak_rss_mb']} MB vs "
        f"{report['runs'][-1]['model_file_bytes'] / 1e6:.1f} MB + {report['runs'][-1]['kv_bytes_at_n_ctx'] / 1e6:.1f} MB.",
        f"- Warm start to first token (`detinfer run --max-tokens 1`, whole process): {fmt(w)} s.",
        f"- 20-turn session ({s['history_tokens']} history tokens): {s['with_reuse_s']} s with prefix reuse vs "
        f"{s['no_cache_s']} s recomputing every prefix: {s['speedup']}x.",
        f"- KV snapshot of {s['snapshot_tokens']} tokens: {s['snapshot_bytes']:,} bytes, save {s['snapshot_save_ms']} ms, "
        f"load {s['snapshot_load_ms']} ms.",
    ]
    warnings = sorted({w for r in report["runs"] for w in r["warnings"]})
    if warnings:
        lines += ["", "Warnings during the runs (figures may be low): " + "; ".join(warnings)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
