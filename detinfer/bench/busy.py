"""``detinfer bench busy``: prefill and decode on an idle machine and beside a busy loop that holds one core.

Per model, each engine configuration runs in a worker process of its own (bench/worker.py): detinfer at 1 and 2
threads and at its default (threads chosen from what is free, compute/threads.py), llama.cpp (``--peer
llama-cpp``, the host build of ``make bench-peers``) at 1 and 2 threads. The same cells are measured idle, then
with ``python -c "while True: pass"`` running (one core's worth of load, placed by the scheduler), alternating
workers run by run; figures are medians of ``runs`` runs with min and max. Then a real ``detinfer serve`` at
``--threads 1`` and at its default, each under SERVER_CLIENTS concurrent streaming clients (bench/serve.py), idle and
busy the same way: aggregate tok/s, every response checked against the same request alone and the two servers'
answers against each other. The floors (issue 37): under load the default is at least 0.9x the 1-thread speed in
every cell and for the server; idle, 2 threads are at least 1.6x 1 thread. Results go to ``bench/busy.json`` and a
section of docs/benchmarks.md (kept when the main suite rewrites the file).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..errors import DetinferError, InputError
from .report import BUSY_BEGIN, BUSY_END, display_name, floor_table, stats, write_section
from .serve import PROMPTS, _Server, measure
from .suite import _machine, _Worker, machine_line, peer_dir

CELLS = (("prefill_256", "prefill", 256), ("decode_64", "decode", 64))
AUTO = 0  # the worker's --threads for detinfer's default (set_threads(None))
LOADS = ("idle", "busy")
FLOOR_BUSY, FLOOR_IDLE = 0.9, 1.6
SETTLE_S = 1.0  # after the busy loop starts, before the first run
SERVER_CLIENTS = 4  # concurrent streaming clients of each server (its --batch too: they step together)
SERVER_THREADS = (1, None)  # the server's --threads 1 and its default


def configs(peer: bool) -> list[tuple[str, int]]:
    """(engine, threads) of every worker; threads AUTO is detinfer's default."""
    return [("detinfer", 1), ("detinfer", 2), ("detinfer", AUTO)] + ([("llama-cpp", 1), ("llama-cpp", 2)] if peer else [])


def label(engine: str, threads: int) -> str:
    return f"{engine} {'default' if threads == AUTO else f'{threads}t'}"


def server_label(threads: int | None) -> str:
    return f"server {'default' if threads is None else f'{threads}t'}"


def busy_loop() -> subprocess.Popen:
    """A process that keeps one core busy until killed."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


@contextmanager
def _under(load: str) -> Iterator[None]:
    """Nothing for "idle"; for "busy", :func:`busy_loop` running (settled first) until the block ends."""
    loop = busy_loop() if load == "busy" else None
    try:
        if loop is not None:
            time.sleep(SETTLE_S)
        yield
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()


def _servers(model: str, runs: int, progress: Callable[[str], None]) -> dict:
    """{load: {server label: tok/s stats}} of SERVER_CLIENTS clients at each of SERVER_THREADS, alternating run by
    run. DetinferError if a response differs from the same request alone, or the two servers' answers differ."""
    servers: list[tuple[str, _Server]] = []
    try:
        for threads in SERVER_THREADS:
            progress(f"{display_name(model)}: starting {server_label(threads)}")
            servers.append((server_label(threads), _Server(model, threads=threads, batch=SERVER_CLIENTS)))
            servers[-1][1].stream(PROMPTS[0])  # warm-up
        alone = [[server.stream(p)["hashes"] for p in PROMPTS[:SERVER_CLIENTS]] for _, server in servers]
        if any(a != alone[0] for a in alone):
            raise DetinferError(f"{display_name(model)}: the servers' answers depended on --threads; report this")
        figures = {}
        for load in LOADS:
            samples: dict[str, list[float]] = {name: [] for name, _ in servers}
            with _under(load):
                progress(f"{display_name(model)}: {load}, server, {SERVER_CLIENTS} clients")
                for _ in range(runs):
                    for name, server in servers:
                        samples[name].append(measure(server, SERVER_CLIENTS, alone[0], f"{display_name(model)} {name}")["tok_s"])
            figures[load] = {name: stats(v).model_dump() for name, v in samples.items()}
        return figures
    finally:
        for _, server in servers:
            server.stop()


def run_busy(models: Sequence[str], *, runs: int, peer: bool, peers_dir: Path, progress: Callable[[str], None]) -> dict:
    """Every cell of :data:`CELLS` for every configuration, idle and busy, per model (see the module docstring).
    Raises InputError for ``runs`` < 1 or a llama.cpp peer that is not built."""
    if runs < 1:
        raise InputError(f"--runs must be at least 1, got {runs}")
    if peer and not (peer_dir(peers_dir, "host") / "BUILD").exists():
        raise InputError(f"no llama.cpp build in {peer_dir(peers_dir, 'host')}; run `make bench-peers` or drop --peer")
    tokens = max(n for _, op, n in CELLS if op == "prefill")
    out: dict = {"machine": _machine(), "runs": runs, "cells": [name for name, _, _ in CELLS], "models": {}}
    for model in models:
        workers = []
        try:
            for engine, threads in configs(peer):
                progress(f"{display_name(model)}: starting {label(engine, threads)}")
                workers.append((label(engine, threads), _Worker(engine, model, threads, "host", "text", tokens, peers_dir)))
            figures: dict[str, dict[str, dict]] = {}
            for load in LOADS:
                samples = {name: {cell: [] for cell, _, _ in CELLS} for name, _ in workers}
                with _under(load):
                    for cell, op, n in CELLS:
                        progress(f"{display_name(model)}: {load}, {cell}")
                        for _ in range(runs):
                            for name, w in workers:
                                samples[name][cell].append(n / w.ask(op=op, n=n)["seconds"])
                figures[load] = {name: {cell: stats(v).model_dump() for cell, v in cells.items()} for name, cells in samples.items()}
        finally:
            for _, w in workers:
                w.close()
        figures["server"] = _servers(model, runs, progress)
        out["models"][model] = figures
    return out


def floors(fig: dict) -> list[tuple[str, str, bool]]:
    """(floor, measured, holds) of one model's figures."""
    rows = []
    for cell in (c for c, _, _ in CELLS):
        one, auto = fig["busy"]["detinfer 1t"][cell]["median"], fig["busy"]["detinfer default"][cell]["median"]
        rows.append((f"busy, {cell}: default >= {FLOOR_BUSY}x 1 thread", f"{auto / one:.2f}x", auto >= FLOOR_BUSY * one))
        one, two = fig["idle"]["detinfer 1t"][cell]["median"], fig["idle"]["detinfer 2t"][cell]["median"]
        rows.append((f"idle, {cell}: 2 threads >= {FLOOR_IDLE}x 1 thread", f"{two / one:.2f}x", two >= FLOOR_IDLE * one))
    one, auto = (fig["server"]["busy"][server_label(t)]["median"] for t in SERVER_THREADS)
    rows.append((f"busy, server, {SERVER_CLIENTS} clients: default >= {FLOOR_BUSY}x --threads 1", f"{auto / one:.2f}x", auto >= FLOOR_BUSY * one))
    return rows


def markdown(result: dict) -> str:
    """The section of docs/benchmarks.md, between BUSY_BEGIN and BUSY_END."""
    m = result["machine"]
    lines = [BUSY_BEGIN, "## Beside a busy core (`detinfer bench busy`)", "",
             f"{machine_line(m)}, median of {result['runs']} runs (min–max), tok/s; busy: a `while True: pass` "
             "process running. detinfer's default chooses its thread count from the cores other processes leave free "
             "(detinfer/compute/threads.py).", ""]  # fmt: skip
    cells = result["cells"]
    for model, fig in result["models"].items():
        lines += [f"### {display_name(model)}", "", "| engine | " + " | ".join(f"{load} {c}" for load in LOADS for c in cells) + " |",
                  "|---|" + "---:|" * (len(LOADS) * len(cells))]  # fmt: skip
        for name in fig["idle"]:
            s = [fig[load][name][c] for load in LOADS for c in cells]
            lines.append(f"| {name} | " + " | ".join(_fmt(x) for x in s) + " |")
        lines += ["", f"`detinfer serve --batch {SERVER_CLIENTS}`, {SERVER_CLIENTS} concurrent streaming clients, aggregate tok/s:", "",
                  "| server | " + " | ".join(LOADS) + " |", "|---|" + "---:|" * len(LOADS)]  # fmt: skip
        for name in fig["server"]["idle"]:
            lines.append(f"| {name} | " + " | ".join(_fmt(fig["server"][load][name]) for load in LOADS) + " |")
        lines += floor_table(floors(fig))
        lines.append("")
    return "\n".join(lines + [BUSY_END]) + "\n"


def _fmt(x: dict) -> str:
    return f"{x['median']:g} ({x['min']:g}–{x['max']:g})"


def write_busy(result: dict, out: Path, markdown_path: Path) -> None:
    """``result`` as JSON at ``out`` and as the busy section of ``markdown_path`` (replaced, or appended)."""
    write_section(result, out, markdown_path, markdown(result), BUSY_BEGIN, BUSY_END)
