"""Where the forward pass spends its time: every kernel call of a real forward, timed and grouped by kind.

Usage: python bench/profile.py [--model NAME|PATH ...] [--threads 1,2] [--prefill 512] [--decode 64] [--reps 3]
[--out bench/profile.json] [--markdown docs/benchmarks.md] [--label TEXT] [--before EARLIER.json]
[--render EARLIER.json]

For each model and thread count: one prefill of ``--prefill`` tokens and ``--decode`` single-token decode steps,
``--reps`` times (the fastest repetition is kept, per phase). Every numba kernel the engine calls (matmuls by GGML
type, attention, norms, RoPE, activations, KV writes, activation codes, additions, the embedding row) is wrapped in a
timer at the Python level, so a kernel's figure includes numba's dispatch of that call; "Python between kernels"
is the rest of the wall time (the engine's loop, slicing, buffer look-ups). "dispatch" is the number of kernel
calls times the measured cost of calling a kernel that does nothing with as many array arguments (numba's
argument unboxing and type dispatch), the part of every kernel's figure that is not arithmetic.

Timings only (results are never compared here; tests check the bytes). Wrapping adds ~0.2 µs per call.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
from numba import njit

from detinfer.bench.report import PROFILE_BEGIN, PROFILE_END, replace_section
from detinfer.bench.suite import source
from detinfer.compute import engine as engine_module
from detinfer.compute import kernels, linear
from detinfer.compute.engine import Engine, set_threads
from detinfer.fileio import atomic_write_text
from detinfer.records.machine import describe, machine

TEXT = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
KERNEL_GROUPS = {
    "attention": "attention", "rmsnorm": "norms", "rmsnorm_heads": "norms", "rope_norm": "RoPE", "rope_neox": "RoPE",
    "swiglu": "activation", "geglu": "activation", "kv_write": "KV write", "quantize_blocks": "activation codes",
    "rmsnorm_tokens": "norms", "rmsnorm_heads_tokens": "norms", "kv_write_tokens": "KV write",
    "quantize_blocks_tokens": "activation codes",
    "add_inplace": "add / bias", "add_bias": "add / bias",
    "delta_net": "recurrent layer (conv, delta rule, gated norm)", "gate_heads": "attention output gate",
}


class Profile:
    """Accumulated seconds and call counts per group while ``active``."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, group: str, fn):
        def wrapper(*args):
            t0 = time.perf_counter()
            r = fn(*args)
            self.seconds[group] += time.perf_counter() - t0
            self.calls[group] += 1
            return r

        return wrapper


def install(profile: Profile, eng: Engine) -> Callable[[], None]:
    """Wrap the kernels the engine calls (module attributes, the engine's bound RoPE/activation, the matmuls);
    returns what undoes the module-level wrapping (the next model's kernels must compile against the real ones)."""
    saved = {name: getattr(kernels, name) for name in KERNEL_GROUPS}
    call = linear.matmul
    for name, group in KERNEL_GROUPS.items():
        setattr(kernels, name, profile.timed(group, getattr(kernels, name)))
    eng._embd_row = profile.timed("embedding row", eng._embd_row)
    eng._rope = profile.timed("RoPE", eng._rope)
    eng._ffn_act = profile.timed("activation", eng._ffn_act)
    eng._rope_tokens = profile.timed("RoPE", eng._rope_tokens)
    eng._ffn_act_tokens = profile.timed("activation", eng._ffn_act_tokens)

    def matmul(m, x, xq, out):
        key = f"matmul {m.ggml_type.name}" + (" (output)" if m.name in ("output.weight", "token_embd.weight") else "")
        t0 = time.perf_counter()
        call(m, x, xq, out)
        profile.seconds[key] += time.perf_counter() - t0
        profile.calls[key] += 1

    linear.matmul = engine_module.matmul = matmul

    def undo() -> None:
        for name, fn in saved.items():
            setattr(kernels, name, fn)
        linear.matmul = engine_module.matmul = call

    return undo


@njit(cache=True)
def _noop(a, b, c, d, e, f, g):
    return None


def dispatch_seconds(reps: int = 20000) -> float:
    """Seconds per call of a kernel that does nothing with seven array arguments (numba dispatch only)."""
    a = np.zeros((2, 2), np.float32)
    _noop(a, a, a, a, a, a, a)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            _noop(a, a, a, a, a, a, a)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def phase(eng: Engine, profile: Profile, ids: list[int], n_prefill: int, n_decode: int, reps: int) -> dict:
    """The fastest of ``reps`` prefill and decode runs, each with its own per-group breakdown (ms per token)."""
    best: dict[str, dict] = {}
    for _ in range(reps):
        for name in ("prefill", "decode"):
            cache = eng.new_cache()
            if name == "decode":
                logits = eng.forward(ids[:16], cache)
            profile.seconds.clear()
            profile.calls.clear()
            t0 = time.perf_counter()
            if name == "prefill":
                eng.forward(ids[:n_prefill], cache)
                n = n_prefill
            else:
                for _ in range(n_decode):
                    logits = eng.forward([int(logits.argmax())], cache)
                n = n_decode
            wall = time.perf_counter() - t0
            if name not in best or wall < best[name]["wall_s"]:
                groups = {g: {"ms_per_token": 1e3 * s / n, "calls_per_token": profile.calls[g] / n}
                          for g, s in sorted(profile.seconds.items(), key=lambda kv: -kv[1])}
                inside = sum(profile.seconds.values())
                groups["Python between kernels"] = {"ms_per_token": 1e3 * (wall - inside) / n, "calls_per_token": 0}
                best[name] = {"wall_s": wall, "tokens": n, "tok_s": n / wall, "groups": groups}
    return best


def markdown(report: dict, before: dict | None = None) -> str:
    """The profile as markdown; with ``before`` (an earlier report of the same models), its ms/token side by side."""
    lines = [f"## Profile: {report['label']}", "",
             f"`python bench/profile.py` on {report['when']}: {report['machine']}. ms per token (prefill: the whole "
             f"prompt's time divided by its tokens), fastest of {report['reps']} repetitions; a kernel's figure "
             f"includes its numba dispatch, {report['dispatch_us']:.2f} µs per kernel call (a no-op kernel with seven "
             "array arguments)." + (f" *Before*: {before['label']} ({before['when']})." if before else ""), ""]
    old_runs = {(r["model"], r["threads"]): r for r in (before or {}).get("runs", [])}
    for run in report["runs"]:
        old = old_runs.get((run["model"], run["threads"]))
        for name in ("prefill", "decode"):
            p = run[name]
            q = old[name] if old else None
            calls = sum(g["calls_per_token"] for g in p["groups"].values())
            total = 1e3 / p["tok_s"]
            head = f"### {run['model']}, {run['threads']} thread(s), {name} of {p['tokens']} tokens: {p['tok_s']:.1f} tok/s"
            lines += [head + (f" (before: {q['tok_s']:.1f})" if q else ""), "",
                      "| part | " + ("before ms/token | " if q else "") + "ms/token | share | calls/token |",
                      "|---|" + ("---|" if q else "") + "---|---|---|"]
            for g, v in p["groups"].items():
                was = f"{q['groups'][g]['ms_per_token']:.4f} | " if q and g in q["groups"] else ("– | " if q else "")
                lines.append(f"| {g} | {was}{v['ms_per_token']:.4f} | {100 * v['ms_per_token'] / total:.1f}% | "
                             f"{v['calls_per_token']:.1f} |")
            disp = calls * report["dispatch_us"] / 1e3
            lines += [f"| *of which numba dispatch* ({calls:.1f} calls × {report['dispatch_us']:.2f} µs) | " + ("| " if q else "")
                      + f"{disp:.4f} | {100 * disp / total:.1f}% | |", ""]
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace) -> dict:
    """Profile every model at every thread count of ``args``; the report as bench/profile.json holds it."""
    runs = []
    for model in args.model or ["smollm2-135m-instruct-q4_1", "gemma3-270m-q4_k_m"]:
        eng = Engine.load(model)
        ids = eng.tokenizer.encode(TEXT)
        cache = eng.new_cache()
        eng.forward(eng.forward(ids[:64], cache).argmax(keepdims=True).tolist(), cache)  # compile before wrapping:
        profile = Profile()  # an njit caller compiled after install would see the Python wrapper, not the kernel
        undo = install(profile, eng)
        for th in [int(t) for t in args.threads.split(",")]:
            set_threads(th)
            eng.forward(ids[:64], eng.new_cache())  # compile and warm up at this thread count
            result = phase(eng, profile, ids, args.prefill, args.decode, args.reps)
            runs.append({"model": model, "threads": th} | result)
            print(f"{model} {th} thread(s): prefill {result['prefill']['tok_s']:.1f} tok/s, decode {result['decode']['tok_s']:.1f} tok/s", flush=True)
        undo()
    return {"label": args.label or source(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps,
            "machine": describe(machine()), "dispatch_us": 1e6 * dispatch_seconds(), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--label", help="the profile's title (default: the commit, detinfer.bench.suite.source())")
    ap.add_argument("--before", type=Path, help="an earlier --out file, shown side by side")
    ap.add_argument("--render", type=Path, help="render this earlier --out file instead of measuring")
    args = ap.parse_args()
    report = json.loads(args.render.read_text()) if args.render else measure(args)
    if args.out and not args.render:
        atomic_write_text(args.out, json.dumps(report, indent=1) + "\n")
    text = markdown(report, json.loads(args.before.read_text()) if args.before else None)
    if args.markdown:  # its own section of the file (docs/benchmarks.md keeps it when `detinfer bench` rewrites the rest)
        replace_section(args.markdown, f"{PROFILE_BEGIN}\n{text}{PROFILE_END}\n", PROFILE_BEGIN, PROFILE_END)
    print(text)


if __name__ == "__main__":
    main()
