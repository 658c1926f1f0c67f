"""Benchmarks (``make bench``): prefill and decode throughput at 1 and 2 threads, peak RSS, warm start.

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


def _busy_warning() -> str | None:
    load = os.getloadavg()[0]
    return f"load average {load:.2f}: another process may be using a core" if load > 0.5 else None


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
    ap.add_argument("mode", nargs="?", default="suite", choices=["suite", "worker"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results.json")
    args = ap.parse_args(argv)
    if args.mode == "worker":
        print(json.dumps(worker(args.model, args.threads, args.repeats)))
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
    report = {
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "model": args.model or "smollm2-135m-instruct-q4_1",
        "n_ctx": N_CTX,
        "runs": runs,
        "warm_start_to_first_token_s": warm_start(args.model, args.repeats),
    }
    atomic_write_text(args.out, canonical_json(report))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
