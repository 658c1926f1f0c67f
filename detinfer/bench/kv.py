"""``detinfer bench kv``: generation with the KV cache against a naive loop that recomputes the whole sequence for
every token, checked to produce the same tokens, timed per token and plotted (matplotlib, the ``[bench]`` extra).
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..compute.engine import Engine
from ..errors import InputError
from ..fileio import atomic_write_bytes
from .report import KVCurve, KVTarget, load_report
from .suite import busy_warning

PROMPT = "Once upon a time, in a small village by the sea,"
DEFAULT_TARGETS = (64, 512, 2048)
DEFAULT_NAIVE_BUDGET_S = 120.0
SEPARATION_FACTOR = 2.0
EXTRAPOLATION_STEPS = 5  # naive steps whose median bounds each step the naive arm did not run
PROMPT_ROOM = 64  # context positions kept for the prompt


def context_for(targets: Sequence[int]) -> int:
    """The n_ctx to load the engine with: room for the prompt and the largest target."""
    return max(targets) + PROMPT_ROOM


def check_kv_options(targets: Sequence[int], naive_budget_s: float, plot: Path | None, results: Path) -> None:
    """Raise InputError for bad ``bench kv`` options, if ``plot`` is asked without matplotlib installed, or if
    ``results`` exists but is not a results file the curve can be added to."""
    if not targets or min(targets) < 1:
        raise InputError(f"--tokens must be positive token counts, got {list(targets)}")
    if naive_budget_s <= 0:
        raise InputError(f"--naive-budget must be positive seconds, got {naive_budget_s}")
    if plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise InputError("--plot needs matplotlib: pip install 'detinfer[bench]'") from None
    if results.exists():
        load_report(results)


def greedy(logits: np.ndarray) -> int:
    """The greedy token: the highest logit, ties to the lowest id (np.argmax returns the first maximum)."""
    return int(np.argmax(logits))


def cached_arm(engine: Engine, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and seconds per step with the KV cache: the prompt's prefill, then one token per forward."""
    cache = engine.new_cache()
    tokens, times = [], []
    t0 = time.perf_counter()
    logits = engine.forward(prompt, cache)
    while True:
        tokens.append(greedy(logits))
        times.append(time.perf_counter() - t0)
        if len(tokens) == n:
            return tokens, times
        t0 = time.perf_counter()
        logits = engine.forward(tokens[-1:], cache)


def naive_arm(engine: Engine, prompt: Sequence[int], n: int, budget_s: float) -> tuple[list[int], list[float]]:
    """Greedy tokens and seconds per step recomputing the whole sequence (prompt + tokens so far) from an empty cache
    every step; stops after the step that takes the total past ``budget_s``."""
    cache = engine.new_cache()
    tokens, times = [], []
    while len(tokens) < n and sum(times) <= budget_s:
        cache.truncate(0)
        t0 = time.perf_counter()
        logits = engine.forward(list(prompt) + tokens, cache)
        tokens.append(greedy(logits))
        times.append(time.perf_counter() - t0)
    return tokens, times


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token over the shorter length, or None if one is a prefix of the other."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def separation_step(cached_s: Sequence[float], naive_s: Sequence[float], factor: float = SEPARATION_FACTOR) -> int | None:
    """The first step from which the naive arm's cumulative time stays >= ``factor`` x the cached arm's (over the
    steps both arms ran), or None if it never does."""
    c, nv = np.cumsum(cached_s[: len(naive_s)]), np.cumsum(naive_s)
    apart = nv >= factor * c
    if not apart.size or not apart[-1]:
        return None
    together = np.flatnonzero(~apart)
    return int(together[-1]) + 1 if together.size else 0


def target_totals(n: int, cached_s: Sequence[float], naive_s: Sequence[float]) -> KVTarget:
    """Totals for the first ``n`` tokens; if the naive arm stopped before ``n``, a lower bound: each missing step
    costs at least the median of its last measured steps (a later step recomputes a longer sequence)."""
    cached = float(sum(cached_s[:n]))
    if len(naive_s) >= n:
        naive, kind = float(sum(naive_s[:n])), "measured"
    else:
        floor = statistics.median(naive_s[-EXTRAPOLATION_STEPS:])
        naive, kind = float(sum(naive_s) + (n - len(naive_s)) * floor), "extrapolated lower bound"
    return KVTarget(tokens=n, cached_s=round(cached, 4), naive_s=round(naive, 4), naive_kind=kind, ratio=round(naive / cached, 2))


def kv_curve(engine: Engine, threads: int, targets: Sequence[int], naive_budget_s: float, model: str,
             warn: Callable[[str], None] = lambda msg: None) -> KVCurve:
    """Run both arms to max(targets) tokens (the smaller targets are prefixes of the same run) and compare tokens.

    Raises InputError if prompt + max(targets) does not fit in the engine's context.
    """
    prompt = engine.tokenizer.encode(PROMPT)
    n = max(targets)
    if len(prompt) + n > engine.n_ctx:
        raise InputError(f"{len(prompt)} prompt + {n} generated tokens exceed the context of {engine.n_ctx}")
    engine.warm_up()
    warnings: list[str] = []

    def check_load(arm: str) -> None:
        if (msg := busy_warning()) is not None:
            warnings.append(f"{arm} arm: {msg}")
            warn(warnings[-1])

    check_load("cached")
    cached_tokens, cached_s = cached_arm(engine, prompt, n)
    check_load("naive")
    naive_tokens, naive_s = naive_arm(engine, prompt, n, naive_budget_s)
    mismatch = first_mismatch(cached_tokens, naive_tokens)
    return KVCurve(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), model=model, threads=threads, prompt_tokens=len(prompt),
        cached_step_s=[round(t, 6) for t in cached_s], naive_step_s=[round(t, 6) for t in naive_s],
        naive_budget_s=naive_budget_s, naive_stopped_early=len(naive_s) < n, tokens_identical=mismatch is None,
        compared_tokens=len(naive_tokens), first_mismatch=mismatch, separation_step=separation_step(cached_s, naive_s),
        targets=[target_totals(t, cached_s, naive_s) for t in sorted(set(targets))], warnings=warnings,
    )


def plot_kv(kv: KVCurve, path: Path) -> None:
    """Time per token and cumulative time against position, both arms, on one PNG written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    p0 = kv.prompt_tokens
    xc = np.arange(p0, p0 + len(kv.cached_step_s))
    xn = xc[: len(kv.naive_step_s)]
    fig, (ax_step, ax_cum) = plt.subplots(1, 2, figsize=(13, 5))
    for ax, yc, yn, ylabel in ((ax_step, np.array(kv.cached_step_s) * 1e3, np.array(kv.naive_step_s) * 1e3, "time per token (ms)"),
                               (ax_cum, np.cumsum(kv.cached_step_s), np.cumsum(kv.naive_step_s), "cumulative time (s)")):
        ax.plot(xc, yc, label="with KV cache", lw=1)
        ax.plot(xn, yn, label="naive: recompute the whole sequence", lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("position (prompt + generated tokens)")
        ax.set_ylabel(ylabel)
        for t in kv.targets:
            ax.axvline(p0 + t.tokens - 1, color="grey", ls=":", lw=0.8)
        if kv.separation_step is not None:
            ax.axvline(p0 + kv.separation_step, color="red", ls="--", lw=0.8,
                       label=f"curves separate (naive ≥ {SEPARATION_FACTOR:g}× cumulative) at {p0 + kv.separation_step}")
        if kv.naive_stopped_early:
            ax.plot(xn[-1:], yn[-1:], "kx", label=f"naive stopped: {kv.naive_budget_s:g} s budget")
        ax.grid(alpha=0.3, which="both")
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())  # 10, 100, 1000 rather than 10^1, 10^2, 10^3
            axis.set_minor_formatter(NullFormatter())
    fig.legend(*ax_step.get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
    totals = "; ".join(f"{t.tokens} tokens: {t.ratio:.1f}× ({'lower bound' if t.naive_kind != 'measured' else 'measured'})"
                       for t in kv.targets)
    ax_cum.set_title(f"naive / cached total time: {totals}", fontsize=8)
    check = (f"naive tokens == cached tokens in all {kv.compared_tokens} steps compared" if kv.tokens_identical
             else f"TOKENS DIFFER from step {kv.first_mismatch}")
    fig.suptitle(f"{kv.model}, {kv.threads} thread(s), greedy: {check}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=110)
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
