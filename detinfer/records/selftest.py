"""The determinism matrix: every invariance the contract promises, checked by bytes on this machine.

``python -m detinfer.records.selftest --threads N --chunk-size K`` prints one fingerprint as JSON, so invariances across
processes (thread counts, fresh processes, compile targets) are checked by comparing the output of separate runs.
:func:`matrix` runs them all (``detinfer selftest``), plus a negative control: the same engine with one
reduction reassociated must be detected as differing, or the matrix proves nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numba
import numpy as np
from numba import njit

from ..compute import kernels
from ..compute.engine import Engine, set_threads
from ..compute.generate import GenerationResult, generate
from ..compute.sampling import Sampling
from ..compute.threads import fixed_threads
from ..errors import DetinferError
from .kvfile import load_kv, save_kv

DEFAULT_TEXT = (
    "Once upon a time, in a small village at the edge of a great forest, there lived a wise old woman who "
    "kept bees. Every morning she walked to the river, counted 17 stones, and sang to the water. "
    "One day a traveller asked her why. She smiled, pointed at the hives, and said: \"The bees taught me "
    "patience; the river taught me to listen. Sit, and I will tell you the rest.\""
)


def fingerprint(engine: Engine, tokens: list[int], *, chunk_size: int, gen_tokens: int = 8, seed: int = 7,
                speculate: str | None = None, result: GenerationResult | None = None) -> dict:  # fmt: skip
    """sha256 of the logits at every prompt position and of the KV cache after the prompt, plus a seeded
    sampled continuation (token ids and logits digest chain) of ``gen_tokens`` tokens, decoded with the drafter
    ``speculate`` if given; ``result`` receives the continuation (its draft counts)."""
    cache = engine.new_cache()
    logits = engine.forward(tokens, cache, all_logits=True, chunk_size=chunk_size)
    res = result if result is not None else GenerationResult()
    sampling = Sampling.create(temperature=0.8, top_p=0.9, top_k=40, seed=seed, max_tokens=gen_tokens, ignore_eos=True)
    for _ in generate(engine, tokens, sampling, chunk_size=chunk_size, result=res, speculate=speculate):
        pass
    return {
        "prompt_logits_sha256": hashlib.sha256(logits.astype("<f4").tobytes()).hexdigest(),
        "prompt_kv_sha256": cache.digest(),
        "generated": res.tokens,
        "final_digest": res.digests[-1],
        "final_kv_sha256": res.kv_sha256,
    }


@dataclass
class Row:
    """One invariance: "identical", or "differs" with the largest |delta logit| and first divergent position."""

    invariance: str
    result: str
    max_abs_delta: float | None = None
    first_divergent: int | None = None
    note: str = ""


def _compare_logits(name: str, a: np.ndarray, b: np.ndarray, kv_a: str, kv_b: str) -> Row:
    rows = np.nonzero((a.view(np.uint32) != b.view(np.uint32)).any(axis=1))[0]
    if len(rows) == 0 and kv_a == kv_b:
        return Row(name, "identical")
    return Row(name, "differs", float(np.abs(a - b).max()), int(rows[0]) if len(rows) else None, "" if kv_a == kv_b else "KV bytes differ")


def _compare_fingerprints(name: str, a: dict, b: dict) -> Row:
    if a == b:
        return Row(name, "identical")
    ga, gb = a["generated"], b["generated"]
    step = next((i for i in range(min(len(ga), len(gb))) if ga[i] != gb[i]), None)
    differing = ", ".join(k for k in sorted(a) if a[k] != b.get(k))
    return Row(name, "differs", None, step, f"differs: {differing}")


def probe_process(model: str | None, *, threads: int | None = None, env: dict | None = None, kv_type: str = "f32", text: str = DEFAULT_TEXT) -> dict:
    """Fingerprint computed in a fresh process (``python -m detinfer.records.selftest``)."""
    cmd = [sys.executable, "-m", "detinfer.records.selftest", "--kv-type", kv_type, "--text", text]
    if model:
        cmd += ["--model", str(model)]
    if threads:
        cmd += ["--threads", str(threads)]
    full_env = dict(os.environ, **(env or {}))
    if threads:
        full_env["NUMBA_NUM_THREADS"] = str(max(threads, int(full_env.get("NUMBA_NUM_THREADS", 0) or 0), os.cpu_count() or 1))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env)
    if proc.returncode != 0:
        raise DetinferError(f"selftest probe failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout)


@njit(cache=True)
def _rmsnorm_reassociated(x, w, eps, out):
    """Negative control: RMSNorm with the sum of squares taken right to left (otherwise identical)."""
    n = x.shape[1]
    for t in range(x.shape[0]):
        xt = x[t]
        ss = np.float32(0.0)
        for i in range(n - 1, -1, -1):
            ss += xt[i] * xt[i]
        scale = np.float32(1.0) / np.float32(math.sqrt(ss / np.float32(n) + eps))
        ot = out[t]
        for i in range(n):
            ot[i] = (xt[i] * scale) * w[i]


@contextmanager
def reassociated_rmsnorm():
    """Temporarily run the engine with :func:`_rmsnorm_reassociated` (for the negative control only)."""
    original = kernels.rmsnorm
    kernels.rmsnorm = _rmsnorm_reassociated
    try:
        yield
    finally:
        kernels.rmsnorm = original


def _batch_row(engine: Engine, tokens: list[int]) -> Row:
    """One batched forward step of four sequences (decode rows, a prefill chunk, a draft window; each its own cache
    and positions) against each run alone: logits and KV bytes."""
    cut = lambda a, b: tokens[min(a, len(tokens) - 1) : min(b, len(tokens))]  # noqa: E731
    seqs = [(cut(0, 10), cut(10, 11), False), ([], cut(0, 7), False), (cut(0, 20), cut(20, 25), True), (cut(0, 3), cut(3, 4), True)]

    def holding(prefix: list[int]):
        cache = engine.new_cache()
        if prefix:
            engine.forward(prefix, cache)
        return cache

    alone = []
    for prefix, new, all_logits in seqs:
        cache = holding(prefix)
        alone.append((engine.forward(new, cache, all_logits=all_logits).tobytes(), cache.digest()))
    caches = [holding(prefix) for prefix, _, _ in seqs]
    batched = engine.forward_batch([(new, cache, all_logits) for (_, new, all_logits), cache in zip(seqs, caches)])
    got = [(logits.tobytes(), cache.digest()) for logits, cache in zip(batched, caches)]
    differing = [i for i, (a, b) in enumerate(zip(got, alone)) if a != b]
    name = "batched forward (4 sequences: decode rows, a prefill chunk, a draft window) vs each alone"
    return Row(name, "identical") if not differing else Row(name, "differs", None, None, f"sequences {differing} differ")


def matrix(engine: Engine, model: str | None, *, text: str = DEFAULT_TEXT, processes: bool = True,
           on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Run every invariance of the contract on ``text``; returns one Row each (in process and, with
    ``processes``, across fresh processes: threads 1 vs all cores, two fresh processes, compile targets)."""
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        if on_row:
            on_row(row)

    tokens = engine.tokenizer.encode(text)

    def run(chunk: int, tokens=tokens):
        cache = engine.new_cache()
        return engine.forward(tokens, cache, all_logits=True, chunk_size=chunk), cache.digest()

    limit = numba.config.NUMBA_NUM_THREADS
    with fixed_threads(limit):  # the reference of every row, and the other side of "threads 1 vs limit"
        base, base_kv = run(len(tokens))
    for chunk in (1, 7, 64):
        logits, kv = run(chunk)
        add(_compare_logits(f"prefill chunk {chunk} vs whole prompt", logits, base, kv, base_kv))
    split = len(tokens) // 2
    cache = engine.new_cache()
    first = engine.forward(tokens[:split], cache, all_logits=True)
    first_cache = cache.snapshot()
    second = engine.forward(tokens[split:], cache, all_logits=True)
    add(_compare_logits("prefix reuse: A cached, then B appended vs A+B at once", np.concatenate([first, second]), base, cache.digest(), base_kv))
    cache.truncate(split)
    again = engine.forward(tokens[split:], cache, all_logits=True)
    add(_compare_logits("rollback: truncate to A, recompute B", np.concatenate([first, again]), base, cache.digest(), base_kv))
    with fixed_threads(1):
        one, one_kv = run(64)
    add(_compare_logits(f"threads 1 vs {limit} (same process)", one, base, one_kv, base_kv))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prefix.detkv")
        save_kv(path, first_cache, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
        restored = engine.new_cache()
        restored.restore(load_kv(path, model_sha256=engine.model_file.sha256))
    rest = engine.forward(tokens[split:], restored, all_logits=True)
    add(_compare_logits("KV saved to a .detkv file and restored vs never saved", np.concatenate([first, rest]), base, restored.digest(), base_kv))
    add(_batch_row(engine, tokens))
    repeated = engine.tokenizer.encode(text + "\n\n" + text)  # a model tends to go on quoting: drafts are taken
    drafts = GenerationResult()
    spec = fingerprint(engine, repeated, chunk_size=64, gen_tokens=48, speculate="ngram", result=drafts)
    row = _compare_fingerprints("speculative decoding (ngram drafts) vs none, sampled", spec,
                                fingerprint(engine, repeated, chunk_size=64, gen_tokens=48))
    row.note = " ".join(filter(None, (row.note, f"drafts taken {drafts.accepted_tokens} of {drafts.draft_tokens}")))
    add(row)
    with reassociated_rmsnorm():
        control, control_kv = run(len(tokens))
    row = _compare_logits("negative control: reassociated RMSNorm must differ", control, base, control_kv, base_kv)
    row.result = "detected" if row.result == "differs" else "NOT DETECTED"
    add(row)
    if processes:
        fp = fingerprint(engine, tokens, chunk_size=64)
        add(_compare_fingerprints(f"threads 1 vs {os.cpu_count()} (separate processes)",
                                  probe_process(model, threads=1, text=text), probe_process(model, threads=os.cpu_count(), text=text)))
        add(_compare_fingerprints("two fresh processes (and this one)", probe_process(model, text=text), fp))
        with tempfile.TemporaryDirectory() as generic_cache, tempfile.TemporaryDirectory() as host_cache:
            generic = probe_process(model, text=text, env={"NUMBA_CPU_NAME": "generic", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": generic_cache})
            host = probe_process(model, text=text, env={"NUMBA_CACHE_DIR": host_cache})
        add(_compare_fingerprints("compile target generic x86-64 vs host (separate caches)", generic, host))
    return rows


def ok(rows: list[Row]) -> bool:
    """True if every invariance held and the negative control was detected."""
    return all(r.result in ("identical", "detected") for r in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv-type", default="f32")
    ap.add_argument("--text", default=DEFAULT_TEXT)
    args = ap.parse_args(argv)
    try:
        set_threads(args.threads)
        engine = Engine.load(args.model, n_ctx=args.ctx, kv_type=args.kv_type)
        tokens = engine.tokenizer.encode(args.text)
        print(json.dumps(fingerprint(engine, tokens, chunk_size=args.chunk_size), sort_keys=True))
    except DetinferError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
