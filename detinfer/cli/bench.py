"""``detinfer bench``: the benchmark suite beside llama.cpp, the KV-cache curve and the constraint cost (bench/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from .. import api
from ..errors import DetinferError
from .common import App, ModelOpt, ThreadsOpt, app, err, fail, flag, out, warn

bench_app = App()
app.add_typer(bench_app, name="bench")


@bench_app.callback(invoke_without_command=True)
def bench(
    cli_ctx: typer.Context,
    models: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Suite model, a registry name or .gguf path "
                                                        "(repeatable; default: SmolLM2, and gemma3 when it loads, unless "
                                                        "--large-model is given).")] = None,
    large_models: Annotated[Optional[list[str]], typer.Option("--large-model", help="1B-class model (repeatable): prefill 64 "
                                                              "and 512, decode 32, GB/s against the memory bandwidth.")] = None,
    isa: Annotated[str, typer.Option("--isa", help="Instruction sets, comma-separated: host (each engine's default) "
                                     "and avx2 (AVX2 + FMA, AVX-512 off).")] = "host,avx2",
    runs: Annotated[int, typer.Option("--runs", help="Runs per figure (the median, min and max are reported).")] = 3,
    large_runs: Annotated[Optional[int], typer.Option("--large-runs", help="Runs per 1B-class figure (default: --runs).")] = None,
    peer: Annotated[Optional[str], typer.Option("--peer", help="Also run this engine side by side: llama-cpp "
                                                "(one build per ISA, see --peers-dir).")] = None,
    peers_dir: Annotated[Path, typer.Option("--peers-dir", help="Where `make bench-peers` put llama-cpp-python, one "
                                            "llama-cpp-<isa> folder per ISA.")] = Path(".bench"),
    threads: Annotated[str, typer.Option("--threads", help="Thread counts, comma-separated.")] = "1,2",
    prefill: Annotated[Optional[str], typer.Option("--prefill", help="Prefill sizes, comma-separated, for every model "
                                                   "(default: 64,512,2048; 1B-class 64,512).")] = None,
    decode: Annotated[Optional[int], typer.Option("--decode", help="Decoded tokens per run for every model (default: "
                                                  "128; 1B-class 32).")] = None,
    cells_only: Annotated[bool, flag("--cells-only", help="Only the prefill/decode cells: no fastmath arm, "
                                             "start-up or session figures.")] = False,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Results (JSON).")] = Path("bench/results.json"),
    markdown: Annotated[Path, typer.Option("--markdown", help="Markdown tables.")] = Path("docs/benchmarks.md"),
) -> None:
    """The standard benchmark suite, detinfer vs llama.cpp; takes minutes, on an otherwise idle machine.

    Prefill and decode tok/s per ISA at 1 and 2 threads, detinfer vs llama.cpp (and fastmath), 1B-class GB/s
    against the memory bandwidth, RSS, cold/warm start, prefix reuse."""
    if cli_ctx.invoked_subcommand is not None:
        return
    from ..bench.report import display_name, figure_label
    from ..bench.suite import (
        DEFAULT_MODELS,
        Options,
        parse_counts,
        parse_isas,
        run_suite,
    )

    try:
        opts = Options(models=tuple(models or (() if large_models else DEFAULT_MODELS)), large_models=tuple(large_models or ()),
                       isas=parse_isas(isa), runs=runs, large_runs=large_runs, peer=peer, peers_dir=peers_dir,
                       threads=parse_counts(threads, "--threads"), decode=decode, cells_only=cells_only,
                       prefill=parse_counts(prefill, "--prefill") if prefill is not None else None)
        report = run_suite(opts, out_path, markdown, warn=warn, progress=lambda msg: err.print(f"[dim]{escape(msg)}[/]"))
    except DetinferError as e:
        fail(e)
    table = Table("model", "ISA", "threads", "engine", "tok/s (medians)")
    for m in report.models:
        for run in m.isas:
            for tr in run.threads:
                for e in tr.engines:
                    cells = ", ".join(f"{figure_label(name)} {s.median:g}" for name, s in e.figures.items())
                    table.add_row(escape(display_name(m.model)), run.isa, str(tr.threads), e.engine, cells)
    out.print(table)
    out.print(f"wrote {escape(str(out_path))} and {escape(str(markdown))}")


@bench_app.command("kv")
def bench_kv(
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    tokens: Annotated[Optional[list[int]], typer.Option("--tokens", help="Generated-token targets (repeatable; "
                                                        "default 64, 512, 2048).")] = None,
    naive_budget: Annotated[float, typer.Option("--naive-budget", help="Seconds after which the naive arm stops.")] = 120.0,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write the PNG plot here (needs matplotlib).")] = None,
    results: Annotated[Path, typer.Option("--results", help="Results file to add the curve to.")] = Path("bench/results.json"),
    markdown: Annotated[Path, typer.Option("--markdown", help="Markdown regenerated from the results.")] = Path("docs/benchmarks.md"),
) -> None:
    """Greedy generation with the KV cache vs recomputing the whole sequence every token: same tokens, timed, plotted."""
    from ..bench.kv import (
        DEFAULT_TARGETS,
        check_kv_options,
        context_for,
        kv_curve,
        plot_kv,
    )
    from ..bench.suite import add_kv_curve

    targets = tokens or list(DEFAULT_TARGETS)
    try:
        check_kv_options(targets, naive_budget, plot, results)
        n_threads = api.set_threads(threads)
        engine = api.load(model, n_ctx=context_for(targets), threads=threads).engine
        with err.status("generating with and without the KV cache…"):
            kv = kv_curve(engine, n_threads, targets, naive_budget, model=model or api.DEFAULT_MODEL, warn=warn)
        if plot is not None:
            plot_kv(kv, plot)
            kv = kv.model_copy(update={"plot": str(plot)})
        add_kv_curve(kv, results, markdown)
    except DetinferError as e:
        fail(e)
    for t in kv.targets:
        out.print(f"{t.tokens} tokens: cached {t.cached_s:.3g} s, naive {t.naive_s:.4g} s ({t.naive_kind}): {t.ratio:.1f}×")
    out.print(("tokens identical" if kv.tokens_identical else f"TOKENS DIFFER from step {kv.first_mismatch}")
              + f" in {kv.compared_tokens} steps compared" + (f"; plot: {escape(str(plot))}" if plot else ""))
    if not kv.tokens_identical:
        raise typer.Exit(1)


@bench_app.command("constraint")
def bench_constraint(
    model: ModelOpt = None,
    threads: ThreadsOpt = 1,
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens decoded per run.")] = 128,
    runs: Annotated[int, typer.Option("--runs", help="Runs per arm, interleaved; the minimum of each is compared.")] = 5,
) -> None:
    """Decode time with a JSON-schema constraint (the allowed-token mask) vs without: same prompt, same token count."""
    from ..bench.constraint import OVERHEAD_LIMIT, check_options
    from ..bench.constraint import bench_constraint as run_bench

    try:
        check_options(tokens, runs)
        n_threads = api.set_threads(threads)
        engine = api.load(model, n_ctx=512, threads=threads).engine
        with err.status("decoding with and without the constraint…"):
            b = run_bench(engine, tokens, runs, warn=warn)
    except DetinferError as e:
        fail(e)
    out.print(f"{b.tokens} tokens at {n_threads} thread(s), {runs} interleaved runs per arm: decode without constraint "
              f"min {min(b.free_s):.3f} s, with JSON-schema constraint min {min(b.constrained_s):.3f} s; "
              f"mask overhead {b.overhead:+.1%} (limit {OVERHEAD_LIMIT:.0%})")




@bench_app.command("busy")
def bench_busy(
    models: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Registry name or .gguf path (repeatable; "
                                                        "default: SmolLM2 and Gemma 3).")] = None,
    runs: Annotated[int, typer.Option("--runs", help="Runs per figure (the median, min and max are reported).")] = 3,
    peer: Annotated[bool, flag("--peer", help="Also llama.cpp at 1 and 2 threads (the host build in --peers-dir).")] = False,
    peers_dir: Annotated[Path, typer.Option("--peers-dir", help="Where `make bench-peers` put llama-cpp-python.")] = Path(".bench"),
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Results (JSON).")] = Path("bench/busy.json"),
    markdown: Annotated[Path, typer.Option("--markdown", help="Markdown file whose busy section is replaced.")] = Path("docs/benchmarks.md"),
) -> None:
    """Speed beside a busy loop that holds one core, and idle: prefill, decode, a real server. Use an idle machine.

    detinfer at 1, 2 and its default threads, llama.cpp at 1 and 2; then a real server at --threads 1 and its
    default under 4 concurrent clients."""
    from ..bench.busy import run_busy, write_busy
    from ..bench.suite import DEFAULT_MODELS

    try:
        result = run_busy(models or DEFAULT_MODELS, runs=runs, peer=peer, peers_dir=peers_dir,
                          progress=lambda msg: err.print(f"[dim]{escape(msg)}[/]"))  # fmt: skip
        write_busy(result, out_path, markdown)
    except DetinferError as e:
        fail(e)
    out.print(f"wrote {escape(str(out_path))} and the busy section of {escape(str(markdown))}")


@bench_app.command("speculate")
def bench_speculate(
    models: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Registry name or .gguf path (repeatable; "
                                                        "default: SmolLM2 and Gemma 3).")] = None,
    threads: Annotated[str, typer.Option("--threads", help="Thread counts, comma-separated.")] = "1,2",
    runs: Annotated[int, typer.Option("--runs", help="Runs per figure (the median, min and max are reported).")] = 3,
    peer: Annotated[bool, flag("--peer", help="Also llama.cpp's prompt lookup vs its plain decoding (the host build in --peers-dir).")] = False,
    peers_dir: Annotated[Path, typer.Option("--peers-dir", help="Where `make bench-peers` put llama-cpp-python.")] = Path(".bench"),
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Results (JSON).")] = Path("bench/speculate.json"),
    markdown: Annotated[Path, typer.Option("--markdown", help="Markdown file whose speculation section is replaced.")] = Path("docs/benchmarks.md"),
) -> None:
    """Decode with and without --speculate ngram on a task that quotes its context and on free text (same bytes,
    checked). Use an otherwise idle machine."""
    from ..bench.speculate import run_speculate, write_speculate
    from ..bench.suite import DEFAULT_MODELS, parse_counts

    try:
        result = run_speculate(models or DEFAULT_MODELS, threads=parse_counts(threads, "--threads"), runs=runs, peer=peer,
                               peers_dir=peers_dir, progress=lambda msg: err.print(f"[dim]{escape(msg)}[/]"))  # fmt: skip
        write_speculate(result, out_path, markdown)
    except DetinferError as e:
        fail(e)
    out.print(f"wrote {escape(str(out_path))} and the speculation section of {escape(str(markdown))}")


@bench_app.command("lockstep")
def bench_lockstep(
    models: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Registry name or .gguf path (repeatable; "
                                                        "default: SmolLM2 and Gemma 3).")] = None,
    threads: Annotated[str, typer.Option("--threads", help="Thread counts, comma-separated.")] = "1,2",
    runs: Annotated[int, typer.Option("--runs", help="Runs per figure (the median, min and max are reported).")] = 3,
    manifests: Annotated[Path, typer.Option("--manifests", help="The folder of manifests to verify.")] = Path("manifests"),
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Results (JSON).")] = Path("bench/lockstep.json"),
    markdown: Annotated[Path, typer.Option("--markdown", help="Markdown file whose lockstep section is replaced.")] = Path("docs/benchmarks.md"),
) -> None:
    """verify and batch one file at a time and in lockstep (--batch 1 and the default), as detinfer processes (same
    results, checked). Use an otherwise idle machine."""
    from ..bench.lockstep import run_lockstep, write_lockstep
    from ..bench.suite import DEFAULT_MODELS, parse_counts

    try:
        result = run_lockstep(models or DEFAULT_MODELS, threads=parse_counts(threads, "--threads"), runs=runs, manifests=manifests,
                              progress=lambda msg: err.print(f"[dim]{escape(msg)}[/]"))  # fmt: skip
        write_lockstep(result, out_path, markdown)
    except DetinferError as e:
        fail(e)
    out.print(f"wrote {escape(str(out_path))} and the lockstep section of {escape(str(markdown))}")


@bench_app.command("serve")
def bench_serve(
    models: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Registry name or .gguf path (repeatable; "
                                                        "default: SmolLM2 and Gemma 3).")] = None,
    threads: Annotated[str, typer.Option("--threads", help="The server's --threads values, comma-separated.")] = "1,2",
    batches: Annotated[str, typer.Option("--batch", help="The server's --batch values, comma-separated.")] = "1,4,8",
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Results (JSON).")] = Path("bench/serve.json"),
    markdown: Annotated[Path, typer.Option("--markdown", help="Markdown file whose server section is replaced.")] = Path("docs/benchmarks.md"),
) -> None:
    """A real server under 1, 2, 4 and 8 concurrent streaming clients, one request per step and batched (every
    response checked against the same request alone). Use an otherwise idle machine."""
    from ..bench.serve import run_serve, write_serve
    from ..bench.suite import DEFAULT_MODELS, parse_counts

    try:
        result = run_serve(models or DEFAULT_MODELS, threads=parse_counts(threads, "--threads"), batches=parse_counts(batches, "--batch"),
                           progress=lambda msg: err.print(f"[dim]{escape(msg)}[/]"))  # fmt: skip
        write_serve(result, out_path, markdown)
    except DetinferError as e:
        fail(e)
    out.print(f"wrote {escape(str(out_path))} and the server section of {escape(str(markdown))}")
