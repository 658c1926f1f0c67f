"""Matmul kernel timings on the real model weights: one forward's worth of matmuls, per kind, per token.

Usage: python bench/kernels.py [--threads 1,2] [--tokens 1,64] [--reps 7]. Prints the minimum over repeats
(this machine's timings are noisy) of: all Q4 layer matmuls, the output projection, and the sum, in ms per
token, plus the engine's decode and 64-token prefill rate. Timings only: results are never compared here
(tests/test_kernels.py checks the bytes). The standard suite is `detinfer bench`.

``--kinds Q8_0,Q4_1,Q5_0,...`` instead times one matmul call per GGML type on synthetic weights of the
shapes in ``--shapes`` (default 2048x640,640x2048, the Gemma 3 270M FFN), cycling through enough distinct
matrices (``--stream-mb``) that the weights stream from memory as in decode rather than sitting in cache.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from detinfer.compute.engine import Engine
from detinfer.compute.linear import Activations, matmul, project
from detinfer.model.weights import QMatrix

# Byte offsets of the f16 scale fields in each block (ggml-common.h), set to sane values in synthetic weights:
# random bytes there would give NaN, inf and subnormal scales, and subnormal arithmetic is slower.
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def sweep(mats, ins, outs) -> float:
    t0 = time.perf_counter()
    for mm, o in zip(mats, outs):
        x, xs = ins[mm.n_in]
        (matmul if isinstance(mm, QMatrix) else project)(mm, x, xs, o)
    return time.perf_counter() - t0


def synthetic_rows(kind: str, n_out: int, n_in: int, rng: np.random.Generator,
                   scale: tuple[float, float] = (1e-3, 2e-2)) -> np.ndarray:
    """Raw rows (uint8 [n_out, row_bytes]) of GGML type ``kind``: random bytes with f16 scales uniform in ``scale``."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (n_out * n_in // block, size), dtype=np.uint8)
    for o in F16_FIELDS[kind]:
        raw[:, o : o + 2] = rng.uniform(*scale, raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_out, -1)


def per_kind(kinds: list[str], shapes: list[tuple[int, int]], threads: list[int], tokens: list[int], reps: int, stream_mb: int) -> None:
    """ms per matmul call for each kind and shape, weights streamed from memory (see the module docstring)."""
    rng = np.random.default_rng(0)
    for n_out, n_in in shapes:
        mats = {}
        for kind in kinds:
            if n_in % GGML_QUANT_SIZES[GGMLQuantizationType[kind]][0]:
                continue
            one = QMatrix.from_raw(kind, GGMLQuantizationType[kind], synthetic_rows(kind, n_out, n_in, rng), n_in)
            mats[kind] = [one] + [QMatrix(kind, one.ggml_type, n_out, n_in, one.kind, tuple(a.copy() if isinstance(a, np.ndarray) else a for a in one.arrays))
                                  for _ in range(max(0, stream_mb * 2**20 // one.nbytes - 1))]
        for th in threads:
            if th > numba.config.NUMBA_NUM_THREADS:
                continue
            numba.set_num_threads(th)
            for T in tokens:
                x = rng.standard_normal((T, n_in)).astype(np.float32)
                ins = {n_in: (x, Activations.of(x))}
                outs = [np.empty((T, n_out), np.float32)]
                best = dict.fromkeys(mats, np.inf)
                for ms in mats.values():
                    sweep(ms[:1], ins, outs)  # compile outside the timing
                for _ in range(reps):  # kinds interleaved, so a burst of load elsewhere does not hit one kind only
                    for kind, ms in mats.items():
                        best[kind] = min(best[kind], sweep(ms, ins, outs * len(ms)) / len(ms))
                cols = [f"{kind} {b * 1e3:7.3f}" for kind, b in best.items()]
                print(f"{n_out}x{n_in} threads={th} T={T:3d} ms/call: " + "  ".join(cols), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", default="1,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--kinds", default="", help="time these GGML types on synthetic weights instead of the model")
    ap.add_argument("--shapes", default="2048x640,640x2048")
    ap.add_argument("--stream-mb", type=int, default=64)
    a = ap.parse_args()
    threads = [int(v) for v in a.threads.split(",")]
    tokens = [int(v) for v in a.tokens.split(",")]
    if a.kinds:
        shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
        per_kind(a.kinds.split(","), shapes, threads, tokens, a.reps, a.stream_mb)
        return
    eng = Engine.load("smollm2-135m-instruct-q4_1", n_ctx=1024)
    w = eng.weights
    layer_mats = [m for L in w.layers for m in (L.attn_qkv, L.attn_output, L.ffn_gate_up, L.ffn_down)]
    rng = np.random.default_rng(0)
    for th in threads:
        if th > numba.config.NUMBA_NUM_THREADS:
            continue
        numba.set_num_threads(th)
        for T in tokens:
            ins = {}
            for n_in in {m.n_in for m in layer_mats + [w.output]}:
                x = rng.standard_normal((T, n_in)).astype(np.float32)
                ins[n_in] = (x, Activations.of(x))
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
