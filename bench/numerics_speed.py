"""A/B speed of two detinfer checkouts (default: git HEAD~N vs this working tree) on prefill and decode, 1 thread.

    .venv/bin/python bench/numerics_speed.py --base REV [--rounds 15] [--model NAME ...]

Each side is one long-lived worker process (its own NUMBA_CACHE_DIR) holding the loaded engine; the rounds
alternate A, B, A, B ... so both see the same load on a shared machine, and the minimum over rounds is reported
(the least disturbed run). A round: prefill 64 tokens into a fresh KV cache, then decode 32 tokens one by one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = list(range(100, 164))  # 64 token ids, valid in both vocabularies


def worker(model: str) -> None:
    from detinfer.compute.engine import Engine, set_threads

    set_threads(1)
    engine = Engine.load(model, n_ctx=256)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        cache = engine.new_cache()
        t0 = time.perf_counter()
        logits = engine.forward(PROMPT, cache)
        t1 = time.perf_counter()
        for _ in range(32):
            logits = engine.forward([int(logits.argmax())], cache)
        t2 = time.perf_counter()
        print(json.dumps({"prefill": t1 - t0, "decode": (t2 - t1) / 32}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the A side")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--model", action="append", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        archive = subprocess.run(["git", "archive", args.base, "detinfer"], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        print(f"| model | figure | A: {args.base} | B: working tree | B / A |\n|---|---|---|---|---|")
        for model in args.model or ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"]:
            procs = {}
            for side, path in (("A", base), ("B", ROOT)):
                env = {**os.environ, "PYTHONPATH": str(path), "NUMBA_NUM_THREADS": "1", "NUMBA_CACHE_DIR": f"{tmp}/cache-{side}"}
                procs[side] = subprocess.Popen([sys.executable, __file__, "--base", args.base, "--worker", model], cwd=tmp,
                                               env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            best = {side: {"prefill": float("inf"), "decode": float("inf")} for side in procs}
            for _ in range(args.rounds + 1):  # the first round warms up (JIT compile or cache load), not counted
                for side, p in procs.items():
                    p.stdin.write("go\n")
                    p.stdin.flush()
                    r = json.loads(p.stdout.readline())
                    if _ > 0:
                        best[side] = {k: min(best[side][k], r[k]) for k in r}
            for p in procs.values():
                p.stdin.close()
                p.wait()
            for k, unit, scale in (("prefill", "ms for 64 tokens", 1e3), ("decode", "ms per token", 1e3)):
                a, b = best["A"][k] * scale, best["B"][k] * scale
                print(f"| {model} | {k} ({unit}) | {a:.2f} | {b:.2f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
