"""Matmul kernel timings on the real model weights: one forward's worth of matmuls, per kind, per token.

Usage: python bench/kernels.py [--threads 1,2] [--tokens 1,64] [--reps 7]. Prints the minimum over repeats
(this machine's timings are noisy) of: all Q4 layer matmuls, the output projection, and the sum, in ms per
token, plus the engine's decode and 64-token prefill rate. Timings only: results are never compared here
(tests/test_kernels.py checks the bytes). The standard suite is `detinfer bench`.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from detinfer import kernels
from detinfer.engine import Engine


def sweep(mats, ins, outs) -> float:
    t0 = time.perf_counter()
    for mm, o in zip(mats, outs):
        x, xs = ins[mm.n_in]
        mm(x, xs, o)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    eng = Engine.load("smollm2-135m-instruct-q4_1", n_ctx=1024)
    w = eng.weights
    layer_mats = [m for L in w.layers for m in (L.attn_qkv, L.attn_output, L.ffn_gate_up, L.ffn_down)]
    rng = np.random.default_rng(0)
    for th in [int(v) for v in a.threads.split(",")]:
        if th > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(th)
        for T in [int(v) for v in a.tokens.split(",")]:
            ins = {}
            for n_in in {m.n_in for m in layer_mats + [w.output]}:
                x = rng.standard_normal((T, n_in)).astype(np.float32)
                xs = np.empty((T, n_in // kernels.QK), np.float32)
                kernels.block_sums(x, xs)
                ins[n_in] = (x, xs)
            louts = [np.empty((T, m.n_out), np.float32) for m in layer_mats]
            oout = [np.empty((T, w.output.n_out), np.float32)]
            best_l = min(sweep(layer_mats, ins, louts) for _ in range(a.reps))
            best_o = min(sweep([w.output], ins, oout) for _ in range(a.reps))
            print(
                f"threads={th} T={T:3d}: layer matmuls {best_l / T * 1e3:6.2f} ms/token, "
                f"output {best_o / T * 1e3:6.2f} ms/token, sum {(best_l + best_o) / T * 1e3:6.2f}",
                flush=True,
            )
        toks = list(range(1000, 1064))
        best_p, best_d = 1e9, 1e9
        for _ in range(3):
            c = eng.new_cache()
            t0 = time.perf_counter()
            logits = eng.forward(toks, c)
            best_p = min(best_p, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(32):
                logits = eng.forward([int(logits.argmax())], c)
            best_d = min(best_d, time.perf_counter() - t0)
        print(f"threads={th}: engine prefill(64) {64 / best_p:6.1f} tok/s, decode {32 / best_d:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
