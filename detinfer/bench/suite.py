"""The benchmark suite behind ``detinfer bench`` (and ``make bench``).

Per model, per instruction set (``--isa``, default ``host,avx2``) and at 1 and 2 threads: prefill tok/s of
prompts of each ``prefill`` size and decode tok/s over ``decode`` tokens, for up to three engines measured side by
side in separate worker processes, alternating run by run:

- ``detinfer``: the engine as shipped (the determinism contract). On ``avx2`` its workers compile for numba's
  ``haswell`` target with no extra features (AVX2 + FMA, AVX-512 off; scripts/portability.py's haswell target),
  in their own JIT cache (numba's cache key ignores the target);
- ``detinfer-fastmath`` (suite models, host only): the same engine with every kernel compiled with fastmath
  (reductions reassociated, benchmark only; see ``kernels.FASTMATH``), in its own JIT cache: the cost of the contract;
- ``llama-cpp`` (``--peer llama-cpp``): llama-cpp-python built for that ISA (``make bench-peers``: one folder per
  ISA under ``--peers-dir``, put first on the worker's import path), on the same token ids and threads.

Every worker reports what it was compiled for (numba's target and a probe of the code it compiles; llama.cpp's
system info). Suite models (``--model``; cells prefill 64, 512, 2048 and decode 128) also get, on the host, peak
RSS against GGUF size + KV bytes, cold and warm start to the first token of ``detinfer run`` and the 20-turn
session with prefix reuse against recomputation. 1B-class models (``--large-model``; prefill 64, 512 and decode
32, seeded random token ids) get the weight bytes each decoded token streams, set against this machine's read
bandwidth measured in the same run (:mod:`detinfer.bench_bandwidth`). Every figure is the median of ``runs`` runs
with min and max; the CPU is checked for other busy processes right before each run (2-thread numba runs slow down
many-fold when a core is taken). Results go to ``bench/results.json`` and ``docs/benchmarks.md``
(:mod:`detinfer.bench_report`). Speed is measured here only, never asserted in tests.

``python -m detinfer.bench.worker worker|session ...`` (bench/worker.py) is the worker side of the suite.
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..model.gguf_file import check_magic
from ..model.registry import DEFAULT_MODEL, REGISTRY, resolve_model
from ..paths import detinfer_home
from ..records.manifest import cpu_name
from .report import (
    BenchReport,
    EngineRun,
    IsaRun,
    KVCurve,
    ModelReport,
    SessionFigures,
    StartTimes,
    ThreadRun,
    display_name,
    load_report,
    stats,
    write_report,
)

SUITE_CELLS = ((64, 512, 2048), 128)  # (prefill sizes, decode tokens) of --model
LARGE_CELLS = ((64, 512), 32)  # of --large-model: a 1B decode runs at a few tok/s
DECODE_PROMPT = 16  # tokens prefilled before the timed decode
THREADS = (1, 2)
N_CTX = 4096
DEFAULT_MODELS = (DEFAULT_MODEL, "gemma3-270m-q4_k_m")  # a default model that does not load is skipped, with the reason
PEERS = ("llama-cpp",)
ISAS = ("host", "avx2")
# what each ISA's detinfer workers run with: host = numba's default target, so any inherited override is removed
ISA_ENV = {"host": {}, "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}}
ISA_NEEDS = {"host": (), "avx2": ("avx2", "fma")}  # host CPU features an ISA's code needs
FASTMATH_ENV = "DETINFER_BENCH_FASTMATH"  # read once by detinfer.kernels
TEXT = " ".join(f"item {i}: the quick brown fox jumps over the lazy dog." for i in range(400))
RANDOM_IDS_SEED = 0
PEER_BUILD_FILE = "BUILD"  # written by `make bench-peers` into each peer folder: how it was built


def figures(prefill: Sequence[int], decode: int) -> list[tuple[str, str, int]]:
    """(figure name, worker op, tokens) of each cell: ``prefill_<n>_tok_s`` for each prefill size, ``decode_<n>_tok_s``."""
    return [(f"prefill_{n}_tok_s", "prefill", n) for n in prefill] + [(f"decode_{decode}_tok_s", "decode", decode)]


@dataclass(frozen=True)
class Options:
    """What ``detinfer bench`` runs. models: suite models; large_models: 1B-class models (registry names or GGUF
    paths); large_runs: runs per 1B-class figure (None: ``runs``); prefill / decode: override both kinds' cells (None:
    SUITE_CELLS / LARGE_CELLS); cells_only: no fastmath arm, start-up or session figures; threads: the thread counts."""

    models: tuple[str, ...] = DEFAULT_MODELS
    large_models: tuple[str, ...] = ()
    isas: tuple[str, ...] = ISAS
    runs: int = 3
    large_runs: int | None = None
    peer: str | None = None
    peers_dir: Path = Path(".bench")
    prefill: tuple[int, ...] | None = None
    decode: int | None = None
    cells_only: bool = False
    threads: tuple[int, ...] = THREADS

    def cells(self, kind: str) -> list[tuple[str, str, int]]:
        """:func:`figures` of a model of ``kind`` "suite" or "large"."""
        prefill, decode = SUITE_CELLS if kind == "suite" else LARGE_CELLS
        return figures(self.prefill or prefill, self.decode or decode)

    def runs_of(self, kind: str) -> int:
        return self.large_runs if kind == "large" and self.large_runs is not None else self.runs


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


def parse_isas(text: str) -> tuple[str, ...]:
    """``--isa host,avx2`` -> ("host", "avx2") in the given order, repeats dropped; InputError for an unknown or
    empty list."""
    isas = tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    unknown = [x for x in isas if x not in ISAS]
    if unknown or not isas:
        raise InputError(f"unknown ISA {unknown[0]!r}; known: {', '.join(ISAS)}" if unknown else "--isa lists no instruction set")
    return isas


def parse_counts(text: str, option: str) -> tuple[int, ...]:
    """"64,512" -> (64, 512); InputError naming ``option`` for anything but comma-separated integers."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise InputError(f"{option} takes comma-separated integers, got {text!r}") from None


def host_features() -> set[str]:
    """The host CPU's features as LLVM names them ("avx2", "fma", "avx512f", ...)."""
    import llvmlite.binding as llvm

    return {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}


def peer_dir(peers_dir: Path, isa: str) -> Path:
    """The folder ``make bench-peers`` installs llama-cpp-python for ``isa`` into."""
    return peers_dir / f"llama-cpp-{isa}"


def check_options(opts: Options) -> None:
    """Raise InputError (or GGUFError for a model path that is not a GGUF file) for options the suite cannot run
    with, before anything is loaded or written."""
    if opts.runs < 1:
        raise InputError(f"--runs must be at least 1, got {opts.runs}")
    if opts.large_runs is not None and opts.large_runs < 1:
        raise InputError(f"--large-runs must be at least 1, got {opts.large_runs}")
    if not opts.threads or min(opts.threads) < 1:
        raise InputError(f"--threads must be positive thread counts, got {list(opts.threads)}")
    if not opts.models and not opts.large_models:
        raise InputError("no models to benchmark")
    if opts.prefill is not None and (not opts.prefill or min(opts.prefill) < 1 or max(opts.prefill) > N_CTX):
        raise InputError(f"--prefill sizes must be 1..{N_CTX}, got {list(opts.prefill)}")
    if opts.decode is not None and not 1 <= opts.decode <= N_CTX - DECODE_PROMPT:
        raise InputError(f"--decode must be 1..{N_CTX - DECODE_PROMPT}, got {opts.decode}")
    if opts.peer is not None and opts.peer not in PEERS:
        raise InputError(f"unknown peer {opts.peer!r}; known peers: {', '.join(PEERS)}")
    for isa in opts.isas:
        if missing := [f for f in ISA_NEEDS[isa] if f not in host_features()]:
            raise InputError(f"--isa {isa} needs a CPU with {' and '.join(f.upper() for f in ISA_NEEDS[isa])}; this host has no "
                             f"{', '.join(f.upper() for f in missing)}")
    if opts.peer is not None:
        for isa in opts.isas:
            if not (peer_dir(opts.peers_dir, isa) / "llama_cpp" / "__init__.py").is_file():
                raise InputError(f"--peer llama-cpp on {isa} needs llama-cpp-python built for it in "
                                 f"{peer_dir(opts.peers_dir, isa)}; `make bench-peers` builds one per ISA")
    for model in opts.models + opts.large_models:
        if model not in REGISTRY:  # a registry model that is not pulled is skipped later, with the reason
            check_magic(resolve_model(model))


def random_ids(n_vocab: int, n: int = N_CTX) -> list[int]:
    """``n`` token ids drawn uniformly from [0, n_vocab), seeded: the 1B-class prompts, the same for every engine."""
    import numpy as np

    return np.random.default_rng(RANDOM_IDS_SEED).integers(0, n_vocab, n).tolist()


def streamed_weight_bytes(model_file) -> int:
    """Bytes of the weight matrices one decoded token reads, as stored in the GGUF: every 2-D tensor, except
    token_embd when an output.weight exists (then only the embedding rows looked up are read)."""
    untied = "output.weight" in model_file.tensors
    return sum(t.nbytes for name, t in model_file.tensors.items()
               if len(t.shape) == 2 and not (untied and name == "token_embd.weight"))


def compiled_isa() -> str:
    """What numba compiles for in this process, checked on real code: its target (NUMBA_CPU_NAME/FEATURES) and a
    probe loop's assembly, searched for FMA instructions (detinfer's explicit ``fma32``) and for AVX-512 (zmm or
    mask registers, or vcvtuqq2pd, AVX-512DQ's uint64 -> float64 conversion, which LLVM uses whenever it may)."""
    import numba
    import numpy as np

    from ..compute.numerics import fma32
    from ..records.machine import machine

    @numba.njit(cache=False)
    def probe(a, u, out):
        for i in range(a.size):
            a[i] = fma32(a[i], a[i], np.float32(1.0))
        for i in range(u.size):
            out[i] = np.float64(u[i])

    probe(np.ones(64, np.float32), np.arange(64, dtype=np.uint64), np.empty(64))
    asm = next(iter(probe.inspect_asm().values()))
    avx512 = bool(re.search(r"%zmm\d|%k[1-7]\b|vcvtuqq2pd", asm))
    widest = next(r for r in ("zmm", "ymm", "xmm", "") if f"%{r}" in asm) or "none"
    return (f"numba target {machine()['compile_target']}; probe: FMA {'yes' if 'vfmadd' in asm else 'no'}, "
            f"AVX-512 {'yes' if avx512 else 'no'}, widest vector register {widest}")


def worker_env(kind: str, isa: str, threads: int, peers_dir: Path) -> dict[str, str]:
    """The environment of a worker of engine ``kind`` on ``isa``: its thread count; for llama.cpp the ISA's peer
    folder first on PYTHONPATH; for detinfer the ISA's compile target (ISA_ENV) and, for anything but the host's
    default build, a JIT cache of its own under $DETINFER_HOME/bench (numba's cache key ignores the target and
    fastmath); the host's default build keeps the inherited cache."""
    env = dict(os.environ, NUMBA_NUM_THREADS=str(threads or os.cpu_count() or 1))  # 0: detinfer's default, every core
    if kind == "llama-cpp":
        inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
        env["PYTHONPATH"] = os.pathsep.join([str(peer_dir(peers_dir, isa).resolve()), *inherited])
        return env
    for key in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", FASTMATH_ENV):
        env.pop(key, None)
    env.update(ISA_ENV[isa])
    if kind == "detinfer-fastmath":
        env[FASTMATH_ENV] = "1"
    cache = "-".join(([] if isa == "host" else [isa]) + (["fastmath"] if kind == "detinfer-fastmath" else []))
    if cache:
        env["NUMBA_CACHE_DIR"] = str(detinfer_home() / "bench" / f"numba-{cache}")
    return env


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, kind: str, model: str, threads: int, isa: str, ids: str, tokens: int, peers_dir: Path):
        self.kind = kind
        self.stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "detinfer.bench.worker", "worker", "--engine", "llama-cpp" if kind == "llama-cpp" else "detinfer",
             "--model", model, "--threads", str(threads), "--ids", ids, "--tokens", str(tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env=worker_env(kind, isa, threads, peers_dir),
        )
        self.ready = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:  # a library may print to stdout too: the reply is the JSON object line
            if line.startswith("{"):
                return json.loads(line)
        self.stderr.seek(0)
        tail = self.stderr.read().strip().splitlines()[-1:] or ["no output"]
        code = self.proc.wait()
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        raise RuntimeError(f"{self.kind} worker {how}: {tail[0]}")

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


def measure_engines(model: str, kind: str, isa: str, threads: int, engines: list[str], opts: Options,
                    warn: Callable[[str], None]) -> tuple[list[EngineRun], dict[str, dict]]:
    """Every cell of ``kind`` for each engine on ``isa`` at ``threads``, alternating engines run by run. Returns the
    runs and each engine's info (sizes, compile flags). Raises ModelUnavailable if detinfer cannot load the model;
    a llama.cpp worker that dies while loading (a crashing build) is left out with a warning."""
    cells = opts.cells(kind)
    tokens = max([DECODE_PROMPT] + [n for _, op, n in cells if op == "prefill"])
    ids = "random" if kind == "large" else "text"
    workers: list[_Worker] = []
    try:
        for engine in engines:
            try:
                workers.append(_Worker(engine, model, threads, isa, ids, tokens, opts.peers_dir))
            except RuntimeError as e:
                if engine != "llama-cpp":
                    raise
                warn(f"{display_name(model)}, {isa}, {threads} thread(s): llama.cpp not measured: {e}")
                continue
            if "error" in workers[-1].ready:
                raise ModelUnavailable(f"{engine}: {workers[-1].ready['error']}")
        samples: dict[str, dict[str, list[float]]] = {w.kind: {name: [] for name, _, _ in cells} for w in workers}
        for name, op, n in cells:
            for _ in range(opts.runs_of(kind)):
                for w in workers:
                    if (msg := busy_warning()) is not None:
                        warn(f"{display_name(model)}, {isa}, {threads} thread(s), {w.kind}, {name}: {msg}")
                    samples[w.kind][name].append(n / w.ask(op=op, n=n)["seconds"])
        infos = {w.kind: w.ask(op="info") for w in workers}
        if "detinfer-fastmath" in infos and not infos["detinfer-fastmath"]["fastmath"]:
            raise RuntimeError("the fastmath worker did not compile its kernels with fastmath")
        runs_ = [EngineRun(engine=w.kind, figures={k: stats(v) for k, v in samples[w.kind].items()},
                           peak_rss_mb=infos[w.kind]["peak_rss_mb"]) for w in workers]
        return runs_, infos
    finally:
        for w in workers:
            w.close()


def start_times(model: str, runs: int, warn: Callable[[str], None]) -> StartTimes:
    """Cold start (each run in a fresh, empty NUMBA_CACHE_DIR) and warm start (the usual cache, filled first) of
    ``detinfer run --max-tokens 1``, alternating, whole process."""
    from ..compute.engine import PROGRESS_MARK

    cmd = [sys.executable, "-m", "detinfer.cli", "run", "--prompt", "Hello", "--max-tokens", "1", "--quiet", "--model", model]
    # as an installed package runs: Python keeps its bytecode (a sandbox's PYTHONDONTWRITEBYTECODE costs 0.1 s a start)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)  # fills the JIT and bytecode caches; fails if the model cannot run
    cold, warm, shown = [], [], True
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="detinfer-cold-") as cache_dir:
            if (msg := busy_warning()) is not None:
                warn(f"{model}, cold start: {msg}")
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(env, NUMBA_CACHE_DIR=cache_dir))
            cold.append(time.perf_counter() - t0)
            shown = shown and PROGRESS_MARK in proc.stderr
        if (msg := busy_warning()) is not None:
            warn(f"{model}, warm start: {msg}")
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        warm.append(time.perf_counter() - t0)
    return StartTimes(cold_s=stats(cold), warm_s=stats(warm), progress_message=shown)


def bench_model(model: str, kind: str, opts: Options, warn: Callable[[str], None]) -> ModelReport:
    """The suite for one model of ``kind`` "suite" or "large" (``status="skipped"`` with the reason if it does not load)."""
    extras = kind == "suite" and not opts.cells_only
    report = ModelReport(model=model, kind=kind, status="ok")
    if extras:
        try:
            report.start = start_times(model, opts.runs, warn)  # first: it fills the JIT cache, so no worker's RSS counts compiling
        except subprocess.CalledProcessError as e:
            return ModelReport(model=model, kind=kind, status="skipped",
                               reason=(e.stderr.strip().splitlines() or ["detinfer run failed"])[-1])
    for isa in opts.isas:
        engines = ["detinfer"] + (["detinfer-fastmath"] if extras and isa == "host" else []) + ([opts.peer] if opts.peer else [])
        build = peer_dir(opts.peers_dir, isa) / PEER_BUILD_FILE
        run = IsaRun(isa=isa, detinfer_env=ISA_ENV[isa], flags={},
                     peer_build=build.read_text().strip() if opts.peer and build.is_file() else None)
        for threads in opts.threads:
            try:
                measured, infos = measure_engines(model, kind, isa, threads, engines, opts, warn)
            except ModelUnavailable as e:
                return ModelReport(model=model, kind=kind, status="skipped", reason=str(e))
            ours = infos["detinfer"]
            report.sha256, report.model_file_bytes = ours["sha256"], ours["model_file_bytes"]
            report.kv_bytes_at_n_ctx, report.weight_bytes_per_token = ours["kv_bytes_at_n_ctx"], ours["weight_bytes_per_token"]
            run.flags |= {e: info["flags"] for e, info in infos.items() if e != "detinfer-fastmath"}
            run.threads.append(ThreadRun(threads=threads, engines=measured))
        report.isas.append(run)
    if not extras:
        return report
    if (msg := busy_warning()) is not None:
        warn(f"{model}, session: {msg}")
    threads = max(opts.threads)
    proc = subprocess.run([sys.executable, "-m", "detinfer.bench.worker", "session", "--model", model, "--threads", str(threads),
                           "--runs", str(opts.runs)], capture_output=True, text=True, check=False,
                          env=dict(os.environ, NUMBA_NUM_THREADS=str(threads)))
    if proc.returncode != 0:  # reported, without losing the figures already measured
        warn(f"{model}: session benchmark failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    else:
        report.session = SessionFigures.model_validate_json(proc.stdout.strip().splitlines()[-1])
    return report


def run_suite(opts: Options, out: Path, markdown_path: Path, warn: Callable[[str], None],
              progress: Callable[[str], None]) -> BenchReport:
    """Benchmark every model, write ``out`` (JSON) and ``markdown_path`` atomically, return the report.

    With large models, the memory bandwidth is measured first. A model that does not load, or whose benchmark
    fails, is recorded as skipped with the reason. A previous report's ``kv_curve`` (dated) is kept.
    Raises InputError for bad options (see :func:`check_options`).
    """
    from .bandwidth import measure_bandwidth

    check_options(opts)
    warnings: list[str] = []

    def warn_(msg: str) -> None:
        warnings.append(msg)
        warn(msg)

    if opts.runs < 3:
        warn_(f"{opts.runs} run(s) per figure: medians of fewer than 3 runs are for smoke tests, not for the published table")
    bandwidth = []
    if opts.large_models:
        progress("measuring memory bandwidth")
        if (msg := busy_warning()) is not None:
            warn_(f"bandwidth: {msg}")
        bandwidth = measure_bandwidth(opts.threads)
    reports = []
    for kind, models in (("suite", opts.models), ("large", opts.large_models)):
        for model in models:
            progress(f"benchmarking {model}")
            try:
                reports.append(bench_model(model, kind, opts, warn_))
            except RuntimeError as e:  # a worker that crashed: recorded, and the other models still run
                reports.append(ModelReport(model=model, kind=kind, status="skipped", reason=f"benchmark failed: {e}"))
            if reports[-1].status == "skipped":
                warn_(f"{model} skipped: {reports[-1].reason}")
    try:
        previous = load_report(out) if out.exists() else None
    except InputError:
        previous = None  # a results file of an older schema is replaced whole
    report = BenchReport(
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), machine=_machine(), n_ctx=N_CTX, runs_per_figure=opts.runs,
        large_runs_per_figure=opts.runs_of("large") if opts.large_models else 0, peer=opts.peer, isas=list(opts.isas),
        bandwidth=bandwidth, models=reports, warnings=warnings, kv_curve=previous.kv_curve if previous else None,
    )
    write_report(report, out, markdown_path)
    return report


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
    """The machine, and when and from which source a bench ran (see :func:`machine_line`)."""
    from ..records.machine import machine

    return {"cpu": cpu_name(), "host_cpu_name": machine()["host_cpu_name"], "isa": machine()["isa"],
            "cores": os.cpu_count() or 0, "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "source": source()}  # fmt: skip


CODE_PATHS = ("detinfer", "bench/*.py", "pyproject.toml")  # what a bench runs, beside its own result files


def source(root: Path = Path(__file__).parents[2]) -> str:
    """The commit a bench ran, ``git describe --always`` of the checkout at ``root`` (detinfer's), with "-dirty" when
    the code it runs (CODE_PATHS) differs from that commit; the result files an earlier bench section wrote do not
    count (a lockstep run after a speculate run read "-dirty"). Outside a checkout: detinfer's version."""
    from ..version import __version__

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("describe", "--always")
    if commit is None:
        return f"detinfer {__version__}"
    return commit + ("-dirty" if git("status", "--porcelain", "--", *CODE_PATHS) else "")


def machine_line(m: dict) -> str:
    """"AMD EPYC (2 cores), 2026-12-07 06:10 UTC, 50ddd85": the start of a bench section (results of runs before the
    date and source were recorded give only the machine)."""
    return f"{m['cpu']} ({m['cores']} cores)" + "".join(f", {m[k]}" for k in ("when", "source") if k in m)
