"""The ``detinfer`` command: a thin typer shell over the library. Errors become one line and an exit code here.

Exit codes: 0 success, 1 a re-executed run does not match its manifest, 2 bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import DetinferError, InputError, MismatchError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Determinism-first LLM inference: bit-identical GGUF inference on the CPU, with run manifests that prove it.",
)
# Not a terminal (pipes, CI logs): a wide fixed width, so tables and summaries are not cut or wrapped at 80 columns.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)

ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help="Registry name or path to a .gguf file.")]
CtxOpt = Annotated[int, typer.Option("--ctx", help="KV cache positions (n_ctx), at most the model's context length.")]
KvOpt = Annotated[str, typer.Option("--kv-type", help="KV cache type: f32 or f16. Quantized types are rejected.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", help="Threads (default: all cores). Never changes a result.")]
CacheBytesOpt = Annotated[int, typer.Option("--cache-bytes", help="Byte budget of the in-memory prefix cache (LRU).")]
DEFAULT_CACHE_BYTES = 1 << 30
ChatTemplateOpt = Annotated[Optional[str], typer.Option(
    "--chat-template", help="Chat template instead of the model's: a built-in format (gemma, chatml, chatml-tools) or a jinja file.")]


def _check_outputs(files: dict[str, Optional[Path]], dirs: Optional[dict[str, Optional[Path]]] = None) -> None:
    """Before any work: every output option names a regular file or new path (files) or a folder detinfer can write
    into (dirs); InputError (one line) otherwise. ``{option: path or None}``."""
    from .fileio import check_output, check_output_dir

    for option, path in files.items():
        if path is not None:
            check_output(path, option)
    for option, path in (dirs or {}).items():
        if path is not None:
            check_output_dir(path, option)


RayOpt = Annotated[Optional[str], typer.Option(
    "--ray", metavar="[ADDRESS]",
    help="Fan the work out over Ray: alone (or local), a local cluster sized to this machine; auto, ray://HOST:PORT or HOST:PORT joins one.")]
ActorsOpt = Annotated[Optional[int], typer.Option("--actors", help="With --ray: how many actors (default: the cluster's CPUs / --threads).")]


def _fail(e: DetinferError) -> None:
    err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)  # user text is never markup
    raise typer.Exit(e.exit_code)


def _fan_out(verb: str, task, payloads: list, failed, *, ray: Optional[str], threads: Optional[int], actors: Optional[int], on_result=None) -> list:
    """Run ``task`` over ``payloads`` here or on Ray (distributed.fan_out) with progress on stderr; results in input order.
    Ctrl-C stops the run (exit 130) and keeps what was already written."""
    from .compute.engine import set_threads
    from .integrations.batch import ItemProgress
    from .integrations.distributed import check_address, fan_out, import_ray

    try:
        if ray is None:
            set_threads(threads)
        else:
            check_address(ray)
            import_ray()
        if actors is not None and ray is None:
            raise InputError("--actors sets the Ray actors; add --ray")
    except DetinferError as e:
        _fail(e)
    where = "in this process" if ray is None else f"on Ray ({ray}), {threads or 1} thread(s) per actor"
    progress = ItemProgress(err, verb, len(payloads), where)

    def done(i: int, result) -> None:
        if on_result is not None:
            on_result(i, result)
        progress(i, result)

    try:
        results = fan_out(task, payloads, done, failed, ray=ray, threads=threads or 1, actors=actors)
    except KeyboardInterrupt:
        progress.close(interrupted=True)
        raise typer.Exit(130)
    except DetinferError as e:
        progress.close(summary=False)
        _fail(e)
    progress.close()
    return results


COMPILE_STATUS_DELAY_S = 2.0  # off a terminal, the compile status line appears only if warming up takes longer


def _compile_kernels(engine) -> None:
    """Compile (first run) or load (JIT cache) every kernel before the real work, with a status on stderr: a
    spinner on a terminal, elsewhere one line if it takes over COMPILE_STATUS_DELAY_S. stdout stays clean."""
    import threading

    from .compute.engine import PROGRESS_MARK

    message = f"{PROGRESS_MARK} or loading them from the cache (a first run compiles for up to ~1 min)…"
    if err.is_terminal:
        with err.status(message):
            engine.warm_up()
        return
    timer = threading.Timer(COMPILE_STATUS_DELAY_S, lambda: err.print(message))
    timer.start()
    try:
        engine.warm_up()
    finally:
        timer.cancel()


@app.command()
def pull(
    name: Annotated[Optional[str], typer.Argument(help="Registry name (default: the default model).")] = None,
    force: Annotated[bool, typer.Option(help="Download again even if present.")] = False,
) -> None:
    """Download a registry model into $DETINFER_HOME/models and verify its sha256."""
    from .model.registry import DEFAULT_MODEL
    from .model.registry import pull as do_pull

    try:
        path = do_pull(name or DEFAULT_MODEL, force=force)
    except DetinferError as e:
        _fail(e)
    out.print(str(path))


@app.command()
def models() -> None:
    """List the registry and what is downloaded."""
    from .model.registry import list_models

    table = Table("name", "size", "present", "sha256", "description")
    for row in list_models():
        table.add_row(row["name"], f"{row['size'] / 1e6:.1f} MB", "yes" if row["present"] else "no", row["sha256"][:16] + "…", row["description"])
    out.print(table)


@app.command()
def info(
    model: Annotated[Optional[str], typer.Argument(help="Registry name or .gguf path.")] = None,
    ctx: CtxOpt = 4096,
) -> None:
    """Show a model's config, tensor types, parameter count and KV cache size."""
    from .compute.kvcache import KV_TYPES, kv_bytes_per_number
    from .model.config import ModelConfig
    from .model.gguf_file import ModelFile
    from .model.registry import resolve_model

    try:
        mf = ModelFile(resolve_model(model))
        cfg = ModelConfig.from_model(mf)
        if not 1 <= ctx <= cfg.n_ctx_train:
            raise InputError(f"--ctx {ctx} is out of range; this model supports 1..{cfg.n_ctx_train} positions")
    except DetinferError as e:
        _fail(e)
    table = Table("key", "value", title=escape(mf.path.name))
    table.add_row("sha256", mf.sha256)
    table.add_row("file size", f"{mf.size:,} bytes")
    table.add_row("parameters", f"{mf.n_params():,}")
    table.add_row("tensor types", ", ".join(f"{k}: {v}" for k, v in mf.type_counts().items()))
    for field in ("arch", "n_vocab", "n_ctx_train", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_ff", "rope_freq_base", "rms_norm_eps", "tied_embeddings"):
        table.add_row(field, str(getattr(cfg, field)))
    if cfg.sliding_window:
        local = [str(i) for i, swa in enumerate(cfg.swa_layers) if not swa]
        table.add_row("sliding_window", f"{cfg.sliding_window} (local layers: rope_freq_base {cfg.rope_freq_base_swa}; global: {', '.join(local)})")
    out.print(table)
    kv = Table("kv type", "bytes / position", f"bytes at n_ctx={ctx}", title="KV cache = n_layer × positions × 2 × kv_width × bytes_per_number")
    for kv_type in KV_TYPES:
        b = kv_bytes_per_number(kv_type)
        kv.add_row(kv_type, f"{cfg.kv_bytes(1, b):,}", f"{cfg.kv_bytes(ctx, b):,} ({cfg.kv_bytes(ctx, b) / 2**20:.1f} MiB)")
    out.print(kv)
    out.print(f"kv_width = n_head_kv × head_dim = {cfg.n_head_kv} × {cfg.head_dim} = {cfg.kv_width}; n_layer = {cfg.n_layer}")


# run options a manifest records: passing them with --manifest would be silently ignored, so it is an error
_RECORDED_OPTIONS = {"prompt", "prompt_file", "messages", "chat", "chat_template", "max_tokens", "temperature", "top_k", "top_p", "min_p",
                     "repeat_penalty", "repeat_last_n", "seed", "stop", "ignore_eos", "ctx", "kv_type",
                     "json_schema", "json_object", "regex", "grammar"}


def _constraint_option(json_schema: Path | None, json_object: bool, regex: str | None, grammar: Path | None):
    """The constraint of run's --json-schema / --json / --regex / --grammar (at most one), or None."""
    from .compute.constrain import Constraint

    given = [o for o, v in (("--json-schema", json_schema), ("--json", json_object or None), ("--regex", regex), ("--grammar", grammar))
             if v is not None]  # fmt: skip
    if len(given) > 1:
        raise InputError(f"give at most one constraint; got {', '.join(given)}")
    if json_schema is not None:
        return Constraint.from_file("json_schema", json_schema)
    if grammar is not None:
        return Constraint.from_file("lark", grammar)
    if regex is not None:
        return Constraint.create("regex", regex)
    return Constraint.create("json_object") if json_object else None


def _given(cli_ctx: typer.Context, names: set[str]) -> list[str]:
    """The options among ``names`` that were typed on the command line (as their first spelling)."""
    return [p.opts[0] for p in cli_ctx.command.params
            if p.name in names and getattr(cli_ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"]


def _run_batch(cli_ctx: typer.Context, batch: Path, out_dir: Optional[Path], resume: bool, *, model: Optional[str], ctx: int,
               kv_type: str, threads: Optional[int], ray: Optional[str], actors: Optional[int]) -> None:
    """`run --batch`: every line of the JSONL file becomes --out-dir/<id>.json, written as it finishes; exit 2 if a
    line is bad input (the others still run)."""
    from .compute.kvcache import parse_kv_type
    from .integrations.batch import (
        BAD_INPUT,
        BatchWriter,
        batch_failed,
        batch_task,
        read_batch,
    )
    from .model.registry import REGISTRY

    try:
        given = _given(cli_ctx, (_RECORDED_OPTIONS - {"ctx", "kv_type"}) | {"manifest", "out_path", "chunk_size", "quiet"})
        if given:
            raise InputError(f"--batch takes prompts and sampling from each line; drop {', '.join(given)}")
        if out_dir is None:
            raise InputError("--batch needs --out-dir DIR, the folder its run manifests go to")
        parse_kv_type(kv_type)
        if model is not None and model not in REGISTRY:
            model = str(Path(model).expanduser().absolute())  # workers see the driver's path, not its working folder
        writer = BatchWriter(out_dir)
        todo, skipped = writer.pending(read_batch(batch, model=model, n_ctx=ctx, kv_type=kv_type), resume)
    except DetinferError as e:
        _fail(e)
    ran = _fan_out("ran", batch_task, todo, batch_failed, ray=ray, threads=threads, actors=actors,
                   on_result=lambda i, r: writer.write(r))
    results = sorted(ran + skipped, key=lambda r: r.line)
    for r in results:
        if r.status == BAD_INPUT:
            out.print(f"line {r.line}: {escape(r.message)}", soft_wrap=True)
    bad = sum(r.status == BAD_INPUT for r in results)
    out.print(f"batch {escape(str(batch))}: {len(ran) - bad} written, {len(skipped)} skipped (--resume), {bad} bad input; "
              f"manifests in {escape(str(out_dir))}", soft_wrap=True)
    raise typer.Exit(2 if bad else 0)


def _read_prompt_file(path: Path) -> str:
    from .fileio import read_input_text

    return read_input_text(path, InputError, "prompt file", stdin=True)


@app.command()
def run(
    cli_ctx: typer.Context,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", help="Read the prompt from a UTF-8 file.")] = None,
    messages: Annotated[Optional[Path], typer.Option("--messages", help="JSON file with a list of {role, content}.")] = None,
    chat: Annotated[bool, typer.Option("--chat", help="Render the prompt as a user message with the chat template.")] = False,
    chat_template: ChatTemplateOpt = None,
    manifest: Annotated[Optional[Path], typer.Option("--manifest", help="Re-execute a recorded run and compare.")] = None,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", help="Maximum new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy (ties to the lowest token id).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p × p_max.")] = 0.0,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="Repetition penalty (1 = off).")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks back over.")] = 64,
    seed: Annotated[int, typer.Option(help="Sampling seed (recorded in the manifest).")] = 0,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable); never emitted.")] = None,
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-generation tokens.")] = False,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="Prefill tokens per chunk. Never changes a result.")] = 64,
    out_path: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the run manifest here.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Do not stream tokens; print only the summary.")] = False,
    json_schema: Annotated[Optional[Path], typer.Option("--json-schema", help="Constrain the output to this JSON Schema (file).")] = None,
    json_object: Annotated[bool, typer.Option("--json", help="Constrain the output to a JSON object.")] = False,
    regex: Annotated[Optional[str], typer.Option("--regex", help="Constrain the output to match this regex.")] = None,
    grammar: Annotated[Optional[Path], typer.Option("--grammar", help="Constrain the output to this Lark grammar (file).")] = None,
    batch: Annotated[Optional[Path], typer.Option("--batch", help="JSONL, one run per line (id, prompt or messages, "
                                                  "optional model, chat_template, sampling): writes --out-dir/<id>.json.")] = None,
    out_dir: Annotated[Optional[Path], typer.Option("--out-dir", help="With --batch: the folder of run manifests.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="With --batch: skip ids whose manifest is already in --out-dir.")] = False,
    ray: RayOpt = None,
    actors: ActorsOpt = None,
) -> None:
    """Generate text and record a run manifest; re-execute one with --manifest; or run a JSONL batch with --batch."""
    from .api import load
    from .compute.constrain import check_ignore_eos
    from .compute.engine import set_threads
    from .compute.kvcache import parse_kv_type
    from .compute.sampling import Sampling
    from .model.chat import load_messages
    from .records.manifest import load_manifest, write_manifest
    from .records.run import engine_for_manifest, reexecute

    def stream(step) -> None:
        if not quiet and step.text:
            sys.stdout.write(step.text)
            sys.stdout.flush()

    if batch is not None:
        _run_batch(cli_ctx, batch, out_dir, resume, model=model, ctx=ctx, kv_type=kv_type, threads=threads, ray=ray, actors=actors)
        return
    try:
        if out_dir is not None or resume or ray is not None or actors is not None:
            raise InputError("--out-dir, --resume, --ray and --actors go with --batch FILE")
        _check_outputs({"--out": out_path})
        parse_kv_type(kv_type)
        set_threads(threads)
        if chunk_size < 1:
            raise InputError(f"--chunk-size must be at least 1, got {chunk_size}")
        if manifest is not None:
            given = _given(cli_ctx, _RECORDED_OPTIONS)
            if given:
                raise InputError(f"--manifest re-executes the recorded inputs and settings; drop {', '.join(given)}")
            recorded = load_manifest(manifest)
            engine = engine_for_manifest(recorded, model)
            _compile_kernels(engine)
            actual, comparison = reexecute(recorded, engine, chunk_size=chunk_size, on_step=stream)
            if not quiet:
                sys.stdout.write("\n")
            if out_path is not None:
                write_manifest(actual, out_path)
            _summary(actual, out_path)
            if comparison.match:
                masks = f" and {len(actual.output.mask_digests)} mask digests" if actual.output.mask_digests is not None else ""
                err.print(f"[bold green]match[/]: tokens, KV hash and all {len(actual.output.logits_digests)} logits digests{masks} "
                          f"equal {escape(str(manifest))}")
                return
            for d in comparison.differences:
                err.print(f"[bold red]mismatch[/] {d.field}: expected {escape(d.expected)} got {escape(d.actual)}", soft_wrap=True)
            if comparison.first_divergent_step is not None:
                err.print(f"first divergent step: {comparison.first_divergent_step}")
            raise MismatchError(f"re-execution of {manifest} does not match")
        sources = sum(x is not None for x in (prompt, prompt_file, messages))
        if sources != 1:
            raise InputError("give exactly one of --prompt, --prompt-file, --messages (or --manifest)")
        text = _read_prompt_file(prompt_file) if prompt_file is not None else prompt
        msgs = load_messages(messages) if messages is not None else None
        if chat_template is not None and not chat and msgs is None:
            raise InputError("--chat-template formats a chat prompt; add --chat (or use --messages)")
        options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repetition_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed, stop=stop or [], ignore_eos=ignore_eos)
        Sampling.create(**options)  # bad sampling values fail before the model is loaded
        constraint = _constraint_option(json_schema, json_object, regex, grammar)
        check_ignore_eos(constraint, ignore_eos)
        llm = load(model, n_ctx=ctx, kv_type=kv_type, threads=threads, chat_template=chat_template)
        chat_input = msgs if msgs is not None else text if chat else None
        steps = llm.stream(None if chat_input is not None else text, messages=chat_input, chunk_size=chunk_size,
                           constraint=constraint, **options)  # fmt: skip
        _compile_kernels(llm.engine)  # after the prompt and the constraint were checked: bad input fails fast
        if not quiet:
            err.print(f"[dim]{escape(llm.engine.model_file.path.name)}: {len(steps.prompt_tokens)} prompt tokens[/]")
        for step in steps:
            stream(step)
        if not quiet:
            sys.stdout.write("\n")
        if out_path is not None:
            steps.result.manifest.save(out_path)
        _summary(steps.result.manifest, out_path)
    except DetinferError as e:
        _fail(e)
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130)


@app.command()
def verify(
    paths: Annotated[Optional[list[Path]], typer.Argument(help="Manifest files or folders (default: manifests/ and golden/).")] = None,
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per manifest plus a summary.")] = False,
    junit_xml: Annotated[Optional[Path], typer.Option("--junit-xml", help="Also write a JUnit XML report (one test case per file).")] = None,
    ray: RayOpt = None,
    actors: ActorsOpt = None,
) -> None:
    """Re-execute recorded manifests and golden streams; exit 0 all match, 1 any mismatch, 2 bad input.

    With GITHUB_ACTIONS=true (set on GitHub's runners) each mismatch or bad file is also an ::error annotation
    line (on stderr with --json, so stdout stays JSON lines)."""
    import os
    from functools import partial

    from rich.progress import Progress

    from .api import verify as verify_paths
    from .compute.engine import set_threads
    from .integrations.batch import verify_failed, verify_task
    from .integrations.ci_report import github_annotations, write_junit
    from .records.machine import describe, short
    from .records.verify import BAD_INPUT, MATCH, collect, exit_code, to_json_lines

    try:
        if ray is None:
            set_threads(threads)
        if not paths:
            paths = [p for p in (Path("manifests"), Path("golden")) if p.is_dir()]
            if not paths:
                raise InputError("no manifests/ or golden/ folder here; pass manifest files or folders")
        files = collect(paths)
        if not files:
            raise InputError(f"no manifests found in {', '.join(map(str, paths))}")
    except DetinferError as e:
        _fail(e)
    if ray is not None or actors is not None:
        results = _fan_out("verified", partial(verify_task, model=model), [str(f) for f in files], verify_failed,
                           ray=ray, threads=threads, actors=actors)
    else:
        with Progress(console=err, transient=True, disable=as_json) as progress:
            task = progress.add_task("verifying", total=len(files))
            results = verify_paths(files, model=model, threads=threads, on_result=lambda r: progress.advance(task))
    if junit_xml is not None:
        try:
            write_junit(results, junit_xml)
        except OSError as e:
            _fail(InputError(f"cannot write --junit-xml {junit_xml}: {e.strerror or e}"))
    annotations = github_annotations(results) if os.environ.get("GITHUB_ACTIONS") == "true" else []
    if as_json:
        out.print(to_json_lines(results), soft_wrap=True, markup=False, emoji=False)  # data: ":pizza:" stays text
        for line in annotations:
            err.print(line, soft_wrap=True, markup=False, emoji=False, highlight=False)
        raise typer.Exit(exit_code(results))
    table = Table("manifest", "model", "steps", "result", "time", "threads", "recorded on", "re-executed on")
    for r in results:
        style = "green" if r.status == MATCH else "red" if r.status != BAD_INPUT else "yellow"
        table.add_row(escape(r.path), escape(r.model), str(r.steps), f"[{style}]{r.status}[/]", f"{r.seconds:.1f}s", str(r.threads or ""),
                      escape(short(r.recorded_on)), escape(short(r.reexecuted_on)))
    out.print(table)
    for described in sorted({describe(m) for r in results for m in (r.recorded_on, r.reexecuted_on) if m}):
        out.print(f"  {escape(described)}", soft_wrap=True)
    for r in results:
        if r.status == MATCH:
            continue
        first, *rest = r.report()
        out.print(f"[bold]{escape(r.path)}[/]: {escape(first)}", soft_wrap=True)
        for line in rest:
            out.print(line, soft_wrap=True, markup=False, emoji=False)
    for line in annotations:
        out.print(line, soft_wrap=True, markup=False, emoji=False, highlight=False)
    raise typer.Exit(exit_code(results))


@app.command()
def selftest(
    model: Annotated[Optional[str], typer.Argument(help="Registry name or .gguf path.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable rows.")] = False,
) -> None:
    """Run every invariance of the determinism contract on this machine (exit 1 if one fails)."""
    import json as _json

    from .compute.engine import Engine
    from .records.selftest import matrix, ok

    try:
        engine = Engine.load(model, n_ctx=512)
        with err.status("running the determinism matrix (separate processes, two compile targets)..."):
            rows = matrix(engine, model)
    except DetinferError as e:
        _fail(e)
    if as_json:
        out.print(_json.dumps([r.__dict__ for r in rows], indent=2), soft_wrap=True, markup=False)
    else:
        table = Table("invariance", "result", "max |Δlogit|", "first divergent", "note", title="determinism matrix")
        for r in rows:
            style = "green" if r.result in ("identical", "detected") else "red"
            table.add_row(r.invariance, f"[{style}]{r.result}[/]", "" if r.max_abs_delta is None else f"{r.max_abs_delta:.3g}",
                          "" if r.first_divergent is None else str(r.first_divergent), escape(r.note))
        out.print(table)
    raise typer.Exit(0 if ok(rows) else 1)


session_app = typer.Typer(help="Scripted multi-turn sessions.", no_args_is_help=True)
kv_app = typer.Typer(help="KV cache snapshot files (.detkv).", no_args_is_help=True)
app.add_typer(session_app, name="session")
app.add_typer(kv_app, name="kv")


def _stream(quiet: bool):
    def on_step(step) -> None:
        if not quiet and step.text:
            sys.stdout.write(step.text)
            sys.stdout.flush()

    return on_step


def _turn_line(i: int, rec) -> None:
    err.print(f"[dim]turn {i}: {len(rec.appended_token_ids)} new prompt tokens, {rec.reused_tokens} reused, "
              f"{len(rec.generated_token_ids)} generated, stop: {rec.stop_reason}, KV {rec.kv_sha256[:12]}…[/]")


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
    cache_bytes: CacheBytesOpt = DEFAULT_CACHE_BYTES,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Run a scripted multi-turn session and record it (written after every turn)."""
    from .compute.engine import Engine, set_threads
    from .compute.kvcache import parse_kv_type
    from .compute.prefix_cache import PrefixCache
    from .model.chat import ChatTemplate
    from .records.session import load_script, run_session

    try:
        _check_outputs({"--out": out_path}, {"--kv-dir": kv_dir})
        parse_kv_type(kv_type)
        set_threads(threads)
        sc = load_script(script)
        template = ChatTemplate.from_option(chat_template) if chat_template is not None else None
        engine = Engine.load(model or sc.model, n_ctx=ctx, kv_type=kv_type)
        run_session(engine, sc.turns, sc.sampling, out=out_path, kv_dir=kv_dir, on_step=_stream(quiet),
                    prefix_cache=PrefixCache(cache_bytes), template=template,
                    on_turn=lambda i, rec: (None if quiet else sys.stdout.write("\n"), _turn_line(i, rec)))
    except DetinferError as e:
        _fail(e)
    if out_path:
        err.print(f"[dim]session: {escape(str(out_path))}[/]")


@app.command()
def replay(
    paths: Annotated[list[Path], typer.Argument(help="Recorded session files, or folders of them (e.g. serve --record DIR).")],
    model: ModelOpt = None,
    threads: ThreadsOpt = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Recompute every prefix from scratch.")] = False,
    kv_dir: Annotated[Optional[Path], typer.Option("--kv-dir", help="Restore each turn's prefix from saved snapshots.")] = None,
    until: Annotated[Optional[int], typer.Option("--until", help="Replay only the first N turns.")] = None,
    then: Annotated[Optional[Path], typer.Option("--then", help="After --until, continue with this script's turns.")] = None,
    out_path: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where --then writes the new session.")] = None,
    cache_bytes: CacheBytesOpt = DEFAULT_CACHE_BYTES,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    ray: RayOpt = None,
    actors: ActorsOpt = None,
) -> None:
    """Re-execute every turn of recorded sessions; exit 0 all match, 1 any mismatch, 2 bad input."""
    import json as _json
    from functools import partial

    from .compute.engine import Engine, set_threads
    from .compute.prefix_cache import PrefixCache
    from .integrations.batch import (
        BAD_INPUT,
        replay_failed,
        replay_task,
        run_local,
        session_files,
    )
    from .records.replay import branch
    from .records.session import load_script, load_session

    warn = lambda msg: err.print(f"[yellow]warning:[/] {escape(msg)}")  # noqa: E731
    try:
        _check_outputs({"--out": out_path})
        if ray is None:
            set_threads(threads)
        files = session_files(paths)
        one_file = then is not None or until is not None or kv_dir is not None
        if one_file and len(files) > 1:
            raise InputError("--until, --then and --kv-dir apply to one session file, not a folder")
        if one_file and (ray is not None or actors is not None):
            raise InputError("--until, --then and --kv-dir replay one session file here; drop --ray")
        if then is not None and (until is None or out_path is None):
            raise InputError("--then needs --until N (the turn to branch after) and --out FILE (where the new session goes)")
        if out_path is not None and then is None:
            raise InputError("--out is where --then writes the branched session; replay itself writes nothing")
        if until is not None:
            record = load_session(files[0])
            if not 1 <= until <= len(record.turns):
                raise InputError(f"--until {until} is out of range; the session has {len(record.turns)} turns")
        if then is not None:
            engine = Engine.load(model or record.model.registry_name or record.informative.get("model_path"),
                                 n_ctx=record.engine.n_ctx, kv_type=record.engine.kv_type)
            sc = load_script(then)
            branch(engine, record, until, sc.turns, sc.sampling, out=out_path, prefix_cache=PrefixCache(cache_bytes),
                   on_step=_stream(False), on_turn=lambda i, rec: (sys.stdout.write("\n"), _turn_line(i, rec)))
            err.print(f"replayed {until} turn(s) exactly, then ran {len(sc.turns)} new turn(s)"
                      + (f"; session: {escape(str(out_path))}" if out_path else ""))
            return
    except DetinferError as e:
        _fail(e)
    task = partial(replay_task, model=model, use_cache=not no_cache, kv_dir=kv_dir, until=until, cache_bytes=cache_bytes)
    if ray is not None or actors is not None:
        results = _fan_out("replayed", task, [str(f) for f in files], replay_failed, ray=ray, threads=threads, actors=actors)
    else:
        results = run_local(partial(task, warn=warn), [str(f) for f in files], lambda i, r: None)
    rows = [row for r in results for row in r.rows]
    if len(rows) == 1 and rows[0]["result"] == BAD_INPUT and not as_json:
        _fail(InputError(rows[0]["message"]))  # the one file asked for cannot be replayed: say why in one line
    if as_json:
        out.print(_json.dumps(rows), soft_wrap=True, markup=False)
    else:
        table = Table("session", "turn", "result", "steps", "reused", "first divergent step", "differs")
        for r in rows:
            style = "green" if r["result"] == "match" else "yellow" if r["result"] == BAD_INPUT else "red"
            table.add_row(escape(Path(r["session"]).name), "" if r["turn"] is None else str(r["turn"]), f"[{style}]{r['result']}[/]",
                          str(r["steps"]), str(r["reused_tokens"]), "" if r["first_divergent_step"] is None else str(r["first_divergent_step"]),
                          escape(", ".join(r["differs"]) or r.get("message", "")) + (escape(f" expected {r['expected']} got {r['actual']}") if "expected" in r else ""))
        out.print(table)
    raise typer.Exit(2 if any(r["result"] == BAD_INPUT for r in rows) else 1 if any(r["differs"] for r in rows) else 0)


@app.command()
def chat(
    record_path: Annotated[Optional[Path], typer.Option("--record", help="Record the conversation to this session file.")] = None,
    system: Annotated[Optional[str], typer.Option("--system", help="System message.")] = None,
    model: ModelOpt = None,
    chat_template: ChatTemplateOpt = None,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    temperature: Annotated[float, typer.Option()] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n")] = 256,
) -> None:
    """Interactive multi-turn chat (empty line or EOF ends it); recorded turn by turn with --record."""
    from .compute.engine import Engine, set_threads
    from .compute.kvcache import parse_kv_type
    from .compute.sampling import SamplingOverrides
    from .model.chat import ChatTemplate
    from .records.session import (
        Conversation,
        effective_sampling,
        new_record,
        run_turn,
        write_session,
    )

    try:
        _check_outputs({"--record": record_path})
        parse_kv_type(kv_type)
        set_threads(threads)
        template = ChatTemplate.from_option(chat_template) if chat_template is not None else None
        engine = Engine.load(model, n_ctx=ctx, kv_type=kv_type)
        _compile_kernels(engine)
        sampling = effective_sampling(SamplingOverrides(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens), None)
        conv, cache, turns = Conversation(engine, template), engine.new_cache(), []
        while True:
            try:
                line = input("> " if sys.stdin.isatty() else "")
            except EOFError:
                break
            if not line.strip():
                break
            msgs = ([{"role": "system", "content": system}] if system and not turns else []) + [{"role": "user", "content": line}]
            turns.append(run_turn(engine, conv, cache, msgs, sampling, on_step=_stream(False)))
            sys.stdout.write("\n")
            if record_path is not None:
                write_session(new_record(engine, turns, template), record_path)
    except DetinferError as e:
        _fail(e)


@kv_app.command("inspect")
def kv_inspect(path: Annotated[Path, typer.Argument(help=".detkv file")]) -> None:
    """Show a KV snapshot's header, model, tokens, sizes and checksum status."""
    from .errors import KVFileError
    from .records.kvfile import inspect_kv

    try:
        info_ = inspect_kv(path)
    except DetinferError as e:
        _fail(e)
    table = Table("field", "value", title=escape(str(path)))
    for k, v in info_.items():
        text = str(v)
        table.add_row(k, escape(text if len(text) <= 120 else text[:117] + "…"))
    out.print(table)
    if info_.get("checksum") != "ok":
        _fail(KVFileError(f"{path}: checksum mismatch; the file is corrupt and would be refused"))


@app.command()
def serve(
    model: ModelOpt = None,
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    host: Annotated[str, typer.Option("--host", help="Bind address (default loopback only).")] = "127.0.0.1",
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="Requests admitted at once; more get 429.")] = 8,
    max_inflight: Annotated[int, typer.Option("--max-inflight", min=1, help="Requests preparing (template, tokenize) at once.")] = 4,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    cache_bytes: CacheBytesOpt = DEFAULT_CACHE_BYTES,
    record_dir: Annotated[Optional[Path], typer.Option("--record", help="Record every request into session files in this directory.")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", envvar="DETINFER_API_KEY", show_envvar=True,
                                                   help="Require Authorization: Bearer KEY on every request.")] = None,
    send_timeout: Annotated[float, typer.Option("--send-timeout", min=0.1, help="Drop a streaming client that reads nothing for this many seconds.")] = 30.0,
    chat_template: ChatTemplateOpt = None,
    drain: Annotated[float, typer.Option("--drain", min=0.0, help="On SIGTERM, seconds running requests may finish before they are cancelled.")] = 5.0,
    read_timeout: Annotated[float, typer.Option("--read-timeout", min=0.1, help="Seconds a client has to send a request's headers, and then its body.")] = 10.0,
) -> None:
    """OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health)."""
    from .api import load
    from .serve import listen
    from .serve.app import create_app
    from .serve.serving import ServerSettings

    try:
        _check_outputs({}, {"--record": record_dir})
        sock = listen.bind(host, port)
        llm = load(model, n_ctx=ctx, kv_type=kv_type, threads=threads, chat_template=chat_template)  # the decode worker sets threads again on its own thread
        engine = llm.engine
        _compile_kernels(engine)
        settings = ServerSettings(max_queue=max_queue, max_inflight=max_inflight, threads=threads, cache_bytes=cache_bytes,
                                  record_dir=record_dir, api_key=api_key or None, send_timeout=send_timeout,
                                  chat_template=llm.chat_template, drain_s=drain, body_timeout=read_timeout)
        app_ = create_app(engine, settings)
    except DetinferError as e:
        _fail(e)
    err.print(f"serving {escape(str(engine.model_file.path.name))} on http://{host}:{port}/v1"
              + (" (API key required)" if api_key else ""))
    listen.serve(app_, sock, drain_s=drain, header_timeout=read_timeout)


bench_app = typer.Typer()
app.add_typer(bench_app, name="bench")


def _warn(msg: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(msg)}", soft_wrap=True)


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
    cells_only: Annotated[bool, typer.Option("--cells-only", help="Only the prefill/decode cells: no fastmath arm, "
                                             "start-up or session figures.")] = False,
    out_path: Annotated[Path, typer.Option("--out", "-o", help="Results (JSON).")] = Path("bench/results.json"),
    markdown: Annotated[Path, typer.Option("--markdown", help="Markdown tables.")] = Path("docs/benchmarks.md"),
) -> None:
    """The standard suite: prefill and decode tok/s per ISA at 1 and 2 threads, detinfer vs llama.cpp (and fastmath),
    1B-class GB/s against the memory bandwidth, RSS, cold/warm start, prefix reuse. Takes minutes; use an otherwise
    idle machine."""
    if cli_ctx.invoked_subcommand is not None:
        return
    from .bench.report import display_name, figure_label
    from .bench.suite import (
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
        report = run_suite(opts, out_path, markdown, warn=_warn, progress=lambda msg: err.print(f"[dim]{escape(msg)}[/]"))
    except DetinferError as e:
        _fail(e)
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
    from .bench.kv import (
        DEFAULT_TARGETS,
        check_kv_options,
        context_for,
        kv_curve,
        plot_kv,
    )
    from .bench.suite import add_kv_curve
    from .compute.engine import Engine, set_threads
    from .model.registry import DEFAULT_MODEL

    targets = tokens or list(DEFAULT_TARGETS)
    try:
        check_kv_options(targets, naive_budget, plot, results)
        n_threads = set_threads(threads)
        engine = Engine.load(model, n_ctx=context_for(targets))
        with err.status("generating with and without the KV cache…"):
            kv = kv_curve(engine, n_threads, targets, naive_budget, model=model or DEFAULT_MODEL, warn=_warn)
        if plot is not None:
            plot_kv(kv, plot)
            kv = kv.model_copy(update={"plot": str(plot)})
        add_kv_curve(kv, results, markdown)
    except DetinferError as e:
        _fail(e)
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
    from .bench.constraint import OVERHEAD_LIMIT, check_options
    from .bench.constraint import bench_constraint as run_bench
    from .compute.engine import Engine, set_threads

    try:
        check_options(tokens, runs)
        n_threads = set_threads(threads)
        engine = Engine.load(model, n_ctx=512)
        with err.status("decoding with and without the constraint…"):
            b = run_bench(engine, tokens, runs, warn=_warn)
    except DetinferError as e:
        _fail(e)
    out.print(f"{b.tokens} tokens at {n_threads} thread(s), {runs} interleaved runs per arm: decode without constraint "
              f"min {min(b.free_s):.3f} s, with JSON-schema constraint min {min(b.constrained_s):.3f} s; "
              f"mask overhead {b.overhead:+.1%} (limit {OVERHEAD_LIMIT:.0%})")


def _summary(m, out_path: Optional[Path]) -> None:
    t = m.informative.timings
    err.print(
        f"[dim]{len(m.output.token_ids)} tokens, stop: {m.output.stop_reason}; prefill {t.get('prefill_tok_s', 0)} tok/s, "
        f"decode {t.get('decode_tok_s', 0)} tok/s, threads {m.informative.threads}; KV {m.output.kv_sha256[:16]}…"
        + (f"; manifest: {escape(str(out_path))}" if out_path else "")
        + "[/]"
    )


def _bare_ray(args: list[str]) -> list[str]:
    """``--ray`` last or before another option means ``--ray local``: a click option cannot have an optional value."""
    return [x for i, a in enumerate(args)
            for x in ([a, "local"] if a == "--ray" and (i + 1 == len(args) or args[i + 1].startswith("-")) else [a])]


def main() -> None:
    """The ``detinfer`` command; it ends with :func:`_quick_exit`."""
    try:
        app(args=_bare_ray(sys.argv[1:]))
    except SystemExit as e:
        _quick_exit(e.code)
    _quick_exit(0)


def _quick_exit(code: int | str | None) -> NoReturn:
    """End the process without tearing the interpreter down: freeing every object of numba, LLVM and a loaded model
    takes ~0.2 s after the command is done (a fifth of a warm start), and nothing needs it. What a normal exit
    must do still happens first: non-daemon threads (a repacked-weights save) are joined, atexit handlers run (Ray
    shutdown, temporary folders), stdout and stderr are flushed; every file detinfer writes is closed and fsynced
    by then. mypy ends the same way (``mypy.util.hard_exit``). A ``code`` that is a message is printed, exit 1;
    an unwritable stdout (a closed pipe) exits 120, as Python's own exit does."""
    import atexit
    import os
    import threading

    if isinstance(code, str):
        sys.stderr.write(code + "\n")
        code = 1
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        code = code or 120
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code or 0)


if __name__ == "__main__":
    main()
