"""Prefill throughput of an n-token prompt (default 512) at 1 and 2 threads: best of a few runs, in tok/s."""

from __future__ import annotations

import sys
import time

import numba

from detinfer.engine import Engine


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    threads = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2]
    eng = Engine.load("smollm2-135m-instruct-q4_1", n_ctx=max(1024, n))
    toks = [1000 + (i * 7919) % 40000 for i in range(n)]
    eng.forward(toks[:8], eng.new_cache())  # compile / warm up
    for th in threads:
        if th > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(th)
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter()
            eng.forward(toks, eng.new_cache())
            best = min(best, time.perf_counter() - t0)
        print(f"threads={th}: prefill({n}) {n / best:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
