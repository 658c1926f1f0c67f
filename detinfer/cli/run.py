"""``detinfer run`` (generate and record a manifest, or re-execute one with --manifest) and ``detinfer batch``
(one manifest per JSONL line, here or on Ray)."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from .. import api
from ..errors import DetinferError, InputError, MismatchError
from ..integrations.batch import BAD_INPUT, batch_failed, batch_lockstep, batch_task, prepare_batch
from .common import (
    SAMPLING_FLAGS,
    ActorsOpt,
    BatchOpt,
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
)

# run options a manifest records: passing them with --manifest would be silently ignored, so it is an error
_RECORDED_OPTIONS = {"prompt", "prompt_file", "messages", "chat", "chat_template", "system", "max_tokens", "temperature", "top_k", "top_p",
                     "min_p", "repeat_penalty", "repeat_last_n", "seed", "stop", "ignore_eos", "ctx", "kv_type",
                     "json_schema", "json_object", "regex", "grammar"}  # fmt: skip


def _given(cli_ctx: typer.Context, names: set[str]) -> list[str]:
    """The options among ``names`` that were typed on the command line (as their first spelling)."""
    return [p.opts[0] for p in cli_ctx.command.params
            if p.name in names and getattr(cli_ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"]


def _summary(m, out_path: Optional[Path]) -> None:
    t, n = m.informative.timings, len(m.output.token_ids)
    err.print(
        f"[dim]{n} token{'s' * (n != 1)}, stop: {m.output.stop_reason}; prefill {t.get('prefill_tok_s', 0)} tok/s, "
        + (f"decode {t.get('decode_tok_s', 0)} tok/s, " if n > 1 else "")  # one token is the prefill's: no decode step
        + f"threads {m.informative.threads}; KV {m.output.kv_sha256[:16]}…"
        + (f"; drafts taken {int(t['accepted_tokens'])} of {int(t['draft_tokens'])}" if "draft_tokens" in t else "")
        + (f"; manifest: {escape(str(out_path))}" if out_path else "")
        + "[/]"
    )


def _rerun(manifest: Path, *, model: Optional[str], threads: Optional[int], chunk_size: int, out_path: Optional[Path], quiet: bool,
           rederive: bool, speculate: Optional[str]) -> None:  # fmt: skip
    """``run --manifest``: re-execute the recorded inputs, stream the text, say match or what differs."""
    outcome = api.rerun(manifest, model=model, threads=threads, chunk_size=chunk_size, on_step=streamer(quiet), warm_up=compiling,
                        rederive=rederive, speculate=speculate)  # fmt: skip
    actual = outcome.reexecuted
    if not quiet:
        sys.stdout.write("\n")
    if out_path is not None:
        actual.save(out_path)
    _summary(actual, out_path)
    if outcome.status == api.MATCH:
        masks = f" and {len(actual.output.mask_digests)} mask digests" if actual.output.mask_digests is not None else ""
        err.print(f"[bold green]match[/]: tokens, KV hash and all {len(actual.output.logits_digests)} logits digests{masks} "
                  f"equal {escape(str(manifest))}")  # fmt: skip
        return
    for d in outcome.differences:
        err.print(f"[bold red]mismatch[/] {d['field']}: expected {escape(d['expected'])} got {escape(d['actual'])}", soft_wrap=True)
    if outcome.divergence is not None:
        err.print(f"first divergent step: {outcome.divergence.step}")
    raise MismatchError(f"re-execution of {manifest} does not match")


@app.command()
def run(
    cli_ctx: typer.Context,
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text, as is (--chat renders it as a user message).")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option("--prompt-file", "-f", "--file", help="Read the prompt from a UTF-8 file (- for stdin).")] = None,
    messages: Annotated[Optional[Path], typer.Option("--messages", help="JSON file with a list of {role, content}.")] = None,
    chat: Annotated[bool, flag("--chat", help="Render the prompt as a user message with the chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="With --chat: a system message before the prompt.")] = None,
    chat_template: ChatTemplateOpt = None,
    manifest: Annotated[Optional[Path], typer.Option("--manifest", help="Re-execute a recorded run and compare.")] = None,
    model: ModelOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", "-n", "--n-predict", help="Maximum new tokens.")] = 128,
    temperature: Annotated[float, typer.Option("--temperature", "--temp", help="0 = greedy (ties to the lowest token id).")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass in (0, 1].")] = 1.0,
    min_p: Annotated[float, typer.Option("--min-p", help="Drop tokens below min_p × p_max.")] = 0.0,
    repeat_penalty: Annotated[float, typer.Option("--repeat-penalty", help="Repetition penalty (1 = off).")] = 1.0,
    repeat_last_n: Annotated[int, typer.Option("--repeat-last-n", help="Tokens the penalty looks back over.")] = 64,
    seed: Annotated[int, typer.Option("--seed", "-s", help="Sampling seed (recorded in the manifest).")] = 0,
    stop: Annotated[Optional[list[str]], typer.Option("--stop", help="Stop string (repeatable); never emitted.")] = None,
    ignore_eos: Annotated[bool, flag("--ignore-eos", help="Do not stop at end-of-generation tokens.")] = False,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    speculate: SpeculateOpt = None,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="Prefill tokens per chunk. Never changes a result.")] = 64,
    out_path: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the run manifest here.")] = None,
    quiet: QuietOpt = False,
    json_schema: Annotated[Optional[Path], typer.Option("--json-schema", help="Constrain the output to this JSON Schema (file).")] = None,
    json_object: Annotated[bool, flag("--json", help="Constrain the output to a JSON object.")] = False,
    regex: Annotated[Optional[str], typer.Option("--regex", help="Constrain the output to match this regex.")] = None,
    grammar: Annotated[Optional[Path], typer.Option("--grammar", help="Constrain the output to this Lark grammar (file).")] = None,
    batch: Annotated[Optional[Path], typer.Option("--batch", hidden=True)] = None,
    rederive: RederiveOpt = False,
) -> None:
    """Generate text and record a run manifest; or re-execute one with --manifest (exit 0 match, 1 mismatch)."""
    try:
        if batch is not None:
            raise InputError("batches are their own command now: detinfer batch FILE --out-dir DIR")
        check_outputs({"--out": out_path})
        api.check_chunk_size(chunk_size)
        if manifest is not None:
            if given := _given(cli_ctx, _RECORDED_OPTIONS):
                raise InputError(f"--manifest re-executes the recorded inputs and settings; drop {', '.join(given)}")
            _rerun(manifest, model=model, threads=threads, chunk_size=chunk_size, out_path=out_path, quiet=quiet, rederive=rederive,
                   speculate=speculate)
            return
        if sum(x is not None for x in (prompt, prompt_file, messages)) != 1:
            raise InputError("give exactly one of --prompt, --prompt-file, --messages (or --manifest)")
        if (chat_template is not None or system is not None) and not chat and messages is None:
            raise InputError(f"{'--chat-template' if chat_template is not None else '--system'} formats a chat prompt; add --chat "
                             "(or use --messages)")  # fmt: skip
        if system is not None and messages is not None:
            raise InputError("--system goes with --chat; a --messages file holds its own system message")
        text = api.read_prompt_file(prompt_file) if prompt_file is not None else prompt
        if text == "":  # a completion of nothing, or an empty message (the library's message names no option)
            what = "the message to send" if chat else "the text to continue"
            raise InputError(f"--prompt-file {prompt_file} is empty; put {what} in it" if prompt_file is not None
                             else f"--prompt is empty; give {what}")  # fmt: skip
        msgs = api.load_messages(messages) if messages is not None else None
        if system is not None:  # (a plain --chat prompt is recorded as text, as before --system existed)
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": text}]
        options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                       repetition_penalty=repeat_penalty, repeat_last_n=repeat_last_n, stop=stop or [], ignore_eos=ignore_eos)  # fmt: skip
        api.Sampling.create(SAMPLING_FLAGS, **options)  # bad sampling values fail before the model is loaded
        constraint = api.constraint_from_options(json_schema=json_schema, json_object=json_object, regex=regex, grammar=grammar,
                                                 ignore_eos=ignore_eos)  # fmt: skip
        llm = api.load(model, n_ctx=ctx, kv_type=kv_type, threads=threads, chat_template=chat_template, rederive=rederive,
                       speculate=speculate)
        chat_input = msgs if msgs is not None else text if chat else None
        steps = llm.stream(None if chat_input is not None else text, messages=chat_input, chunk_size=chunk_size, constraint=constraint,
                           **options)  # fmt: skip
        compiling(llm.warm_up)  # after the prompt and the constraint were checked: bad input fails fast
        raw = chat_input is None and llm.engine.chat_template is not None  # an instruct model given bare text
        if not quiet:
            n = len(steps.prompt_tokens)
            # it continues bare text instead of answering: say which the prompt was
            how = (", rendered by the chat template" if chat_input is not None
                   else ", raw text (--chat formats it with the model's chat template)" if raw else "")
            err.print(f"[dim]{escape(llm.engine.model_file.path.name)}: {n} prompt token{'s' * (n != 1)}{how}[/]")
        on_step = streamer(quiet)
        for step in steps:
            on_step(step)
        if not quiet:
            sys.stdout.write("\n")
        if out_path is not None:
            steps.result.manifest.save(out_path)
        _summary(steps.result.manifest, out_path)
        if not quiet and raw and steps.result.stop_reason == "eos" and not steps.result.text:
            err.print("[dim]the model ended at once (its first token was EOS), as instruct models often do on raw text: try --chat[/]")
    except DetinferError as e:
        fail(e)
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130)


@app.command()
def batch(
    batch_file: Annotated[Path, typer.Argument(metavar="FILE", help="JSONL, one run per line (id, prompt or messages, optional "
                                               "model, chat_template, sampling).")],
    out_dir: Annotated[Path, typer.Option("--out-dir", help="The folder of run manifests (<id>.json).")],
    resume: Annotated[bool, flag("--resume", help="Skip ids whose valid manifest is already in --out-dir.")] = False,
    model: ModelOpt = None,
    ctx: CtxOpt = 4096,
    kv_type: KvOpt = "f32",
    threads: ThreadsOpt = None,
    lockstep: BatchOpt = api.DEFAULT_BATCH,
    ray: RayOpt = None,
    actors: ActorsOpt = None,
    rederive: RederiveOpt = False,
) -> None:
    """Run a JSONL batch: every line becomes --out-dir/<id>.json, written as it finishes.

    Exit 2 if a line is bad input (the others still run)."""
    try:
        writer, todo, skipped = prepare_batch(batch_file, out_dir, resume=resume, model=model, n_ctx=ctx, kv_type=kv_type, rederive=rederive)
    except DetinferError as e:
        fail(e)
    ran = fan_out("ran", batch_task, todo, batch_failed, ray=ray, threads=threads, actors=actors, on_result=lambda i, r: writer.write(r),
                  rederive=rederive, local=partial(batch_lockstep, batch=lockstep), compares=False)  # fmt: skip
    results = sorted(ran + skipped, key=lambda r: r.line)
    for r in results:
        if r.status == BAD_INPUT:  # compiler-style "batch.jsonl:3: ...", as a line that does not parse says it
            at = f"{batch_file}:{r.line}"
            out.print(escape(r.message if r.message.startswith(at) else f"{at}: {r.message}"), soft_wrap=True)
    bad = sum(r.status == BAD_INPUT for r in results)
    where = f"; manifests in {escape(str(out_dir))}" if len(results) > bad else ""  # none written: no folder to name
    out.print(f"batch {escape(str(batch_file))}: {len(ran) - bad} written, {len(skipped)} skipped (--resume), {bad} bad input{where}",
              soft_wrap=True)  # fmt: skip
    raise typer.Exit(2 if bad else 0)
