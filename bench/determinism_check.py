"""Full-engine logits must be the same bytes for every prefill chunk size, at 1 and 2 threads.

Usage: python bench/determinism_check.py OUT.npz   (writes the logits and their sha256; run it once on the host
target and once with NUMBA_CPU_NAME=generic NUMBA_CPU_FEATURES="" and a separate NUMBA_CACHE_DIR, then compare
the printed hashes). Prompt: ~70 tokens of chat-formatted text.
"""

from __future__ import annotations

import hashlib
import sys
import time

import numba
import numpy as np

from detinfer.engine import Engine

PROMPT = (
    "The quick brown fox jumps over the lazy dog. Determinism means that the same prompt, the same model and the "
    "same settings give the same bytes, whatever the thread count or the prefill chunk size. Write a short story "
    "about a lighthouse keeper who counts the waves every night, and what she finds on the beach after the storm."
)


def main() -> None:
    eng = Engine.load("smollm2-135m-instruct-q4_1", n_ctx=256)
    toks = eng.tokenizer.encode(PROMPT)
    print(f"{len(toks)} tokens; numba target {numba.config.CPU_NAME or 'host'}", flush=True)
    results = {}
    threads = [int(a) for a in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 2]
    for th in threads:
        if th > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(th)
        for chunk in (1, 7, 64, len(toks)):
            t0 = time.perf_counter()
            logits = eng.forward(toks, eng.new_cache(), all_logits=True, chunk_size=chunk)
            h = hashlib.sha256(logits.tobytes()).hexdigest()[:16]
            results[(th, chunk)] = logits
            print(f"threads={th} chunk={chunk:3d}: sha256 {h}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    ref = next(iter(results.values()))
    same = all(np.array_equal(ref.view(np.uint32), v.view(np.uint32)) for v in results.values())
    print("ALL IDENTICAL" if same else "MISMATCH", hashlib.sha256(ref.tobytes()).hexdigest())
    if len(sys.argv) > 1:
        np.savez(sys.argv[1], logits=ref)


if __name__ == "__main__":
    main()
