"""What every command shares: the typer app, the consoles, the options several commands take, and the edge where a
DetinferError becomes one line and an exit code. Commands call the library (detinfer.api, .integrations, .serve,
.bench) and nothing below it: option checks live there once.

Exit codes: 0 success, 1 a re-executed record does not match, 2 bad input, 130 interrupted.
"""

from __future__ import annotations

import difflib
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, Callable, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .. import api
from ..errors import DetinferError, InputError
from ..fileio import check_output, check_output_dir
from ..version import __version__


def _version(value: bool) -> None:
    if value:
        out.print(f"detinfer {__version__}")
        raise typer.Exit(0)


class _Help:
    """Help text as the terminal wraps it: a docstring's paragraphs reflowed (their line breaks are the source's,
    which cut ``detinfer --help``'s one-line summaries mid-sentence); --help/-h shown as a flag (typer gives the help
    option no metavar, so its help renders it as ``<bool>``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        if self.help:  # type: ignore[has-type]
            self.help = "\n\n".join(" ".join(p.split()) for p in self.help.split("\n\n"))

    def get_help_option(self, ctx: Any) -> Any:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None:
            option.metavar = ""
        return option


class _Command(_Help, typer.core.TyperCommand):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        """click's, but an option of one value given twice is a usage error: click keeps the last, so
        ``--manifest a.json --manifest b.json`` re-executed b alone."""
        if not ctx.resilient_parsing:
            seen = set()
            for param in self.make_parser(ctx).parse_args(args=list(args))[2]:  # every option in the order given
                if param.param_type_name == "option" and not (param.multiple or param.is_flag or param.count):
                    if param in seen:
                        ctx.fail(f"{param.opts[0]} is given twice; give it once")
                    seen.add(param)
        return super().parse_args(ctx, args)


class _Group(_Help, typer.core.TyperGroup):
    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        """click's main, but a usage error (an unknown option, a value of the wrong type, a missing argument) is one
        line naming the fix, exit 2, like every other error (typer draws a box of several lines)."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except _CLICK_ERROR as e:
            if type(e).__name__ != "NoArgsIsHelpError":  # that one's help was shown: it is the answer
                ctx = getattr(e, "ctx", None)
                see = f" (see `{ctx.command_path if ctx is not None else 'detinfer'} --help`)"
                if type(e).__name__ == "NoSuchOption" and e.possibilities:  # click's 0.6 cutoff offers --out for --bogus
                    e.possibilities = difflib.get_close_matches(e.option_name, e.possibilities, cutoff=SUGGEST_CUTOFF)
                message = e.format_message()
                if type(e) is typer.BadParameter and getattr(e.param, "opts", None):  # a bad value, read as our own range errors
                    message = f"{e.param.opts[0]}: {e.message.replace('Input should be', 'must be', 1)}"
                err.print(f"[bold red]error:[/] {escape(message.rstrip('.'))}{escape(see)}", soft_wrap=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            err.print("Aborted!")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


SUGGEST_CUTOFF = 0.75  # difflib ratio of a suggested option to the unknown one: --max-token -> --max-tokens, --promt -> --prompt

# click's exception base (UsageError's): typer vendors click since 0.25, so it is found from what typer exports
_CLICK_ERROR = typer.BadParameter.__mro__[2]
assert _CLICK_ERROR.__name__ == "ClickException"


class App(typer.Typer):
    """The one typer app class of the CLI, the root and its groups (session, kv, bench): help shown as a flag."""

    def __init__(self, *args: Any, cls: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, cls=cls or _Group, **kwargs)

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = App(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Determinism-first LLM inference: bit-identical GGUF inference on the CPU, with run manifests that prove it.",
)


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True, metavar="",
                                                help="Print detinfer's version and exit.")] = False) -> None:  # fmt: skip
    """Determinism-first LLM inference: bit-identical GGUF inference on the CPU, with run manifests that prove it."""


# Not a terminal (pipes, CI logs): a wide fixed width, so tables and summaries are not cut or wrapped at 80 columns.
out = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)


def flag(*names: str, help: str) -> Any:  # noqa: A002 (typer's name)
    """An on/off option shown as a flag in --help (typer would show it as taking a ``<bool>``)."""
    return typer.Option(*names, help=help, metavar="")


ModelOpt = Annotated[Optional[str], typer.Option("--model", "-m", help=f"Registry name or path to a .gguf file (default: {api.DEFAULT_MODEL}).")]
CtxOpt = Annotated[int, typer.Option("--ctx", "-c", "--ctx-size", help="KV cache positions (n_ctx), at most the model's context length.")]
KvOpt = Annotated[str, typer.Option("--kv-type", help="KV cache type: f32 or f16. Quantized types are rejected.")]
ThreadsOpt = Annotated[Optional[int], typer.Option("--threads", "-t", help="Threads (default: the cores other processes leave free). Never changes a result.")]
SpeculateOpt = Annotated[Optional[str], typer.Option(
    "--speculate", metavar="ngram", help="Speculative decoding: ngram drafts tokens from the context (prompt lookup), checked in one forward. Never changes a result.")]
BatchOpt = Annotated[int, typer.Option(
    "--batch", min=1, help="Sequences decoded together, one forward step for all (1: one at a time). Never changes a result.")]
CacheBytesOpt = Annotated[int, typer.Option("--cache-bytes", help="Byte budget of the in-memory prefix cache (LRU).")]
DEFAULT_CACHE_BYTES = 1 << 30
ChatTemplateOpt = Annotated[Optional[str], typer.Option(
    "--chat-template", help="Chat template instead of the model's: a built-in format (gemma, chatml, chatml-tools) or a jinja file.")]
QuietOpt = Annotated[bool, flag("--quiet", "-q", help="Do not stream tokens; print only the summary.")]
RayOpt = Annotated[Optional[str], typer.Option(
    "--ray", metavar="[ADDRESS]",
    help="Fan the work out over Ray actors. --ray (or --ray local) starts a local cluster sized to this machine; "
         "--ray auto, --ray ray://HOST:PORT or --ray HOST:PORT joins a running one.")]
ActorsOpt = Annotated[Optional[int], typer.Option("--actors", help="With --ray: how many actors (default: the cluster's CPUs / --threads).")]
REDERIVE = "--rederive"
RederiveOpt = Annotated[bool, flag(REDERIVE, help="Use no file derived from the model: parse its header, build the tokenizer, repack the "
                                   "weights and compile every kernel (a fresh numba cache) from the GGUF alone. Slow; same bytes.")]
COMPILE_STATUS_DELAY_S = 2.0  # off a terminal, the compile status line appears only if warming up takes longer


# the sampling fields as the commands' flags spell them, for their error lines
SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p",
                  "min_p": "--min-p", "repetition_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n",
                  "seed": "--seed", "stop": "--stop"}  # fmt: skip


def fail(e: DetinferError) -> NoReturn:
    err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)  # user text is never markup
    raise typer.Exit(e.exit_code)


def warn(msg: str) -> None:
    err.print(f"[yellow]warning:[/] {escape(msg)}", soft_wrap=True)


def check_outputs(files: dict[str, Optional[Path]], dirs: Optional[dict[str, Optional[Path]]] = None) -> None:
    """Before any work: every output option names a regular file or new path (files) or a folder detinfer can write
    into (dirs); InputError (one line) otherwise. ``{option: path or None}``."""
    for option, path in files.items():
        if path is not None:
            check_output(path, option)
    for option, path in (dirs or {}).items():
        if path is not None:
            check_output_dir(path, option)


def compiling(warm_up: Callable[[], bool]) -> None:
    """Run ``warm_up`` (compile on a first run, else load the kernels from numba's cache; True if it compiled) with a
    status on stderr: a spinner on a terminal, elsewhere one line if it takes over COMPILE_STATUS_DELAY_S; then,
    if it compiled, one line saying how long. stdout stays clean."""
    message = f"{api.PROGRESS_MARK} or loading them from the cache (a first run compiles for up to ~1 min)…"
    t0 = time.perf_counter()
    if err.is_terminal:
        with err.status(message):
            compiled = warm_up()
    else:
        timer = threading.Timer(COMPILE_STATUS_DELAY_S, lambda: err.print(message))
        timer.start()
        try:
            compiled = warm_up()
        finally:
            timer.cancel()
    if compiled:
        err.print(f"[dim]compiled the kernels in {time.perf_counter() - t0:.1f} s; numba's JIT cache keeps them for the next start[/]")


def streamer(quiet: bool) -> Callable[[Any], None]:
    """An ``on_step`` that writes each step's text to stdout as it is produced (nothing with ``quiet``)."""

    def on_step(step) -> None:
        if not quiet and step.text:
            sys.stdout.write(step.text)
            sys.stdout.flush()

    return on_step


def fan_out(verb: str, task, payloads: list, failed, *, ray: Optional[str], threads: Optional[int], actors: Optional[int],
            on_result=None, rederive: bool = False, local=None, compares: bool = True) -> list:  # fmt: skip
    """Run ``task`` over ``payloads`` here or on Ray (integrations.distributed.fan_out) with progress on stderr
    (``compares``: the tasks re-execute records, so mismatches are counted); results in input order. Ctrl-C stops
    the run (exit 130) and keeps what was already written."""
    from ..integrations.batch import ItemProgress
    from ..integrations.distributed import check_address, check_rederive, import_ray
    from ..integrations.distributed import fan_out as run_fan_out

    try:
        check_rederive(rederive, ray)
        if ray is None:
            api.set_threads(threads)
        else:
            check_address(ray)
            import_ray()
        if actors is not None and ray is None:
            raise InputError("--actors sets the Ray actors; add --ray")
    except DetinferError as e:
        fail(e)
    where = "in this process" if ray is None else f"on Ray ({ray}), {threads or 1} thread(s) per actor"
    progress = ItemProgress(err, verb, len(payloads), where, compares)

    def done(i: int, result) -> None:
        if on_result is not None:
            on_result(i, result)
        progress(i, result)

    try:
        results = run_fan_out(task, payloads, done, failed, ray=ray, threads=threads or 1, actors=actors, local=local)
    except KeyboardInterrupt:
        progress.close(interrupted=True)
        raise typer.Exit(130)
    except DetinferError as e:
        progress.close(summary=False)
        fail(e)
    progress.close()
    return results
