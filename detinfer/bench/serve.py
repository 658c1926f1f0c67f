"""``detinfer bench serve``: a real ``detinfer serve`` process under 1, 2, 4 and 8 concurrent streaming clients,
with the decode worker stepping one request at a time (``--batch 1``) and at its default (continuous batching).

Per model, ``--threads`` and ``--batch``: one server process; a warm-up, then every client's prompt alone
(its reference bytes), then each client count with the clients released together. Each client streams its own
raw-completion prompt, greedy, ``MAX_TOKENS`` tokens (``ignore_eos``). Figures: aggregate tok/s (all clients'
tokens over the wall time from release to the last token), median time to first token and median request
latency. Every response's ``output_sha256`` and ``kv_sha256`` are compared with the same prompt's alone: a
difference is an error, never a figure. The floor (issue 35): 4 clients at least 2.5x one client's tok/s
(at every ``--batch`` of 4 or more).
Results go to ``bench/serve.json`` and a section of docs/benchmarks.md (kept when the main suite rewrites it).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import DetinferError, InputError
from .report import SERVE_BEGIN, SERVE_END, display_name, floor_table, write_section
from .suite import _machine, machine_line

CLIENTS = (1, 2, 4, 8)
MAX_TOKENS = 64
FLOOR = 2.5  # 4 clients' aggregate tok/s over one client's, where --batch lets 4 run together
PROMPTS = [f"Chapter {i + 1}. The {w} was" for i, w in enumerate(
    ("river", "city", "engine", "garden", "letter", "storm", "market", "library"))]  # fmt: skip


class _Server:
    """``detinfer serve`` in a subprocess on a free loopback port, until :meth:`stop`; ``threads`` None: the
    server's default."""

    def __init__(self, model: str, *, threads: int | None, batch: int):
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "detinfer.cli", "serve", "--model", model, "--port", str(port), "--batch", str(batch),
               "--ctx", "1024", "--max-queue", "16"] + (["--threads", str(threads)] if threads is not None else [])  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise DetinferError(f"detinfer serve --model {model} exited: {self.proc.stderr.read()[-500:]}")  # type: ignore[union-attr]
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    self.model_id = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise DetinferError(f"detinfer serve --model {model} did not answer /health within 300 s")
            time.sleep(0.2)

    def stream(self, prompt: str) -> dict:
        """One streamed completion: its token count, hashes, and the seconds to its first and last token."""
        import httpx

        body = {"model": self.model_id, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        t0, first, tokens, hashes = time.perf_counter(), None, 0, None
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                raise DetinferError(f"the server answered {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = first or time.perf_counter() - t0
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                hashes = chunk.get("detinfer", hashes)
        return {"tokens": tokens, "hashes": hashes, "first_s": first, "end": time.perf_counter(), "start": t0}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _together(server: _Server, n: int) -> list[dict]:
    barrier, out = threading.Barrier(n), [None] * n

    def one(i: int) -> None:
        barrier.wait()
        try:
            out[i] = server.stream(PROMPTS[i])
        except Exception as e:  # reported below, on the calling thread
            out[i] = {"error": e}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if "error" in r:  # type: ignore[operator]
            raise DetinferError(f"a client failed: {r['error']}")  # type: ignore[index]
    return out  # type: ignore[return-value]


def measure(server: _Server, n: int, alone: list, what: str) -> dict:
    """``n`` clients released together, each response checked against its prompt's ``alone`` hashes (a difference
    raises DetinferError naming ``what``): aggregate tok/s, median seconds to the first token and of a request."""
    got = _together(server, n)
    if any(r["hashes"] != alone[i] for i, r in enumerate(got)):
        raise DetinferError(f"{what}, {n} clients: a response differed from the same request alone; report this")
    wall = max(r["end"] for r in got) - min(r["start"] for r in got)
    return {"tok_s": round(sum(r["tokens"] for r in got) / wall, 1),
            "first_token_s": round(statistics.median(r["first_s"] for r in got), 3),
            "latency_s": round(statistics.median(r["end"] - r["start"] for r in got), 3)}  # fmt: skip


def run_serve(models: Sequence[str], *, threads: Sequence[int], batches: Sequence[int], progress: Callable[[str], None]) -> dict:
    """Every client count of :data:`CLIENTS` at every ``threads`` and ``batches`` value, for every model (see the
    module docstring). Raises InputError for a bad count, DetinferError if a response's bytes depended on what ran
    beside it."""
    if not threads or not batches or min(*threads, *batches) < 1:
        raise InputError("every --threads and --batch value must be at least 1")
    out: dict = {"machine": _machine(), "max_tokens": MAX_TOKENS, "models": {}}
    for model in models:
        per_model: dict = {}
        for n_threads, batch in ((t, b) for t in threads for b in batches):
            progress(f"{display_name(model)}: --threads {n_threads} --batch {batch}")
            server = _Server(model, threads=n_threads, batch=batch)
            try:
                server.stream(PROMPTS[0])  # warm-up
                alone = [server.stream(p)["hashes"] for p in PROMPTS]
                what = f"{display_name(model)} --batch {batch}"
                rows = {str(n): measure(server, n, alone, what) for n in CLIENTS}
                per_model[f"{n_threads}/{batch}"] = rows
            finally:
                server.stop()
        out["models"][model] = per_model
    return out


def floors(result: dict) -> list[tuple[str, str, bool]]:
    """(floor, measured, holds) for every model, thread count and ``--batch`` of at least 4."""
    rows = []
    for model, per_model in result["models"].items():
        for key, fig in per_model.items():
            n_threads, batch = key.split("/")
            if int(batch) >= 4:
                ratio = fig["4"]["tok_s"] / fig["1"]["tok_s"]
                rows.append((f"{display_name(model)} {n_threads}t --batch {batch}: 4 clients >= {FLOOR}x one client", f"{ratio:.2f}x", ratio >= FLOOR))
    return rows


def markdown(result: dict) -> str:
    """The section of docs/benchmarks.md, between SERVE_BEGIN and SERVE_END."""
    m = result["machine"]
    lines = [SERVE_BEGIN, "## Server under concurrent load (`detinfer bench serve`)", "",
             f"{machine_line(m)}, `detinfer serve --threads T --batch B` in its own process; each client "
             f"streams its own prompt, greedy, {result['max_tokens']} tokens. tok/s: all clients' tokens over the wall time; "
             "first token and latency: medians over the clients. Every response's output and KV hashes equalled the "
             "same request's alone (checked by the bench).", "",
             "| model | --threads | --batch | clients | tok/s | vs 1 client | first token (s) | latency (s) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for model, per_model in result["models"].items():
        for key, rows in per_model.items():
            for n, f in rows.items():
                lines.append(f"| {display_name(model)} | {' | '.join(key.split('/'))} | {n} | {f['tok_s']:g} | {f['tok_s'] / rows['1']['tok_s']:.2f}x | "
                             f"{f['first_token_s']:g} | {f['latency_s']:g} |")  # fmt: skip
    lines += floor_table(floors(result))
    return "\n".join(lines + ["", SERVE_END]) + "\n"


def write_serve(result: dict, out: Path, markdown_path: Path) -> None:
    """``result`` as JSON at ``out`` and as the server section of ``markdown_path`` (replaced, or appended)."""
    write_section(result, out, markdown_path, markdown(result), SERVE_BEGIN, SERVE_END)
