"""The benchmark tooling: option errors, the KV arms' token check, the results schema, the plot file. No timings are
asserted (speed is measured by ``make bench`` only)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import cli
from gguf_factory import write_tiny_gguf

from detinfer import bench, bench_kv
from detinfer.bench import BenchReport, EngineRun, KVCurve, ModelReport, SessionFigures, StartTimes, ThreadRun, stats
from detinfer.bench_kv import context_for, first_mismatch, kv_curve, plot_kv, separation_step, target_totals
from detinfer.engine import Engine
from detinfer.errors import InputError


@pytest.mark.parametrize(
    "args, message",
    [
        (["bench", "--runs", "0"], "--runs must be at least 1"),
        (["bench", "--peer", "vllm"], "unknown peer 'vllm'"),
        (["bench", "kv", "--tokens", "0"], "--tokens must be positive"),
        (["bench", "kv", "--naive-budget", "0"], "--naive-budget must be positive"),
        (["bench", "kv", "--results", "{old}"], "is not a benchmark results file of schema 1"),
    ],
)
def test_bench_rejects_bad_options_before_loading(tmp_path, args, message):
    old = tmp_path / "old-results.json"
    old.write_text(json.dumps({"runs": []}))  # an earlier format
    result = cli(tmp_path, *[a.format(old=old) for a in args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output


def test_peer_without_llama_cpp_python_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "peer_available", lambda peer: False)
    result = cli(tmp_path, "bench", "--peer", "llama-cpp")
    assert result.exit_code == 2
    assert "llama-cpp-python" in result.output and len(result.output.strip().splitlines()) == 1


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
    import detinfer.cli

    real = bench.warm_up
    monkeypatch.setattr(detinfer.cli, "COMPILE_STATUS_DELAY_S", 0.0)  # as if compiling took long
    monkeypatch.setattr(bench, "warm_up", lambda engine: (time.sleep(0.5), real(engine)))
    r = cli(tmp_path, "run", "--model", tiny_model, "--prompt", "hi there", "-n", "3", "--ctx", "64")
    assert r.exit_code == 0, r.output
    assert bench.PROGRESS_MARK in r.stderr and bench.PROGRESS_MARK not in r.stdout


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


def _report() -> BenchReport:
    s = stats([1.0, 2.0, 3.0])
    figures = {name: s for name, _, _ in bench.FIGURES}
    runs = [ThreadRun(threads=t, engines=[EngineRun(engine=e, figures=figures, peak_rss_mb=300.0)
                                          for e in ("detinfer", "detinfer-fastmath")]) for t in bench.THREADS]
    ok = ModelReport(model=bench.DEFAULT_MODEL, status="ok", model_file_bytes=98_362_432, kv_bytes_at_n_ctx=188_743_680,
                     threads=runs, start=StartTimes(cold_s=s, warm_s=s, progress_message=True),
                     session=SessionFigures(turns=20, history_tokens=565, with_reuse_s=s, no_cache_s=s, snapshot_tokens=1000,
                                            snapshot_bytes=46_084_768, snapshot_save_ms=s, snapshot_load_ms=s))
    skipped = ModelReport(model="gemma3-270m-q4_k_m", status="skipped", reason="unknown model")
    return BenchReport(date="d", machine={"cpu": "cpu", "cores": 2, "python": "3"}, n_ctx=bench.N_CTX, runs_per_figure=3,
                       models=[ok, skipped], warnings=["1.0 cores busy"], kv_curve=_kv("kv.png"))


def test_results_schema_round_trip_and_markdown(tmp_path):
    report = _report()
    out, md = tmp_path / "bench" / "results.json", tmp_path / "docs" / "benchmarks.md"
    bench.write_report(report, out, md)
    assert bench.load_report(out) == report
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and set(data["models"][0]["threads"][0]["engines"][0]["figures"]) == {
        "prefill_64_tok_s", "prefill_512_tok_s", "prefill_2048_tok_s", "decode_128_tok_s"}
    text = md.read_text()
    for needle in ("cost of the contract", "**reference** (NUMERICS.md", "thread scaling", "Skipped: unknown model",
                   "extrapolated lower bound", "![time per token", "| floor | measured | holds |"):
        assert needle in text


@pytest.mark.parametrize("change", [{"extra": 1}, {"schema_version": 2}])
def test_results_of_another_schema_are_refused(tmp_path, change):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_report().model_dump() | change))
    with pytest.raises(InputError, match="not a benchmark results file"):
        bench.load_report(path)


def test_kv_curve_is_added_to_existing_results(tmp_path):
    out, md = tmp_path / "results.json", tmp_path / "benchmarks.md"
    bench.write_report(_report().model_copy(update={"kv_curve": None}), out, md)
    bench.add_kv_curve(_kv(), out, md)
    report = bench.load_report(out)
    assert report.kv_curve == _kv() and len(report.models) == 2
    assert "KV cache vs recomputing" in md.read_text()


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
