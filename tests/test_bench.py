"""The benchmark tooling: option errors, worker environments per ISA, the synthetic 1B-class writer (at a tiny shape),
the KV arms' token check, the results schema and its markdown, the plot file. No timings are asserted (speed is
measured by ``make bench`` only); nothing here needs llama-cpp-python."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import cli
from gguf_factory import write_tiny_gguf

import detinfer
from detinfer.bench import kv as bench_kv
from detinfer.bench import report as bench_report
from detinfer.bench import suite as bench
from detinfer.bench.bandwidth import measure_bandwidth
from detinfer.bench.kv import (
    context_for,
    first_mismatch,
    kv_curve,
    plot_kv,
    separation_step,
    target_totals,
)
from detinfer.bench.report import (
    BandwidthRun,
    BenchReport,
    EngineRun,
    IsaRun,
    KVCurve,
    ModelReport,
    SessionFigures,
    StartTimes,
    ThreadRun,
    stats,
)
from detinfer.compute.engine import PROGRESS_MARK, Engine
from detinfer.errors import DetinferError, InputError
from detinfer.model.gguf_file import ModelFile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/synth_model.py is a script next to bench/kernels.py, which it imports
import synth_model  # noqa: E402


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--runs", "0"], "--runs must be at least 1"),
        (["bench", "--large-runs", "0"], "--large-runs must be at least 1"),
        (["bench", "--peer", "vllm"], "unknown peer 'vllm'"),
        (["bench", "--isa", "host,sse9"], "unknown ISA 'sse9'; known: host, avx2"),
        (["bench", "--isa", ","], "--isa lists no instruction set"),
        (["bench", "--threads", "0"], "--threads must be positive"),
        (["bench", "--threads", "two"], "--threads takes comma-separated integers"),
        (["bench", "--prefill", "64,0"], "--prefill sizes must be 1..4096"),
        (["bench", "--decode", "0"], "--decode must be 1..4080"),
        (["bench", "--model", "{missing}"], "does not exist"),
        (["bench", "--large-model", "{missing}"], "does not exist"),
        (["bench", "--model", "{old}"], "this is not a GGUF file"),
        (["bench", "--large-model", "{old}"], "this is not a GGUF file"),
        (["bench", "kv", "--tokens", "0"], "--tokens must be positive"),
        (["bench", "kv", "--naive-budget", "0"], "--naive-budget must be positive"),
        (["bench", "kv", "--results", "{old}"], "is not a benchmark results file of schema 2"),
    ],
)
def test_bench_rejects_bad_options_before_loading(tmp_path, args, message):
    old = tmp_path / "old-results.json"
    old.write_text(json.dumps({"runs": []}))  # an earlier format
    result = cli(tmp_path, *[a.format(old=old, missing=tmp_path / "missing.gguf") for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_peer_without_its_build_is_one_line(tmp_path):
    result = cli(tmp_path, "bench", "--peer", "llama-cpp", "--isa", "host", "--peers-dir", tmp_path / "peers")
    assert result.exit_code == 2
    assert f"llama-cpp-python built for it in {tmp_path / 'peers' / 'llama-cpp-host'}" in result.output
    assert "make bench-peers" in result.output and len(result.output.strip().splitlines()) == 1


def test_avx2_on_a_host_without_it_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "host_features", lambda: {"sse2", "sse4.2"})
    result = cli(tmp_path, "bench", "--isa", "avx2")
    assert result.exit_code == 2
    assert "--isa avx2 needs a CPU with AVX2 and FMA; this host has no AVX2, FMA" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_isa_list_keeps_order_and_drops_repeats():
    assert bench.parse_isas("avx2, host,avx2") == ("avx2", "host")
    assert bench.parse_isas("host") == ("host",)


def test_worker_environments_per_isa(tmp_path, monkeypatch):
    monkeypatch.setenv("DETINFER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")  # inherited: the host ISA must not keep it
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/usual/cache")
    peers = tmp_path / "peers"
    avx2 = bench.worker_env("detinfer", "avx2", 2, peers)
    assert (avx2["NUMBA_CPU_NAME"], avx2["NUMBA_CPU_FEATURES"], avx2["NUMBA_NUM_THREADS"]) == ("haswell", "", "2")
    assert avx2["NUMBA_CACHE_DIR"] == str(tmp_path / "home" / "bench" / "numba-avx2")
    assert bench.FASTMATH_ENV not in avx2
    host = bench.worker_env("detinfer", "host", 1, peers)
    assert "NUMBA_CPU_NAME" not in host and "NUMBA_CPU_FEATURES" not in host and host["NUMBA_CACHE_DIR"] == "/usual/cache"
    fast = bench.worker_env("detinfer-fastmath", "host", 1, peers)
    assert fast[bench.FASTMATH_ENV] == "1" and fast["NUMBA_CACHE_DIR"].endswith("numba-fastmath")
    peer = bench.worker_env("llama-cpp", "avx2", 1, peers)
    assert peer["PYTHONPATH"].split(os.pathsep) == [str((peers / "llama-cpp-avx2").resolve()), "/elsewhere"]


def test_numba_haswell_target_compiles_without_avx512():
    """The avx2 workers' environment really turns AVX-512 off (a bare NUMBA_CPU_NAME=haswell keeps the host's
    features, AVX-512 included, on an AVX-512 host), and keeps FMA."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")} | bench.ISA_ENV["avx2"]
    code = "from detinfer.bench.suite import compiled_isa; print(compiled_isa())"
    flags = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "numba target haswell features=''" in flags and "FMA yes" in flags and "AVX-512 no" in flags, flags


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = cli(tmp_path, "bench", "kv", "--plot", tmp_path / "kv.png")
    assert result.exit_code == 2
    assert "needs matplotlib" in result.output and len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "kv.png").exists()


def test_mismatch_and_separation_logic():
    assert first_mismatch([5, 6, 7], [5, 6, 8]) == 2
    assert first_mismatch([5, 6, 7], [5, 6]) is None  # the naive arm stopped early: compared over its length
    assert separation_step([1, 1, 1, 1], [1, 1, 5, 4]) == 2  # cumulative 1,2,7,11 against 2 x (1,2,3,4)
    assert separation_step([1, 1, 1], [1, 1, 1]) is None


def test_target_totals_measured_and_lower_bound():
    steps = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    measured = target_totals(4, [0.5] * 10, steps)
    assert (measured.naive_kind, measured.naive_s, measured.cached_s, measured.ratio) == ("measured", 10.0, 2.0, 5.0)
    bound = target_totals(10, [0.5] * 10, steps)
    # 21 s measured + 4 missing steps at the median of the last five (4 s)
    assert (bound.naive_kind, bound.naive_s, bound.ratio) == ("extrapolated lower bound", 37.0, 7.4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("bench") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_engine(tiny_model) -> Engine:
    return Engine.load(tiny_model, n_ctx=context_for([8]))


def test_run_shows_the_compile_status_on_stderr_only(tmp_path, tiny_model, monkeypatch):
    import detinfer.cli.common

    real = Engine.warm_up
    monkeypatch.setattr(detinfer.cli.common, "COMPILE_STATUS_DELAY_S", 0.0)  # as if compiling took long
    monkeypatch.setattr(Engine, "warm_up", lambda engine: (time.sleep(0.5), real(engine)))
    r = cli(tmp_path, "run", "--model", tiny_model, "--prompt", "hi there", "-n", "3", "--ctx", "64")
    assert r.exit_code == 0, r.output
    assert PROGRESS_MARK in r.stderr and PROGRESS_MARK not in r.stdout


def test_kv_arms_give_the_same_tokens(tiny_engine):
    kv = kv_curve(tiny_engine, 1, [4, 8], naive_budget_s=600, model="tiny")
    assert kv.tokens_identical and kv.first_mismatch is None and kv.compared_tokens == 8
    assert not kv.naive_stopped_early and len(kv.cached_step_s) == len(kv.naive_step_s) == 8
    assert [(t.tokens, t.naive_kind) for t in kv.targets] == [(4, "measured"), (8, "measured")]


def test_kv_naive_arm_stops_at_its_budget(tiny_engine):
    kv = kv_curve(tiny_engine, 1, [8], naive_budget_s=1e-9, model="tiny")
    assert kv.naive_stopped_early and len(kv.naive_step_s) == 1 and kv.compared_tokens == 1
    assert kv.tokens_identical and kv.targets[0].naive_kind == "extrapolated lower bound"


def test_kv_curve_reports_differing_tokens(tiny_engine, monkeypatch):
    real = bench_kv.naive_arm

    def off_by_one_at_3(*args):
        tokens, times = real(*args)
        return tokens[:3] + [tokens[3] + 1] + tokens[4:], times

    monkeypatch.setattr(bench_kv, "naive_arm", off_by_one_at_3)
    kv = kv_curve(tiny_engine, 1, [8], naive_budget_s=600, model="tiny")
    assert not kv.tokens_identical and kv.first_mismatch == 3


def test_kv_curve_rejects_targets_beyond_the_context(tiny_engine):
    with pytest.raises(InputError, match="exceed the context"):
        kv_curve(tiny_engine, 1, [context_for([8])], naive_budget_s=1, model="tiny")


def _kv(plot: str | None = None) -> KVCurve:
    steps = [0.01] * 8
    return KVCurve(date="d", model="tiny", threads=1, prompt_tokens=5, cached_step_s=steps, naive_step_s=[0.01, 0.02, 0.04],
                   naive_budget_s=0.05, naive_stopped_early=True, tokens_identical=True, compared_tokens=3,
                   separation_step=1, targets=[target_totals(8, steps, [0.01, 0.02, 0.04])], plot=plot)


def _run(engine: str, figures: dict[str, float]) -> EngineRun:
    return EngineRun(engine=engine, figures={n: stats([v, v, v]) for n, v in figures.items()}, peak_rss_mb=300.0)


def _isa(isa: str, engines: dict[int, dict[str, dict[str, float]]]) -> IsaRun:
    flags = {"detinfer": f"numba target {isa}; probe: FMA yes", "llama-cpp": f"CPU : {isa.upper()} = 1 |"}
    return IsaRun(isa=isa, detinfer_env=bench.ISA_ENV[isa], flags=flags, peer_build=f"llama-cpp-python built for {isa}",
                  threads=[ThreadRun(threads=t, engines=[_run(e, f) for e, f in by_engine.items()]) for t, by_engine in engines.items()])


def _report() -> BenchReport:
    """A small fake report: SmolLM2 on host (with fastmath) and avx2, a 1B-class model, a skipped model."""
    s = stats([1.0, 2.0, 3.0])
    names = [name for name, _, _ in bench.figures(*bench.SUITE_CELLS)]
    cell = lambda v: dict.fromkeys(names, v)  # noqa: E731
    host = _isa("host", {1: {"detinfer": cell(2.0), "detinfer-fastmath": cell(1.0), "llama-cpp": cell(1.0)},
                         2: {"detinfer": cell(2.0), "detinfer-fastmath": cell(1.0), "llama-cpp": cell(2.0)}})
    avx2 = _isa("avx2", {t: {"detinfer": cell(3.0), "llama-cpp": cell(2.0)} for t in bench.THREADS})
    ok = ModelReport(model=bench.DEFAULT_MODEL, status="ok", model_file_bytes=98_362_432, kv_bytes_at_n_ctx=188_743_680,
                     isas=[host, avx2], start=StartTimes(cold_s=s, warm_s=s, progress_message=True),
                     session=SessionFigures(turns=20, history_tokens=565, with_reuse_s=s, no_cache_s=s, snapshot_tokens=1000,
                                            snapshot_bytes=46_084_768, snapshot_save_ms=s, snapshot_load_ms=s))
    large_cells = {"prefill_64_tok_s": 30.0, "decode_32_tok_s": 8.0}
    large = ModelReport(model="/home/x/synthetic-llama-1b-q4_k_m.gguf", kind="large", status="ok", sha256="ab" * 32,
                        model_file_bytes=803_330_272, weight_bytes_per_token=10**9,
                        isas=[_isa("host", {t: {"detinfer": large_cells, "llama-cpp": {"prefill_64_tok_s": 60.0, "decode_32_tok_s": 5.0}}
                                            for t in bench.THREADS})])
    skipped = ModelReport(model="gemma3-270m-q4_k_m", status="skipped", reason="unknown model")
    bandwidth = [BandwidthRun(threads=t, array_bytes=2**30, read_gb_s=stats([10.0 * t]), copy_gb_s=stats([9.0])) for t in bench.THREADS]
    return BenchReport(date="d", machine={"cpu": "cpu", "cores": 2, "python": "3", "isa": "fma,avx2"}, n_ctx=bench.N_CTX,
                       runs_per_figure=3, large_runs_per_figure=2, peer="llama-cpp", isas=["host", "avx2"], bandwidth=bandwidth,
                       models=[ok, skipped, large], warnings=["1.0 cores busy"], kv_curve=_kv("kv.png"))


def test_results_schema_round_trip_and_markdown(tmp_path):
    report = _report()
    out, md = tmp_path / "bench" / "results.json", tmp_path / "docs" / "benchmarks.md"
    bench_report.write_report(report, out, md)
    assert bench_report.load_report(out) == report
    data = json.loads(out.read_text())
    assert data["schema_version"] == 2 and set(data["models"][0]["isas"][0]["threads"][0]["engines"][0]["figures"]) == {
        "prefill_64_tok_s", "prefill_512_tok_s", "prefill_2048_tok_s", "decode_128_tok_s"}
    text = md.read_text()
    for needle in ("cost of the contract", "thread scaling", "Skipped: unknown model", "extrapolated lower bound",
                   "![time per token", "| floor | measured | holds |",
                   # how each engine was built per ISA
                   "- **avx2**: detinfer with NUMBA_CPU_NAME='haswell' NUMBA_CPU_FEATURES='', in its own JIT cache; "
                   "compiled code: numba target avx2; probe: FMA yes.",
                   "llama.cpp: llama-cpp-python built for avx2; `llama_print_system_info()`: `CPU : AVX2 = 1 |`.",
                   # one side-by-side table per ISA, ratio and floor per cell
                   "## detinfer vs llama.cpp: host", "## detinfer vs llama.cpp: avx2",
                   "| smollm2-135m-instruct-q4_1 | 1 | decode 128 | 2 (2–2) | 1 (1–1) | 2.00× | yes |",
                   "| smollm2-135m-instruct-q4_1 | 2 | decode 128 | 2 (2–2) | 2 (2–2) | 1.00× | **no** |",
                   "Floor detinfer / llama.cpp ≥ 1.1× per cell: holds in 4 of 8 cells.",
                   "| smollm2-135m-instruct-q4_1 | 2 | prefill 2048 | 3 (3–3) | 2 (2–2) | 1.50× | yes |",
                   # the 1B-class table: GB/s of weights per decode cell against the read bandwidth
                   "- synthetic-llama-1b-q4_k_m.gguf: 1.000 GB of weight matrices streamed per decoded token",
                   "- Read bandwidth at 2 thread(s): 20 GB/s", "Median (min–max) of 2 run(s), tok/s, token ids fed directly",
                   "| synthetic-llama-1b-q4_k_m.gguf | host | 1 | decode 32 | 8 (8–8) | 5 (5–5) | 1.60× | yes | 8.00 | 80% | yes |",
                   "| synthetic-llama-1b-q4_k_m.gguf | host | 2 | decode 32 | 8 (8–8) | 5 (5–5) | 1.60× | yes | 8.00 | 40% | **no** |",
                   "| synthetic-llama-1b-q4_k_m.gguf | host | 1 | prefill 64 | 30 (30–30) | 60 (60–60) | 0.50× | **no** | – | – | – |"):
        assert needle in text, needle


@pytest.mark.parametrize("change", [{"extra": 1}, {"schema_version": 1}])
def test_results_of_another_schema_are_refused(tmp_path, change):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_report().model_dump() | change))
    with pytest.raises(InputError, match="not a benchmark results file"):
        bench_report.load_report(path)


def test_kv_curve_is_added_to_existing_results(tmp_path):
    out, md = tmp_path / "results.json", tmp_path / "benchmarks.md"
    bench_report.write_report(_report().model_copy(update={"kv_curve": None}), out, md)
    bench.add_kv_curve(_kv(), out, md)
    report = bench_report.load_report(out)
    assert report.kv_curve == _kv() and len(report.models) == 3
    assert "KV cache vs recomputing" in md.read_text()


def test_bandwidth_is_measured_per_thread_count():
    runs = measure_bandwidth((1, 2), array_bytes=1 << 20, runs=2)
    assert [(b.threads, b.array_bytes, b.read_gb_s.runs) for b in runs] == [(1, 1 << 20, 2), (2, 1 << 20, 2)]
    assert all(b.read_gb_s.min > 0 and b.copy_gb_s.min > 0 for b in runs)


TINY = synth_model.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64, n_vocab=1024, n_ctx_train=256)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("mix", synth_model.MIXES)
def test_synthetic_model_loads_runs_and_is_reproducible(tmp_path, mix):
    path = tmp_path / "a.gguf"
    assert synth_model.write_model(path, mix, seed=3, shape=TINY)
    engine = Engine.load(path, n_ctx=64)
    cfg = engine.config
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_vocab) == (
        "llama", 2, 256, 512, 4, 2, 64, 1024)
    assert cfg.tied_embeddings and cfg.rope_freq_base == 500000.0
    logits = engine.forward(bench.random_ids(cfg.n_vocab, 12), engine.new_cache())
    assert np.isfinite(logits).all() and logits.std() > 0
    assert engine.tokenizer.encode("hi there")  # the vocabulary builds and tokenizes
    mf = ModelFile(path)
    matrices = [t for t in mf.tensors.values() if len(t.shape) == 2]
    assert bench.streamed_weight_bytes(mf) == sum(t.nbytes for t in matrices)  # tied: token_embd is the output
    mtime = path.stat().st_mtime_ns
    assert not synth_model.write_model(path, mix, seed=3, shape=TINY)  # up to date: not written again
    assert path.stat().st_mtime_ns == mtime
    again, other = tmp_path / "b.gguf", tmp_path / "c.gguf"
    synth_model.write_model(again, mix, seed=3, shape=TINY)
    synth_model.write_model(other, mix, seed=4, shape=TINY)
    assert _sha256(again) == _sha256(path) != _sha256(other)
    path.write_bytes(path.read_bytes()[:-1] + b"x")  # a damaged file no longer matches its record: rewritten
    assert synth_model.write_model(path, mix, seed=3, shape=TINY) and _sha256(path) == _sha256(again)


TINY_QWEN35 = synth_model.Shape(n_layer=4, n_embd=256, n_ff=512, n_head=2, n_head_kv=1, head_dim=64, n_vocab=1024,
                                n_ctx_train=256, rope_freq_base=1e7, rms_norm_eps=1e-6, arch="qwen35", interval=2, n_rot=16,
                                ssm_conv_kernel=4, ssm_n_k_head=2, ssm_n_v_head=2, ssm_head=32)  # fmt: skip


def test_synthetic_qwen35_model_loads_and_runs_as_one_token_at_a_time(tmp_path):
    path = tmp_path / "q.gguf"
    assert synth_model.write_model(path, "q8_0", seed=1, shape=TINY_QWEN35)
    engine = Engine.load(path, n_ctx=64)
    cfg = engine.config
    assert (cfg.arch, cfg.recurrent_layers, cfg.n_rot, cfg.ssm_conv_width) == ("qwen35", (True, False, True, False), 16, 192)
    ids = bench.random_ids(cfg.n_vocab, 12)
    logits = engine.forward(ids, engine.new_cache(), all_logits=True)
    cache = engine.new_cache()
    assert np.isfinite(logits).all() and logits.std() > 0
    assert np.stack([engine.forward([t], cache) for t in ids]).tobytes() == logits.tobytes()
    assert synth_model.write_model(tmp_path / "l.gguf", "q8_0", seed=3, shape=TINY)  # the llama record keeps its fields
    assert "arch" not in json.loads((tmp_path / "l.gguf.json").read_text())["params"]["shape"]


def test_synthetic_q4_k_m_mix_is_llama_cpps():
    plan = synth_model.tensor_plan("q4_k_m", synth_model.LLAMA_1B)
    six = {int(n.split(".")[1]) for n, (_, kind) in plan.items() if kind == "Q6_K" and n.endswith("attn_v.weight")}
    assert six == {0, 1, 4, 7, 10, 13, 14, 15}
    assert {n for n, (_, kind) in plan.items() if kind == "Q6_K"} == (
        {f"blk.{i}.{t}.weight" for i in six for t in ("attn_v", "ffn_down")} | {"token_embd.weight"})
    assert plan["token_embd.weight"] == ((128256, 2048), "Q6_K") and "output.weight" not in plan
    assert plan["blk.0.ffn_down.weight"] == ((2048, 8192), "Q6_K") and plan["blk.2.attn_k.weight"] == ((512, 2048), "Q4_K")
    q8 = synth_model.tensor_plan("q8_0", synth_model.LLAMA_1B)
    assert {kind for dims, kind in q8.values() if len(dims) == 2} == {"Q8_0"}
    assert {kind for dims, kind in q8.values() if len(dims) == 1} == {"F32"}


def test_plot_is_written_atomically(tmp_path, monkeypatch):
    import detinfer.fileio

    path = tmp_path / "kv.png"
    plot_kv(_kv(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    path.write_bytes(b"old plot")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(detinfer.fileio.os, "replace", crash)  # the rename into place fails
    with pytest.raises(OSError, match="disk full"):
        plot_kv(_kv(), path)
    assert path.read_bytes() == b"old plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv.png"]  # no temp file left behind


def test_busy_bench_measures_every_configuration_idle_and_busy_and_its_section_is_kept(tmp_path, tiny_model, monkeypatch):
    """``detinfer bench busy`` on a tiny model, one run: every configuration has every cell idle and busy, and so do
    the real servers at --threads 1 and their default; the floors are computed from them, the section replaces
    itself in the markdown and survives the main report's rewrite of the file. A server response that does not
    match the same request alone (the clients' results swapped) is an error, never a figure. (Speed itself is never
    asserted.)"""
    from detinfer.bench import busy, serve

    monkeypatch.setattr(busy, "CELLS", (("prefill_8", "prefill", 8), ("decode_4", "decode", 4)))
    monkeypatch.setattr(serve, "MAX_TOKENS", 8)
    result = busy.run_busy([str(tiny_model)], runs=1, peer=False, peers_dir=tmp_path, progress=lambda msg: None)
    fig = result["models"][str(tiny_model)]
    assert set(fig) == {"idle", "busy", "server"} and all(
        set(fig[load]) == {"detinfer 1t", "detinfer 2t", "detinfer default"} for load in busy.LOADS)
    assert all(fig[load][name][cell]["median"] > 0 for load in busy.LOADS for name in fig[load] for cell in ("prefill_8", "decode_4"))
    assert set(fig["server"]) == set(busy.LOADS) and all(
        set(f) == {"server 1t", "server default"} and all(x["median"] > 0 for x in f.values()) for f in fig["server"].values())
    assert len(busy.floors(fig)) == 5
    out, md = tmp_path / "busy.json", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\nbefore\n")
    busy.write_busy(result, out, md)
    busy.write_busy(result, out, md)  # replaced, not appended twice
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nbefore\n") and text.count(bench_report.BUSY_BEGIN) == 1
    assert "| detinfer default |" in text and "| server default |" in text and "default >= 0.9x 1 thread" in text
    bench_report.write_report(_report(), tmp_path / "results.json", md)
    assert busy.markdown(result) in md.read_text()
    # the section says when and from which source it ran: this checkout's commit (a results file of before lacks them)
    source = result["machine"]["source"]
    assert source == bench.source(), source  # tested on its own below
    line = f"{result['machine']['cpu']} ({result['machine']['cores']} cores), {result['machine']['when']}, {source}, median of"
    assert line in busy.markdown(result) and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", result["machine"]["when"])
    older = dict(result, machine={k: v for k, v in result["machine"].items() if k not in ("when", "source")})
    assert f"({result['machine']['cores']} cores), median of" in busy.markdown(older)
    with pytest.raises(InputError, match="make bench-peers"):
        busy.run_busy([str(tiny_model)], runs=1, peer=True, peers_dir=tmp_path, progress=lambda msg: None)
    together = serve._together
    monkeypatch.setattr(serve, "_together", lambda server, n: together(server, n)[::-1])
    with pytest.raises(DetinferError, match="differed from the same request alone"):
        busy._servers(str(tiny_model), 1, lambda msg: None)


def test_speculate_bench_checks_every_run_and_its_section_is_kept(tmp_path, model_path, monkeypatch):
    """``detinfer bench speculate`` on SmolLM2, one run of few tokens: both tasks and arms measured with their
    acceptance, floors computed, the section replaced and kept by the main report; a speculative run whose bytes
    differ (a rollback that keeps one rejected draft) is an error, never a figure. (Speed itself is never asserted.)"""
    from detinfer.bench import speculate
    from detinfer.compute.kvcache import KVCache

    monkeypatch.setattr(speculate, "MAX_TOKENS", 48)
    result = speculate.run_speculate([str(model_path)], threads=(1,), runs=1, progress=lambda msg: None)
    row = result["models"][str(model_path)]["1"]
    assert set(row) == set(speculate.TASKS) and all(row[t][arm]["median"] > 0 for t in row for arm in speculate.ARMS)
    assert row["repeat"]["accepted"] > 0 and len(speculate.floors(result)) == 2
    out, md = tmp_path / "speculate.json", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n")
    speculate.write_speculate(result, out, md)
    speculate.write_speculate(result, out, md)
    assert md.read_text().count(bench_report.SPECULATE_BEGIN) == 1 and "| repeat |" in md.read_text()
    bench_report.write_report(_report(), tmp_path / "results.json", md)
    assert speculate.markdown(result) in md.read_text()
    truncate = KVCache.truncate
    monkeypatch.setattr(KVCache, "truncate", lambda self, n: truncate(self, min(self.n_tokens, n + 1)))
    with pytest.raises(DetinferError, match="speculative decoding changed the output"):
        speculate.run_speculate([str(model_path)], threads=(1,), runs=1, progress=lambda msg: None)


def test_serve_bench_checks_every_response_and_its_section_is_kept(tmp_path, model_path, monkeypatch):
    """``detinfer bench serve`` on SmolLM2 against a real server process at --batch 4, with 1, 2 and 4 clients of few
    tokens: figures for each count, the floor row, the section replaced and kept by the main report; responses
    that do not match the same request alone (the clients' results swapped) are an error, never a figure."""
    from detinfer.bench import serve

    monkeypatch.setattr(serve, "CLIENTS", (1, 2, 4))
    monkeypatch.setattr(serve, "MAX_TOKENS", 8)
    result = serve.run_serve([str(model_path)], threads=(1,), batches=(4,), progress=lambda msg: None)
    rows = result["models"][str(model_path)]["1/4"]
    assert set(rows) == {"1", "2", "4"} and all(r["tok_s"] > 0 and r["latency_s"] > 0 for r in rows.values())
    assert len(serve.floors(result)) == 1
    out, md = tmp_path / "serve.json", tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n")
    serve.write_serve(result, out, md)
    serve.write_serve(result, out, md)
    assert md.read_text().count(bench_report.SERVE_BEGIN) == 1
    bench_report.write_report(_report(), tmp_path / "results.json", md)
    assert serve.markdown(result) in md.read_text()
    together = serve._together
    monkeypatch.setattr(serve, "_together", lambda server, n: together(server, n)[::-1])
    with pytest.raises(DetinferError, match="differed from the same request alone"):
        serve.run_serve([str(model_path)], threads=(1,), batches=(4,), progress=lambda msg: None)


def test_profile_section_replaces_only_itself(tmp_path):
    """bench/profile.py (rendering a stored profile, no measuring) rewrites its own section of docs/benchmarks.md
    and keeps every other command's section, wherever they stand (it once dropped the busy, serve, speculate and
    lockstep sections when they stood in KEPT_SECTIONS order), and a second render changes nothing."""
    repo = Path(__file__).resolve().parents[1]
    sections = {b: f"{b}\nfigures of {b}\n{e}\n" for b, e in bench_report.KEPT_SECTIONS if b != bench_report.PROFILE_BEGIN}
    md = tmp_path / "benchmarks.md"
    md.write_text("# Benchmarks\n\nsuite\n\n" + "".join(sections.values()) + f"{bench_report.PROFILE_BEGIN}\nold\n"
                  f"{bench_report.PROFILE_END}\n")  # fmt: skip
    render = [sys.executable, str(repo / "bench" / "profile.py"), "--render", str(repo / "bench" / "profile.json"),
              "--markdown", str(md)]  # fmt: skip
    subprocess.run(render, check=True, capture_output=True)
    text = md.read_text()
    assert text.startswith("# Benchmarks\n\nsuite\n") and all(s in text for s in sections.values())
    assert text.count(bench_report.PROFILE_BEGIN) == 1 and "\nold\n" not in text and "\n## Profile: " in text
    subprocess.run(render, check=True, capture_output=True)
    assert md.read_text() == text


def test_bench_source_is_the_commit_and_dirty_only_for_code(tmp_path: Path):
    """A bench section's source: the checkout's commit, "-dirty" when the code differs from it, but not for the
    result files an earlier section wrote (docs/, bench/*.json); outside a checkout, detinfer's version."""
    assert bench.source(tmp_path) == f"detinfer {detinfer.__version__}"

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip

    git("init", "-q")
    for name in ("detinfer/kernels.py", "bench/profile.py", "bench/results.json", "docs/benchmarks.md"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("a\n")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    commit = git("rev-parse", "--short", "HEAD")
    assert bench.source(tmp_path) == commit
    (tmp_path / "bench/results.json").write_text("b\n")
    (tmp_path / "docs/benchmarks.md").write_text("b\n")
    assert bench.source(tmp_path) == commit  # a bench's own results are not dirt
    for name in ("bench/profile.py", "detinfer/kernels.py"):
        git("checkout", "--", ".")
        (tmp_path / name).write_text("b\n")
        assert bench.source(tmp_path) == f"{commit}-dirty", name
