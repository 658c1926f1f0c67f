"""Commands over records: ``verify``, ``replay`` (and branching), ``session run``, ``chat``, ``kv inspect`` and
``selftest``."""

from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from .. import api
from ..errors import DetinferError, InputError, KVFileError
from ..integrations.batch import reexecute_failed, reexecute_task
from ..integrations.ci_report import github_annotations, write_junit
from .common import (
    DEFAULT_CACHE_BYTES,
    SAMPLING_FLAGS,
    ActorsOpt,
    App,
    BatchOpt,
    CacheBytesOpt,
    ChatTemplateOpt,
    CtxOpt,
    KvOpt,
    ModelOpt,
    QuietOpt,
    RayOpt,
    RederiveOpt,
    SpeculateOpt,
    ThreadsOpt,
    app,
    check_outputs,
    compiling,
    err,
    fail,
    fan_out,
    flag,
    out,
    streamer,
    warn,
)

JsonOpt = Annotated[bool, flag("--json", help="Machine-readable output: one JSON object per file (or row) and a summary.")]


def _summary_line(outcomes: list, seconds: float, fanned_out: bool, what: str = "") -> None:
    """``12 files: 11 match, 1 mismatch in 4.1 s``: the tally, the whole re-execution's wall time (``seconds``), and
    whether files ran beside each other so that their own times overlap (in lockstep, or ``fanned_out`` over Ray
    actors); ``what``: more about the files (" (149 turns)")."""
    counts = api.summary(outcomes)
    tally = ", ".join(f"{n} {s}" for s in (api.MATCH, api.MISMATCH, api.BAD_INPUT) if (n := counts[s.replace(" ", "_")]))
    ran = sum(r.status != api.BAD_INPUT for r in outcomes)
    overlap = any(r.overlapped for r in outcomes) or (fanned_out and ran > 1)
    out.print(f"{len(outcomes)} file{'s' * (len(outcomes) != 1)}{what}: {tally} in {seconds:.1f} s"
              + " (files ran side by side, so their times overlap)" * overlap, soft_wrap=True)  # fmt: skip


def _print_outcomes(outcomes: list, as_json: bool, seconds: float, fanned_out: bool) -> None:
    """verify's output: a table (or JSON lines), a summary line (:func:`_summary_line`), each non-match's report,
    GitHub annotations; then the exit code."""
    annotations = github_annotations(outcomes) if os.environ.get("GITHUB_ACTIONS") == "true" else []
    if as_json:
        out.print(api.to_json_lines(outcomes), soft_wrap=True, markup=False, emoji=False)  # data: ":pizza:" stays text
        for line in annotations:
            err.print(line, soft_wrap=True, markup=False, emoji=False, highlight=False)
        raise typer.Exit(api.exit_code(outcomes))
    table = Table("manifest", "model", "generated", "result", "time", "threads", "recorded on", "re-executed on")
    for r in outcomes:
        style = "green" if r.status == api.MATCH else "red" if r.status != api.BAD_INPUT else "yellow"
        ran = r.status != api.BAD_INPUT  # a file that did not run has no count or time to show
        table.add_row(escape(r.path), escape(r.model), str(r.steps) if ran else "", f"[{style}]{r.status}[/]", f"{r.seconds:.1f}s" if ran else "", str(r.threads or ""),
                      escape(api.short_machine(r.recorded_on)), escape(api.short_machine(r.reexecuted_on)))
    out.print(table)
    for described in sorted({api.describe_machine(m) for r in outcomes for m in (r.recorded_on, r.reexecuted_on) if m}):
        out.print(f"  {escape(described)}", soft_wrap=True)
    _summary_line(outcomes, seconds, fanned_out)
    _print_reports([r for r in outcomes if r.status != api.MATCH])
    for line in annotations:
        out.print(line, soft_wrap=True, markup=False, emoji=False, highlight=False)
    raise typer.Exit(api.exit_code(outcomes))


@app.command()
def verify(
    paths: Annotated[Optional[list[Path]], typer.Argument(help="Record files or folders (default: manifests/ and golden/).")] = None,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
    junit_xml: Annotated[Optional[Path], typer.Option("--junit-xml", help="Also write a JUnit XML report (one test case per file).")] = None,
    batch: BatchOpt = api.DEFAULT_BATCH,
    ray: RayOpt = None,
    actors: ActorsOpt = None,
    rederive: RederiveOpt = False,
) -> None:
    """Re-execute recorded manifests, golden streams, snapshots and sessions; exit 0 all match, 1 any mismatch, 2 bad input.

    With GITHUB_ACTIONS=true (set on GitHub's runners) each mismatch or bad file is also an ::error annotation
    line (on stderr with --json, so stdout stays JSON lines)."""
    try:
        check_outputs({"--junit-xml": junit_xml})  # before anything runs
        if ray is None:
            api.set_threads(threads)
        if not paths:
            paths = [p for p in (Path("manifests"), Path("golden")) if p.is_dir()]
            if not paths:
                raise InputError("no manifests/ or golden/ folder here; pass manifest files or folders")
        files = api.collect(paths)
        if not files:
            raise InputError(f"no manifests found in {', '.join(map(str, paths))}")
    except DetinferError as e:
        fail(e)
    t0 = time.perf_counter()
    if ray is not None or actors is not None:
        outcomes = fan_out("verified", partial(reexecute_task, model=model), api.read_all(files), reexecute_failed,
                           ray=ray, threads=threads, actors=actors, rederive=rederive)  # fmt: skip
    else:
        with Progress(console=err, transient=True, disable=as_json or not err.is_terminal) as progress:  # a pipe: no blank line
            task = progress.add_task("verifying", total=len(files))
            outcomes = api.verify(files, model=model, threads=threads, on_result=lambda r: progress.advance(task), rederive=rederive,
                                  batch=batch)  # fmt: skip
    seconds = time.perf_counter() - t0
    if junit_xml is not None:
        try:
            write_junit(outcomes, junit_xml)
        except DetinferError as e:
            fail(e)
        except OSError as e:
            fail(InputError(f"cannot write --junit-xml {junit_xml}: {e.strerror or e}"))
    _print_outcomes(outcomes, as_json, seconds, ray is not None)


def _print_reports(outcomes: list) -> None:
    """What is wrong with each file, in full (the table cuts long lines); a one-line report that several files
    share once, after their names (ten Gemma 3 files said "model ... is not downloaded" ten times)."""
    reports = [(r.path, r.report()) for r in outcomes]
    shared: dict[str, list[str]] = {}
    for path, lines in reports:
        if len(lines) == 1:
            shared.setdefault(lines[0], []).append(path)
    for path, (first, *rest) in reports:
        paths = [path] if rest else shared[first]
        if paths[0] == path:  # in file order, at the first file of its group
            if len(paths) == 1 and first.startswith(f"{path} "):  # "x.json is not a JSON record: ...": named already
                out.print(f"[bold]{escape(path)}[/]{escape(first.removeprefix(path))}", soft_wrap=True)
            else:
                names = escape(path) if len(paths) == 1 else f"{len(paths)} files ({escape(', '.join(paths))})"
                out.print(f"[bold]{names}[/]: {escape(first)}", soft_wrap=True)
            for line in rest:
                out.print(line, soft_wrap=True, markup=False, emoji=False)


def _turn_line(i: int, rec) -> None:
    err.print(f"[dim]turn {i}: {len(rec.appended_token_ids)} new prompt tokens, {rec.reused_tokens} reused, "
              f"{len(rec.generated_token_ids)} generated, stop: {rec.stop_reason}, KV {rec.kv_sha256[:12]}…[/]")


@app.command()
def replay(
    paths: Annotated[list[Path], typer.Argument(help="Recorded session files, or folders of them (e.g. serve --record DIR).")],
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    speculate: SpeculateOpt = None,
    no_cache: Annotated[bool, flag("--no-cache", help="Recompute every prefix from scratch.")] = False,
    kv_dir: Annotated[Optional[Path], typer.Option("--kv-dir", help="Restore each turn's prefix from saved snapshots.")] = None,
    until: Annotated[Optional[int], typer.Option("--until", help="Replay only the first N turns.")] = None,
    then: Annotated[Optional[Path], typer.Option("--then", help="After --until, continue with this script's turns.")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where --then writes the new session.")] = None,
    cache_bytes: CacheBytesOpt = DEFAULT_CACHE_BYTES,
    batch: BatchOpt = api.DEFAULT_BATCH,
    as_json: JsonOpt = False,
    ray: RayOpt = None,
    actors: ActorsOpt = None,
    rederive: RederiveOpt = False,
) -> None:
    """Re-execute every turn of recorded sessions; exit 0 all match, 1 any mismatch, 2 bad input."""
    try:
        check_outputs({"--out": out_path})
        if (then is not None or until is not None or kv_dir is not None) and (ray is not None or actors is not None):
            raise InputError("--until, --then and --kv-dir replay one session file here; drop --ray")
        if then is not None and (until is None or out_path is None):
            raise InputError("--then needs --until N (the turn to branch after) and --out FILE (where the new session goes)")
        if out_path is not None and then is None:
            raise InputError("--out is where --then writes the branched session; replay itself writes nothing")
        if then is not None:
            if len(paths) != 1 or not paths[0].is_file():
                raise InputError("--until, --then and --kv-dir apply to one session file, not a folder")
            api.branch(paths[0], until, then, out=out_path, model=model, threads=threads, cache_bytes=cache_bytes,
                       on_step=streamer(False), on_turn=lambda i, rec: (sys.stdout.write("\n"), _turn_line(i, rec)), rederive=rederive)  # fmt: skip
            err.print(f"replayed {until} turn(s) exactly, then ran new turn(s); session: {escape(str(out_path))}")
            return
        t0 = time.perf_counter()
        if ray is not None or actors is not None:
            options = api.ReplayOptions(use_cache=not no_cache, speculate=api.check_speculate(speculate))
            outcomes = fan_out("replayed", partial(reexecute_task, model=model, options=options), api.read_all(api.collect_sessions(paths)),
                               reexecute_failed, ray=ray, threads=threads, actors=actors, rederive=rederive)  # fmt: skip
        else:
            outcomes = api.replay(paths, model=model, threads=threads, use_cache=not no_cache, kv_dir=kv_dir, until=until,
                                  cache_bytes=cache_bytes, warn=warn, rederive=rederive, speculate=speculate, batch=batch)  # fmt: skip
    except DetinferError as e:
        fail(e)
    rows = [row for r in outcomes for row in r.rows()]
    if as_json:
        out.print(json.dumps(rows), soft_wrap=True, markup=False)
    else:
        table = Table("session", "turn", "result", "steps", "reused", "first divergent step", "differs")
        for r in rows:
            style = "green" if r["result"] == "match" else "yellow" if r["result"] == api.BAD_INPUT else "red"
            detail = escape(", ".join(r["differs"]) or r.get("message", "")) + (escape(f" expected {r['expected']} got {r['actual']}") if "expected" in r else "")
            table.add_row(escape(Path(r["session"]).name), "" if r["turn"] is None else str(r["turn"]), f"[{style}]{r['result']}[/]",
                          *((str(r["steps"]), str(r["reused_tokens"])) if r["result"] != api.BAD_INPUT else ("", "")),
                          "" if r["first_divergent_step"] is None else str(r["first_divergent_step"]),
                          detail)  # fmt: skip
        out.print(table)
        turns = sum(len(r.turns) for r in outcomes)
        _summary_line(outcomes, time.perf_counter() - t0, ray is not None, f" ({turns} turn{'s' * (turns != 1)})" if turns else "")
        _print_reports([r for r in outcomes if r.status == api.BAD_INPUT])
    raise typer.Exit(api.exit_code(outcomes))


session_app = App(help="Scripted multi-turn sessions.", no_args_is_help=True)
kv_app = App(help="KV cache snapshot files (.detkv).", no_args_is_help=True)
app.add_typer(session_app, name="session")
app.add_typer(kv_app, name="kv")


@session_app.command("run")
def session_run(
    script: Annotated[Path, typer.Argument(help="Session script (JSON: model, sampling, turns).")],
    out_path: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the session record here.")] = None,
    kv_dir: Annotated[Optional[Path], typer.Option("--kv-dir", help="Save the KV cache after each turn here.")] = None,
    model: ModelOpt = None,
    chat_template: ChatTemplateOpt = None,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    speculate: SpeculateOpt = None,
    cache_bytes: CacheBytesOpt = DEFAULT_CACHE_BYTES,
    quiet: QuietOpt = False,
) -> None:
    """Run a scripted multi-turn session and record it (written after every turn)."""
    try:
        check_outputs({"--out": out_path}, {"--kv-dir": kv_dir})
        sc = api.load_script(script)
        llm = api.load(model or sc.model, n_ctx=ctx, kv_type=kv_type, threads=threads, chat_template=chat_template, speculate=speculate)
        llm.session(sc, cache_bytes=cache_bytes, out=out_path, kv_dir=kv_dir, on_step=streamer(quiet),
                    on_turn=lambda i, rec: (None if quiet else sys.stdout.write("\n"), _turn_line(i, rec)))  # fmt: skip
    except DetinferError as e:
        fail(e)
    if out_path:
        err.print(f"[dim]session: {escape(str(out_path))}[/]")


@app.command()
def chat(
    record_path: Annotated[Optional[Path], typer.Option("--record", help="Record the conversation to this session file.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    model: ModelOpt = None,
    chat_template: ChatTemplateOpt = None,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    speculate: SpeculateOpt = None,
    temperature: Annotated[float, typer.Option("--temperature", "--temp")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[int, typer.Option("--seed", "-s")] = 0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
) -> None:
    """Interactive multi-turn chat (empty line or EOF ends it); recorded turn by turn with --record."""
    try:
        check_outputs({"--record": record_path})
        sampling = dict(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens)
        api.Sampling.create(SAMPLING_FLAGS, **sampling)  # bad sampling values fail before the model is loaded
        llm = api.load(model, n_ctx=ctx, kv_type=kv_type, threads=threads, chat_template=chat_template, speculate=speculate)
        conv = llm.conversation(system=system, **sampling)
        compiling(llm.warm_up)
        while True:
            try:
                line = input("> " if sys.stdin.isatty() else "")
            except EOFError:
                break
            if not line.strip():
                break
            conv.send(line, on_step=streamer(False))
            sys.stdout.write("\n")
            if record_path is not None:
                conv.save(record_path)
    except DetinferError as e:
        fail(e)


@kv_app.command("inspect")
def kv_inspect(path: Annotated[Path, typer.Argument(help=".detkv file")]) -> None:
    """Show a KV snapshot's header, model, tokens, sizes and checksum status."""
    try:
        info_ = api.inspect_kv(path)
    except DetinferError as e:
        fail(e)
    table = Table("field", "value", title=escape(str(path)))
    for k, v in info_.items():
        text = "-" if v is None else str(v)  # (a damaged file's KV hash is not computed)
        table.add_row(k, escape(text if len(text) <= 120 else text[:117] + "…"))
    out.print(table)
    if info_.get("checksum") != "ok":
        fail(KVFileError(f"{path}: checksum mismatch; the file is corrupt and would be refused"))


@app.command()
def selftest(
    model: Annotated[Optional[str], typer.Argument(help="Registry name or .gguf path.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run every invariance of the determinism contract on this machine (exit 1 if one fails)."""
    try:
        with err.status("running the determinism matrix (separate processes, two compile targets)..."):
            rows = api.selftest(model)
    except DetinferError as e:
        fail(e)
    if as_json:
        out.print(json.dumps([r.__dict__ for r in rows], indent=2), soft_wrap=True, markup=False)
    else:
        table = Table("invariance", "result", "max |Δlogit|", "first divergent", "note", title="determinism matrix")
        for r in rows:
            style = "green" if r.result in ("identical", "detected") else "red"
            table.add_row(r.invariance, f"[{style}]{r.result}[/]", "" if r.max_abs_delta is None else f"{r.max_abs_delta:.3g}",
                          "" if r.first_divergent is None else str(r.first_divergent), escape(r.note))
        out.print(table)
    raise typer.Exit(0 if api.selftest_ok(rows) else 1)
