"""The benchmark suite behind ``detinfer bench`` (and ``make bench``).

Per model, at 1 and 2 threads: prefill tok/s of 64, 512 and 2048-token prompts and decode tok/s over 128 tokens,
for up to three engines measured side by side in separate worker processes, alternating run by run:

- ``detinfer``: the engine as shipped (the determinism contract);
- ``detinfer-fastmath``: the same engine with every kernel compiled with fastmath (reductions reassociated,
  benchmark only; see ``kernels.FASTMATH``), in its own JIT cache: the cost of the contract;
- ``llama-cpp`` (``--peer llama-cpp``, if llama-cpp-python is importable): the same text, token counts and threads.

Then peak RSS against GGUF size + KV bytes, cold start (an empty JIT cache) and warm start to the first token of
``detinfer run``, and the 20-turn session with prefix reuse against recomputation. Every figure is the median of
``runs`` runs with min and max; the CPU is checked for other busy processes right before each run (2-thread numba
runs slow down many-fold when a core is taken). Results go to ``bench/results.json`` (:class:`BenchReport`) and a
markdown table in ``docs/benchmarks.md``. Speed is measured here only, never asserted in tests.

``python -m detinfer.bench worker|session ...`` is the worker side of the suite, not a user command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from .errors import DetinferError, InputError
from .fileio import atomic_write_text, read_json
from .manifest import canonical_json, cpu_name
from .paths import detinfer_home
from .registry import DEFAULT_MODEL

SCHEMA_VERSION = 1
PREFILL_SIZES = (64, 512, 2048)
DECODE_TOKENS = 128
DECODE_PROMPT = 16  # tokens prefilled before the timed decode
THREADS = (1, 2)
N_CTX = 4096
DEFAULT_MODELS = (DEFAULT_MODEL, "gemma3-270m-q4_k_m")  # a default model that does not load is skipped, with the reason
PEERS = ("llama-cpp",)
MAX_WARNINGS_SHOWN = 12  # in docs/benchmarks.md; the results file keeps them all
FASTMATH_ENV = "DETINFER_BENCH_FASTMATH"  # read once by detinfer.kernels
PROGRESS_MARK = "compiling kernels"  # what the CLI prints while the first forward compiles (checked at cold start)
TEXT = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
FIGURES = tuple((f"prefill_{n}_tok_s", "prefill", n) for n in PREFILL_SIZES) + (
    (f"decode_{DECODE_TOKENS}_tok_s", "decode", DECODE_TOKENS),
)
# llama-cpp-python 0.3.36 on SmolLM2 Q4_1 on the project's 2-core machine (docs/determinism.md): the documented
# reference when the peer cannot run here. Labelled as such wherever it is used.
REFERENCE_LLAMA_CPP = {
    DEFAULT_MODEL: {
        1: {"prefill_64_tok_s": 204, "prefill_512_tok_s": 197, "prefill_2048_tok_s": 160, "decode_128_tok_s": 65},
        2: {"prefill_64_tok_s": 385, "prefill_512_tok_s": 379, "prefill_2048_tok_s": 304, "decode_128_tok_s": 104},
    }
}
PEER_MISSING = ("--peer llama-cpp needs llama-cpp-python, which is not importable here (pip install llama-cpp-python; "
                "this platform has no binary wheel, so pip builds llama.cpp from source)")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Stats(_Strict):
    """Median, min and max of ``runs`` samples."""

    median: float
    min: float
    max: float
    runs: int


class EngineRun(_Strict):
    """One engine at one thread count: each figure's stats (tok/s) and the worker process's peak RSS."""

    engine: Literal["detinfer", "detinfer-fastmath", "llama-cpp"]
    figures: dict[str, Stats]
    peak_rss_mb: float


class ThreadRun(_Strict):
    threads: int
    engines: list[EngineRun]


class StartTimes(_Strict):
    """Seconds from process start to the end of ``detinfer run --max-tokens 1`` with an empty / a filled JIT cache."""

    cold_s: Stats
    warm_s: Stats
    progress_message: bool  # the cold runs printed the compile progress message on stderr


class SessionFigures(_Strict):
    """The 20-turn scripted session with prefix reuse vs recomputing every prefix, and KV snapshot save/load."""

    turns: int
    history_tokens: int
    with_reuse_s: Stats
    no_cache_s: Stats
    snapshot_tokens: int
    snapshot_bytes: int
    snapshot_save_ms: Stats
    snapshot_load_ms: Stats


class ModelReport(_Strict):
    model: str
    status: Literal["ok", "skipped"]
    reason: str | None = None  # why a model was skipped
    model_file_bytes: int = 0
    kv_bytes_at_n_ctx: int = 0
    threads: list[ThreadRun] = []
    start: StartTimes | None = None
    session: SessionFigures | None = None


class KVTarget(_Strict):
    """Total time to generate ``tokens`` tokens with the KV cache and with the naive loop, and their ratio."""

    tokens: int
    cached_s: float
    naive_s: float
    naive_kind: Literal["measured", "extrapolated lower bound"]
    ratio: float  # naive_s / cached_s


class KVCurve(_Strict):
    """``detinfer bench kv``: greedy generation after a short prompt with the KV cache (one forward per token) and
    with a naive loop that recomputes the whole sequence every step. Step i produces generated token i, at
    position prompt_tokens + i; step 0 is the prompt's prefill in both arms."""

    date: str
    model: str
    threads: int
    prompt_tokens: int
    cached_step_s: list[float]
    naive_step_s: list[float]  # shorter than cached_step_s if the naive arm stopped at its time budget
    naive_budget_s: float
    naive_stopped_early: bool
    tokens_identical: bool  # every token the naive arm produced equals the cached arm's
    compared_tokens: int
    first_mismatch: int | None = None  # step of the first differing token
    separation_step: int | None = None  # from here on the naive arm's cumulative time stays >= 2x the cached arm's
    targets: list[KVTarget]
    warnings: list[str] = []
    plot: str | None = None


class BenchReport(_Strict):
    """``bench/results.json``. ``kv_curve`` is filled in by ``detinfer bench kv`` (:mod:`detinfer.bench_kv`)."""

    schema_version: Literal[1] = SCHEMA_VERSION
    date: str
    machine: dict[str, str | int]
    n_ctx: int
    runs_per_figure: int
    peer: str | None = None
    models: list[ModelReport]
    warnings: list[str] = []
    kv_curve: KVCurve | None = None


def stats(samples: list[float], digits: int = 2) -> Stats:
    """Median, min and max of ``samples`` (at least one)."""
    r = lambda v: round(v, digits)  # noqa: E731
    return Stats(median=r(statistics.median(samples)), min=r(min(samples)), max=r(max(samples)), runs=len(samples))


def _cpu_times() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]  # total, idle + iowait


def busy_warning(window_s: float = 0.3) -> str | None:
    """A warning if other processes keep a core busy right now (2-thread numba runs slow down many-fold then)."""
    try:
        total0, idle0 = _cpu_times()
        time.sleep(window_s)
        total1, idle1 = _cpu_times()
    except OSError:
        return None
    busy = (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(1, total1 - total0))
    return f"{busy:.1f} cores busy before a run: figures may be low" if busy > 0.3 else None


def warm_up(engine) -> None:
    """Compile (first run) or load from numba's cache every kernel the engine uses, outside any timing: a 2-token
    chunk, then a 1-token step (numba types a one-row slice as contiguous, so decode has its own specializations)."""
    cache = engine.new_cache()
    engine.forward([0, 0], cache)
    engine.forward([0], cache)


def peer_available(peer: str) -> bool:
    """Whether the peer engine's Python package is importable (llama-cpp-python for "llama-cpp")."""
    return peer == "llama-cpp" and importlib.util.find_spec("llama_cpp") is not None


def check_options(models: list[str], runs: int, peer: str | None) -> None:
    """Raise InputError for options the suite cannot run with, before anything is loaded."""
    if runs < 1:
        raise InputError(f"--runs must be at least 1, got {runs}")
    if not models:
        raise InputError("no models to benchmark")
    if peer is not None and peer not in PEERS:
        raise InputError(f"unknown peer {peer!r}; known peers: {', '.join(PEERS)}")
    if peer is not None and not peer_available(peer):
        raise InputError(PEER_MISSING)


# ---- worker side: one engine in one process, driven by JSON lines on stdin -------------------------------------


class _DetinferArm:
    def __init__(self, model: str, threads: int):
        from .engine import Engine, set_threads

        set_threads(threads)
        self.engine = Engine.load(model, n_ctx=N_CTX)
        self.ids = self.engine.tokenizer.encode(TEXT)
        warm_up(self.engine)

    def prefill(self, n: int) -> float:
        cache = self.engine.new_cache()
        t0 = time.perf_counter()
        self.engine.forward(self.ids[:n], cache)
        return time.perf_counter() - t0

    def decode(self, n: int) -> float:
        cache = self.engine.new_cache()
        logits = self.engine.forward(self.ids[:DECODE_PROMPT], cache)
        t0 = time.perf_counter()
        for _ in range(n):
            logits = self.engine.forward([int(logits.argmax())], cache)
        return time.perf_counter() - t0

    def info(self) -> dict:
        from . import kernels

        return {"model_file_bytes": self.engine.model_file.size, "kv_bytes_at_n_ctx": self.engine.kv_bytes(),
                "fastmath": kernels.FASTMATH}


class _LlamaCppArm:
    def __init__(self, model: str, threads: int):
        from llama_cpp import Llama

        from .registry import resolve_model

        self.llm = Llama(model_path=str(resolve_model(model)), n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.ids = self.llm.tokenize(TEXT.encode("utf-8"), add_bos=False)
        self.prefill(8)

    def _greedy(self) -> int:
        """The last evaluated token's greedy successor. The low-level logits: recent ``Llama.eval`` keeps
        ``scores`` only with logits_all, and the last decode asked for one row of logits."""
        import llama_cpp
        import numpy as np

        return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.llm.ctx), shape=(self.llm.n_vocab(),)).argmax())

    def prefill(self, n: int) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(self.ids[:n])
        return time.perf_counter() - t0

    def decode(self, n: int) -> float:
        self.llm.reset()
        self.llm.eval(self.ids[:DECODE_PROMPT])
        t0 = time.perf_counter()
        for _ in range(n):
            self.llm.eval([self._greedy()])
        return time.perf_counter() - t0

    def info(self) -> dict:
        return {}


def _serve_worker(kind: str, model: str, threads: int) -> int:
    """Load one engine, then answer {"op": "prefill"|"decode", "n": N} with seconds and {"op": "info"} with sizes
    and peak RSS, one JSON line each; a model that cannot load answers {"error": ...} once and exits 0."""
    try:
        arm = _LlamaCppArm(model, threads) if kind == "llama-cpp" else _DetinferArm(model, threads)
        if len(arm.ids) < max(PREFILL_SIZES):
            raise InputError(f"the benchmark text is only {len(arm.ids)} tokens for {model}")
    except DetinferError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "info":
            reply = arm.info() | {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        else:
            reply = {"seconds": getattr(arm, cmd["op"])(cmd["n"])}
        print(json.dumps(reply), flush=True)
    return 0


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, kind: str, model: str, threads: int):
        env = dict(os.environ, NUMBA_NUM_THREADS=str(threads))
        if kind == "detinfer-fastmath":
            env.update({FASTMATH_ENV: "1", "NUMBA_CACHE_DIR": str(detinfer_home() / "bench" / "numba-fastmath")})
        self.kind = kind
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "detinfer.bench", "worker", "--engine", "llama-cpp" if kind == "llama-cpp" else "detinfer",
             "--model", model, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env,
        )
        self.ready = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:  # a library may print to stdout too: the reply is the JSON object line
            if line.startswith("{"):
                return json.loads(line)
        self.stderr.seek(0)
        tail = self.stderr.read().strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"{self.kind} worker exited with code {self.proc.wait()}: {tail[0]}")

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.stderr.close()


# ---- parent side: the suite -----------------------------------------------------------------------------------


class ModelUnavailable(Exception):
    """A model the contract engine cannot load (not downloaded, unsupported architecture...): skipped, with why."""


def measure_engines(model: str, threads: int, engines: list[str], runs: int, warn: Callable[[str], None]) -> tuple[list[EngineRun], dict]:
    """Every figure for each engine at ``threads``, alternating engines run by run. Returns the runs and the
    contract engine's info (model file and KV bytes). Raises ModelUnavailable if an engine cannot load the model."""
    workers: list[_Worker] = []
    try:
        for kind in engines:
            workers.append(_Worker(kind, model, threads))
            if "error" in workers[-1].ready:
                raise ModelUnavailable(f"{kind}: {workers[-1].ready['error']}")
        samples: dict[str, dict[str, list[float]]] = {w.kind: {name: [] for name, _, _ in FIGURES} for w in workers}
        for name, op, n in FIGURES:
            for _ in range(runs):
                for w in workers:
                    if (msg := busy_warning()) is not None:
                        warn(f"{model}, {threads} thread(s), {w.kind}, {name}: {msg}")
                    samples[w.kind][name].append(n / w.ask(op=op, n=n)["seconds"])
        infos = [w.ask(op="info") for w in workers]
        if any(w.kind == "detinfer-fastmath" and not info["fastmath"] for w, info in zip(workers, infos)):
            raise RuntimeError("the fastmath worker did not compile its kernels with fastmath")
        runs_ = [EngineRun(engine=w.kind, figures={k: stats(v) for k, v in samples[w.kind].items()}, peak_rss_mb=info["peak_rss_mb"])
                 for w, info in zip(workers, infos)]
        return runs_, infos[0]
    finally:
        for w in workers:
            w.close()


def start_times(model: str, runs: int, warn: Callable[[str], None]) -> StartTimes:
    """Cold start (each run in a fresh, empty NUMBA_CACHE_DIR) and warm start (the usual cache, filled first) of
    ``detinfer run --max-tokens 1``, alternating, whole process."""
    cmd = [sys.executable, "-m", "detinfer.cli", "run", "--prompt", "Hello", "--max-tokens", "1", "--quiet", "--model", model]
    subprocess.run(cmd, check=True, capture_output=True, text=True)  # fills the usual JIT cache; fails if the model cannot run
    cold, warm, shown = [], [], True
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="detinfer-cold-") as cache_dir:
            if (msg := busy_warning()) is not None:
                warn(f"{model}, cold start: {msg}")
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ, NUMBA_CACHE_DIR=cache_dir))
            cold.append(time.perf_counter() - t0)
            shown = shown and PROGRESS_MARK in proc.stderr
        if (msg := busy_warning()) is not None:
            warn(f"{model}, warm start: {msg}")
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        warm.append(time.perf_counter() - t0)
    return StartTimes(cold_s=stats(cold), warm_s=stats(warm), progress_message=shown)


def session_figures(model: str, threads: int, runs: int) -> SessionFigures:
    """The 20-turn scripted session (tests/data/agent20.json) with prefix reuse vs recomputing every prefix, and
    KV snapshot save/load of 1,000 tokens; each ``runs`` times."""
    from .chat import ChatTemplate
    from .engine import Engine, set_threads
    from .kvfile import load_kv, save_kv
    from .prefix_cache import PrefixCache
    from .session import load_script, replay_turns, run_session

    set_threads(threads)
    script = load_script(Path(__file__).resolve().parent.parent / "tests" / "data" / "agent20.json")
    engine = Engine.load(model, n_ctx=2048)
    # a model without a chat template (Gemma 3 base) runs the session in its family's built-in format
    template = None if engine.chat_template else ChatTemplate.from_option("gemma" if engine.config.arch == "gemma3" else "chatml")
    warm_up(engine)
    reuse, naive, save_ms, load_ms = [], [], [], []
    for _ in range(runs):
        t0 = time.perf_counter()
        record = run_session(engine, script.turns, script.sampling, prefix_cache=PrefixCache(1 << 30), template=template)
        reuse.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        replayed = replay_turns(engine, record, use_cache=False)
        naive.append(time.perf_counter() - t0)
        if any(diffs for _, diffs, _ in replayed):
            raise RuntimeError("the session replayed without the cache differs from the run with prefix reuse")
    cache = engine.new_cache()
    engine.forward(engine.tokenizer.encode(TEXT)[:1000], cache)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.detkv"
        for _ in range(runs):
            t0 = time.perf_counter()
            size = save_kv(path, cache, model_sha256=engine.model_file.sha256, tokenizer_sha256=engine.tokenizer.hash)
            save_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            load_kv(path, model_sha256=engine.model_file.sha256)
            load_ms.append((time.perf_counter() - t0) * 1e3)
    return SessionFigures(
        turns=len(record.turns),
        history_tokens=sum(len(t.appended_token_ids) + len(t.generated_token_ids) for t in record.turns),
        with_reuse_s=stats(reuse), no_cache_s=stats(naive), snapshot_tokens=cache.n_tokens, snapshot_bytes=size,
        snapshot_save_ms=stats(save_ms, 1), snapshot_load_ms=stats(load_ms, 1),
    )


def bench_model(model: str, runs: int, peer: str | None, warn: Callable[[str], None]) -> ModelReport:
    """The suite for one model (``status="skipped"`` with the reason if it does not load)."""
    engines = ["detinfer", "detinfer-fastmath"] + ([peer] if peer else [])
    report = ModelReport(model=model, status="ok")
    try:
        report.start = start_times(model, runs, warn)  # first: it fills the JIT cache, so no worker's RSS counts compiling
    except subprocess.CalledProcessError as e:
        return ModelReport(model=model, status="skipped", reason=(e.stderr.strip().splitlines() or ["detinfer run failed"])[-1])
    for threads in THREADS:
        try:
            measured, info = measure_engines(model, threads, engines, runs, warn)
        except ModelUnavailable as e:
            return ModelReport(model=model, status="skipped", reason=str(e))
        report.model_file_bytes, report.kv_bytes_at_n_ctx = info["model_file_bytes"], info["kv_bytes_at_n_ctx"]
        report.threads.append(ThreadRun(threads=threads, engines=measured))
    if (msg := busy_warning()) is not None:
        warn(f"{model}, session: {msg}")
    proc = subprocess.run([sys.executable, "-m", "detinfer.bench", "session", "--model", model, "--threads", str(max(THREADS)),
                           "--runs", str(runs)], capture_output=True, text=True, check=False,
                          env=dict(os.environ, NUMBA_NUM_THREADS=str(max(THREADS))))
    if proc.returncode != 0:  # reported, without losing the figures already measured
        warn(f"{model}: session benchmark failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    else:
        report.session = SessionFigures.model_validate_json(proc.stdout.strip().splitlines()[-1])
    return report


def run_suite(models: list[str], runs: int, peer: str | None, out: Path, markdown_path: Path,
              warn: Callable[[str], None], progress: Callable[[str], None]) -> BenchReport:
    """Benchmark every model, write ``out`` (JSON) and ``markdown_path`` atomically, return the report.

    A model that does not load, or whose benchmark fails, is recorded as skipped with the reason. A previous
    report's ``kv_curve`` (dated) is kept.
    Raises InputError for bad options (see :func:`check_options`).
    """
    check_options(models, runs, peer)
    warnings: list[str] = []

    def warn_(msg: str) -> None:
        warnings.append(msg)
        warn(msg)

    if runs < 3:
        warn_(f"{runs} run(s) per figure: medians of fewer than 3 runs are for smoke tests, not for the published table")
    reports = []
    for model in models:
        progress(f"benchmarking {model}")
        try:
            reports.append(bench_model(model, runs, peer, warn_))
        except RuntimeError as e:  # a worker that crashed: recorded, and the other models still run
            reports.append(ModelReport(model=model, status="skipped", reason=f"benchmark failed: {e}"))
        if reports[-1].status == "skipped":
            warn_(f"{model} skipped: {reports[-1].reason}")
    try:
        previous = load_report(out) if out.exists() else None
    except InputError:
        previous = None  # a results file of an older schema is replaced whole
    report = BenchReport(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        machine=_machine(),
        n_ctx=N_CTX, runs_per_figure=runs, peer=peer, models=reports, warnings=warnings,
        kv_curve=previous.kv_curve if previous else None,
    )
    write_report(report, out, markdown_path)
    return report


def load_report(path: Path) -> BenchReport:
    """Read ``bench/results.json``; raises InputError if it is unreadable or not of this schema."""
    from pydantic import ValidationError

    data = read_json(path, InputError, "benchmark results file")
    try:
        return BenchReport.model_validate(data)
    except ValidationError as e:
        raise InputError(f"{path} is not a benchmark results file of schema {SCHEMA_VERSION} ({e.errors()[0]['msg']}); "
                         "regenerate it with `detinfer bench` or pass another path") from None


def add_kv_curve(kv: KVCurve, out: Path, markdown_path: Path) -> BenchReport:
    """Put ``kv`` into the report at ``out`` (a new report without suite figures if there is none) and rewrite
    ``out`` and ``markdown_path``."""
    if out.exists():  # InputError if it is not a results file of this schema: run `detinfer bench` first
        report = load_report(out).model_copy(update={"kv_curve": kv})
    else:
        report = BenchReport(date=kv.date, machine=_machine(), n_ctx=N_CTX, runs_per_figure=0, models=[], kv_curve=kv)
    write_report(report, out, markdown_path)
    return report


def _machine() -> dict[str, str | int]:
    return {"cpu": cpu_name(), "cores": os.cpu_count() or 0, "python": platform.python_version()}


def write_report(report: BenchReport, out: Path, markdown_path: Path) -> None:
    """Write the report as canonical JSON and as markdown, each atomically."""
    atomic_write_text(out, canonical_json(report.model_dump()))
    atomic_write_text(markdown_path, markdown(report, markdown_path.parent))


def _fmt(s: Stats) -> str:
    return f"{s.median:g} ({s.min:g}–{s.max:g})"


def _engine(run: ThreadRun, name: str) -> EngineRun | None:
    return next((e for e in run.engines if e.engine == name), None)


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


Floor = tuple[str, str, bool]  # (floor from issue 6, measured value, holds)
DECODE = f"decode_{DECODE_TOKENS}_tok_s"
FLOOR_FIGURES = ("prefill_512_tok_s", DECODE)  # the figures the scaling and contract-cost floors name
PEER_FLOORS = {1: {DECODE: 1.2}, 2: {DECODE: 1.3, "prefill_512_tok_s": 1.0}}  # detinfer / llama.cpp at threads


def _label(name: str) -> str:
    return name.removesuffix("_tok_s").replace("_", " ")


def _medians(tr: ThreadRun, engine: str) -> dict[str, float] | None:
    e = _engine(tr, engine)
    return None if e is None else {name: e.figures[name].median for name, _, _ in FIGURES}


def _ratio_rows(m: ModelReport) -> tuple[list[str], list[Floor]]:
    """Table rows of thread scaling, cost of the contract and detinfer / llama.cpp (measured, else the reference),
    and the floors they decide."""
    names = [name for name, _, _ in FIGURES]
    times = lambda v: f"{v:.2f}×"  # noqa: E731
    percent = lambda v: f"{v:+.1%}"  # noqa: E731
    row = lambda label, t, values, fmt: f"| {label} | {t} | " + " | ".join(fmt(values[n]) for n in names) + " |"  # noqa: E731
    lines = ["| ratio | threads | " + " | ".join(map(_label, names)) + " |", "|---" * (len(names) + 2) + "|"]
    floors: list[Floor] = []
    by_t = {tr.threads: tr for tr in m.threads}
    if 1 in by_t and 2 in by_t:
        one, two = _medians(by_t[1], "detinfer"), _medians(by_t[2], "detinfer")
        scale = {n: two[n] / one[n] for n in names}
        lines.append(row("thread scaling (2 / 1 thread)", "", scale, times))
        floors += [(f"2-thread / 1-thread scaling, {_label(n)} ≥ 1.7×", times(scale[n]), scale[n] >= 1.7) for n in FLOOR_FIGURES]
    for t, tr in by_t.items():
        contract, fast = _medians(tr, "detinfer"), _medians(tr, "detinfer-fastmath")
        if fast is not None:
            cost = {n: fast[n] / contract[n] - 1 for n in names}
            lines.append(row("cost of the contract (fastmath / contract − 1)", t, cost, percent))
            floors += [(f"cost of the contract, {_label(n)}, {t} thread(s) ≤ 10%", percent(cost[n]), cost[n] <= 0.10) for n in FLOOR_FIGURES]
        peer, label, note = _medians(tr, "llama-cpp"), "detinfer / llama.cpp (measured side by side)", ""
        if peer is None:
            peer = REFERENCE_LLAMA_CPP.get(m.model, {}).get(t)
            label, note = "detinfer / llama.cpp **reference** (NUMERICS.md, not measured in this run)", " (reference)"
        if peer is None:
            continue
        ratio = {n: contract[n] / peer[n] for n in names}
        lines.append(row(label, t, ratio, times))
        floors += [(f"{_label(n)} at {t} thread(s) ≥ {f}× llama.cpp{note}", times(ratio[n]), ratio[n] >= f)
                   for n, f in PEER_FLOORS.get(t, {}).items()]
    return lines, floors


def _other_figures(m: ModelReport) -> tuple[list[str], list[Floor]]:
    """Peak RSS, start times and the session, as bullet lines, and the floors they decide."""
    rss = max(e.peak_rss_mb for tr in m.threads for e in tr.engines if e.engine == "detinfer")
    budget = (m.model_file_bytes + m.kv_bytes_at_n_ctx) / 2**20 + 150
    lines = [f"- Peak RSS (contract engine's worker, after the 2048-token prefill): {rss:g} MB against GGUF "
             f"{m.model_file_bytes / 2**20:.1f} MB + KV at n_ctx {N_CTX} {m.kv_bytes_at_n_ctx / 2**20:.1f} MB."]
    floors = [("peak RSS ≤ GGUF + KV bytes + 150 MB", f"{rss:g} MB ≤ {budget:.0f} MB", rss <= budget)]
    if (s := m.start) is not None:
        lines.append(f"- Start to first token (`detinfer run --max-tokens 1`, whole process): cold (empty JIT cache) {_fmt(s.cold_s)} s, "
                     f"warm {_fmt(s.warm_s)} s; progress message while compiling: {'shown' if s.progress_message else 'NOT shown'}.")
        floors += [("warm start to first token ≤ 1.5 s", f"{s.warm_s.median:g} s", s.warm_s.median <= 1.5),
                   ("cold start ≤ 30 s with a progress message", f"{s.cold_s.median:g} s", s.cold_s.median <= 30 and s.progress_message)]
    if (se := m.session) is not None:
        lines += [f"- {se.turns}-turn session ({se.history_tokens} history tokens): {_fmt(se.with_reuse_s)} s with prefix reuse vs "
                  f"{_fmt(se.no_cache_s)} s recomputing every prefix: {se.no_cache_s.median / se.with_reuse_s.median:.1f}× (medians).",
                  f"- KV snapshot of {se.snapshot_tokens} tokens: {se.snapshot_bytes:,} bytes, save {_fmt(se.snapshot_save_ms)} ms, "
                  f"load {_fmt(se.snapshot_load_ms)} ms."]
    return lines, floors


def _model_markdown(m: ModelReport, runs: int) -> list[str]:
    """One model's section: the figures table, the ratios, the other figures and the floors."""
    if m.status == "skipped":
        return [f"## {m.model}", "", f"Skipped: {m.reason}", ""]
    names = [name for name, _, _ in FIGURES]
    lines = [f"## {m.model}", "", f"Median (min–max) of {runs} run(s), tok/s; engines alternate run by run.", "",
             "| threads | engine | " + " | ".join(map(_label, names)) + " | peak RSS MB |", "|---" * (len(names) + 3) + "|"]
    lines += [f"| {tr.threads} | {e.engine} | " + " | ".join(_fmt(e.figures[n]) for n in names) + f" | {e.peak_rss_mb:g} |"
              for tr in m.threads for e in tr.engines]
    ratio_lines, ratio_floors = _ratio_rows(m)
    other_lines, other_floors = _other_figures(m)
    floors = ratio_floors + other_floors
    return (lines + [""] + ratio_lines + [""] + other_lines
            + ["", "| floor | measured | holds |", "|---|---|---|"] + [f"| {f} | {v} | {_yes(ok)} |" for f, v, ok in floors] + [""])


def kv_markdown(kv: KVCurve, folder: Path) -> list[str]:
    """The KV-cache curve section of docs/benchmarks.md (written in ``folder``, which the plot's link is relative to)."""
    lines = ["## KV cache vs recomputing the prefix", "",
             f"`detinfer bench kv` on {kv.date}: {kv.model}, {kv.threads} thread(s), greedy after a {kv.prompt_tokens}-token prompt. "
             f"The naive loop recomputes the whole sequence for every token"
             + (f" and stopped at its {kv.naive_budget_s:g} s budget after {len(kv.naive_step_s)} tokens" if kv.naive_stopped_early else "")
             + ". Tokens: " + (f"identical in all {kv.compared_tokens} steps compared." if kv.tokens_identical
                              else f"**differ** from step {kv.first_mismatch} (of {kv.compared_tokens} compared)."), ""]
    if kv.plot:
        lines += [f"![time per token and cumulative time against position]({os.path.relpath(kv.plot, folder)})", ""]
    lines += ["| tokens generated | with KV cache s | naive s | naive is | naive / cached |", "|---|---|---|---|---|"]
    lines += [f"| {t.tokens} | {t.cached_s:.3g} | {t.naive_s:.4g} | {t.naive_kind} | {t.ratio:.1f}× |" for t in kv.targets]
    last = kv.targets[-1]
    lines += ["", f"Floor: cached vs naive at {last.tokens} tokens ≥ 20× less total time: {last.ratio:.1f}× ({last.naive_kind}): "
              f"{_yes(last.ratio >= 20)}."]
    if kv.naive_stopped_early:
        lines.append("An extrapolated lower bound adds, for every step the naive arm did not run, the median time of its last "
                     "five measured steps: each later step recomputes a longer sequence, so it cannot be faster.")
    if kv.warnings:
        lines += [""] + [f"- warning: {w}" for w in kv.warnings]
    return lines + [""]


def markdown(report: BenchReport, folder: Path) -> str:
    """The report as docs/benchmarks.md in ``folder``: one section per model, the KV-cache curve, warnings."""
    mc = report.machine
    lines = ["# Benchmarks", "",
             f"Generated by `make bench` (`detinfer bench`) on {report.date}: {mc['cpu']}, {mc['cores']} cores, Python {mc['python']}, "
             f"n_ctx {report.n_ctx}. Figures are measured, never asserted in tests; `detinfer-fastmath` is the same engine "
             "with fastmath kernels (benchmark only, not deterministic), the reference for the cost of the contract.", ""]
    if report.peer is None:
        lines += ["llama.cpp was not run side by side (`--peer llama-cpp` needs llama-cpp-python, which has no binary wheel for "
                  "this platform); ratios marked **reference** use the llama-cpp-python 0.3.36 figures measured on the same model "
                  "and machine in NUMERICS.md.", ""]
    for m in report.models:
        lines += _model_markdown(m, report.runs_per_figure)
    if report.kv_curve is not None:
        lines += kv_markdown(report.kv_curve, folder)
    if report.warnings:
        shown = report.warnings[:MAX_WARNINGS_SHOWN]
        lines += ["## Warnings during the runs", "", f"{len(report.warnings)} warning(s); the figures they name may be low.", ""]
        lines += [f"- {w}" for w in shown] + ([f"- … and {len(report.warnings) - len(shown)} more in the results file"]
                                              if len(report.warnings) > len(shown) else []) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Worker entry points of the suite (run by :func:`run_suite` in subprocesses)."""
    ap = argparse.ArgumentParser(description="detinfer benchmark workers (use `detinfer bench`)")
    ap.add_argument("mode", choices=["worker", "session"])
    ap.add_argument("--engine", choices=["detinfer", "llama-cpp"], default="detinfer")
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    if args.mode == "worker":
        return _serve_worker(args.engine, args.model, args.threads)
    print(session_figures(args.model, args.threads, args.runs).model_dump_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
